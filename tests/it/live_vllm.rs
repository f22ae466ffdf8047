//! Against a live vLLM (scripts/backends.sh start vllm; HEADROOM_VLLM_URL): the metric names the
//! gateway reads are the ones this vLLM really exposes. Ignored in a plain `cargo test` (it needs
//! the server); scripts/test.sh runs it with `--ignored` once vLLM is up, and there a missing URL
//! or an unreachable server fails the test instead of skipping it.

use std::collections::BTreeSet;

use headroom_server::config::EngineKind;
use headroom_server::scrape::{VLLM_KV_USAGE, VLLM_RUNNING, VLLM_WAITING, parse_engine_metrics};

/// Names of the samples in a Prometheus text (labels and values cut off, comments skipped).
fn sample_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
#[ignore = "needs a live vLLM: scripts/test.sh starts one and runs this with --ignored"]
async fn the_gateway_reads_the_metric_names_this_vllm_exposes() {
    let url = std::env::var("HEADROOM_VLLM_URL")
        .expect("HEADROOM_VLLM_URL must point at the vLLM that scripts/backends.sh started");
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("vLLM /metrics")
        .text()
        .await
        .unwrap();
    let live: BTreeSet<String> = sample_names(&text)
        .into_iter()
        .filter(|n| n.starts_with("vllm:"))
        .collect();
    let (kv_current, kv_older) = (VLLM_KV_USAGE[0], &VLLM_KV_USAGE[1..]);
    for name in [VLLM_WAITING, VLLM_RUNNING, kv_current] {
        assert!(
            live.contains(name),
            "the gateway reads {name}, which this vLLM does not expose; it exposes: {live:?}"
        );
    }
    // The older KV name is a fallback for older versions only: this one must not need it.
    for name in kv_older {
        assert!(!live.contains(*name), "{name} is exposed too: {live:?}");
    }
    let load = parse_engine_metrics(EngineKind::Vllm, &text, tokio::time::Instant::now())
        .expect("the gateway finds vLLM's load in its /metrics");
    assert!(load.waiting.is_some() && load.running.is_some() && load.kv_cache_usage.is_some());
    let kv = load.kv_cache_usage.unwrap();
    assert!(
        (0.0..=1.0).contains(&kv),
        "kv_cache_usage_perc is a fraction: {kv}"
    );
}
