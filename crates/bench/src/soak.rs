//! `headroom soak`: the same workload in N rounds with a quiet gap after each. Each round records
//! its throughput and the client-side queue depth (most requests in flight); each gap records the
//! idle memory floor. The floors and throughputs go to the leak verdict of `headroom-gpu`, for
//! this invocation and, with a history file, across every invocation of the same workload.

use std::sync::Arc;
use std::time::Duration;

use headroom_gpu::{GpuProbe, LeakConfig, LeakReport, Sample};
use serde::Serialize;
use tokio::sync::watch;

use crate::BenchError;
use crate::client::Outcome;
use crate::gpumem::GpuWatch;
use crate::history::{History, StoredRound};
use crate::report::Outcomes;
use crate::runner::{self, Progress, RunConfig};
use crate::stats::LatencyHistogram;

/// What the idle floor measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorSource {
    /// All GPUs: `used - reserved`.
    Device,
    /// One process's memory (e.g. the inference server's pid).
    Process(u32),
}

/// Settings of a soak.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub run: RunConfig,
    pub scenario: String,
    pub url: String,
    pub rounds: u32,
    pub gap: Duration,
    pub gpu_interval: Duration,
    pub floor: FloorSource,
    pub leak: LeakConfig,
    pub history: Option<std::path::PathBuf>,
    pub sample_file: Option<std::path::PathBuf>,
    /// Prometheus endpoint polled during each round for the server-side queue depth (a
    /// `headroom serve` gateway's `/metrics`, or a vLLM engine's).
    pub metrics_url: Option<String>,
    /// Sent as `Authorization: Bearer KEY` to `metrics_url` (a gateway off loopback needs one).
    pub metrics_api_key: Option<String>,
}

/// One round.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RoundReport {
    pub round: u32,
    pub started_at_ms: u64,
    pub duration_s: f64,
    pub requests_sent: u64,
    pub outcomes: Outcomes,
    pub request_throughput_rps: f64,
    pub output_token_throughput_tps: f64,
    /// Most requests in flight at once (client-side queue depth).
    pub max_in_flight: u64,
    /// Deepest server-side queue seen in `--metrics-url` during the round.
    pub server_queue_depth_max: Option<f64>,
    pub e2e_p50_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    /// Highest used memory during the round.
    pub peak_bytes: Option<u64>,
    /// Lowest memory in the quiet gap after the round.
    pub idle_floor_bytes: Option<u64>,
}

/// The verdict over the rounds kept in the history file.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryReport {
    pub file: String,
    pub workload: String,
    pub invocations: u64,
    pub rounds: u64,
    pub leak: Option<LeakReport>,
    pub reason: Option<String>,
}

/// The soak's result.
#[derive(Debug, Clone, Serialize)]
pub struct SoakReport {
    pub tool: String,
    pub scenario: String,
    pub url: String,
    pub gap_s: f64,
    pub interrupted: bool,
    pub gpu_available: bool,
    pub gpu_reason: Option<String>,
    pub rounds: Vec<RoundReport>,
    /// `leak`, `no_leak` or `inconclusive` with the evidence; `None` with `reason` when the
    /// verdict could not be computed (no GPU telemetry).
    pub leak: Option<LeakReport>,
    pub reason: Option<String>,
    pub history: Option<HistoryReport>,
}

/// Per-tick total of the floor measure in `[from, to)`; the minimum is the floor.
fn floor_of(samples: &[Sample], from_ms: u64, to_ms: u64, source: FloorSource) -> Option<u64> {
    let mut ticks: Vec<(u64, u64)> = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.ts_ms >= from_ms && s.ts_ms < to_ms)
    {
        let v = match source {
            FloorSource::Device => s.used_without_reserved(),
            FloorSource::Process(pid) => s.process_used_bytes(pid),
        };
        match ticks.last_mut() {
            Some((ts, total)) if *ts == s.ts_ms => *total += v,
            _ => ticks.push((s.ts_ms, v)),
        }
    }
    ticks.into_iter().map(|(_, v)| v).min()
}

