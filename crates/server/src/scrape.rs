//! Engine metrics: parsing Prometheus text from vLLM (`vllm:num_requests_waiting`,
//! `vllm:num_requests_running`, `vllm:kv_cache_usage_perc` or its older name
//! `vllm:gpu_cache_usage_perc`) and llama.cpp (`llamacpp:requests_deferred`,
//! `llamacpp:requests_processing`, with `/slots` when `/metrics` is off), and the loops that feed
//! them and GPU memory readings to the gate and to the gauges.

use std::sync::Arc;
use std::time::Duration;

use headroom_gate::{EngineLoad, Gate};
use headroom_gpu::GpuProbe;
use serde_json::Value;
use tokio::time::Instant;

use crate::config::EngineKind;
use crate::telemetry::{
    GPU_MEMORY_USED_BYTES, Telemetry, UPSTREAM_KV_CACHE_USAGE, UPSTREAM_LAST_SCRAPE_TIMESTAMP,
    UPSTREAM_REQUESTS_RUNNING, UPSTREAM_REQUESTS_WAITING,
};

/// vLLM's queue gauge the gateway reads (summed over `model_name`s).
pub const VLLM_WAITING: &str = "vllm:num_requests_waiting";
/// vLLM's running-requests gauge the gateway reads.
pub const VLLM_RUNNING: &str = "vllm:num_requests_running";
/// vLLM's KV-cache usage gauge (0–1), current name first; the older `gpu_` name (before vLLM
/// 0.10) is still read when the current one is absent.
pub const VLLM_KV_USAGE: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];

/// Sum of one metric over all its label sets (e.g. several `model_name`s); `None` when absent.
pub(crate) fn metric_sum(text: &str, name: &str) -> Option<f64> {
    metric_fold(text, name, |a, b| a + b)
}

fn metric_max(text: &str, name: &str) -> Option<f64> {
    metric_fold(text, name, f64::max)
}

/// Whether `line` is a sample of exactly `name` (not of a longer name sharing the prefix).
fn is_sample_of(line: &str, name: &str) -> bool {
    line.strip_prefix(name)
        .and_then(|rest| rest.chars().next())
        .is_some_and(|c| c == '{' || c == ' ' || c == '\t')
}

