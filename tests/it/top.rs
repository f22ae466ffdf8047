//! `headroom top` end to end through the built binary: no-driver behaviour, replays of a recorded
//! sample file, and lanes read from a real HTTP server on 127.0.0.1.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use axum::Router;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use serde_json::Value;

fn headroom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .output()
        .expect("run headroom")
}

fn sample_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gpu/two-gpus-10s.jsonl")
}

fn stderr_line(output: &Output) -> String {
    let text = String::from_utf8_lossy(&output.stderr).to_string();
    assert_eq!(
        text.trim_end().lines().count(),
        1,
        "one line on stderr: {text}"
    );
    text.trim_end().to_string()
}

/// The last line of each GPU in the sample file, read independently of the code under test.
fn last_lines_per_gpu() -> Vec<Value> {
    let text = std::fs::read_to_string(sample_file()).expect("sample file");
    let mut last: Vec<Value> = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).expect("json line");
        let gpu = v["gpu"].as_u64().expect("gpu") as usize;
        if last.len() <= gpu {
            last.resize(gpu + 1, Value::Null);
        }
        last[gpu] = v;
    }
    last
}

/// Serves `router` on 127.0.0.1:0 from a background runtime; returns the base URL.
fn serve(router: Router) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            tx.send(listener.local_addr().expect("addr"))
                .expect("send addr");
            axum::serve(listener, router).await.expect("serve");
        });
    });
    let addr = rx.recv().expect("server address");
    format!("http://{addr}")
}

#[test]
fn once_without_a_driver_exits_2_naming_the_loaders_reason() {
    let output = headroom(&["top", "--once"]);
    if headroom_gpu::NvmlProbe::new().is_ok() {
        // A machine with a driver: --once must then print a snapshot instead.
        assert!(output.status.success(), "{output:?}");
        return;
    }
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    let line = stderr_line(&output);
    assert!(line.starts_with("headroom: "), "{line}");
    assert!(line.contains("no NVIDIA driver"), "{line}");
    assert!(
        line.contains("libnvidia-ml"),
        "the loader's reason is named: {line}"
    );
    assert!(output.stdout.is_empty());
}

#[test]
fn record_without_a_driver_exits_2_too() {
    if headroom_gpu::NvmlProbe::new().is_ok() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("rec.jsonl");
    let output = headroom(&[
        "top",
        "--record",
        file.to_str().expect("path"),
        "--duration",
        "200ms",
    ]);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(stderr_line(&output).contains("no NVIDIA driver"));
}

#[test]
fn replay_once_renders_every_gpu_and_process() {
    let file = sample_file();
    let output = headroom(&["top", "--once", "--replay", file.to_str().expect("path")]);
    assert!(output.status.success(), "{output:?}");
    let text = String::from_utf8(output.stdout).expect("utf8");
    for needle in [
        "GPU 0 · NVIDIA L4",
        "GPU 1 · Tesla T4",
        "vllm",
        "whisper-server",
        "last 60 s",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in:\n{text}");
    }
    // Sorted by memory: the larger process first.
    assert!(text.find("vllm").expect("vllm") < text.find("whisper-server").expect("whisper"));
}

#[test]
fn replay_once_json_reports_the_last_sample_of_each_gpu() {
    let file = sample_file();
    let output = headroom(&[
        "top",
        "--once",
        "--format",
        "json",
        "--replay",
        file.to_str().expect("path"),
    ]);
    assert!(output.status.success(), "{output:?}");
    let json: Value = serde_json::from_slice(&output.stdout).expect("json");
    let expected = last_lines_per_gpu();
    let gpus = json["gpus"].as_array().expect("gpus");
    assert_eq!(gpus.len(), expected.len());
    for (gpu, line) in gpus.iter().zip(&expected) {
        assert_eq!(gpu["used_bytes"], line["used_bytes"]);
        assert_eq!(gpu["free_bytes"], line["free_bytes"]);
        assert_eq!(gpu["ts_ms"], line["ts_ms"]);
        assert_eq!(
            gpu["processes"].as_array().map(Vec::len),
            line["processes"].as_array().map(Vec::len)
        );
    }
    assert_eq!(json["lanes"], Value::Null, "no --gateway, no lanes");
}

