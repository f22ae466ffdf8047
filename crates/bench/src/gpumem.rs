//! GPU memory during a run, through the `headroom-gpu` sampler: baseline before the load, peak
//! during it, the delta, each process's peak and a time series; or `available: false` with the
//! reason when there is no driver.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use headroom_gpu::{GpuProbe, Sample, Sampler, SamplerConfig};
use serde::{Deserialize, Serialize};

/// Points kept in the report's time series (the samples are thinned evenly beyond this).
const MAX_SERIES_POINTS: usize = 2000;

/// A sampler that may not exist (no driver), with the reason why not.
#[derive(Debug)]
pub struct GpuWatch {
    sampler: Option<Sampler>,
    reason: Option<String>,
    interval: Duration,
    /// Each device's name, from the probe's first answer (a sampler's samples carry none).
    names: BTreeMap<u32, String>,
}

impl GpuWatch {
    /// Starts sampling `probe` every `interval`; never fails: no probe (`Err(reason)`) or a probe
    /// that cannot answer leaves the watch unavailable with the reason. Needs a tokio runtime.
    pub fn start(
        probe: Result<Arc<dyn GpuProbe>, String>,
        interval: Duration,
        sample_file: Option<std::path::PathBuf>,
    ) -> GpuWatch {
        let probe = match probe {
            Ok(p) => p,
            Err(reason) => return GpuWatch::unavailable(reason, interval),
        };
        // About an hour of ticks for every GPU, within ~50 MB; longer runs keep the newest hour
        // (the baseline is taken aside before the run starts).
        let first = probe.snapshot().unwrap_or_default();
        let names = first.iter().map(|d| (d.index, d.name.clone())).collect();
        let devices = first.len().max(1);
        let capacity = (3_600_000 / interval.as_millis().max(1) as usize)
            .saturating_mul(devices)
            .clamp(1_000, 400_000);
        let mut config = SamplerConfig::new(interval).with_ring_capacity(capacity);
        if let Some(file) = sample_file {
            config = config.with_file(file);
        }
        match Sampler::start(probe, config) {
            Ok(sampler) => GpuWatch {
                sampler: Some(sampler),
                reason: None,
                interval,
                names,
            },
            Err(e) => GpuWatch::unavailable(e.to_string(), interval),
        }
    }

    /// A watch that records nothing, with `reason`.
    pub fn unavailable(reason: String, interval: Duration) -> GpuWatch {
        GpuWatch {
            sampler: None,
            reason: Some(reason),
            interval,
            names: BTreeMap::new(),
        }
    }

    pub fn available(&self) -> bool {
        self.sampler.is_some()
    }

    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Samples so far (empty when unavailable).
    pub fn samples(&self) -> Vec<Sample> {
        self.sampler
            .as_ref()
            .map(|s| s.samples())
            .unwrap_or_default()
    }

    /// The newest total used memory across GPUs.
    pub fn latest_used(&self) -> Option<u64> {
        let latest = self.sampler.as_ref()?.latest();
        (!latest.is_empty()).then(|| latest.iter().map(|s| s.used_bytes).sum())
    }

    /// Stops sampling; returns the samples and the reason telemetry is missing, if it is.
    pub async fn finish(self) -> (Vec<Sample>, Option<String>, u64) {
        match self.sampler {
            None => (Vec::new(), self.reason, 0),
            Some(sampler) => match sampler.stop().await {
                Ok(mut run) => {
                    // The first sample of each device carries its name, as in a sample file.
                    let mut named = std::collections::BTreeSet::new();
                    for s in &mut run.samples {
                        if named.insert(s.gpu) && s.name.is_none() {
                            s.name = self.names.get(&s.gpu).cloned();
                        }
                    }
                    (run.samples, None, run.stats.probe_errors)
                }
                Err(e) => (Vec::new(), Some(e.to_string()), 0),
            },
        }
    }
}

/// One device seen during the run.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuDevice {
    pub index: u32,
    pub name: Option<String>,
    pub total_bytes: u64,
}

