//! The files under `deploy/` against a running gateway: every PromQL expression of the Grafana
//! dashboard and of the alert rules parses, and names only metrics that a running `serve` really
//! exports (scraped here after traffic that makes each family appear). The box figures that
//! `headroom up` feeds in come from a stub provider shaped as `up` reports them.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use headroom_gpu::{DeviceSnapshot, GpuProbe, ScriptedProbe};
use headroom_server::ServeSettings;
use promql_parser::parser::{self, Expr};
use serde_json::{Value, json};

use crate::serve_upstream;

/// The box as `headroom up` reports it: one audio backend that restarted once.
struct StubBox;

impl headroom_server::admin_box::BoxProvider for StubBox {
    fn report(&self) -> headroom_server::admin_box::BoxReport {
        use headroom_server::admin_box::{BackendReport, BackendState, BoxReport};
        BoxReport {
            probe: "host".into(),
            capacity_bytes: 8 << 30,
            margin_bytes: 256 << 20,
            text_budget_bytes: 4 << 30,
            backends: vec![BackendReport {
                name: "whisper".into(),
                role: "audio".into(),
                engine: "whisper".into(),
                pid: Some(4242),
                state: BackendState::Ready,
                upstream: "http://127.0.0.1:9".into(),
                resident_bytes: 300 << 20,
                peak_bytes: 500 << 20,
                current_bytes: 320 << 20,
                restarts: 1,
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
}

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Grafana's variables replaced by values PromQL accepts.
fn ungrafana(expr: &str) -> String {
    expr.replace("$__rate_interval", "5m")
        .replace("$__interval", "1m")
        .replace("\"$lane\"", "\".*\"")
        .replace("$lane", ".*")
}

/// Every metric name an expression selects.
fn selected(expr: &Expr, out: &mut BTreeSet<String>) {
    match expr {
        Expr::VectorSelector(vs) => {
            if let Some(n) = &vs.name {
                out.insert(n.clone());
            }
        }
        Expr::MatrixSelector(ms) => {
            if let Some(n) = &ms.vs.name {
                out.insert(n.clone());
            }
        }
        Expr::Aggregate(a) => {
            selected(&a.expr, out);
            if let Some(p) = &a.param {
                selected(p, out);
            }
        }
        Expr::Unary(u) => selected(&u.expr, out),
        Expr::Binary(b) => {
            selected(&b.lhs, out);
            selected(&b.rhs, out);
        }
        Expr::Paren(p) => selected(&p.expr, out),
        Expr::Subquery(s) => selected(&s.expr, out),
        Expr::Call(c) => {
            for a in &c.args.args {
                selected(a, out);
            }
        }
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

/// `(where, expression)` for every query of the dashboard, its variables included.
fn dashboard_queries(dash: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dash["panels"].as_array().unwrap() {
        for t in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {:?}", panel["title"]),
                t["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    for var in dash["templating"]["list"].as_array().unwrap() {
        if var["type"] == "query" {
            // label_values(METRIC, LABEL) is Grafana's, not PromQL: check its metric.
            let q = var["query"].as_str().unwrap();
            let metric = q
                .trim_start_matches("label_values(")
                .split(',')
                .next()
                .unwrap()
                .trim()
                .to_string();
            out.push((format!("variable {:?}", var["name"]), metric));
        }
    }
    out
}

/// `(alert, expression)` for every rule of a Prometheus rules file.
fn rule_queries(path: &std::path::Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(path).unwrap();
    let docs = yaml_rust2::YamlLoader::load_from_str(&text).unwrap();
    let mut out = Vec::new();
    for group in docs[0]["groups"].as_vec().unwrap() {
        for rule in group["rules"].as_vec().unwrap() {
            let name = rule["alert"]
                .as_str()
                .or_else(|| rule["record"].as_str())
                .unwrap();
            out.push((name.to_string(), rule["expr"].as_str().unwrap().to_string()));
        }
    }
    out
}

/// Metric names in a Prometheus text exposition (histograms as their `_bucket`, `_sum` and
/// `_count` series).
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            l.split(|c: char| c == '{' || c.is_whitespace())
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// Runs a gateway with an engine lane, a fallback lane and a GPU probe, drives traffic that
/// makes every metric family appear, and returns its `/metrics` text.
async fn scrape_busy_gateway() -> String {
    let up = serve_upstream::start().await;
    *up.metrics_text.lock().unwrap() = "# TYPE vllm:num_requests_waiting gauge\n\
        vllm:num_requests_waiting{model_name=\"m\"} 0\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\"} 1\n\
        # TYPE vllm:kv_cache_usage_perc gauge\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.2\n"
        .to_string();
    let toml = format!(
        r#"
listen = "127.0.0.1:0"
scrape_interval = "100ms"

[[lanes]]
name = "text"
paths = ["/v1/chat/completions"]
upstreams = ["{u}"]
max_inflight = 1
max_queue = 0
policy = "fallback"
fallback = "rule-based-cleanup"
engine = "vllm"

[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{u}"]
max_inflight = 1
max_queue = 2
gpu_memory_per_job = "1GiB"
"#,
        u = up.url()
    );
    let probe: Arc<dyn GpuProbe> =
        Arc::new(ScriptedProbe::constant(vec![DeviceSnapshot::with_memory(
            0,
            24 << 30,
            6 << 30,
        )]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let gateway =
        headroom_server::Gateway::new(ServeSettings::from_toml(&toml).unwrap(), Some(probe))
            .unwrap()
            .with_box(Arc::new(StubBox));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(gateway.serve(listener, async move {
        let _ = stopped.await;
    }));
    let base = format!("http://{addr}");
    let c = reqwest::Client::builder().no_proxy().build().unwrap();
    let chat = |delay: &'static str, stream: bool| {
        let c = c.clone();
        let url = format!("{base}/v1/chat/completions");
        async move {
            c.post(url)
                .header("content-type", "application/json")
                .header("x-test-delay-ms", delay)
                .body(
                    json!({"model": "m", "stream": stream,
                           "messages": [{"role": "user", "content": "um so hello"}]})
                    .to_string(),
                )
                .send()
                .await
                .unwrap()
                .bytes()
                .await
                .unwrap()
        }
    };
    // A streamed answer (TTFT, duration, queue wait), then one held while another arrives (the
    // second is refused and falls back), and a body that is not JSON (refused input).
    chat("0", true).await;
    let held = tokio::spawn(chat("800", false));
    tokio::time::sleep(Duration::from_millis(200)).await;
    chat("0", false).await;
    held.await.unwrap();
    let bad = c
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
    // Let the engine scrape and the GPU loop publish at least once.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let _ = stop.send(());
    served.await.unwrap().unwrap();
    text
}

fn check(queries: &[(String, String)], have: &BTreeSet<String>) {
    let mut problems = Vec::new();
    for (place, q) in queries {
        let q = ungrafana(q);
        let expr = match parser::parse(&q) {
            Ok(e) => e,
            Err(e) => {
                problems.push(format!("{place}: does not parse ({e}): {q}"));
                continue;
            }
        };
        let mut names = BTreeSet::new();
        selected(&expr, &mut names);
        if names.is_empty() {
            problems.push(format!("{place}: selects no metric: {q}"));
        }
        for n in names {
            if !have.contains(&n) {
                problems.push(format!("{place}: `{n}` is not exported"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_rules_name_only_exported_metrics() {
    let text = scrape_busy_gateway().await;
    let have = exported(&text);
    // The traffic reached every family the files use (else the check below proves nothing).
    for family in [
        "headroom_queue_wait_seconds_bucket",
        "headroom_ttft_seconds_bucket",
        "headroom_rejections_total",
        "headroom_fallbacks_total",
        "headroom_bad_requests_total",
        "headroom_gpu_memory_used_bytes",
        "headroom_upstream_kv_cache_usage",
        "headroom_upstream_last_scrape_timestamp_seconds",
        "headroom_lane_info",
        "headroom_memory_free_bytes",
        "headroom_lane_memory_per_job_bytes",
        "headroom_box_backend_restarts_total",
        "headroom_box_backend_start_failures_total",
        "headroom_box_backend_memory_bytes",
    ] {
        assert!(have.contains(family), "{family} missing from:\n{text}");
    }
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("deploy/grafana/headroom.json")).unwrap(),
    )
    .unwrap();
    let queries = dashboard_queries(&dash);
    assert!(queries.len() >= 20, "{} queries", queries.len());
    check(&queries, &have);
    let rules = rule_queries(&root().join("deploy/prometheus/alerts.yml"));
    assert_eq!(rules.len(), 6);
    check(&rules, &have);
}

#[test]
fn the_check_catches_a_wrong_name_and_a_broken_expression() {
    let have: BTreeSet<String> = ["headroom_lane_inflight".to_string()].into();
    let good = vec![("a".to_string(), "sum(headroom_lane_inflight)".to_string())];
    check(&good, &have);
    for bad in ["sum(headroom_lane_inflite)", "sum(headroom_lane_inflight"] {
        let q = vec![("b".to_string(), bad.to_string())];
        let r = std::panic::catch_unwind(|| check(&q, &have));
        assert!(r.is_err(), "{bad} passed the check");
    }
}