#[test]
fn gateway_lanes_are_shown_with_missing_fields_tolerated() {
    let body = r#"{"lanes":[
        {"name":"audio","inflight":2,"queued":1,"rejected":5,"max_inflight":4,"max_queue":8},
        {"name":"text","inflight":3}
    ]}"#;
    let url = serve(Router::new().route(
        "/admin/lanes",
        get(move || async move { ([(header::CONTENT_TYPE, "application/json")], body) }),
    ));
    let file = sample_file();
    let path = file.to_str().expect("path");
    let output = headroom(&[
        "top",
        "--once",
        "--format",
        "json",
        "--replay",
        path,
        "--gateway",
        &url,
    ]);
    assert!(output.status.success(), "{output:?}");
    let json: Value = serde_json::from_slice(&output.stdout).expect("json");
    let lanes = json["lanes"].as_array().expect("lanes");
    assert_eq!(lanes.len(), 2);
    assert_eq!(lanes[0]["name"], "audio");
    assert_eq!(lanes[0]["rejected"], 5);
    assert_eq!(lanes[1]["inflight"], 3);
    assert_eq!(lanes[1]["queued"], Value::Null);

    let output = headroom(&["top", "--once", "--replay", path, "--gateway", &url]);
    let text = String::from_utf8(output.stdout).expect("utf8");
    assert!(text.contains("gateway lanes"), "{text}");
    assert!(text.contains("2/4"), "in-flight of max: {text}");
}

/// A gateway off loopback requires an API key: `top --gateway` sends `--api-key` (or
/// `HEADROOM_API_KEY`) as a bearer token, and says what is missing when it has none.
#[test]
fn gateway_lanes_are_read_with_an_api_key() {
    let body = r#"{"lanes":[{"name":"text","inflight":1}]}"#;
    let url = serve(Router::new().route(
        "/admin/lanes",
        get(move |headers: axum::http::HeaderMap| async move {
            let auth = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok());
            if auth == Some("Bearer top-key") {
                ([(header::CONTENT_TYPE, "application/json")], body).into_response()
            } else {
                (StatusCode::UNAUTHORIZED, "no key").into_response()
            }
        }),
    ));
    let file = sample_file();
    let path = file.to_str().expect("path");
    let base = [
        "top",
        "--once",
        "--format",
        "json",
        "--replay",
        path,
        "--gateway",
        &url,
    ];
    let output = headroom(&base);
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert!(stderr_line(&output).contains("--api-key"), "{output:?}");
    let mut with_key = base.to_vec();
    with_key.extend(["--api-key", "top-key"]);
    let output = headroom(&with_key);
    assert!(output.status.success(), "{output:?}");
    let json: Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(json["lanes"][0]["name"], "text");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(base)
        .env("HEADROOM_API_KEY", "top-key")
        .output()
        .expect("runs");
    assert!(output.status.success(), "{output:?}");
}

#[test]
fn gateway_errors_exit_2_naming_the_url() {
    let url = serve(Router::new().route(
        "/admin/lanes",
        get(|| async { (StatusCode::NOT_FOUND, "no such route") }),
    ));
    let file = sample_file();
    let path = file.to_str().expect("path");
    let output = headroom(&["top", "--once", "--replay", path, "--gateway", &url]);
    assert_eq!(output.status.code(), Some(2));
    let line = stderr_line(&output);
    assert!(
        line.contains("/admin/lanes") && line.contains("HTTP 404"),
        "{line}"
    );

    // A port nobody listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("addr");
    drop(closed);
    let output = headroom(&[
        "top",
        "--once",
        "--replay",
        path,
        "--gateway",
        &format!("http://{addr}"),
    ]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr_line(&output).contains(&addr.to_string()));
}

#[test]
fn bad_input_exits_2_with_one_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "{\"ts_ms\":1,\"gpu\":0,\"used_bytes\":1,\"free_bytes\":1}\nnot json\n",
    )
    .expect("write");
    let output = headroom(&["top", "--once", "--replay", bad.to_str().expect("path")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr_line(&output).contains("bad.jsonl:2"));

    let missing = dir.path().join("missing.jsonl");
    let output = headroom(&["top", "--once", "--replay", missing.to_str().expect("path")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr_line(&output).contains("missing.jsonl"));

    for args in [
        vec!["top", "--once", "--interval", "2ms"],
        vec!["top", "--once", "--interval", "fast"],
        vec!["top", "--once", "--gateway", "https://127.0.0.1:1"],
        vec!["top", "--speed", "-1", "--once"],
    ] {
        let output = headroom(&args);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {output:?}");
        stderr_line(&output);
    }
}

#[test]
fn live_view_without_a_terminal_says_what_to_use_instead() {
    let file = sample_file();
    let output = headroom(&["top", "--replay", file.to_str().expect("path")]);
    assert_eq!(output.status.code(), Some(2));
    assert!(stderr_line(&output).contains("--once"));
}
