//! The status page (`/ui`) in a real headless Chromium, driven over the DevTools protocol: the
//! page must show the gateway's lanes live, show the 429s of a burst as the clients saw them,
//! and call its data stale once the gateway is gone. Also the page without JavaScript (the
//! server-rendered table) and the page's key check.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use headroom_gpu::{GpuProbe, ScriptedProbe};
use headroom_server::{Running, ServeSettings};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

use crate::serve_upstream;

fn config(upstream: &str, keys: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
api_keys = [{keys}]
scrape_interval = "200ms"

[[lanes]]
name = "text"
paths = ["/v1/chat/completions"]
upstreams = ["{upstream}"]
max_inflight = 1
max_queue = 0
policy = "reject"
engine = "vllm"

[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{upstream}"]
max_inflight = 2
max_queue = 4
"#
    )
}

async fn gateway(toml: &str) -> Running {
    let config = ServeSettings::from_toml(toml).expect("test config is valid");
    // A 24 GiB card whose use climbs from 6 GiB to 12 GiB over the first 30 readings.
    let used: Vec<u64> = (0..=30).map(|i| (6 << 30) + i * (200 << 20)).collect();
    let probe: Arc<dyn GpuProbe> = Arc::new(ScriptedProbe::single_gpu_series(
        24 << 30,
        4242,
        "vllm",
        &used,
    ));
    headroom_server::spawn(config, Some(probe))
        .await
        .expect("gateway starts")
}

/// What a vLLM's /metrics says, for the engines table.
fn vllm_metrics(up: &serve_upstream::Upstream) {
    *up.metrics_text.lock().unwrap() = "# TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{model_name=\"m\"} 0\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\"} 1\n\
        # TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.37\n"
        .to_string();
}

/// The browser to drive: `HEADROOM_CHROMIUM`, else the first of the usual names on PATH.
fn chromium() -> Option<String> {
    if let Ok(p) = std::env::var("HEADROOM_CHROMIUM") {
        return Some(p);
    }
    let path = std::env::var_os("PATH")?;
    for name in ["chromium", "chromium-browser", "google-chrome", "chrome"] {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Some(candidate.to_string_lossy().into_owned());
            }
        }
    }
    None
}

/// CI and `HEADROOM_REQUIRE_BROWSER=1` must have a browser: a missing one fails there.
fn browser_required() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false")
        || std::env::var("HEADROOM_REQUIRE_BROWSER").is_ok_and(|v| v == "1")
}

/// The browser to drive, or `None` (said on stderr) where there is none and none is required.
fn chromium_or_skip() -> Option<String> {
    let binary = chromium();
    if binary.is_none() {
        assert!(
            !browser_required(),
            "no Chromium found (install Debian's `chromium`, or set HEADROOM_CHROMIUM)"
        );
        eprintln!("skipped: no Chromium on PATH (CI requires one)");
    }
    binary
}

