//! Where the CPU went during a night: each backend's process tree, `up` itself (its supervisor and
//! gateway run in one process), the drill, and the rest of the machine, beside the time the
//! machine spent idle, waiting on I/O and stolen by its host; and what the pool's memory cgroup
//! did with its file cache (its charge, the cache in it, file pages read again after the kernel
//! evicted them to stay under the limit). Read from `/proc` and the cgroup every few seconds and
//! summed into windows of the night. On two shared cores a lane that slows over the night while
//! its memory stays flat is explained here: a process whose CPU grows, a cgroup at its limit
//! evicting the files its engines run from, or a machine that gave less.

use std::collections::BTreeMap;

use serde::Serialize;

/// One process's cumulative figures from its `/proc/PID/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ProcStat {
    /// `utime + stime`: its own threads.
    pub own: u64,
    /// `cutime + cstime`: children it has waited for.
    pub reaped: u64,
    /// `majflt + cmajflt`: page faults that read from disk.
    pub major_faults: u64,
    /// `minflt + cminflt`: page faults served from memory (fresh pages an allocator touches).
    pub minor_faults: u64,
}

/// A process tree's cumulative figures at one reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TreeCpu {
    /// The PID the tree was read from: figures of two readings compare only for the same root.
    pub root: u32,
    pub ticks: u64,
    pub major_faults: u64,
    #[serde(default)]
    pub minor_faults: u64,
}

/// The machine's cumulative CPU time over all its CPUs, in clock ticks (`/proc/stat`'s `cpu`
/// line).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MachineCpu {
    /// user + nice + system + irq + softirq (guest time is inside user).
    pub busy: u64,
    pub idle: u64,
    pub iowait: u64,
    /// Time the hypervisor ran something else while this machine wanted to run.
    pub steal: u64,
}

/// The pool's memory cgroup at one reading, in bytes (the counts cumulative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct CgroupMem {
    /// The whole charge: what the limit is compared with (file cache included).
    pub usage_bytes: u64,
    /// File cache charged to it (logs written, model files read or mapped).
    pub file_bytes: u64,
    /// Of that, files mapped into the engines (mapped weights, libraries).
    pub mapped_file_bytes: u64,
    /// File pages read again after they were evicted (a page each), since the cgroup was made.
    pub refaults: u64,
}

/// One reading of everything counted.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuSample {
    /// Seconds from the drill's clock start.
    pub t_s: f64,
    /// By name: each backend's tree, `up`'s own process, the drill's own process.
    pub trees: BTreeMap<String, Option<TreeCpu>>,
    pub machine: Option<MachineCpu>,
    #[serde(default)]
    pub cgroup: Option<CgroupMem>,
}

/// One window of the night: each name's CPU as a percentage of one core, and the machine's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CpuWindow {
    /// The window on the drill's clock (the report gives it as seconds into the night).
    #[serde(skip)]
    pub from_s: f64,
    #[serde(skip)]
    pub to_s: f64,
    /// Seconds between the readings summed (the window less what falls outside its readings).
    pub covered_s: f64,
    pub percent_of_core: BTreeMap<String, f64>,
    pub major_faults: BTreeMap<String, u64>,
    pub minor_faults: BTreeMap<String, u64>,
    /// The machine's busy time that none of the names accounts for.
    pub other_percent: Option<f64>,
    pub idle_percent: Option<f64>,
    pub iowait_percent: Option<f64>,
    pub steal_percent: Option<f64>,
    /// The pool's cgroup: its highest charge, its file cache at the window's last reading, and
    /// the file data read again after eviction during the window.
    pub cgroup_peak_usage_bytes: Option<u64>,
    pub cgroup_file_bytes: Option<u64>,
    pub cgroup_refault_bytes: Option<u64>,
}

/// The `cpu` line of `/proc/stat`.
pub fn parse_machine(stat: &str) -> Option<MachineCpu> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_ascii_whitespace()
        .skip(1)
        .map(|x| x.parse().ok())
        .collect::<Option<_>>()?;
    let at = |i: usize| v.get(i).copied().unwrap_or(0);
    if v.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal guest guest_nice
    Some(MachineCpu {
        busy: at(0) + at(1) + at(2) + at(5) + at(6),
        idle: at(3),
        iowait: at(4),
        steal: at(7),
    })
}

