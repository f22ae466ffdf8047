//! `/admin/box` and the 503 while a backend restarts, through a real gateway on 127.0.0.1 in front
//! of a real (in-process) upstream, with a box provider steered by the test the way `headroom up`'s
//! supervisor steers its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_server::ServeSettings;
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
            start_failures: 0,
            last_exit: None,
            drifted: false,
            retry_after_ms: None,
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
    let config = ServeSettings::from_toml(toml).unwrap();
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
    // The pool now, for tools without NVML: no memory reading here (no lane admits on memory),
    // so the capacity and the backends' memory now, on a pool named for the probe.
    assert_eq!(v["pool"]["name"], "GPU 0");
    assert_eq!(v["pool"]["total_bytes"], 1u64 << 30);
    assert_eq!(v["pool"]["used_bytes"], 201u64 << 20);

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
    get_text(c, &format!("{base}/metrics")).await
}

/// A GET with the test's key; the body as text.
async fn get_text(c: &reqwest::Client, url: &str) -> String {
    c.get(url)
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_enforced_box_shows_its_cgroup_oom_kills_and_restart_reasons() {
    let hits = Arc::new(AtomicU64::new(0));
    let up = upstream(hits).await;
    let mut r = report(&up);
    r.backends[0].restarts = 2;
    r.backends[0].last_exit = Some("oom_killed".into());
    r.enforce = Some(headroom_server::admin_box::EnforceReport {
        cgroup: "/sys/fs/cgroup/memory/headroom-up-1-2-box".into(),
        version: "v1".into(),
        limit_bytes: 1 << 30,
        usage_bytes: 700 << 20,
        working_set_bytes: 600 << 20,
        oom_kills: 2,
    });
    let provider: Arc<dyn BoxProvider> = Arc::new(Steered(Mutex::new(r)));
    let (base, _stop) = gateway(&config(&up), Some(provider)).await;
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let text = get_text(&c, &format!("{base}/admin/box")).await;
    let body: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["enforce"]["oom_kills"], 2);
    assert_eq!(body["enforce"]["limit_bytes"], 1u64 << 30);
    assert_eq!(body["backends"][0]["last_exit"], "oom_killed");
    let metrics = scrape(&c, &base).await;
    for line in [
        "headroom_box_oom_kills_total 2",
        "# TYPE headroom_box_oom_kills_total counter",
        "headroom_box_memory_limit_bytes 1073741824",
        "headroom_box_memory_working_set_bytes 629145600",
        "headroom_box_memory_usage_bytes 734003200",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} missing:\n{metrics}"
        );
    }
    let page = get_text(&c, &format!("{base}/ui")).await;
    assert!(page.contains("OOM kills 2"), "{page}");
    assert!(page.contains("headroom-up-1-2-box"), "{page}");
    assert!(page.contains("<td>oom_killed</td>"), "{page}");
}