fn peak_of(samples: &[Sample], from_ms: u64, to_ms: u64) -> Option<u64> {
    let mut ticks: Vec<(u64, u64)> = Vec::new();
    for s in samples
        .iter()
        .filter(|s| s.ts_ms >= from_ms && s.ts_ms <= to_ms)
    {
        match ticks.last_mut() {
            Some((ts, total)) if *ts == s.ts_ms => *total += s.used_bytes,
            _ => ticks.push((s.ts_ms, s.used_bytes)),
        }
    }
    ticks.into_iter().map(|(_, v)| v).max()
}

/// Sum of the queue-depth gauges in Prometheus text: `headroom_lane_queue_depth` (a
/// `headroom serve` gateway, all lanes) and `vllm:num_requests_waiting` (a vLLM engine). `None`
/// when neither is present.
pub fn queue_depth_from_metrics(text: &str) -> Option<f64> {
    let mut total = None;
    for line in text.lines().map(str::trim) {
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let name = &line[..name_end];
        if name != "headroom_lane_queue_depth" && name != "vllm:num_requests_waiting" {
            continue;
        }
        let value = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite());
        if let Some(v) = value {
            *total.get_or_insert(0.0) += v;
        }
    }
    total
}

/// Polls `url` every 250 ms and keeps the deepest queue seen in `deepest` (until aborted).
async fn poll_queue_depth(
    client: reqwest::Client,
    url: String,
    api_key: Option<String>,
    deepest: Arc<std::sync::Mutex<Option<f64>>>,
) {
    loop {
        let mut get = client.get(&url).timeout(Duration::from_secs(2));
        if let Some(key) = &api_key {
            get = get.bearer_auth(key);
        }
        let text = match get.send().await.and_then(|r| r.error_for_status()) {
            Ok(r) => r.text().await.ok(),
            Err(_) => None,
        };
        if let Some(depth) = text.as_deref().and_then(queue_depth_from_metrics) {
            let mut d = deepest.lock().unwrap_or_else(|e| e.into_inner());
            *d = Some(d.map_or(depth, |m: f64| m.max(depth)));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A key naming the workload in the history file.
pub fn workload_key(config: &SoakConfig) -> String {
    let load = match config.run.load {
        crate::Load::Closed { concurrency } => format!("closed:{concurrency}"),
        crate::Load::Open { rate, burstiness } => format!("open:{rate}:{burstiness}"),
    };
    let kinds: Vec<String> = config
        .run
        .specs
        .iter()
        .map(|s| format!("{}:{}:{}", s.name, s.kind.as_str(), s.max_tokens))
        .collect();
    format!(
        "{}|{}|{}|n={:?}|d={:?}|{}",
        config.scenario,
        config.url,
        load,
        config.run.requests,
        config.run.duration.map(|d| d.as_secs_f64()),
        kinds.join(",")
    )
}

/// Runs the rounds. `on_round` is called after each round's gap (for progress lines).
pub async fn soak(
    client: reqwest::Client,
    config: SoakConfig,
    probe: Result<Arc<dyn GpuProbe>, String>,
    cancel: watch::Receiver<bool>,
    mut on_round: impl FnMut(&RoundReport),
) -> Result<SoakReport, BenchError> {
    if config.rounds == 0 {
        return Err(BenchError::BadInput("--rounds must be at least 1".into()));
    }
    let history = match &config.history {
        Some(path) => Some(History::open(path)?),
        None => None,
    };
    let watch = GpuWatch::start(probe, config.gpu_interval, config.sample_file.clone());
    let invocation = format!("{}-{}", headroom_gpu::sampler::now_ms(), std::process::id());
    let mut rounds = Vec::new();
    let mut interrupted = false;
    for n in 0..config.rounds {
        if *cancel.borrow() {
            interrupted = true;
            break;
        }
        let mut run_config = config.run.clone();
        if n > 0 {
            run_config.warmup = 0;
        }
        let deepest = Arc::new(std::sync::Mutex::new(None::<f64>));
        let poller = config.metrics_url.clone().map(|url| {
            tokio::spawn(poll_queue_depth(
                client.clone(),
                url,
                config.metrics_api_key.clone(),
                Arc::clone(&deepest),
            ))
        });
        let run = runner::run(
            client.clone(),
            run_config,
            Arc::new(Progress::default()),
            cancel.clone(),
        )
        .await;
        if let Some(task) = poller {
            task.abort();
            let _ = task.await;
        }
        let server_queue_depth_max = *deepest.lock().unwrap_or_else(|e| e.into_inner());
        let round_end_ms = run.started_at_ms + run.duration.as_millis() as u64;
        let mut cancel_gap = cancel.clone();
        tokio::select! {
            _ = tokio::time::sleep(config.gap) => {}
            _ = cancel_gap.wait_for(|c| *c) => { interrupted = true; }
        }
        let gap_end_ms = headroom_gpu::sampler::now_ms();
        let samples = watch.samples();
        let mut outcomes = Outcomes::default();
        let mut e2e = LatencyHistogram::new();
        let mut ttft = LatencyHistogram::new();
        let mut tokens = 0u64;
        for r in &run.records {
            outcomes.add(r.outcome);
            if r.outcome == Outcome::Ok {
                e2e.record(r.e2e);
                if let Some(t) = r.ttft {
                    ttft.record(t);
                }
                tokens += r.output_tokens.unwrap_or(0);
            }
        }
        let secs = run.duration.as_secs_f64().max(1e-9);
        let round = RoundReport {
            round: n,
            started_at_ms: run.started_at_ms,
            duration_s: run.duration.as_secs_f64(),
            requests_sent: run.requests_sent,
            request_throughput_rps: outcomes.ok as f64 / secs,
            outcomes,
            output_token_throughput_tps: tokens as f64 / secs,
            max_in_flight: run.max_in_flight,
            server_queue_depth_max,
            e2e_p50_ms: e2e.summary().p50,
            ttft_p50_ms: ttft.summary().p50,
            peak_bytes: peak_of(&samples, run.started_at_ms, round_end_ms),
            // The gap starts when the last request has ended, so the queue is empty.
            idle_floor_bytes: floor_of(&samples, round_end_ms, gap_end_ms + 1, config.floor),
        };
        on_round(&round);
        let stopped = run.interrupted || interrupted;
        if !stopped {
            rounds.push(round);
        } else {
            interrupted = true;
            break;
        }
    }
    let gpu_available = watch.available();
    let (_, gpu_reason, _) = watch.finish().await;
    let (leak, reason) = verdict_of(
        gpu_available,
        gpu_reason.as_deref(),
        rounds
            .iter()
            .map(|r| (r.idle_floor_bytes, r.request_throughput_rps)),
        &config.leak,
    );
    let history_report = match history {
        None => None,
        Some(h) => {
            let workload = workload_key(&config);
            for r in &rounds {
                h.append(
                    &workload,
                    &StoredRound {
                        invocation: invocation.clone(),
                        round: r.round,
                        started_at_ms: r.started_at_ms,
                        idle_floor_bytes: r.idle_floor_bytes,
                        peak_bytes: r.peak_bytes,
                        request_throughput_rps: r.request_throughput_rps,
                        output_token_throughput_tps: r.output_token_throughput_tps,
                        max_in_flight: r.max_in_flight,
                        requests_sent: r.requests_sent,
                        ok: r.outcomes.ok,
                    },
                )?;
            }
            let stored = h.rounds(&workload)?;
            let any_floor = stored.iter().any(|r| r.idle_floor_bytes.is_some());
            let (leak, reason) = verdict_of(
                any_floor,
                Some("no stored round has a memory floor"),
                stored
                    .iter()
                    .map(|r| (r.idle_floor_bytes, r.request_throughput_rps)),
                &config.leak,
            );
            Some(HistoryReport {
                file: config
                    .history
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                invocations: h.invocations(&workload)?,
                rounds: stored.len() as u64,
                workload,
                leak,
                reason,
            })
        }
    };
    Ok(SoakReport {
        tool: "headroom soak".into(),
        scenario: config.scenario.clone(),
        url: config.url.clone(),
        gap_s: config.gap.as_secs_f64(),
        interrupted,
        gpu_available,
        gpu_reason,
        rounds,
        leak,
        reason,
        history: history_report,
    })
}

fn verdict_of(
    available: bool,
    why_not: Option<&str>,
    rounds: impl Iterator<Item = (Option<u64>, f64)>,
    config: &LeakConfig,
) -> (Option<LeakReport>, Option<String>) {
    if !available {
        return (
            None,
            Some(format!(
                "no leak verdict without GPU telemetry: {}",
                why_not.unwrap_or("unknown reason")
            )),
        );
    }
    let (floors, throughputs): (Vec<f64>, Vec<f64>) =
        rounds.filter_map(|(f, t)| f.map(|f| (f as f64, t))).unzip();
    match headroom_gpu::verdict_with(&floors, &throughputs, config) {
        Ok(report) => (Some(report), None),
        Err(e) => (None, Some(format!("no leak verdict: {e}"))),
    }
}

/// The plain-text summary printed with `--format table`.
pub fn table(r: &SoakReport) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let mib = |b: Option<u64>| {
        b.map(|b| format!("{:.1}", b as f64 / 1048576.0))
            .unwrap_or_else(|| "–".into())
    };
    let _ = writeln!(
        out,
        "{:>5} {:>8} {:>8} {:>10} {:>10} {:>9} {:>12} {:>12} {:>10}",
        "round", "sent", "failed", "ok req/s", "tok/s", "queue", "floor MiB", "peak MiB", "e2e p50"
    );
    for x in &r.rounds {
        let _ = writeln!(
            out,
            "{:>5} {:>8} {:>8} {:>10.2} {:>10.1} {:>9} {:>12} {:>12} {:>10}",
            x.round,
            x.requests_sent,
            x.outcomes.total() - x.outcomes.ok,
            x.request_throughput_rps,
            x.output_token_throughput_tps,
            x.max_in_flight,
            mib(x.idle_floor_bytes),
            mib(x.peak_bytes),
            x.e2e_p50_ms
                .map(|v| format!("{v:.1}"))
                .unwrap_or_else(|| "–".into())
        );
    }
    let verdict_line = |leak: &Option<LeakReport>, reason: &Option<String>| match leak {
        Some(l) => format!(
            "{} — {} (floor slope {:.2} MiB/round, p = {:.3})",
            l.verdict, l.reason, l.floor.slope_mib_per_round, l.floor.p_value
        ),
        None => reason.clone().unwrap_or_default(),
    };
    let _ = writeln!(out, "verdict: {}", verdict_line(&r.leak, &r.reason));
    if let Some(h) = &r.history {
        let _ = writeln!(
            out,
            "history ({} rounds over {} invocations): {}",
            h.rounds,
            h.invocations,
            verdict_line(&h.leak, &h.reason)
        );
    }
    if r.interrupted {
        let _ = writeln!(
            out,
            "interrupted: rounds after the interruption were not run"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ts: u64, used: u64, reserved: u64) -> Sample {
        Sample {
            ts_ms: ts,
            gpu: 0,
            used_bytes: used,
            free_bytes: 0,
            total_bytes: 1 << 30,
            reserved_bytes: reserved,
            name: None,
            utilization_percent: None,
            processes: vec![],
        }
    }

    #[test]
    fn floor_is_the_lowest_tick_in_the_gap_without_reserved() {
        let samples = vec![
            s(10, 500, 10),
            s(20, 300, 10),
            s(30, 200, 10),
            s(40, 900, 10),
        ];
        assert_eq!(floor_of(&samples, 15, 35, FloorSource::Device), Some(190));
        assert_eq!(floor_of(&samples, 50, 60, FloorSource::Device), None);
        assert_eq!(peak_of(&samples, 10, 30), Some(500));
    }

    #[test]
    fn queue_depth_sums_gateway_lanes_and_vllm_waiting() {
        let text = "# HELP headroom_lane_queue_depth Requests waiting.\n\
            headroom_lane_queue_depth{lane=\"text\"} 3\n\
            headroom_lane_queue_depth{lane=\"audio\"} 1\n\
            headroom_lane_queue_depth_total 99\n\
            vllm:num_requests_waiting{engine=\"0\"} 2.0\n";
        assert_eq!(queue_depth_from_metrics(text), Some(6.0));
        assert_eq!(queue_depth_from_metrics("up 1\n"), None);
    }

    #[test]
    fn no_telemetry_gives_a_reason_instead_of_a_verdict() {
        let (leak, reason) = verdict_of(
            false,
            Some("no NVIDIA driver"),
            std::iter::empty(),
            &LeakConfig::default(),
        );
        assert!(leak.is_none());
        assert!(reason.unwrap().contains("no NVIDIA driver"));
    }
}
