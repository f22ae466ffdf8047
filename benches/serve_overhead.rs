//! What `headroom serve` adds on top of talking to the upstream directly: per-request latency for
//! small non-streaming completions and wall time for one long SSE stream, each printed as a ratio
//! against the direct (reference) run. Run with `cargo bench --bench serve_overhead`.

use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::response::{IntoResponse, Response};
use axum::routing::post;

const REQUESTS: usize = 400;
const STREAM_CHUNKS: usize = 5000;

async fn upstream(body: Bytes) -> Response {
    let streaming = std::str::from_utf8(&body).is_ok_and(|b| b.contains("\"stream\":true"));
    if !streaming {
        return axum::Json(serde_json::json!({
            "id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]
        }))
        .into_response();
    }
    let chunk = Bytes::from(format!(
        "data: {}\n\n",
        serde_json::json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "tok "}}]})
    ));
    let events = futures_util::stream::iter(
        (0..STREAM_CHUNKS)
            .map(move |_| Ok::<_, std::io::Error>(chunk.clone()))
            .chain(std::iter::once(Ok(Bytes::from("data: [DONE]\n\n")))),
    );
    let mut r = Response::new(Body::from_stream(events));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1)]
}

async fn latencies(c: &reqwest::Client, url: &str) -> Vec<Duration> {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
    let mut out = Vec::with_capacity(REQUESTS);
    for _ in 0..REQUESTS {
        let start = Instant::now();
        let r = c
            .post(url)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        let _ = r.bytes().await.unwrap();
        out.push(start.elapsed());
    }
    out.sort();
    out
}

async fn stream_time(c: &reqwest::Client, url: &str) -> Duration {
    let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hello"}]}"#;
    let start = Instant::now();
    let r = c
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    start.elapsed()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(
            listener,
            Router::new().route("/v1/chat/completions", post(upstream)),
        )
        .await
        .unwrap();
    });
    let config = headroom_server::ServeSettings::from_toml(&format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"http://{up}\"]\nmax_inflight = 64\n"
    ))
    .unwrap();
    let gw = headroom_server::spawn(config, None).await.unwrap();
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let direct_url = format!("http://{up}/v1/chat/completions");
    let gateway_url = format!("http://{}/v1/chat/completions", gw.addr);

    // Warm both paths.
    let _ = latencies(&c, &direct_url).await;
    let _ = latencies(&c, &gateway_url).await;
    let direct = latencies(&c, &direct_url).await;
    let through = latencies(&c, &gateway_url).await;
    let direct_stream = stream_time(&c, &direct_url).await;
    let through_stream = stream_time(&c, &gateway_url).await;

    println!(
        "serve_overhead ({REQUESTS} sequential small completions, one {STREAM_CHUNKS}-chunk SSE stream)"
    );
    for (name, p) in [("p50", 0.5), ("p99", 0.99)] {
        let (d, t) = (percentile(&direct, p), percentile(&through, p));
        println!(
            "  {name}: direct {:>8.3} ms  via gateway {:>8.3} ms  ratio {:.2}  (+{:.3} ms)",
            d.as_secs_f64() * 1e3,
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() / d.as_secs_f64(),
            (t.as_secs_f64() - d.as_secs_f64()) * 1e3
        );
    }
    println!(
        "  stream: direct {:>8.1} ms  via gateway {:>8.1} ms  ratio {:.2}",
        direct_stream.as_secs_f64() * 1e3,
        through_stream.as_secs_f64() * 1e3,
        through_stream.as_secs_f64() / direct_stream.as_secs_f64()
    );
    gw.shutdown().await.unwrap();
}
