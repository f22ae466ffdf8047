//! The night's memory timeline: once a second, each backend's memory (its process tree's PSS, the
//! way `up`'s host pool reads it, through `headroom-gpu`), the pool's cgroup usage and limit, the
//! co-tenant's memory and the OOM kills counted so far. Both boxes are read the same way, by the
//! drill itself; a backend whose PID changed was restarted. Every [`CPU_EVERY`] the CPU each of
//! them, `up` and the drill used is read as well ([`crate::cpu`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::watch;

use crate::boxes::{Running, View};
use crate::cpu::{self, CpuSample};

/// How often the CPU figures are read.
pub const CPU_EVERY: Duration = Duration::from_secs(10);

/// One reading.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemSample {
    /// Seconds from the drill's clock start.
    pub t_s: f64,
    /// Each backend's memory (`None`: not running at that moment).
    pub backends: BTreeMap<String, Option<u64>>,
    pub pool_bytes: Option<u64>,
    pub co_tenant_bytes: Option<u64>,
    pub oom_kills: Option<u64>,
}

impl MemSample {
    /// The backends' memory together, when every one of them was read.
    pub fn backends_total(&self) -> Option<u64> {
        self.backends
            .values()
            .try_fold(0u64, |acc, b| Some(acc + (*b)?))
    }
}

/// A PID change of a backend (a restart) seen by the watcher.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PidChange {
    pub backend: String,
    pub t_s: f64,
    pub from: Option<u32>,
    pub to: Option<u32>,
}

#[derive(Debug, Default)]
pub struct Recorded {
    pub samples: Vec<MemSample>,
    pub changes: Vec<PidChange>,
    pub last: View,
    pub limit_bytes: Option<u64>,
    pub cpu: Vec<CpuSample>,
}