/// One process's highest memory during the run (summed over GPUs).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessPeak {
    pub pid: u32,
    pub name: String,
    pub peak_bytes: u64,
}

/// Used memory (all GPUs) at `t_ms` from the start of the measured phase.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct GpuPoint {
    pub t_ms: i64,
    pub used_bytes: u64,
}

/// The `gpu` section of a report.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GpuReport {
    pub available: bool,
    pub reason: Option<String>,
    pub interval_ms: u64,
    pub devices: Vec<GpuDevice>,
    /// Lowest used memory (all GPUs) before the load began.
    pub baseline_bytes: Option<u64>,
    /// Highest used memory (all GPUs) while the load ran.
    pub peak_bytes: Option<u64>,
    /// `peak_bytes - baseline_bytes`.
    pub delta_bytes: Option<i64>,
    pub per_process_peak: Vec<ProcessPeak>,
    pub samples: u64,
    pub probe_errors: u64,
    pub series: Vec<GpuPoint>,
}

impl GpuReport {
    /// What the memory figures are of, for titles: "host RAM" when they are the pool of a
    /// `headroom up` on a CPU box, else "GPU memory".
    pub fn label(&self) -> &'static str {
        if self
            .devices
            .iter()
            .any(|d| d.name.as_deref() == Some("host RAM"))
        {
            "host RAM"
        } else {
            "GPU memory"
        }
    }
}

/// One tick: the total over GPUs and each process's total.
struct Tick {
    ts_ms: u64,
    used: u64,
}

fn ticks(samples: &[Sample]) -> Vec<Tick> {
    let mut out: Vec<Tick> = Vec::new();
    for s in samples {
        match out.last_mut() {
            Some(t) if t.ts_ms == s.ts_ms => t.used += s.used_bytes,
            _ => out.push(Tick {
                ts_ms: s.ts_ms,
                used: s.used_bytes,
            }),
        }
    }
    out
}