/// Runs the built binary on a blocking thread; returns (exit code, stdout, stderr).
async fn headroom(args: Vec<String>) -> (Option<i32>, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(&args)
            .output()
            .expect("run headroom");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

/// Where there is no NVML (a CPU box), `top`, `bench` and `soak` read the pool of the
/// `headroom up` behind the gateway from its `/admin/box` (with the API key): `top` draws it,
/// `bench` charts it, and `soak` gives its leak verdict on it. The box's backend grows by 16 MiB
/// a second here, so the soak's floors rise round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_bench_and_soak_read_the_box_pool_without_nvml() {
    if headroom_gpu::NvmlProbe::new().is_ok() {
        eprintln!("a GPU driver here: the tools read NVML, not the box's pool");
        return;
    }
    let hits = Arc::new(AtomicU64::new(0));
    let up = upstream(hits.clone()).await;
    let steered = Arc::new(Steered(Mutex::new(report(&up))));
    let toml = format!(
        "{}\n[memory]\nprobe = \"host\"\ncapacity = \"1GiB\"\nwatch = [\"{up}\"]\n",
        config(&up)
    );
    let (base, stop) = gateway(&toml, Some(steered.clone())).await;
    let grow = {
        let steered = steered.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                steered.0.lock().unwrap().backends[0].current_bytes += (16 << 20) / 10;
            }
        })
    };
    let key = |mut a: Vec<&str>| {
        a.extend(["--api-key", "sekret"]);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };

    // top: the pool, named for what it is, with the backend as its process.
    let (code, out, err) = headroom(key(vec![
        "top",
        "--once",
        "--format",
        "json",
        "--gateway",
        &base,
    ]))
    .await;
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["source"], "box");
    assert_eq!(v["gpus"][0]["name"], "host RAM");
    assert_eq!(v["gpus"][0]["total_bytes"], 1u64 << 30);
    assert_eq!(v["gpus"][0]["processes"][0]["pid"], 4242);
    assert!(
        v["gpus"][0]["used_bytes"].as_u64().unwrap() >= 201 << 20,
        "{v}"
    );
    // Without the key the gateway refuses, and top says why in one line (exit 2).
    let (code, _, err) = headroom(
        ["top", "--once", "--gateway", &base]
            .into_iter()
            .map(String::from)
            .collect(),
    )
    .await;
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("requires an API key"), "{err}");

    // bench: the pool sampled and charted.
    let dir = tempfile::tempdir().unwrap();
    let audio = dir.path().join("audio");
    std::fs::create_dir(&audio).unwrap();
    std::fs::write(
        audio.join("a.wav"),
        headroom_server::audio::fixtures::wav(1.0, 8000, 1),
    )
    .unwrap();
    let charts = dir.path().join("charts");
    // The same transcription workload for bench and soak, with the key.
    let workload = |tool: &str, more: &[&str]| {
        let mut a = vec![tool, "--url", &base, "--model", "whisper-1", "--kind"];
        a.extend(["transcription", "--audio-dir", audio.to_str().unwrap()]);
        a.extend(more);
        key(a)
    };
    let (code, out, err) = headroom(workload(
        "bench",
        &[
            "--requests",
            "6",
            "--format",
            "json",
            "--charts",
            charts.to_str().unwrap(),
        ],
    ))
    .await;
    assert_eq!(code, Some(0), "{err}");
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["gpu"]["available"], true, "{}", r["gpu"]);
    assert_eq!(r["gpu"]["devices"][0]["name"], "host RAM");
    assert!(!r["gpu"]["series"].as_array().unwrap().is_empty());
    let chart = std::fs::read_to_string(charts.join("gpu-memory.svg")).unwrap();
    assert!(chart.contains("host RAM and requests"), "chart title");
    assert!(chart.contains("<polyline"), "a memory line is drawn");

    // soak: a verdict on the pool's floors, which rise here.
    let (code, out, err) = headroom(workload(
        "soak",
        &[
            "--rounds",
            "6",
            "--duration",
            "1s",
            "--gap",
            "1s",
            "--format",
            "json",
        ],
    ))
    .await;
    assert_eq!(code, Some(0), "{err}");
    let s: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["gpu_available"], true, "{}", s["gpu_reason"]);
    assert_eq!(s["leak"]["verdict"], "leak", "{}", s["leak"]);
    grow.abort();
    let _ = stop.send(());
}

/// An upstream that reads each request and closes the connection without an answer, as an engine
/// killed mid-job does (found by the drill's hour: a dictation in flight when Whisper was killed
/// got the gateway's 502 and was never served).
async fn dying_upstream() -> String {
    use tokio::io::AsyncReadExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                let _ = tokio::time::timeout(Duration::from_millis(300), async {
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                })
                .await;
                drop(conn);
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_backend_that_dies_under_a_request_gets_503_with_retry_after_under_up() {
    let up = dying_upstream().await;
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    // Under `up`: the supervisor has not seen the exit yet (the backend still reads ready).
    let mut r = report(&up);
    r.backends[0].retry_after_ms = Some(2500);
    let steered: Arc<dyn BoxProvider> = Arc::new(Steered(Mutex::new(r)));
    let (base, _stop) = gateway(&config(&up), Some(steered)).await;
    let r = transcribe(&c, &base).await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "3");
    let v: serde_json::Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "backend_unavailable");
    // Without a box the gateway cannot know the upstream will come back: its 502 stands.
    let (base, _stop) = gateway(&config(&up), None).await;
    let r = transcribe(&c, &base).await;
    assert_eq!(r.status(), 502);
    assert!(r.headers().get("retry-after").is_none());
}