/// The values of `name`'s samples. The exposition format is read by `prom_text_format_parser`
/// (label values with `}`, `,` or escaped quotes, optional timestamps); each candidate line is
/// parsed on its own, so one malformed line elsewhere in an engine's output (or a metric the
/// parser finds inconsistent) does not hide the rest.
fn metric_values<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .map(str::trim)
        .filter(move |l| is_sample_of(l, name))
        .flat_map(move |line| {
            let (metrics, _) = prom_text_format_parser::parse_scrape(line);
            metrics
                .into_iter()
                .filter(|m| m.name == name)
                .flat_map(|m| m.samples)
                .filter(|s| s.value.value_type == prom_text_format_parser::ValueType::Sample)
                .filter_map(|s| s.value.value.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .filter(|v| v.is_finite())
}

fn metric_fold(text: &str, name: &str, fold: fn(f64, f64) -> f64) -> Option<f64> {
    metric_values(text, name).reduce(fold)
}

/// Engine load from a `/metrics` text.
pub fn parse_engine_metrics(kind: EngineKind, text: &str, at: Instant) -> Option<EngineLoad> {
    let load = match kind {
        EngineKind::Vllm => EngineLoad {
            waiting: metric_sum(text, VLLM_WAITING),
            running: metric_sum(text, VLLM_RUNNING),
            kv_cache_usage: VLLM_KV_USAGE.iter().find_map(|name| metric_max(text, name)),
            observed_at: at,
        },
        EngineKind::LlamaCpp => EngineLoad {
            waiting: metric_sum(text, "llamacpp:requests_deferred"),
            running: metric_sum(text, "llamacpp:requests_processing"),
            // llama.cpp removed its KV-usage gauge (kv_cache_usage_ratio); read it if present.
            kv_cache_usage: metric_max(text, "llamacpp:kv_cache_usage_ratio"),
            observed_at: at,
        },
    };
    (load.waiting.is_some() || load.running.is_some() || load.kv_cache_usage.is_some())
        .then_some(load)
}

/// Engine load from llama.cpp's `/slots` JSON: busy slots are running; nothing is known to wait.
pub(crate) fn parse_llamacpp_slots(body: &str, at: Instant) -> Option<EngineLoad> {
    let slots: Value = serde_json::from_str(body).ok()?;
    let slots = slots.as_array()?;
    let busy = slots
        .iter()
        .filter(|s| {
            s.get("is_processing")
                .and_then(Value::as_bool)
                .unwrap_or(false)
                || s.get("state")
                    .and_then(Value::as_i64)
                    .is_some_and(|st| st != 0)
        })
        .count();
    Some(EngineLoad {
        waiting: None,
        running: Some(busy as f64),
        kv_cache_usage: None,
        observed_at: at,
    })
}

/// One upstream whose engine metrics are read.
#[derive(Debug, Clone)]
pub(crate) struct ScrapeTarget {
    pub upstream: String,
    pub kind: EngineKind,
    pub metrics_path: String,
}

pub(crate) async fn scrape_once(
    client: &reqwest::Client,
    t: &ScrapeTarget,
    timeout: Duration,
) -> Option<EngineLoad> {
    let url = format!("{}{}", t.upstream, t.metrics_path);
    // One bound for the whole read, head and body: `timeout` is what one read may take.
    let get = |url: String| async move {
        let read = async {
            let resp = client.get(url).send().await.ok()?;
            if !resp.status().is_success() {
                return None;
            }
            resp.text().await.ok()
        };
        tokio::time::timeout(timeout, read).await.ok().flatten()
    };
    if let Some(text) = get(url).await
        && let Some(load) = parse_engine_metrics(t.kind, &text, Instant::now())
    {
        return Some(load);
    }
    if t.kind == EngineKind::LlamaCpp {
        let body = get(format!("{}/slots", t.upstream)).await?;
        return parse_llamacpp_slots(&body, Instant::now());
    }
    None
}

/// Reads every target's metrics every `interval`, forever, each read allowed `timeout` (a slow
/// read delays that target's next one). Each target runs on its own timer,
/// concurrently with the others, so one hung replica delays and stales only its own reading;
/// a failed scrape leaves that replica's last reading to go stale (which the gate treats as
/// saturated for that replica unless the lane says fail-open).
pub(crate) async fn scrape_loop(
    client: reqwest::Client,
    targets: Vec<ScrapeTarget>,
    gate: Gate,
    telemetry: Arc<Telemetry>,
    interval: Duration,
    timeout: Duration,
) {
    let loops = targets
        .iter()
        .map(|t| scrape_target_loop(&client, t, &gate, &telemetry, interval, timeout));
    futures_util::future::join_all(loops).await;
}

async fn scrape_target_loop(
    client: &reqwest::Client,
    t: &ScrapeTarget,
    gate: &Gate,
    telemetry: &Telemetry,
    interval: Duration,
    timeout: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let labels = [("upstream", t.upstream.as_str())];
    loop {
        tick.tick().await;
        if let Some(load) = scrape_once(client, t, timeout).await {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            telemetry
                .gauge(UPSTREAM_LAST_SCRAPE_TIMESTAMP, &labels)
                .set(now);
            if let Some(kv) = load.kv_cache_usage {
                telemetry.gauge(UPSTREAM_KV_CACHE_USAGE, &labels).set(kv);
            }
            if let Some(w) = load.waiting {
                telemetry.gauge(UPSTREAM_REQUESTS_WAITING, &labels).set(w);
            }
            if let Some(r) = load.running {
                telemetry.gauge(UPSTREAM_REQUESTS_RUNNING, &labels).set(r);
            }
            gate.set_engine_load(&t.upstream, load);
        }
    }
}

/// Publishes GPU memory in use every `interval`.
pub(crate) async fn gpu_loop(
    probe: Arc<dyn GpuProbe>,
    telemetry: Arc<Telemetry>,
    names: Arc<crate::pools::PoolNames>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let p = probe.clone();
        let Ok(Ok(devices)) = tokio::task::spawn_blocking(move || p.snapshot()).await else {
            continue;
        };
        for d in devices {
            names.note(&d);
            let index = d.index.to_string();
            telemetry
                .gauge(GPU_MEMORY_USED_BYTES, &[("gpu", &index)])
                .set(d.used_bytes as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = "# HELP vllm:num_requests_waiting Number of requests waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 3.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 1.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"a\"} 2.0\n\
vllm:num_requests_waiting_by_reason{reason=\"x\"} 99\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.42\n";

    #[tokio::test(start_paused = true)]
    async fn reads_vllm_current_and_old_names() {
        let now = Instant::now();
        let l = parse_engine_metrics(EngineKind::Vllm, VLLM, now).unwrap();
        assert_eq!(l.waiting, Some(4.0));
        assert_eq!(l.running, Some(2.0));
        assert_eq!(l.kv_cache_usage, Some(0.42));
        let old = "vllm:gpu_cache_usage_perc{model_name=\"a\"} 0.9\nvllm:num_requests_waiting 0\n";
        let l = parse_engine_metrics(EngineKind::Vllm, old, now).unwrap();
        assert_eq!(l.kv_cache_usage, Some(0.9));
        assert!(parse_engine_metrics(EngineKind::Vllm, "unrelated 1\n", now).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn braces_in_label_values_and_timestamps_are_read_correctly() {
        let now = Instant::now();
        // A `}` inside a label value ended the labels early in the old reader, and the
        // timestamp after the value was taken for a value by readers that split on spaces.
        let text = "vllm:num_requests_waiting{model_name=\"a}b\",engine=\"0\"} 3 1700000000000\n\
vllm:num_requests_waiting{model_name=\"say \\\"hi\\\" {x}\"} 2\n\
vllm:num_requests_running{model_name=\"a}b\"} 5 1700000000000\n\
vllm:kv_cache_usage_perc{model_name=\"}\"} 0.25 1700000000000\n";
        let l = parse_engine_metrics(EngineKind::Vllm, text, now).unwrap();
        assert_eq!(l.waiting, Some(5.0));
        assert_eq!(l.running, Some(5.0));
        assert_eq!(l.kv_cache_usage, Some(0.25));
        // A malformed line elsewhere does not hide the good ones.
        let mixed = "garbage{{{ 1\nvllm:num_requests_running 4\nvllm:num_requests_running{x=\"unterminated} 9\n";
        let l = parse_engine_metrics(EngineKind::Vllm, mixed, now).unwrap();
        assert_eq!(l.running, Some(4.0));
    }

    #[tokio::test(start_paused = true)]
    async fn reads_llamacpp_metrics_and_slots() {
        let now = Instant::now();
        let text = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\nllamacpp:requests_deferred 1\n";
        let l = parse_engine_metrics(EngineKind::LlamaCpp, text, now).unwrap();
        assert_eq!((l.running, l.waiting), (Some(2.0), Some(1.0)));
        let slots = r#"[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]"#;
        assert_eq!(parse_llamacpp_slots(slots, now).unwrap().running, Some(1.0));
        assert!(parse_llamacpp_slots("not json", now).is_none());
    }
}