/// Summarizes samples for a measured phase `[from_ms, to_ms]` (Unix ms).
pub fn summarize(
    samples: &[Sample],
    reason: Option<String>,
    interval: Duration,
    probe_errors: u64,
    from_ms: u64,
    to_ms: u64,
) -> GpuReport {
    let interval_ms = interval.as_millis() as u64;
    if samples.is_empty() {
        return GpuReport {
            available: false,
            reason: Some(reason.unwrap_or_else(|| "no GPU samples were taken".into())),
            interval_ms,
            devices: Vec::new(),
            baseline_bytes: None,
            peak_bytes: None,
            delta_bytes: None,
            per_process_peak: Vec::new(),
            samples: 0,
            probe_errors,
            series: Vec::new(),
        };
    }
    let mut devices: BTreeMap<u32, GpuDevice> = BTreeMap::new();
    for s in samples {
        let d = devices.entry(s.gpu).or_insert(GpuDevice {
            index: s.gpu,
            name: None,
            total_bytes: s.total(),
        });
        if d.name.is_none() {
            d.name = s.name.clone();
        }
    }
    let ticks = ticks(samples);
    let before: Vec<&Tick> = ticks.iter().filter(|t| t.ts_ms < from_ms).collect();
    let during: Vec<&Tick> = ticks
        .iter()
        .filter(|t| t.ts_ms >= from_ms && t.ts_ms <= to_ms)
        .collect();
    let baseline = before
        .iter()
        .map(|t| t.used)
        .min()
        .or_else(|| ticks.first().map(|t| t.used));
    let peak = during
        .iter()
        .map(|t| t.used)
        .max()
        .or_else(|| ticks.iter().map(|t| t.used).max());
    let mut procs: BTreeMap<u32, ProcessPeak> = BTreeMap::new();
    let mut per_tick: BTreeMap<(u64, u32), u64> = BTreeMap::new();
    for s in samples
        .iter()
        .filter(|s| s.ts_ms >= from_ms && s.ts_ms <= to_ms)
    {
        for p in &s.processes {
            *per_tick.entry((s.ts_ms, p.pid)).or_default() += p.used_bytes;
            procs.entry(p.pid).or_insert(ProcessPeak {
                pid: p.pid,
                name: p.name.clone(),
                peak_bytes: 0,
            });
        }
    }
    for ((_, pid), used) in per_tick {
        if let Some(p) = procs.get_mut(&pid) {
            p.peak_bytes = p.peak_bytes.max(used);
        }
    }
    let mut per_process_peak: Vec<ProcessPeak> = procs.into_values().collect();
    per_process_peak.sort_by_key(|p| std::cmp::Reverse(p.peak_bytes));
    let step = ticks.len().div_ceil(MAX_SERIES_POINTS).max(1);
    let series = ticks
        .iter()
        .step_by(step)
        .map(|t| GpuPoint {
            t_ms: t.ts_ms as i64 - from_ms as i64,
            used_bytes: t.used,
        })
        .collect();
    GpuReport {
        available: true,
        reason: None,
        interval_ms,
        devices: devices.into_values().collect(),
        baseline_bytes: baseline,
        peak_bytes: peak,
        delta_bytes: match (baseline, peak) {
            (Some(b), Some(p)) => Some(p as i64 - b as i64),
            _ => None,
        },
        per_process_peak,
        samples: samples.len() as u64,
        probe_errors,
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_gpu::ProcessMemory;

    fn sample(ts: u64, gpu: u32, used: u64, pid_used: &[(u32, u64)]) -> Sample {
        Sample {
            ts_ms: ts,
            gpu,
            used_bytes: used,
            free_bytes: 1000 - used,
            total_bytes: 1000,
            reserved_bytes: 0,
            name: Some(format!("GPU {gpu}")),
            utilization_percent: None,
            processes: pid_used
                .iter()
                .map(|&(pid, u)| ProcessMemory {
                    pid,
                    name: format!("p{pid}"),
                    used_bytes: u,
                })
                .collect(),
        }
    }

    #[test]
    fn baseline_peak_delta_and_process_peaks() {
        let samples = vec![
            sample(90, 0, 110, &[(1, 100)]),
            sample(95, 0, 100, &[(1, 100)]),
            sample(100, 0, 300, &[(1, 200), (2, 90)]),
            sample(100, 1, 50, &[(1, 40)]),
            sample(105, 0, 250, &[(1, 150)]),
            sample(200, 0, 900, &[]), // after the run: not the peak
        ];
        let r = summarize(&samples, None, Duration::from_millis(5), 0, 100, 150);
        assert!(r.available);
        assert_eq!(r.baseline_bytes, Some(100));
        assert_eq!(r.peak_bytes, Some(350));
        assert_eq!(r.delta_bytes, Some(250));
        assert_eq!(r.devices.len(), 2);
        assert_eq!(r.per_process_peak[0].pid, 1);
        assert_eq!(r.per_process_peak[0].peak_bytes, 240);
        assert_eq!(r.per_process_peak[1].peak_bytes, 90);
        assert_eq!(r.series.len(), 5);
        assert_eq!(r.series[0].t_ms, -10);
    }

    #[test]
    fn no_samples_means_unavailable_with_reason() {
        let r = summarize(
            &[],
            Some("no NVIDIA driver: libnvidia-ml.so.1".into()),
            Duration::from_millis(50),
            0,
            0,
            1,
        );
        assert!(!r.available);
        assert!(r.reason.unwrap().contains("libnvidia-ml"));
        assert_eq!(r.peak_bytes, None);
    }

    #[tokio::test]
    async fn watch_without_driver_is_unavailable() {
        let probe: Arc<dyn GpuProbe> = Arc::new(headroom_gpu::ScriptedProbe::no_driver(
            "no libnvidia-ml.so.1",
        ));
        let w = GpuWatch::start(Ok(probe), Duration::from_millis(10), None);
        assert!(!w.available());
        let (samples, reason, _) = w.finish().await;
        assert!(samples.is_empty());
        assert!(reason.unwrap().contains("libnvidia-ml"));
    }
}