/// A memory cgroup's `memory.stat`: v1's hierarchical `total_*` keys, or v2's.
pub fn parse_cgroup_stat(stat: &str, usage_bytes: u64) -> Option<CgroupMem> {
    let field = |key: &str| {
        stat.lines().find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse::<u64>().ok())?
        })
    };
    if let Some(file_bytes) = field("total_cache") {
        return Some(CgroupMem {
            usage_bytes,
            file_bytes,
            mapped_file_bytes: field("total_mapped_file").unwrap_or(0),
            refaults: field("total_workingset_refault_file")
                .or_else(|| field("total_workingset_refault"))
                .unwrap_or(0),
        });
    }
    Some(CgroupMem {
        usage_bytes,
        file_bytes: field("file")?,
        mapped_file_bytes: field("file_mapped").unwrap_or(0),
        refaults: field("workingset_refault_file")
            .or_else(|| field("workingset_refault"))
            .unwrap_or(0),
    })
}

/// The memory cgroup in `dir` (v1 or v2) now.
pub fn read_cgroup(dir: &std::path::Path) -> Option<CgroupMem> {
    let usage = ["memory.current", "memory.usage_in_bytes"]
        .iter()
        .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())?;
    let stat = std::fs::read_to_string(dir.join("memory.stat")).ok()?;
    parse_cgroup_stat(&stat, usage.trim().parse().ok()?)
}

/// A `/proc/PID/stat` line. The command name (field 2) may hold spaces and parentheses, so the
/// fields are counted from the last `)`.
pub fn parse_process(stat: &str) -> Option<ProcStat> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_ascii_whitespace().collect();
    // After the name: state(0) ppid(1) pgrp(2) session(3) tty_nr(4) tpgid(5) flags(6) minflt(7)
    // cminflt(8) majflt(9) cmajflt(10) utime(11) stime(12) cutime(13) cstime(14).
    let n = |i: usize| {
        f.get(i)
            .and_then(|x| x.parse::<i64>().ok())
            .map(|x| x.max(0) as u64)
    };
    Some(ProcStat {
        own: n(11)? + n(12)?,
        reaped: n(13)? + n(14)?,
        major_faults: n(9)? + n(10)?,
        minor_faults: n(7)? + n(8)?,
    })
}

