//! The view model of `headroom top`: per GPU the newest sample and 60 s of history, the gateway's
//! lanes, the sort order, and a status line.

use std::collections::{BTreeMap, VecDeque};

use headroom_gpu::Sample;
use headroom_gpu::probe::ProcessMemory;
use serde_json::{Value, json};

use crate::lanes::Lane;

/// How much history the sparkline shows.
pub const HISTORY_WINDOW_MS: u64 = 60_000;

/// Process table order; `s` cycles through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SortKey {
    Memory,
    Pid,
    Name,
}

impl SortKey {
    pub fn next(self) -> Self {
        match self {
            SortKey::Memory => SortKey::Pid,
            SortKey::Pid => SortKey::Name,
            SortKey::Name => SortKey::Memory,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            SortKey::Memory => "memory",
            SortKey::Pid => "pid",
            SortKey::Name => "name",
        }
    }
}

/// What is known about the gateway's lanes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LanesView {
    /// No `--gateway` given.
    Off,
    Loaded(Vec<Lane>),
    Failed(String),
}

/// One GPU as the screen shows it.
#[derive(Debug, Clone)]
pub struct GpuView {
    pub name: String,
    pub latest: Sample,
    /// (ts_ms, used_bytes), oldest first, at most [`HISTORY_WINDOW_MS`] old.
    pub history: VecDeque<(u64, u64)>,
}

/// Everything the screen shows.
#[derive(Debug, Clone)]
pub struct TopState {
    /// Where the samples come from, e.g. `nvml every 50 ms` or `replay run.jsonl`.
    pub source: String,
    pub gpus: BTreeMap<u32, GpuView>,
    pub lanes: LanesView,
    pub sort: SortKey,
    /// A problem worth one line at the bottom (probe error, end of replay).
    pub status: Option<String>,
    /// Device names known before the samples (a live sampler's samples carry none).
    pub names: BTreeMap<u32, String>,
}

impl TopState {
    pub fn new(source: impl Into<String>) -> Self {
        TopState {
            source: source.into(),
            gpus: BTreeMap::new(),
            lanes: LanesView::Off,
            sort: SortKey::Memory,
            status: None,
            names: BTreeMap::new(),
        }
    }

    /// Takes one sample in. Samples of a GPU are expected in time order; an older one than the
    /// newest seen is ignored.
    pub fn push(&mut self, sample: &Sample) {
        let known = self.names.get(&sample.gpu).cloned();
        let view = self.gpus.entry(sample.gpu).or_insert_with(|| GpuView {
            name: known.unwrap_or_else(|| format!("GPU {}", sample.gpu)),
            latest: sample.clone(),
            history: VecDeque::new(),
        });
        if let Some(name) = &sample.name {
            view.name = name.clone();
        }
        if view
            .history
            .back()
            .is_some_and(|(ts, _)| *ts > sample.ts_ms)
        {
            return;
        }
        view.latest = sample.clone();
        view.history.push_back((sample.ts_ms, sample.used_bytes));
        let oldest = sample.ts_ms.saturating_sub(HISTORY_WINDOW_MS);
        while view.history.front().is_some_and(|(ts, _)| *ts < oldest) {
            view.history.pop_front();
        }
    }

    pub fn cycle_sort(&mut self) {
        self.sort = self.sort.next();
    }

    /// The newest sample time over all GPUs.
    pub fn latest_ts_ms(&self) -> Option<u64> {
        self.gpus.values().map(|g| g.latest.ts_ms).max()
    }

    /// A GPU's processes in the current sort order.
    pub fn sorted_processes(&self, gpu: &GpuView) -> Vec<ProcessMemory> {
        let mut processes = gpu.latest.processes.clone();
        match self.sort {
            SortKey::Memory => {
                processes.sort_by(|a, b| b.used_bytes.cmp(&a.used_bytes).then(a.pid.cmp(&b.pid)))
            }
            SortKey::Pid => processes.sort_by_key(|p| p.pid),
            SortKey::Name => processes.sort_by(|a, b| a.name.cmp(&b.name).then(a.pid.cmp(&b.pid))),
        }
        processes
    }

