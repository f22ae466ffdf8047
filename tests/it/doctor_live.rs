//! `headroom doctor --metrics` against real servers: the `headroom serve` binary in front of the
//! in-process timed upstream, once refusing text while audio idles (the policy finding, with
//! the share the clients saw) and once quiet (nothing wrong). The llama.cpp case runs against
//! the real llama.cpp server in tests/e2e/test_doctor_live.py.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::serve_upstream;

/// Starts `headroom serve` on a free port with `toml`; returns the child and its address.
fn serve(toml: &str, dir: &tempfile::TempDir) -> (std::process::Child, String) {
    use std::io::BufRead;
    let path = dir.path().join("headroom.toml");
    std::fs::write(&path, toml).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (child, addr)
}

fn config(upstream: &str, text_lane: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\n\
         [[lanes]]\nname = \"audio\"\npaths = [\"/v1/audio/transcriptions\"]\nupstreams = [\"{upstream}\"]\n\
         max_inflight = 1\nmax_queue = 4\nqueue_timeout = \"10s\"\nrequest_timeout = \"30s\"\npolicy = \"queue\"\n\
         [[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{upstream}\"]\n{text_lane}\n"
    )
}

/// Runs the doctor binary against `metrics` and returns its JSON.
async fn doctor(metrics: &str, interval: &str) -> Value {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args([
            "doctor",
            "--metrics",
            metrics,
            "--interval",
            interval,
            "--format",
            "json",
        ])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "doctor failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Sends chat requests in bursts of `burst` concurrent ones, each held `delay_ms` upstream,
/// until `stop` is set; counts what the clients got.
async fn load(
    base: String,
    burst: usize,
    delay_ms: u64,
    stop: Arc<std::sync::atomic::AtomicBool>,
    sent: Arc<AtomicU64>,
    refused: Arc<AtomicU64>,
    client: Option<&'static str>,
) {
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let mut rounds = 0;
    while !stop.load(Ordering::Relaxed) && rounds < 200 {
        rounds += 1;
        let mut tasks = Vec::new();
        for _ in 0..burst {
            let (c, base, body) = (c.clone(), base.clone(), body.clone());
            tasks.push(tokio::spawn(async move {
                let mut rb = c.post(format!("{base}/v1/chat/completions"));
                if let Some(id) = client {
                    rb = rb.header("x-headroom-client", id);
                }
                rb.header("content-type", "application/json")
                    .header("x-test-delay-ms", delay_ms.to_string())
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }));
        }
        for t in tasks {
            let status = t.await.unwrap();
            sent.fetch_add(1, Ordering::Relaxed);
            if status == 429 || status == 503 {
                refused.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn findings(report: &Value) -> Vec<Value> {
    report["endpoints"][0]["findings"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn doctor_metrics_names_a_gateway_that_rejects_text_while_audio_idles() {
    let _serial = crate::common::SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = serve(
        &config(
            &up.url(),
            "max_inflight = 1\nmax_queue = 0\nqueue_timeout = \"5s\"\nrequest_timeout = \"30s\"\npolicy = \"reject\"",
        ),
        &dir,
    );
    let base = format!("http://{addr}");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (sent, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // Four at once on a one-slot lane with no queue: three of every four are refused.
    let driver = tokio::spawn(load(
        base.clone(),
        4,
        400,
        stop.clone(),
        sent.clone(),
        refused.clone(),
        None,
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = doctor(&format!("{base}/metrics"), "2s").await;
    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    let _ = child.kill();
    let _ = child.wait();

    assert_eq!(report["endpoints"][0]["source"], "gateway", "{report:#}");
    let all = findings(&report);
    let f = all
        .iter()
        .find(|f| f["cause"] == "rejecting_while_audio_idle")
        .unwrap_or_else(|| panic!("no policy finding: {report:#}"));
    eprintln!(
        "policy finding: {f:#}\nclients: {} sent, {} refused",
        sent.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
    assert_eq!(f["lane"], "text");
    let share = f["numbers"]["refused_share"].as_f64().unwrap();
    let client_share = refused.load(Ordering::Relaxed) as f64 / sent.load(Ordering::Relaxed) as f64;
    assert!(
        (share - client_share).abs() < 0.2,
        "doctor measured {share:.3}, clients saw {client_share:.3}"
    );
    assert!(share > 0.5, "{share}");
    let fix = f["fix"].as_str().unwrap();
    assert!(fix.contains("policy = \"queue\""), "{fix}");
    assert!(fix.contains("max_inflight"), "{fix}");
    assert!(
        fix.contains(&format!("({:.1}%)", share * 100.0)),
        "the fix prints the measured share: {fix}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn doctor_metrics_says_nothing_is_wrong_with_a_quiet_gateway() {
    let _serial = crate::common::SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = serve(
        &config(
            &up.url(),
            "max_inflight = 2\nmax_queue = 0\nqueue_timeout = \"5s\"\nrequest_timeout = \"30s\"\npolicy = \"reject\"",
        ),
        &dir,
    );
    let base = format!("http://{addr}");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (sent, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // One request at a time on a two-slot lane: served, never refused.
    let driver = tokio::spawn(load(
        base.clone(),
        1,
        50,
        stop.clone(),
        sent.clone(),
        refused.clone(),
        None,
    ));
    let report = doctor(&format!("{base}/metrics"), "2s").await;
    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    let _ = child.kill();
    let _ = child.wait();

    eprintln!("quiet gateway: {:#}", report["endpoints"][0]["figures"]);
    assert_eq!(refused.load(Ordering::Relaxed), 0);
    let e = &report["endpoints"][0];
    assert_eq!(e["source"], "gateway");
    assert!(findings(&report).is_empty(), "{report:#}");
    assert!(
        e["figures"]["text.requests"].as_f64().unwrap() >= 3.0,
        "the quiet verdict rests on real traffic: {report:#}"
    );
    assert_eq!(report["findings"], 0);
}

#[test]
fn doctor_metrics_refuses_bad_addresses_with_one_line_and_exit_2() {
    for (args, needle) in [
        (vec!["--metrics", "ftp://127.0.0.1/metrics"], "only http://"),
        (vec!["--metrics", "not a url"], "is not a URL"),
        (
            vec![
                "--metrics",
                "http://127.0.0.1:9/metrics",
                "--interval",
                "0s",
            ],
            "must be above 0",
        ),
        (
            vec![
                "--metrics",
                "http://127.0.0.1:9/metrics",
                "--interval",
                "1s",
            ],
            "cannot read",
        ),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
            .arg("doctor")
            .args(&args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn doctor_metrics_names_clients_that_come_back_before_retry_after() {
    let _serial = crate::common::SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (mut child, addr) = serve(
        &config(
            &up.url(),
            "max_inflight = 1\nmax_queue = 0\nqueue_timeout = \"5s\"\nrequest_timeout = \"30s\"\npolicy = \"reject\"",
        ),
        &dir,
    );
    let base = format!("http://{addr}");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (sent, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    // One identified client that retries at once, whatever Retry-After said (at least 1 s).
    let driver = tokio::spawn(load(
        base.clone(),
        3,
        100,
        stop.clone(),
        sent.clone(),
        refused.clone(),
        Some("impatient-client"),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = doctor(&format!("{base}/metrics"), "2s").await;
    stop.store(true, Ordering::Relaxed);
    driver.await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let all = findings(&report);
    let f = all
        .iter()
        .find(|f| f["cause"] == "retry_after_ignored")
        .unwrap_or_else(|| panic!("no Retry-After finding: {report:#}"));
    eprintln!("retry finding: {f:#}");
    assert_eq!(f["lane"], "text");
    let early = f["numbers"]["early_retries"].as_f64().unwrap();
    let refused_in_window = f["numbers"]["refused"].as_f64().unwrap();
    assert!(early >= 1.0 && refused_in_window >= 1.0, "{f:#}");
    assert!(f["fix"].as_str().unwrap().contains("Retry-After"));
}
