//! headroom-bench: load generation against OpenAI-compatible endpoints (chat, completions,
//! transcription, speech), SSE timing, HDR latency statistics, GPU memory sampled during the run
//! through `headroom-gpu`, reports (JSON with a schema, Markdown, SVG), and soak rounds with a
//! leak verdict and a SQLite history.
//!
//! The binary's `bench` and `soak` subcommands are thin: they turn flags into a [`BenchConfig`]
//! or [`soak::SoakConfig`] and call [`bench`] or [`soak::soak`].

pub mod arrivals;
pub mod client;
pub mod gpumem;
pub mod history;
pub mod report;
pub mod runner;
pub mod soak;
pub mod sse;
pub mod stats;
pub mod svg;
pub mod workload;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use headroom_gpu::GpuProbe;
use tokio::sync::watch;

pub use client::{Outcome, RequestRecord};
pub use gpumem::{GpuReport, GpuWatch};
pub use report::{Report, ReportMeta, Slo};
/// The HTTP client crate, so callers build clients of the same version.
pub use reqwest;
pub use runner::{Progress, RunConfig, RunOutcome, http_client};
pub use workload::{Load, RequestKind, RequestSpec, Scenario, SpecDefaults};

/// Why a bench or soak could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// Flags, files or the target are not usable; the message is one line.
    #[error("{0}")]
    BadInput(String),
    /// The machine cannot do what was asked (e.g. no HTTP client).
    #[error("{0}")]
    Environment(String),
    #[error("history file: {0}")]
    History(String),
}

/// Everything one `headroom bench` run needs.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub run: RunConfig,
    pub meta: ReportMeta,
    pub gpu_interval: Duration,
    /// Sample file the sampler appends to.
    pub sample_file: Option<PathBuf>,
    /// Offered rates of a sweep; each step runs for the run's duration or request count.
    pub sweep: Option<Vec<f64>>,
}

/// Checks every target answers and accepts the API key, before any load: an unreachable URL or
/// a 401/403 is a one-line [`BenchError::BadInput`]. Servers without `/v1/models` are fine.
/// Returns the model ids the first target lists (empty when it lists none).
pub async fn preflight(
    client: &reqwest::Client,
    specs: &[RequestSpec],
) -> Result<Vec<String>, BenchError> {
    let mut first_models: Option<Vec<String>> = None;
    let targets: BTreeSet<(String, Option<String>)> = specs
        .iter()
        .map(|s| (s.url.clone(), s.api_key.clone()))
        .collect();
    for (url, key) in targets {
        let base = url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base);
        let models = format!("{base}/v1/models");
        let mut req = client.get(&models).timeout(Duration::from_secs(10));
        if let Some(key) = &key {
            req = req.bearer_auth(key);
        }
        match req.send().await {
            Err(e) => {
                return Err(BenchError::BadInput(format!(
                    "cannot reach {url}: {}",
                    client::describe_reqwest(&e)
                )));
            }
            Ok(r) if r.status().as_u16() == 401 || r.status().as_u16() == 403 => {
                return Err(BenchError::BadInput(format!(
                    "{url} refused the API key (HTTP {}){}",
                    r.status().as_u16(),
                    if key.is_none() {
                        "; pass one with --api-key"
                    } else {
                        ""
                    }
                )));
            }
            Ok(r) => {
                let ok = r.status().is_success();
                let body = r.bytes().await.unwrap_or_default();
                let models: Vec<String> = if ok {
                    serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|v| {
                            v.get("data")?.as_array().map(|a| {
                                a.iter()
                                    .filter_map(|m| m.get("id")?.as_str().map(str::to_string))
                                    .collect()
                            })
                        })
                        .unwrap_or_default()
                } else {
                    Vec::new()
                };
                first_models.get_or_insert(models);
            }
        }
    }
    Ok(first_models.unwrap_or_default())
}

/// Runs a bench (or a sweep) with GPU sampling and builds the report. `cancel` turning `true`
/// ends the run early; the report then has `interrupted: true` and what finished.
pub async fn bench(
    client: reqwest::Client,
    config: BenchConfig,
    probe: Result<Arc<dyn GpuProbe>, String>,
    progress: Arc<Progress>,
    cancel: watch::Receiver<bool>,
) -> Result<Report, BenchError> {
    if config.run.specs.is_empty() {
        return Err(BenchError::BadInput("nothing to send".into()));
    }
    let watch = GpuWatch::start(probe, config.gpu_interval, config.sample_file.clone());
    if watch.available() {
        // A few samples before any load, for the baseline.
        tokio::time::sleep(config.gpu_interval * 3).await;
    }
    // Kept aside: on a long run the ring may drop them before the run ends.
    let before = watch.samples();
    let (run, sweep) = match &config.sweep {
        None => (
            runner::run(client, config.run.clone(), progress, cancel).await,
            None,
        ),
        Some(rates) => {
            let (run, sweep) = run_sweep(client, &config, rates, progress, cancel).await;
            (run, Some(sweep))
        }
    };
    if watch.available() {
        tokio::time::sleep(config.gpu_interval * 2).await;
    }
    let interval = watch.interval();
    let (mut samples, reason, probe_errors) = watch.finish().await;
    if let Some(first) = samples.first().map(|s| s.ts_ms) {
        let mut all: Vec<_> = before.into_iter().filter(|s| s.ts_ms < first).collect();
        all.append(&mut samples);
        samples = all;
    }
    let from = run.started_at_ms;
    let to = from + run.duration.as_millis() as u64;
    let gpu = gpumem::summarize(&samples, reason, interval, probe_errors, from, to);
    Ok(report::build(
        &config.meta,
        &config.run.specs,
        &run,
        gpu,
        sweep,
    ))
}