    /// The screen's content as JSON (what `top --once --format json` prints).
    pub fn to_json(&self) -> Value {
        let gpus: Vec<Value> = self
            .gpus
            .values()
            .map(|gpu| {
                let s = &gpu.latest;
                let total = s.total();
                let processes: Vec<Value> = self
                    .sorted_processes(gpu)
                    .iter()
                    .map(|p| {
                        json!({
                            "pid": p.pid,
                            "name": p.name,
                            "used_bytes": p.used_bytes,
                            "share": share(p.used_bytes, total),
                        })
                    })
                    .collect();
                let history_used: Vec<u64> = gpu.history.iter().map(|(_, u)| *u).collect();
                json!({
                    "gpu": s.gpu,
                    "name": gpu.name,
                    "ts_ms": s.ts_ms,
                    "total_bytes": total,
                    "used_bytes": s.used_bytes,
                    "free_bytes": s.free_bytes,
                    "reserved_bytes": s.reserved_bytes,
                    "utilization_percent": s.utilization_percent,
                    "used_share": share(s.used_bytes, total),
                    "min_used_bytes_60s": history_used.iter().min(),
                    "max_used_bytes_60s": history_used.iter().max(),
                    "processes": processes,
                })
            })
            .collect();
        let lanes = match &self.lanes {
            LanesView::Off => Value::Null,
            LanesView::Loaded(lanes) => json!(lanes),
            LanesView::Failed(reason) => json!({ "error": reason }),
        };
        json!({
            "source": self.source,
            "ts_ms": self.latest_ts_ms(),
            "gpus": gpus,
            "lanes": lanes,
        })
    }
}

/// `part / whole` rounded to 4 decimals; 0 when the whole is unknown.
pub fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64 / whole as f64 * 10_000.0).round() / 10_000.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts_ms: u64, used: u64) -> Sample {
        Sample {
            ts_ms,
            gpu: 0,
            used_bytes: used,
            free_bytes: 1000 - used,
            total_bytes: 1000,
            reserved_bytes: 0,
            name: None,
            utilization_percent: None,
            processes: vec![
                ProcessMemory {
                    pid: 30,
                    name: "b".into(),
                    used_bytes: 10,
                },
                ProcessMemory {
                    pid: 10,
                    name: "c".into(),
                    used_bytes: 300,
                },
                ProcessMemory {
                    pid: 20,
                    name: "a".into(),
                    used_bytes: 50,
                },
            ],
        }
    }

    #[test]
    fn history_keeps_sixty_seconds_and_ignores_stale_samples() {
        let mut state = TopState::new("test");
        for k in 0..=70 {
            state.push(&sample(k * 1000, 100 + k));
        }
        let gpu = &state.gpus[&0];
        assert_eq!(gpu.history.front(), Some(&(10_000, 110)));
        assert_eq!(gpu.history.len(), 61);
        state.push(&sample(5_000, 999));
        assert_eq!(state.gpus[&0].latest.used_bytes, 170);
    }

    #[test]
    fn sort_cycles_through_memory_pid_name() {
        let mut state = TopState::new("test");
        state.push(&sample(1, 400));
        let order = |state: &TopState| -> Vec<u32> {
            state
                .sorted_processes(&state.gpus[&0])
                .iter()
                .map(|p| p.pid)
                .collect()
        };
        assert_eq!(order(&state), vec![10, 20, 30]);
        state.cycle_sort();
        assert_eq!(order(&state), vec![10, 20, 30]);
        state.cycle_sort();
        assert_eq!(order(&state), vec![20, 30, 10]);
        state.cycle_sort();
        assert_eq!(state.sort, SortKey::Memory);
    }

    #[test]
    fn json_has_shares_and_sixty_second_range() {
        let mut state = TopState::new("test");
        state.push(&sample(1, 400));
        state.push(&sample(2, 250));
        state.lanes = LanesView::Failed("connection refused".into());
        let json = state.to_json();
        assert_eq!(json["gpus"][0]["used_bytes"], 250);
        assert_eq!(json["gpus"][0]["used_share"], 0.25);
        assert_eq!(json["gpus"][0]["max_used_bytes_60s"], 400);
        assert_eq!(json["gpus"][0]["processes"][0]["share"], 0.3);
        assert_eq!(json["lanes"]["error"], "connection refused");
        assert_eq!(json["ts_ms"], 2);
    }
}
