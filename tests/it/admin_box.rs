//! `/admin/box` and the 503 while a backend restarts, through a real gateway on 127.0.0.1 in front
//! of a real (in-process) upstream, with a box provider steered by the test the way `headroom up`'s
//! supervisor steers its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_server::ServeConfig;
use headroom_server::admin_box::{BackendReport, BackendState, BoxProvider, BoxReport};

struct Steered(Mutex<BoxReport>);

impl BoxProvider for Steered {
    fn report(&self) -> BoxReport {
        self.0.lock().unwrap().clone()
    }
}

fn report(upstream: &str) -> BoxReport {
    BoxReport {
        probe: "host".into(),
        capacity_bytes: 1 << 30,
        margin_bytes: 1 << 27,
        text_budget_bytes: 1 << 29,
        backends: vec![BackendReport {
            name: "stt".into(),
            role: "audio".into(),
            engine: "whisper".into(),
            pid: Some(4242),
            state: BackendState::Ready,
            upstream: upstream.into(),
            resident_bytes: 200 << 20,
            peak_bytes: 260 << 20,
            current_bytes: 201 << 20,
            restarts: 0,
            drifted: false,
            retry_after_ms: None,
            restart_reason: None,
            flags: Vec::new(),
            plan_check: None,
        }],
        enforce: None,
    }
}

/// An upstream that answers every transcription and counts them.
async fn upstream(hits: Arc<AtomicU64>) -> String {
    let app = axum::Router::new().route(
        "/v1/audio/transcriptions",
        axum::routing::post(move || {
            let hits = hits.clone();
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                axum::Json(serde_json::json!({"text": "hello"}))
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

async fn gateway(
    toml: &str,
    provider: Option<Arc<dyn BoxProvider>>,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let config = ServeConfig::from_toml(toml).unwrap();
    let mut g = headroom_server::Gateway::new(config, None).unwrap();
    if let Some(p) = provider {
        g = g.with_box(p);
    }
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(g.serve(l, async move {
        let _ = rx.await;
    }));
    (format!("http://{addr}"), tx)
}

fn config(upstream: &str) -> String {
    format!(
        r#"
api_keys = ["sekret"]
shutdown_grace = "1s"
[[lanes]]
name = "stt"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{upstream}"]
policy = "queue"
max_queue = 4
"#
    )
}

async fn transcribe(c: &reqwest::Client, base: &str) -> reqwest::Response {
    let wav = headroom_server::audio::fixtures::wav(1.0, 8000, 1);
    let boundary = "b0undary";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(&wav);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    c.post(format!("{base}/v1/audio/transcriptions"))
        .bearer_auth("sekret")
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn admin_box_is_keyed_and_a_restarting_backend_gets_503_with_retry_after() {
    let hits = Arc::new(AtomicU64::new(0));
    let up = upstream(hits.clone()).await;
    let steered = Arc::new(Steered(Mutex::new(report(&up))));
    let (base, _stop) = gateway(&config(&up), Some(steered.clone())).await;
    let c = reqwest::Client::builder().no_proxy().build().unwrap();

    let r = c.get(format!("{base}/admin/box")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(format!("{base}/admin/box"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["backends"][0]["name"], "stt");
    assert_eq!(v["backends"][0]["state"], "ready");
    assert_eq!(v["backends"][0]["peak_bytes"], 260u64 << 20);

    assert_eq!(transcribe(&c, &base).await.status(), 200);
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    {
        let mut r = steered.0.lock().unwrap();
        r.backends[0].state = BackendState::Restarting;
        r.backends[0].retry_after_ms = Some(3000);
        r.backends[0].restarts = 1;
    }
    let t0 = Instant::now();
    let r = transcribe(&c, &base).await;
    assert!(
        t0.elapsed() < Duration::from_secs(2),
        "a 503 must come at once"
    );
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "3");
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "backend_unavailable");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "nothing was sent to the restarting backend"
    );

    let metrics = scrape(&c, &base).await;
    assert!(
        metrics.contains("headroom_box_backend_restarts_total{backend=\"stt\",role=\"audio\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("headroom_box_backend_up{backend=\"stt\",state=\"restarting\"} 0"),
        "{metrics}"
    );

    steered.0.lock().unwrap().backends[0].state = BackendState::Ready;
    assert_eq!(transcribe(&c, &base).await.status(), 200);
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn without_a_box_the_route_is_unknown() {
    let hits = Arc::new(AtomicU64::new(0));
    let up = upstream(hits).await;
    let (base, _stop) = gateway(&config(&up), None).await;
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let r = c
        .get(format!("{base}/admin/box"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let metrics = scrape(&c, &base).await;
    assert!(!metrics.contains("headroom_box_"));
}

/// The gateway's `/metrics` text, asked for with the test's key.
async fn scrape(c: &reqwest::Client, base: &str) -> String {
    c.get(format!("{base}/metrics"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