/// A step is saturated when ok throughput falls under 80 % of the offered rate (the step's time
/// includes draining its last requests, so a queueing server shows up as a longer step) or more
/// than 5 % of its requests fail (429s included).
fn saturated(rate: f64, run: &RunOutcome) -> bool {
    let ok = run
        .records
        .iter()
        .filter(|r| r.outcome == Outcome::Ok)
        .count() as f64;
    let total = run.records.len().max(1) as f64;
    let achieved = ok / run.duration.as_secs_f64().max(1e-9);
    achieved < 0.8 * rate || (total - ok) / total > 0.05
}

async fn run_sweep(
    client: reqwest::Client,
    config: &BenchConfig,
    rates: &[f64],
    progress: Arc<Progress>,
    cancel: watch::Receiver<bool>,
) -> (RunOutcome, report::SweepReport) {
    let mut steps = Vec::new();
    let mut combined: Option<RunOutcome> = None;
    let mut saturation = None;
    for (i, &rate) in rates.iter().enumerate() {
        let mut run_config = config.run.clone();
        run_config.load = Load::Open {
            rate,
            burstiness: match config.run.load {
                Load::Open { burstiness, .. } => burstiness,
                Load::Closed { .. } => 1.0,
            },
        };
        if i > 0 {
            run_config.warmup = 0;
        }
        for s in &mut run_config.specs {
            s.load = None;
        }
        let step = runner::run(
            client.clone(),
            run_config,
            Arc::clone(&progress),
            cancel.clone(),
        )
        .await;
        let is_saturated = saturated(rate, &step);
        let mut e2e = stats::LatencyHistogram::new();
        let mut ttft = stats::LatencyHistogram::new();
        let mut outcomes = report::Outcomes::default();
        for r in &step.records {
            outcomes.add(r.outcome);
            if r.outcome == Outcome::Ok {
                e2e.record(r.e2e);
                if let Some(t) = r.ttft {
                    ttft.record(t);
                }
            }
        }
        let secs = step.duration.as_secs_f64().max(1e-9);
        steps.push(report::SweepStep {
            rate,
            requests_sent: step.requests_sent,
            duration_s: step.duration.as_secs_f64(),
            request_throughput_rps: outcomes.ok as f64 / secs,
            outcomes,
            ttft_p50_ms: ttft.summary().p50,
            e2e_p50_ms: e2e.summary().p50,
            e2e_p99_ms: e2e.summary().p99,
            saturated: is_saturated,
        });
        if !is_saturated {
            saturation = Some(rate);
        }
        let interrupted = step.interrupted;
        combined = Some(match combined {
            None => step,
            Some(mut all) => {
                let shift =
                    Duration::from_millis(step.started_at_ms.saturating_sub(all.started_at_ms));
                all.records.extend(step.records.into_iter().map(|mut r| {
                    r.started += shift;
                    r
                }));
                all.requests_sent += step.requests_sent;
                all.duration = shift + step.duration;
                all.interrupted |= step.interrupted;
                all.max_in_flight = all.max_in_flight.max(step.max_in_flight);
                all
            }
        });
        progress.sent.store(0, std::sync::atomic::Ordering::Relaxed);
        if is_saturated || interrupted {
            break;
        }
    }
    let run = combined.unwrap_or(RunOutcome {
        records: Vec::new(),
        requests_sent: 0,
        duration: Duration::ZERO,
        started_at_ms: headroom_gpu::sampler::now_ms(),
        interrupted: false,
        max_in_flight: 0,
    });
    (
        run,
        report::SweepReport {
            steps,
            saturation_rps: saturation,
        },
    )
}

/// Parses `--sweep`: a comma list of rates (`1,2,4,8`) or `auto` (1, 2, 4 … 1024, stopping at
/// saturation).
pub fn parse_sweep(text: &str) -> Result<Vec<f64>, BenchError> {
    if text.trim() == "auto" {
        return Ok((0..11).map(|i| f64::from(1u32 << i)).collect());
    }
    let rates: Result<Vec<f64>, _> = text.split(',').map(|r| r.trim().parse::<f64>()).collect();
    match rates {
        Ok(r) if !r.is_empty() && r.iter().all(|x| (1e-6..=1e7).contains(x)) => Ok(r),
        _ => Err(BenchError::BadInput(format!(
            "--sweep `{text}`: give positive rates like 1,2,4,8 or `auto`"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sweep_lists_parse() {
        assert_eq!(parse_sweep("1, 2.5,4").unwrap(), vec![1.0, 2.5, 4.0]);
        assert_eq!(parse_sweep("auto").unwrap()[3], 8.0);
        assert!(parse_sweep("1,-2").is_err());
        assert!(parse_sweep("fast").is_err());
    }
}