/// Reads the box every `every` until `stop` turns true.
pub async fn run(
    running: Arc<Running>,
    clock: Instant,
    every: Duration,
    co_tenant: Arc<Mutex<Option<u32>>>,
    into: Arc<Mutex<Recorded>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut pids: BTreeMap<String, Option<u32>> = BTreeMap::new();
    let mut next_cpu = clock.elapsed();
    loop {
        let view = running.view().await;
        let t_s = clock.elapsed().as_secs_f64();
        let cpu_now = (clock.elapsed() >= next_cpu && !view.backends.is_empty()).then(|| {
            next_cpu += CPU_EVERY;
            cpu_sample(&running, &view, t_s)
        });
        let mut backends = BTreeMap::new();
        let mut changes = Vec::new();
        for b in &view.backends {
            let bytes = b
                .pid
                .and_then(|p| headroom_gpu::tree_memory(p).ok())
                .map(|m| m.bytes());
            backends.insert(b.name.clone(), bytes);
            let before = pids.insert(b.name.clone(), b.pid);
            if let Some(before) = before
                && before != b.pid
            {
                changes.push(PidChange {
                    backend: b.name.clone(),
                    t_s,
                    from: before,
                    to: b.pid,
                });
            }
        }
        let co = *co_tenant.lock().expect("co-tenant lock");
        let co_tenant_bytes = co
            .and_then(|p| headroom_gpu::tree_memory(p).ok())
            .map(|m| m.bytes());
        {
            let mut r = into.lock().expect("recorder lock");
            if !view.backends.is_empty() {
                r.samples.push(MemSample {
                    t_s,
                    backends,
                    pool_bytes: view.pool_bytes,
                    co_tenant_bytes,
                    oom_kills: view.oom_kills,
                });
                r.limit_bytes = view.limit_bytes.or(r.limit_bytes);
                r.changes.extend(changes);
                r.cpu.extend(cpu_now);
                r.last = view;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// The CPU figures now: each backend's tree, `up`'s own process, the drill's, the machine's.
fn cpu_sample(running: &Running, view: &View, t_s: f64) -> CpuSample {
    let mut trees: BTreeMap<String, Option<cpu::TreeCpu>> = view
        .backends
        .iter()
        .map(|b| (b.name.clone(), b.pid.and_then(cpu::read_tree)))
        .collect();
    if let Some(up) = running.supervisor_pid() {
        trees.insert(SUPERVISOR.into(), cpu::read_process(up));
    }
    trees.insert(DRILL.into(), cpu::read_process(std::process::id()));
    CpuSample {
        t_s,
        trees,
        machine: cpu::read_machine(),
        cgroup: view
            .procs_file
            .as_deref()
            .and_then(std::path::Path::parent)
            .and_then(cpu::read_cgroup),
    }
}

/// The names `up` and the drill have among the CPU figures.
pub const SUPERVISOR: &str = "up (supervisor + gateway)";
pub const DRILL: &str = "drill";

/// The lowest backends' total among samples in `[from, to]`.
pub fn floor(samples: &[MemSample], from: f64, to: f64) -> Option<u64> {
    samples
        .iter()
        .filter(|s| s.t_s >= from && s.t_s <= to)
        .filter_map(MemSample::backends_total)
        .min()
}

/// The floors of the quiet gaps `[(from, to)]`, one per gap with a whole reading, stitched across
/// restarts: a backend restarted (killed by a fault, or by the kernel) starts again from its
/// load-time memory, which would read as a fall, or a rise, of the floor that no leak made. The
/// leak verdict depends only on differences between floors, so after a restart the series is
/// shifted to go on from the last floor before it: a leak shows within each stretch of the same
/// processes, and a restart neither hides one nor makes one.
pub fn stitched_floors(
    samples: &[MemSample],
    changes: &[PidChange],
    gaps: &[(f64, f64)],
) -> Vec<(usize, u64, i64)> {
    let mut out = Vec::new();
    let mut shift: i64 = 0;
    let mut last: Option<(f64, u64)> = None;
    for (i, (from, to)) in gaps.iter().enumerate() {
        let Some(f) = floor(samples, *from, *to) else {
            continue;
        };
        if let Some((prev_to, prev_floor)) = last
            && changes
                .iter()
                .any(|c| c.from.is_some() && c.t_s > prev_to && c.t_s <= *to)
        {
            shift = (prev_floor as i64 + shift) - f as i64;
        }
        out.push((i, f, shift));
        last = Some((*to, f));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(t: f64, a: Option<u64>, b: Option<u64>) -> MemSample {
        MemSample {
            t_s: t,
            backends: [("a".to_string(), a), ("b".to_string(), b)]
                .into_iter()
                .collect(),
            pool_bytes: None,
            co_tenant_bytes: None,
            oom_kills: None,
        }
    }

    #[test]
    fn a_restart_between_gaps_is_stitched_out_of_the_floors() {
        let samples = vec![
            s(1.0, Some(100), Some(50)),
            s(11.0, Some(102), Some(50)),
            // b killed at 15 s and restarted smaller.
            s(21.0, Some(104), Some(10)),
            s(31.0, Some(106), Some(10)),
        ];
        let gaps = [(0.0, 2.0), (10.0, 12.0), (20.0, 22.0), (30.0, 32.0)];
        let changes = vec![PidChange {
            backend: "b".into(),
            t_s: 15.0,
            from: Some(7),
            to: Some(8),
        }];
        let f = stitched_floors(&samples, &changes, &gaps);
        let series: Vec<i64> = f.iter().map(|(_, v, shift)| *v as i64 + shift).collect();
        // The rise of 2 a gap goes on; the 40 lost at the restart does not show.
        assert_eq!(series, vec![150, 152, 152, 154]);
        // Without a restart nothing moves.
        let plain = stitched_floors(&samples, &[], &gaps);
        assert!(plain.iter().all(|(_, _, shift)| *shift == 0));
    }

    #[test]
    fn floors_take_whole_samples_inside_the_window() {
        let samples = vec![
            s(1.0, Some(10), Some(5)),
            s(2.0, Some(3), None), // b restarting: not a whole sample
            s(3.0, Some(8), Some(5)),
            s(9.0, Some(1), Some(1)), // outside
        ];
        assert_eq!(floor(&samples, 1.0, 3.0), Some(13));
        assert_eq!(floor(&samples, 4.0, 5.0), None);
    }
}