fn read_stat(pid: u32) -> Option<ProcStat> {
    parse_process(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `root`'s process tree: every member's own time and the time of the children it reaped (a
/// reaped child's time moves into its parent's, so nothing is counted twice). `None` when `root`
/// is gone.
pub fn read_tree(root: u32) -> Option<TreeCpu> {
    let pids = headroom_gpu::process_tree(root);
    let first = read_stat(*pids.first()?)?;
    let mut ticks = first.own + first.reaped;
    let mut major_faults = first.major_faults;
    let mut minor_faults = first.minor_faults;
    for s in pids[1..].iter().filter_map(|p| read_stat(*p)) {
        ticks += s.own + s.reaped;
        major_faults += s.major_faults;
        minor_faults += s.minor_faults;
    }
    Some(TreeCpu {
        root,
        ticks,
        major_faults,
        minor_faults,
    })
}

/// One process alone, without its children: `up`, whose children are the backends (counted as
/// theirs) and whose reaped children are backends that died.
pub fn read_process(pid: u32) -> Option<TreeCpu> {
    let s = read_stat(pid)?;
    Some(TreeCpu {
        root: pid,
        ticks: s.own,
        major_faults: s.major_faults,
        minor_faults: s.minor_faults,
    })
}

/// The machine now.
pub fn read_machine() -> Option<MachineCpu> {
    parse_machine(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// Clock ticks per second of `/proc`'s figures.
pub fn ticks_per_second() -> f64 {
    rustix::param::clock_ticks_per_second() as f64
}

/// Sums the readings into one window per `[bounds[i], bounds[i + 1])`. A pair of consecutive
/// readings belongs to the window its midpoint falls in; a name whose root differs from the one last
/// read (a restarted backend) counts the new root's whole life in the pair that first reads it.
pub fn windows(samples: &[CpuSample], bounds: &[f64], ticks_per_s: f64) -> Vec<CpuWindow> {
    let pairs = pairs(samples);
    bounds
        .windows(2)
        .map(|w| window(samples, &pairs, w[0], w[1], ticks_per_s))
        .collect()
}

/// Two consecutive readings and what each name used between them.
struct Pair<'a> {
    a: &'a CpuSample,
    b: &'a CpuSample,
    used: BTreeMap<&'a str, TreeCpu>,
}

/// Every pair of consecutive readings (the second later than the first), each name's use over it
/// counted once for all windows.
fn pairs(samples: &[CpuSample]) -> Vec<Pair<'_>> {
    // Per name, the root last read before the pair's second reading.
    let mut last_root: BTreeMap<&str, u32> = BTreeMap::new();
    let mut out = Vec::new();
    for p in samples.windows(2) {
        let (a, b) = (&p[0], &p[1]);
        for (name, t) in &a.trees {
            if let Some(t) = t {
                last_root.insert(name, t.root);
            }
        }
        if b.t_s <= a.t_s {
            continue;
        }
        let mut used = BTreeMap::new();
        for (name, now) in &b.trees {
            let Some(now) = now else { continue };
            let before = match a.trees.get(name) {
                Some(Some(before)) if before.root == now.root => *before,
                // Started again since the root last read (a restarted engine): the whole of its
                // new life falls after that reading — its start-up, left to `other` before.
                _ if last_root.get(name.as_str()).is_some_and(|&r| r != now.root) => TreeCpu {
                    root: now.root,
                    ticks: 0,
                    major_faults: 0,
                    minor_faults: 0,
                },
                _ => continue,
            };
            used.insert(
                name.as_str(),
                TreeCpu {
                    root: now.root,
                    ticks: now.ticks.saturating_sub(before.ticks),
                    major_faults: now.major_faults.saturating_sub(before.major_faults),
                    minor_faults: now.minor_faults.saturating_sub(before.minor_faults),
                },
            );
        }
        out.push(Pair { a, b, used });
    }
    out
}

fn window(samples: &[CpuSample], all: &[Pair], from: f64, to: f64, ticks_per_s: f64) -> CpuWindow {
    let pairs: Vec<&Pair> = all
        .iter()
        .filter(|p| {
            let mid = (p.a.t_s + p.b.t_s) / 2.0;
            mid >= from && mid < to
        })
        .collect();
    let covered: f64 = pairs.iter().map(|p| p.b.t_s - p.a.t_s).sum();
    let pct = |ticks: u64| {
        if covered > 0.0 {
            ticks as f64 / ticks_per_s / covered * 100.0
        } else {
            0.0
        }
    };
    let mut ticks: BTreeMap<String, u64> = BTreeMap::new();
    let mut faults: BTreeMap<String, u64> = BTreeMap::new();
    let mut minor: BTreeMap<String, u64> = BTreeMap::new();
    for p in &pairs {
        for (name, used) in &p.used {
            *ticks.entry(name.to_string()).or_default() += used.ticks;
            *faults.entry(name.to_string()).or_default() += used.major_faults;
            *minor.entry(name.to_string()).or_default() += used.minor_faults;
        }
    }
    let machine: Option<MachineCpu> = pairs.iter().try_fold(MachineCpu::default(), |acc, p| {
        let (a, b) = (p.a.machine?, p.b.machine?);
        Some(MachineCpu {
            busy: acc.busy + b.busy.saturating_sub(a.busy),
            idle: acc.idle + b.idle.saturating_sub(a.idle),
            iowait: acc.iowait + b.iowait.saturating_sub(a.iowait),
            steal: acc.steal + b.steal.saturating_sub(a.steal),
        })
    });
    let machine = machine.filter(|_| !pairs.is_empty());
    let named: u64 = ticks.values().sum();
    let page = rustix::param::page_size() as u64;
    let refaults: Option<u64> = pairs.iter().try_fold(0u64, |acc, p| {
        Some(acc + p.b.cgroup?.refaults.saturating_sub(p.a.cgroup?.refaults))
    });
    let mut inside = samples
        .iter()
        .filter(|s| s.t_s >= from && s.t_s < to)
        .filter_map(|s| s.cgroup);
    CpuWindow {
        from_s: from,
        to_s: to,
        covered_s: covered,
        percent_of_core: ticks.iter().map(|(k, v)| (k.clone(), pct(*v))).collect(),
        major_faults: faults,
        minor_faults: minor,
        other_percent: machine.map(|m| pct(m.busy.saturating_sub(named))),
        idle_percent: machine.map(|m| pct(m.idle)),
        iowait_percent: machine.map(|m| pct(m.iowait)),
        steal_percent: machine.map(|m| pct(m.steal)),
        cgroup_peak_usage_bytes: inside.clone().map(|c| c.usage_bytes).max(),
        cgroup_file_bytes: inside.next_back().map(|c| c.file_bytes),
        cgroup_refault_bytes: refaults.filter(|_| !pairs.is_empty()).map(|r| r * page),
    }
}

/// `n` equal windows over `[from, from + length]`: about ten minutes each, at least three and
/// at most twelve.
pub fn bounds(from: f64, length: f64) -> Vec<f64> {
    let n = (length / 600.0).round().clamp(3.0, 12.0) as usize;
    (0..=n)
        .map(|i| from + length * i as f64 / n as f64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_line_splits_busy_from_idle_iowait_and_steal() {
        let stat = "cpu  100 20 30 400 50 6 7 8 90 0\ncpu0 1 2 3 4 5 6 7 8 9 0\nintr 5\n";
        let m = parse_machine(stat).unwrap();
        // 100 + 20 + 30 + 6 + 7; guest (90) is inside user already.
        assert_eq!(
            m,
            MachineCpu {
                busy: 163,
                idle: 400,
                iowait: 50,
                steal: 8
            }
        );
        assert_eq!(parse_machine("cpu0 1 2 3 4\n"), None);
        assert_eq!(parse_machine("cpu  1 x 3 4\n"), None);
    }

    #[test]
    fn a_process_line_is_read_after_the_last_parenthesis() {
        // A name with spaces and a `)` inside, as a Python launcher may set.
        let stat = "4242 (py (worker) 1) S 1 4242 4242 0 -1 4194560 900 10 7 3 250 40 12 6 20 0 \
                    9 0 100 1000 50";
        assert_eq!(
            parse_process(stat),
            Some(ProcStat {
                own: 290,
                reaped: 18,
                major_faults: 10,
                minor_faults: 910
            })
        );
        assert_eq!(parse_process("12 (x) S 1 2"), None);
    }

    #[test]
    fn the_cgroup_stat_reads_v1_totals_and_v2_keys() {
        let v1 = "cache 5\nmapped_file 1\ntotal_cache 371347456\ntotal_mapped_file 162689024\n\
                  total_workingset_refault_file 132446\ntotal_inactive_file 9\n";
        assert_eq!(
            parse_cgroup_stat(v1, 2_577_039_360),
            Some(CgroupMem {
                usage_bytes: 2_577_039_360,
                file_bytes: 371_347_456,
                mapped_file_bytes: 162_689_024,
                refaults: 132_446
            })
        );
        let v2 = "anon 100\nfile 4096\nfile_mapped 2048\nworkingset_refault_anon 3\n\
                  workingset_refault_file 7\n";
        assert_eq!(
            parse_cgroup_stat(v2, 9000),
            Some(CgroupMem {
                usage_bytes: 9000,
                file_bytes: 4096,
                mapped_file_bytes: 2048,
                refaults: 7
            })
        );
        assert_eq!(parse_cgroup_stat("anon 1\n", 1), None);
    }

    fn sample(t: f64, a: Option<(u32, u64)>, machine: (u64, u64, u64, u64)) -> CpuSample {
        CpuSample {
            t_s: t,
            trees: [(
                "a".to_string(),
                a.map(|(root, ticks)| TreeCpu {
                    root,
                    ticks,
                    major_faults: ticks / 10,
                    minor_faults: ticks,
                }),
            )]
            .into_iter()
            .collect(),
            machine: Some(MachineCpu {
                busy: machine.0,
                idle: machine.1,
                iowait: machine.2,
                steal: machine.3,
            }),
            cgroup: Some(CgroupMem {
                usage_bytes: 1000 + t as u64,
                file_bytes: t as u64,
                mapped_file_bytes: 0,
                refaults: 3 * t as u64,
            }),
        }
    }

    #[test]
    fn windows_sum_pairs_by_midpoint_and_count_a_restarted_root_from_its_start() {
        // 100 ticks a second; readings every 10 s.
        let samples = vec![
            sample(0.0, Some((7, 0)), (0, 0, 0, 0)),
            sample(10.0, Some((7, 500)), (1_000, 900, 50, 50)),
            sample(20.0, Some((7, 1_000)), (2_000, 1_800, 100, 100)),
            // Restarted: a new root, 40 ticks into its life; that pair counts the 40 for `a`.
            sample(30.0, Some((8, 40)), (3_500, 2_300, 150, 250)),
            sample(40.0, Some((8, 1_040)), (5_000, 2_800, 200, 400)),
        ];
        let w = windows(&samples, &[0.0, 20.0, 40.0], 100.0);
        assert_eq!(w.len(), 2);
        // First window: pairs (0,10) and (10,20): 1000 ticks over 20 s = 50 % of a core.
        assert_eq!(w[0].covered_s, 20.0);
        assert_eq!(w[0].percent_of_core["a"], 50.0);
        assert_eq!(w[0].major_faults["a"], 100);
        assert_eq!(w[0].minor_faults["a"], 1_000);
        // The machine: 2000 busy ticks over 20 s = 100 %, of which `a` is 50: other 50.
        assert_eq!(w[0].other_percent, Some(50.0));
        assert_eq!(w[0].idle_percent, Some(90.0));
        assert_eq!(w[0].iowait_percent, Some(5.0));
        assert_eq!(w[0].steal_percent, Some(5.0));
        // The cgroup: its highest charge among the readings inside the window (0 and 10 s),
        // its cache at the last of them, and 60 pages read again over the pairs (3 a second).
        assert_eq!(w[0].cgroup_peak_usage_bytes, Some(1010));
        assert_eq!(w[0].cgroup_file_bytes, Some(10));
        let page = rustix::param::page_size() as u64;
        assert_eq!(w[0].cgroup_refault_bytes, Some(60 * page));
        // Second window: (20,30) is a restart, where the new root's 40 ticks count, then
        // (30,40)'s 1000: 1040 ticks over the window's 20 s of readings = 52 %; the machine's
        // 3000 busy ticks = 150 %, of which 98 % is someone else's.
        assert_eq!(w[1].percent_of_core["a"], 52.0);
        assert!((w[1].other_percent.unwrap() - 98.0).abs() < 1e-9);
        assert_eq!(w[1].steal_percent, Some(15.0));
    }

    #[test]
    fn a_backend_down_for_a_reading_then_started_again_counts_its_start_up() {
        let samples = vec![
            sample(0.0, Some((7, 0)), (0, 0, 0, 0)),
            sample(10.0, Some((7, 200)), (1_000, 900, 0, 0)),
            // Killed: nothing to read.
            sample(20.0, None, (2_000, 1_800, 0, 0)),
            // Started again, 300 ticks of start-up by its first reading, then 100 more.
            sample(30.0, Some((9, 300)), (3_000, 2_700, 0, 0)),
            sample(40.0, Some((9, 400)), (4_000, 3_600, 0, 0)),
        ];
        let w = windows(&samples, &[0.0, 40.0], 100.0);
        // 200 + 300 + 100 ticks over 40 s = 15 % of a core; before, the 300 went to `other`.
        assert_eq!(w[0].percent_of_core["a"], 15.0);
        assert_eq!(w[0].other_percent, Some(85.0));
    }

    /// A real tree: a shell that only waits, and its child that spins. The tree's figure has the
    /// child's time; the root's own has almost none.
    #[test]
    fn a_tree_counts_its_children_and_a_process_alone_does_not() {
        use rustix::process::{Pid, Signal, kill_process};
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sh -c 'while :; do :; done' & wait"])
            .spawn()
            .expect("sh");
        let root = shell.id();
        std::thread::sleep(std::time::Duration::from_millis(300));
        let (tree0, own0) = (read_tree(root), read_process(root));
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let (tree1, own1) = (read_tree(root), read_process(root));
        for pid in headroom_gpu::process_tree(root).into_iter().rev() {
            if let Some(p) = Pid::from_raw(pid as i32) {
                let _ = kill_process(p, Signal::KILL);
            }
        }
        let _ = shell.wait();
        let tree = tree1.unwrap().ticks - tree0.unwrap().ticks;
        let own = own1.unwrap().ticks - own0.unwrap().ticks;
        let tree_s = tree as f64 / ticks_per_second();
        // The spinner gets a tenth of a core over 1.5 s even on a busy two-core machine.
        assert!(
            tree_s >= 0.15,
            "the tree used {tree_s:.2} s of CPU in 1.5 s"
        );
        assert!(
            own * 10 <= tree,
            "the waiting shell used {own} ticks, its tree {tree}"
        );
    }

    #[test]
    fn about_ten_minutes_a_window() {
        assert_eq!(bounds(100.0, 3600.0).len(), 7);
        assert_eq!(bounds(0.0, 120.0), vec![0.0, 40.0, 80.0, 120.0]);
        assert_eq!(bounds(0.0, 36_000.0).len(), 13);
    }
}
