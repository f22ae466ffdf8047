//! A fake OpenAI-compatible server that behaves like llama.cpp's after a stream: it answers with
//! a chunked SSE reply that advertises keep-alive, then closes the socket without reading the
//! next request. A client that reuses the pooled connection sends its next request into a socket
//! the server is closing; the server never reads it. `headroom bench`'s client must send such a
//! request again on a fresh connection and never count it as a server error; `headroom serve`'s
//! upstream client must lose none of them either (it lets a connection rest after a stream before
//! reusing it, and sends again a request the server reset unread, never one it may have run).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::StreamExt;

/// How long the server keeps a socket open after the last chunk before closing it unread: long
/// enough that a client's next request on the pooled connection lands inside the window.
const LINGER: Duration = Duration::from_millis(40);

pub struct ClosingServer {
    pub url: String,
    /// POST requests whose head and body the server read and answered (the bench's preflight
    /// GET /v1/models is answered and not counted).
    pub served: Arc<AtomicU64>,
}

/// Reads one request (head and Content-Length body) and returns its method; `None` when the
/// peer closed first.
fn read_request(reader: &mut BufReader<std::net::TcpStream>) -> Option<String> {
    let mut length = 0usize;
    let mut method = None;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        if method.is_none() {
            method = Some(line.split_whitespace().next()?.to_string());
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    method
}

fn models(stream: &mut std::net::TcpStream) {
    let body = r#"{"object":"list","data":[{"id":"m","object":"model"}]}"#;
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

fn answer(stream: &mut std::net::TcpStream, seq: u64) -> std::io::Result<()> {
    let mut out = String::from(
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5, max=100\r\n\r\n",
    );
    for i in 0..3 {
        let event = format!(
            "data: {{\"id\":\"c{seq}\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}},\"finish_reason\":null}}]}}\n\n"
        );
        out.push_str(&format!("{:x}\r\n{event}\r\n", event.len()));
    }
    let done = "data: [DONE]\n\n";
    out.push_str(&format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len()));
    stream.write_all(out.as_bytes())?;
    stream.flush()
}

/// Starts the server on 127.0.0.1 (a thread per connection, one answered request each).
pub fn start() -> ClosingServer {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = Arc::new(AtomicU64::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut stream) = conn else { continue };
            let count = count.clone();
            std::thread::spawn(move || {
                let Ok(read_half) = stream.try_clone() else {
                    return;
                };
                let mut reader = BufReader::new(read_half);
                match read_request(&mut reader).as_deref() {
                    Some("POST") => {}
                    Some(_) => return models(&mut stream),
                    None => return,
                }
                let seq = count.fetch_add(1, Ordering::SeqCst);
                if answer(&mut stream, seq).is_ok() {
                    // Keep-alive was advertised, but the socket closes without reading on.
                    std::thread::sleep(LINGER);
                }
            });
        }
    });
    ClosingServer { url, served }
}

fn headroom(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .output()
        .expect("run headroom")
}

#[test]
fn bench_resends_a_request_that_met_a_stale_pooled_connection_and_counts_no_error() {
    let server = start();
    let out = headroom(&[
        "bench",
        "--format",
        "json",
        "--no-gpu",
        "--url",
        &server.url,
        "--model",
        "m",
        "--concurrency",
        "1",
        "--requests",
        "20",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&stdout).expect("JSON report");
    assert_eq!(r["outcomes"]["ok"], 20, "{}", r["errors"]);
    assert_eq!(r["outcomes"]["other_error"], 0, "{}", r["errors"]);
    // Every request reached the server exactly once: none was lost, none doubled.
    assert_eq!(server.served.load(Ordering::SeqCst), 20);
    let retried = r["stale_connection_retries"]
        .as_u64()
        .expect("retries counted");
    eprintln!("stale pooled connections met and resent: {retried} of 20");
    assert!(
        retried >= 1,
        "the test server should have made the client meet a closed pooled connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_streams_back_to_back_through_an_upstream_that_closes_after_each_stream() {
    let server = start();
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{}\"]\nmax_inflight = 1\n",
        server.url
    );
    let config = headroom_server::ServeSettings::from_toml(&toml).expect("valid config");
    let g = headroom_server::spawn(config, None).await.expect("starts");
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut failures = Vec::new();
    for i in 0..40 {
        let r = c
            .post(format!("http://{}/v1/chat/completions", g.addr))
            .header("content-type", "application/json")
            .body(r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}]}"#)
            .send()
            .await
            .expect("gateway answers");
        let status = r.status();
        let mut body = Vec::new();
        let mut s = r.bytes_stream();
        while let Some(chunk) = s.next().await {
            body.extend_from_slice(&chunk.expect("body"));
        }
        let text = String::from_utf8_lossy(&body);
        if status != 200 || !text.contains("[DONE]") || text.contains("\"error\"") {
            failures.push(format!("{i}: {status} {text}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(server.served.load(Ordering::SeqCst), 40);
    g.shutdown().await.unwrap();
}