/// One headless Chromium with one page, spoken to over its DevTools websocket.
struct Browser {
    child: tokio::process::Child,
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn launch(binary: &str) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut child = tokio::process::Command::new(binary)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1280,860",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("chromium starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let deadline = Instant::now() + Duration::from_secs(60);
        let browser_ws = loop {
            let line = tokio::time::timeout_at(deadline, lines.next_line())
                .await
                .expect("chromium prints its DevTools address within 60 s")
                .expect("chromium's stderr is readable")
                .expect("chromium exited before listening");
            if let Some(url) = line.split("DevTools listening on ").nth(1) {
                break url.trim().to_string();
            }
        };
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // ws://127.0.0.1:PORT/devtools/browser/ID → the page target from /json/list.
        let hostport = browser_ws
            .trim_start_matches("ws://")
            .split('/')
            .next()
            .unwrap()
            .to_string();
        let list: Value = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(format!("http://{hostport}/json/list"))
            .send()
            .await
            .unwrap()
            .bytes()
            .await
            .map(|b| serde_json::from_slice(&b).unwrap())
            .unwrap();
        let page_ws = list
            .as_array()
            .and_then(|a| a.iter().find(|t| t["type"] == "page"))
            .and_then(|t| t["webSocketDebuggerUrl"].as_str())
            .expect("chromium has a page target")
            .to_string();
        let (ws, _) = tokio_tungstenite::connect_async(page_ws.as_str())
            .await
            .expect("DevTools websocket connects");
        Browser {
            child,
            ws,
            next_id: 1,
            _profile: profile,
        }
    }

    /// Sends one DevTools command and waits for its answer (events in between are skipped).
    async fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.ws.send(Message::text(msg)).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let frame = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method} within 30 s"))
                .expect("websocket open")
                .expect("websocket frame");
            let Message::Text(text) = frame else { continue };
            let v: Value = serde_json::from_str(&text).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method} failed: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Evaluates a JavaScript expression in the page and returns its value.
    async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "returnByValue": true}),
            )
            .await;
        r["result"]["value"].clone()
    }

    /// Polls `expression` until `accept` holds, for at most `within`; returns the last value.
    async fn wait_for(
        &mut self,
        expression: &str,
        within: Duration,
        accept: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let v = self.eval(expression).await;
            if accept(&v) || Instant::now() >= deadline {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Browser {
    /// Waits (at most `within`) until the page says its data is `want` (`live`, `stale`).
    async fn wait_state(&mut self, want: &str, within: Duration) -> Value {
        self.wait_for(
            "document.querySelector('main').dataset.state",
            within,
            |v| v == &json!(want),
        )
        .await
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

const TEXT_ROW: &str = r#"document.querySelector('#lanes tr[data-lane="text"]')"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_shows_lanes_live_and_the_429s_of_a_burst() {
    let Some(binary) = chromium_or_skip() else {
        return;
    };
    let up = serve_upstream::start().await;
    vllm_metrics(&up);
    let g = gateway(&config(&up.url(), "")).await;
    let base = format!("http://{}", g.addr);
    let mut browser = Browser::launch(&binary).await;
    browser
        .call("Page.navigate", json!({"url": format!("{base}/ui")}))
        .await;

    // The script has taken over (state "live") and shows both lanes with their limits.
    let state = browser
        .wait_for(
            &format!("document.querySelector('main').dataset.state + '|' + ({TEXT_ROW} ? {TEXT_ROW}.querySelector('.inflight').textContent : '')"),
            Duration::from_secs(20),
            |v| v.as_str().is_some_and(|s| s.starts_with("live|")),
        )
        .await;
    assert_eq!(
        state,
        json!("live|0/1"),
        "the page shows the text lane live"
    );
    let audio = browser
        .eval(r#"document.querySelector('#lanes tr[data-lane="audio"] .queued').textContent"#)
        .await;
    assert_eq!(audio, json!("0/4"));
    let before = browser
        .eval(&format!("{TEXT_ROW}.querySelector('.t429').textContent"))
        .await;
    assert_eq!(before, json!("0"));
    // Memory from the probe and the engine's own load, as the gateway read them.
    let memory = browser
        .wait_for(
            "document.querySelector('#memory tbody td:nth-child(2)').textContent",
            Duration::from_secs(10),
            |v| v.as_str().is_some_and(|s| s.ends_with("GiB")),
        )
        .await;
    let gib: f64 = memory
        .as_str()
        .unwrap()
        .trim_end_matches(" GiB")
        .parse()
        .unwrap();
    assert!((6.0..=12.01).contains(&gib), "memory shown: {memory}");
    let kv = browser
        .wait_for(
            "document.querySelector('#engines tbody td:nth-child(2)').textContent",
            Duration::from_secs(10),
            |v| v == &json!("37 %"),
        )
        .await;
    assert_eq!(kv, json!("37 %"), "engine KV usage shown");

    // A burst of ten against one slot and no queue: the clients count their 429s.
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let sends = (0..10).map(|i| {
        let c = client.clone();
        let url = format!("{base}/v1/chat/completions");
        let body = body.clone();
        async move {
            c.post(url)
                .header("content-type", "application/json")
                .header("x-test-id", format!("burst-{i}"))
                .header("x-test-delay-ms", "1500")
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    });
    let statuses = futures_util::future::join_all(sends).await;
    let rejected = statuses.iter().filter(|s| **s == 429).count();
    assert!(
        rejected >= 5,
        "the burst is rejected by the lane: {statuses:?}"
    );

    // The page shows exactly what the clients saw, and names the code.
    let shown = browser
        .wait_for(
            &format!("{TEXT_ROW}.querySelector('.t429').textContent"),
            Duration::from_secs(10),
            |v| v == &json!(rejected.to_string()),
        )
        .await;
    assert_eq!(shown, json!(rejected.to_string()), "429 total on the page");
    let codes = browser
        .eval("Array.from(document.querySelectorAll('#rejections td.code')).map(e => e.textContent).join(',')")
        .await;
    assert!(
        codes.as_str().unwrap_or("").contains("lane_saturated"),
        "rejections by code: {codes}"
    );
    let rate = browser
        .eval(&format!(
            "parseFloat({TEXT_ROW}.querySelector('.r429').textContent)"
        ))
        .await;
    assert!(
        rate.as_f64().unwrap_or(0.0) > 0.0,
        "429/s over the last 10 s: {rate}"
    );

    // A picture of it, for the README when asked for.
    let shot = browser
        .call("Page.captureScreenshot", json!({"format": "png"}))
        .await;
    let png = {
        use base64::Engine as _;
        base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().unwrap())
            .unwrap()
    };
    assert_eq!(&png[1..4], b"PNG");
    let target = std::env::var("HEADROOM_UI_SCREENSHOT").unwrap_or_else(|_| {
        std::env::temp_dir()
            .join("headroom-ui.png")
            .display()
            .to_string()
    });
    std::fs::write(&target, &png).unwrap();

    // The gateway goes away: the page must say its data is stale, not keep showing it as live.
    g.shutdown().await.unwrap();
    let gone = browser.wait_state("stale", Duration::from_secs(15)).await;
    assert_eq!(gone, json!("stale"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_without_javascript_is_a_table_and_needs_the_key() {
    let up = serve_upstream::start().await;
    let g = gateway(&config(&up.url(), r#""page-key""#)).await;
    let base = format!("http://{}", g.addr);
    let client = reqwest::Client::builder().no_proxy().build().unwrap();

    // Without a key: 401 that makes a browser ask (Basic), in OpenAI's error shape.
    let r = client.get(format!("{base}/ui")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let ask = r.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(ask.starts_with("Basic"), "{ask}");
    let err: Value = serde_json::from_slice(&r.bytes().await.unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "invalid_api_key");
    // A wrong Basic password is refused; the key as the password is accepted; so is Bearer.
    let r = client
        .get(format!("{base}/ui/state"))
        .basic_auth("anyone", Some("nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client
        .get(format!("{base}/ui/state"))
        .bearer_auth("page-key")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    // One rejection, then the server-rendered page (what a browser without JavaScript shows).
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let slow = {
        let c = client.clone();
        let url = format!("{base}/v1/chat/completions");
        let body = body.clone();
        tokio::spawn(async move {
            c.post(url)
                .bearer_auth("page-key")
                .header("content-type", "application/json")
                .header("x-test-delay-ms", "1500")
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth("page-key")
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    // The ring samples once a second: wait for a sample that has the rejection.
    let deadline = Instant::now() + Duration::from_secs(10);
    let html = loop {
        let html = client
            .get(format!("{base}/ui"))
            .basic_auth("ops", Some("page-key"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if html.contains("<td>lane_saturated</td>") || Instant::now() >= deadline {
            break html;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        html.contains(r#"<tr data-lane="text">"#),
        "lanes table rendered"
    );
    assert!(
        html.contains(r#"<td class="t429">1</td>"#),
        "one 429 in the table"
    );
    assert!(
        html.contains("<td>lane_saturated</td><td>429</td>"),
        "{html}"
    );
    assert!(
        !html.contains("src=\"http"),
        "nothing loaded from elsewhere"
    );
    g.shutdown().await.unwrap();
}

const AUDIO_WAITING: &str = r#"document.querySelector('#lanes tr[data-lane="audio"] .waiting')"#;

/// A transcription that waits on memory, on the real host pool: the fake audio upstream runs in
/// its own Python process (its process tree is the pool's member, read from /proc), the first job
/// holds the upstream for 8 s with a reservation of 600 MiB, and a second one cannot fit beside it
/// in the 1000 MiB pool (600 + 64 MiB margin against about 390 MiB left) but will once the first
/// ends. While it waits the page must say why: the pool's name, the need and margin, and the free
/// figure the gate compared; then the job must get in (blocked for now, not refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn page_shows_why_an_audio_job_waits_for_memory() {
    let Some(binary) = chromium_or_skip() else {
        return;
    };
    let _serial = crate::common::SERIAL.lock().await;
    let upstream = crate::memory::AllocUpstream::start(16, 8000, 0);
    let pool = crate::memory::Pool::new("600MiB");
    let mut config = pool.config(&upstream.url);
    config.lanes[0].spec.name = "audio".into();
    let g = headroom_server::spawn(config, None)
        .await
        .expect("gateway starts");
    let base = format!("http://{}", g.addr);
    let mut browser = Browser::launch(&binary).await;
    browser
        .call("Page.navigate", json!({"url": format!("{base}/ui")}))
        .await;
    let state = browser.wait_state("live", Duration::from_secs(20)).await;
    assert_eq!(state, json!("live"));

    let (b1, b2) = (base.clone(), base.clone());
    let first = tokio::spawn(async move {
        crate::memory::transcribe(
            &reqwest::Client::builder().no_proxy().build().unwrap(),
            &b1,
            None,
        )
        .await
    });
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    crate::serve::wait_lane(&c, &base, "audio", Duration::from_secs(10), |l| {
        l["inflight"] == 1
    })
    .await;
    let second = tokio::spawn(async move {
        crate::memory::transcribe(
            &reqwest::Client::builder().no_proxy().build().unwrap(),
            &b2,
            None,
        )
        .await
    });
    let lanes = crate::serve::wait_lane(&c, &base, "audio", Duration::from_secs(5), |l| {
        l["waiting_for"]["reason"] == "host_memory"
    })
    .await;
    let audio = crate::serve::lane(&lanes, "audio");
    assert_eq!(audio["waiting_for"]["reason"], "host_memory", "{audio}");
    assert_eq!(audio["memory"]["pool"], "host RAM");
    assert_eq!(lanes["memory"][0]["name"], "host RAM");
    let read_free = lanes["memory"][0]["free_bytes"].as_u64().unwrap() as f64 / MIB;

    // The lane's row says what holds it, with the figures.
    let shown = browser
        .wait_for(
            &format!("{AUDIO_WAITING} ? {AUDIO_WAITING}.textContent : ''"),
            Duration::from_secs(10),
            |v| v.as_str().is_some_and(|s| s.contains("MiB free")),
        )
        .await;
    let shown = shown.as_str().unwrap_or("").to_string();
    assert!(
        shown.starts_with("host RAM: needs 600.0 MiB + 64.0 MiB margin; "),
        "waiting cell: {shown:?}"
    );
    let free: f64 = shown
        .split("; ")
        .nth(1)
        .and_then(|rest| rest.split(" MiB free").next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no free figure in {shown:?}"));
    assert!(
        (free - read_free).abs() < 32.0 && free < 600.0 + 64.0 + 584.0,
        "page says {free} MiB free, /admin/lanes {read_free} MiB"
    );
    assert!(shown.contains("MiB reserved"), "{shown:?}");
    // The pool is named for what it is in the memory and ledger tables too.
    let names = browser
        .eval("[document.querySelector('#memory tbody td').textContent, document.querySelector('#ledger-table tbody td').textContent].join('|')")
        .await;
    assert_eq!(names, json!("host RAM|host RAM"));

    // Blocked for now, not refused: the second job gets in once the first ends.
    let (status, _, code, _) = first.await.unwrap();
    assert_eq!(status, 200, "{code:?}");
    let (status, _, code, waited) = second.await.unwrap();
    assert_eq!(
        status, 200,
        "the waiting job gets in after the first: {code:?}"
    );
    assert!(waited >= Duration::from_secs(4), "it waited: {waited:?}");
    let cleared = browser
        .wait_for(
            &format!("{AUDIO_WAITING} ? {AUDIO_WAITING}.textContent : 'none'"),
            Duration::from_secs(10),
            |v| v == &json!(""),
        )
        .await;
    assert_eq!(cleared, json!(""), "nothing waits any more");
    g.shutdown().await.unwrap();
}

const MIB: f64 = (1u64 << 20) as f64;
