//! The host memory pool: host RAM seen as one "device" whose users are process trees. This is
//! what a CPU-only or unified-memory box has, and it lets `up`, `serve` and the ledger run the same
//! code on a machine without a GPU.
//!
//! A member is a named root PID (a backend `up` started, or a process `serve` was told to watch);
//! its memory is the resident set of the root and all of its descendants, read from `/proc`:
//! the proportional set size (PSS, from `/proc/PID/smaps_rollup`) where the kernel offers it, so
//! pages shared inside a tree (forked workers, shared libraries) are not counted twice, else the
//! resident set size (RSS, from `/proc/PID/status`).
//!
//! Cost: the pool reads at two rates. Once a second (and whenever a process of the tree has gone)
//! a member's tree is walked again (one `children` read per thread) and each process's PSS read
//! from `smaps_rollup` (the kernel walks every mapping for it: the expensive part). In between,
//! one `pread` of each known process's `statm`, kept open, gives its RSS now; the tree's figure is
//! that RSS less the shared surplus (RSS − PSS) seen at the last full read, so growth in private
//! memory (what a job adds) shows at the sampler's rate while shared pages are still counted
//! once. A member that is one cgroup instead of a tree would read its usage file there: one read
//! per sample, nothing to walk. Readers of one pool (the supervisor's sampler and serve's memory
//! feed) can share one reading per period ([`HostPool::share_readings_within`]). Where
//! `/proc/PID/task/TID/children` is missing (kernels without `CONFIG_PROC_CHILDREN`), the tree is
//! found by scanning every `/proc/*/stat` instead.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::probe::{DeviceSnapshot, GpuProbe, ProbeError, ProcessMemory};

/// The memory of one process tree at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeMemory {
    /// The PID the tree was read from.
    pub root: u32,
    /// Every process of the tree that was alive while it was read (root first).
    pub pids: Vec<u32>,
    /// Sum of the resident set sizes (shared pages counted once per process).
    pub rss_bytes: u64,
    /// Sum of the proportional set sizes; `None` where the kernel does not offer
    /// `smaps_rollup` (or it was unreadable for one of the processes).
    pub pss_bytes: Option<u64>,
}

impl TreeMemory {
    /// The figure headroom uses: PSS where available, else RSS.
    pub fn bytes(&self) -> u64 {
        self.pss_bytes.unwrap_or(self.rss_bytes)
    }
}

/// `root` and all of its descendants (root first, then breadth first). Empty when `root` does not
/// exist. Processes that exit while the tree is read are left out.
pub fn process_tree(root: u32) -> Vec<u32> {
    if !Path::new(&format!("/proc/{root}")).exists() {
        return Vec::new();
    }
    match tree_from_children_files(root) {
        Some(tree) => tree,
        None => tree_from_stat_scan(root),
    }
}

/// Walks `/proc/PID/task/*/children`; `None` when the kernel has no such files.
fn tree_from_children_files(root: u32) -> Option<Vec<u32>> {
    if !Path::new(&format!("/proc/{root}/task/{root}/children")).exists() {
        return None;
    }
    let mut seen = HashSet::from([root]);
    let mut order = vec![root];
    let mut queue = VecDeque::from([root]);
    while let Some(pid) = queue.pop_front() {
        // A process that exited meanwhile has no children left to find: skip read errors.
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(text) = fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in text.split_ascii_whitespace().filter_map(|s| s.parse().ok()) {
                if seen.insert(child) {
                    order.push(child);
                    queue.push_back(child);
                }
            }
        }
    }
    Some(order)
}

/// Finds the tree from every process's parent PID in `/proc/*/stat`.
fn tree_from_stat_scan(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(ppid) = read_ppid(pid) {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut order = vec![root];
    let mut seen = HashSet::from([root]);
    let mut queue = VecDeque::from([root]);
    while let Some(pid) = queue.pop_front() {
        for &child in children.get(&pid).map(Vec::as_slice).unwrap_or(&[]) {
            if seen.insert(child) {
                order.push(child);
                queue.push_back(child);
            }
        }
    }
    order
}

/// The parent PID from `/proc/PID/stat`. The command name (field 2) may hold spaces and
/// parentheses, so the fields are counted from the last `)`.
fn read_ppid(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // After the name: state, ppid, ...
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// One process's resident figures, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ProcMemory {
    rss: u64,
    pss: Option<u64>,
}

/// Reads one process: `smaps_rollup` (Rss and Pss) when present, else `status` (VmRSS).
/// `Ok(None)` when the process has gone (or is a zombie with no memory left to read).
fn proc_memory(pid: u32) -> io::Result<Option<ProcMemory>> {
    match fs::read_to_string(format!("/proc/{pid}/smaps_rollup")) {
        Ok(text) => {
            let rss = kib_field(&text, "Rss:");
            let pss = kib_field(&text, "Pss:");
            if let (Some(rss), Some(pss)) = (rss, pss) {
                return Ok(Some(ProcMemory {
                    rss,
                    pss: Some(pss),
                }));
            }
            // A zombie or kernel thread has an empty rollup; fall through to status.
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                return Ok(None);
            }
        }
        // Permission denied (another user's process) or a read racing the exit: try status.
        Err(_) => {}
    }
    match fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(text) => Ok(Some(ProcMemory {
            rss: kib_field(&text, "VmRSS:").unwrap_or(0),
            pss: None,
        })),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
        // ESRCH shows up as "No such process" when the process exits mid-read.
        Err(err) if err.raw_os_error() == Some(3) => Ok(None),
        Err(err) => Err(err),
    }
}

/// The value of a `Name:   1234 kB` line, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..]
        .split_ascii_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// The memory of `root`'s process tree. Fails with `NotFound` when `root` does not exist.
pub fn tree_memory(root: u32) -> io::Result<TreeMemory> {
    let tree = process_tree(root);
    if tree.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("no process {root}"),
        ));
    }
    let mut pids = Vec::with_capacity(tree.len());
    let mut rss_bytes = 0u64;
    let mut pss_sum = Some(0u64);
    for pid in tree {
        let Some(mem) = proc_memory(pid)? else {
            continue;
        };
        pids.push(pid);
        rss_bytes = rss_bytes.saturating_add(mem.rss);
        pss_sum = match (pss_sum, mem.pss) {
            (Some(sum), Some(pss)) => Some(sum.saturating_add(pss)),
            _ => None,
        };
    }
    if pids.first() != Some(&root) {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("process {root} exited"),
        ));
    }
    Ok(TreeMemory {
        root,
        pids,
        rss_bytes,
        pss_bytes: pss_sum,
    })
}

/// Total host RAM from `/proc/meminfo` (`MemTotal`), for a pool sized "the whole machine".
pub fn host_mem_total() -> io::Result<u64> {
    let text = fs::read_to_string("/proc/meminfo")?;
    kib_field(&text, "MemTotal:")
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no MemTotal in /proc/meminfo"))
}

/// How often a member's process tree is walked again (its `children` files: cheap). A tree
/// whose processes changed is read in full at once.
pub const TREE_WALK_EVERY: Duration = Duration::from_secs(1);
/// How often a member's PSS is read again from `smaps_rollup` although its tree did not change
/// (the kernel walks every mapping of the process for it: the expensive read). Between two, the
/// shared surplus (RSS − PSS) is taken as unchanged: what a job adds is private memory, which
/// RSS and PSS count alike.
pub const PSS_EVERY: Duration = Duration::from_secs(10);
/// A tree whose RSS moved by more than [`moved_enough`] since its last full read is read in full
/// again, at most this often: file pages it maps (a model loaded at start, a library) may be
/// shared with other processes, which PSS divides and RSS does not, so the surplus is taken again
/// whenever the tree's memory really moves (idle, it does not: no extra cost).
pub const REANCHOR_AFTER: Duration = Duration::from_millis(250);

/// How little a process's RSS may move while its `smaps_rollup` is read for its `statm` to be
/// compared with the walk.
const STILL_BYTES: u64 = 1 << 20;

/// How far a tree's RSS must move from its last full read to be read in full again: 8 MiB, or
/// 5 % of what it held then if that is more.
fn moved_enough(rss_at_full: u64) -> u64 {
    (8u64 << 20).max(rss_at_full / 20)
}

/// The RSS in an open `/proc/PID/statm` (its second field, in pages), read again from the start.
/// `None` once the process has been reaped (the kernel answers ESRCH for a file opened before).
fn statm_bytes(statm: &File) -> Option<u64> {
    let mut buf = [0u8; 160];
    let n = statm.read_at(&mut buf, 0).ok()?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    let pages: u64 = text.split_ascii_whitespace().nth(1)?.parse().ok()?;
    Some(pages.saturating_mul(rustix::param::page_size() as u64))
}

/// One process of a followed tree: its `statm`, kept open so each reading is one `pread` (an
/// open `/proc` file also stays bound to its process: once that exits the read fails, and a
/// process that reuses the PID is never read by mistake).
#[derive(Debug)]
struct Followed {
    pid: u32,
    statm: File,
    /// RSS − PSS at the last full read: shared pages charged to other processes.
    surplus: u64,
}

/// One member's tree as the pool follows it between full reads.
#[derive(Debug)]
struct TreeReader {
    procs: Vec<Followed>,
    /// When the PSS was read (the last full read).
    full_at: Instant,
    /// When the tree was last walked and found unchanged (or read in full).
    walked_at: Instant,
    /// The tree's RSS (from `statm`) at the last full read.
    rss_at_full: u64,
}

impl TreeReader {
    /// Walks `root`'s tree and reads every process in full (PSS where the kernel offers it, else
    /// RSS); `None` when `root` is gone.
    fn full(root: u32) -> Option<(TreeReader, u64)> {
        let now = Instant::now();
        let mut procs = Vec::new();
        let mut total = 0u64;
        let mut rss_total = 0u64;
        for pid in process_tree(root) {
            let Ok(statm) = File::open(format!("/proc/{pid}/statm")) else {
                continue;
            };
            let before = statm_bytes(&statm);
            let Ok(Some(mem)) = proc_memory(pid) else {
                continue;
            };
            let after = statm_bytes(&statm);
            let held = mem.pss.unwrap_or(mem.rss);
            let surplus = match (before, after) {
                // Still while it was read: the surplus against statm's own RSS (the kernel's
                // counters, which can differ a little from the page walk), so the next fast
                // reading starts from `held` exactly.
                (Some(b), Some(a)) if b.abs_diff(a) <= STILL_BYTES => {
                    (a / 2 + b / 2).saturating_sub(held)
                }
                // Moving (a job allocating and freeing in bursts): statm read a moment apart
                // from the walk could be far off, so the walk's own RSS gives the surplus.
                _ => mem.rss.saturating_sub(held),
            };
            let rss = after.unwrap_or(mem.rss);
            total = total.saturating_add(held);
            rss_total = rss_total.saturating_add(rss);
            procs.push(Followed {
                pid,
                statm,
                surplus,
            });
        }
        let tree = TreeReader {
            procs,
            full_at: now,
            walked_at: now,
            rss_at_full: rss_total,
        };
        (!tree.procs.is_empty()).then_some((tree, total))
    }

    /// Whether a walk of `root`'s tree finds exactly the processes followed.
    fn unchanged(&self, root: u32) -> bool {
        let mut walked = process_tree(root);
        let mut followed: Vec<u32> = self.procs.iter().map(|p| p.pid).collect();
        walked.sort_unstable();
        followed.sort_unstable();
        walked == followed
    }

    /// The tree's RSS and its figure from `statm` alone; `None` when one of its processes has
    /// gone (the tree changed: walk it again).
    fn fast(&self) -> Option<(u64, u64)> {
        self.procs
            .iter()
            .try_fold((0u64, 0u64), |(rss_sum, sum), p| {
                let rss = statm_bytes(&p.statm)?;
                Some((
                    rss_sum.saturating_add(rss),
                    sum.saturating_add(rss.saturating_sub(p.surplus)),
                ))
            })
    }
}

/// How a pool's readings were made, for benchmarks and tests of its cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolReadStats {
    /// Member readings that walked the tree and read `smaps_rollup`.
    pub full_reads: u64,
    /// Tree walks that found the same processes (then read from `statm`).
    pub walks: u64,
    /// Member readings from the open `statm` files (walked or not).
    pub fast_reads: u64,
    /// Snapshots handed to a reader from the previous one (see
    /// [`HostPool::share_readings_within`]).
    pub shared: u64,
}

/// How often a pool walks trees and reads PSS (the constants; shorter in tests).
#[derive(Debug, Clone, Copy)]
struct Periods {
    walk: Duration,
    pss: Duration,
    reanchor: Duration,
}

const PERIODS: Periods = Periods {
    walk: TREE_WALK_EVERY,
    pss: PSS_EVERY,
    reanchor: REANCHOR_AFTER,
};

/// A snapshot kept for the next reader: when it was read, of which members, and the device.
type LastReading = (Instant, Vec<(String, u32)>, DeviceSnapshot);

/// The reading state of a pool: each member's followed tree and the last snapshot.
#[derive(Debug, Default)]
struct PoolReader {
    trees: HashMap<u32, TreeReader>,
    last: Option<LastReading>,
    stats: PoolReadStats,
}

impl PoolReader {
    /// The bytes of the tree rooted at `root`: from `statm` while its PSS is recent, its
    /// processes are the ones followed (walked again every `periods.walk`) and its RSS has not
    /// moved far since (else at most every `periods.reanchor`), otherwise from a full read.
    fn member_bytes(&mut self, root: u32, now: Instant, periods: Periods) -> u64 {
        if let Some(tree) = self.trees.get_mut(&root)
            && now.saturating_duration_since(tree.full_at) < periods.pss
        {
            let mut current = true;
            if now.saturating_duration_since(tree.walked_at) >= periods.walk {
                current = tree.unchanged(root);
                tree.walked_at = now;
                self.stats.walks += u64::from(current);
            }
            if current && let Some((rss, bytes)) = tree.fast() {
                let moved = rss.abs_diff(tree.rss_at_full) > moved_enough(tree.rss_at_full);
                if !moved || now.saturating_duration_since(tree.full_at) < periods.reanchor {
                    self.stats.fast_reads += 1;
                    return bytes;
                }
            }
        }
        self.stats.full_reads += 1;
        match TreeReader::full(root) {
            Some((tree, bytes)) => {
                self.trees.insert(root, tree);
                bytes
            }
            None => {
                self.trees.remove(&root);
                0
            }
        }
    }
}

/// A pool of host RAM of a configured capacity, shared by named members (process trees). As a
/// [`GpuProbe`] it answers one device, index 0, named `host`. Cloning is cheap and every clone
/// sees the same members and readings, so the supervisor can add a backend after a sampler took
/// the probe.
#[derive(Debug, Clone)]
pub struct HostPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    capacity_bytes: u64,
    members: Mutex<BTreeMap<String, u32>>,
    reader: Mutex<PoolReader>,
    /// Nanoseconds within which a snapshot is handed to the next reader instead of reading again.
    share_within_ns: AtomicU64,
    periods: Periods,
}

impl HostPool {
    /// A pool of `capacity_bytes` with no members yet.
    pub fn new(capacity_bytes: u64) -> Self {
        Self::with_periods(capacity_bytes, PERIODS)
    }

    fn with_periods(capacity_bytes: u64, periods: Periods) -> Self {
        HostPool {
            inner: Arc::new(PoolInner {
                capacity_bytes,
                members: Mutex::new(BTreeMap::new()),
                reader: Mutex::new(PoolReader::default()),
                share_within_ns: AtomicU64::new(0),
                periods,
            }),
        }
    }

    /// The configured capacity.
    pub fn capacity_bytes(&self) -> u64 {
        self.inner.capacity_bytes
    }

    /// A cheap handle on the same pool (a clone).
    pub fn handle(&self) -> HostPool {
        self.clone()
    }

    /// Hands a snapshot younger than `within` (with the same members) to the next reader instead
    /// of reading `/proc` again. Two readers polling every `P` share one reading per period when
    /// `within` is `P / 2`, whatever their phases; a reading is then at most `within` older than
    /// the call. Zero (the default) reads on every call.
    pub fn share_readings_within(&self, within: Duration) {
        let ns = u64::try_from(within.as_nanos()).unwrap_or(u64::MAX);
        self.inner.share_within_ns.store(ns, Ordering::Relaxed);
    }

    /// Adds `name` with root `root_pid`, or moves it to a new root (e.g. after a restart).
    pub fn set_member(&self, name: &str, root_pid: u32) {
        self.members().insert(name.to_string(), root_pid);
    }

    /// Removes `name`; unknown names are ignored.
    pub fn remove_member(&self, name: &str) {
        self.members().remove(name);
    }

    /// The root PID of `name`, if it is a member.
    pub fn member(&self, name: &str) -> Option<u32> {
        self.members().get(name).copied()
    }

    /// The members, by name, with their root PIDs.
    pub fn member_list(&self) -> Vec<(String, u32)> {
        self.members()
            .iter()
            .map(|(name, pid)| (name.clone(), *pid))
            .collect()
    }

    /// How the readings so far were made.
    pub fn read_stats(&self) -> PoolReadStats {
        self.reader().stats
    }

    /// The pool's device right now. A member whose root has exited counts 0 bytes and is still
    /// listed (with 0), so a reader sees that it is gone rather than a missing row.
    pub fn device(&self) -> DeviceSnapshot {
        // Copy the members out so that setting one never waits for a /proc read.
        let members = self.member_list();
        let share = Duration::from_nanos(self.inner.share_within_ns.load(Ordering::Relaxed));
        let mut reader = self.reader();
        if let Some((at, seen, device)) = &reader.last
            && at.elapsed() < share
            && *seen == members
        {
            let device = device.clone();
            reader.stats.shared += 1;
            return device;
        }
        let now = Instant::now();
        reader
            .trees
            .retain(|root, _| members.iter().any(|(_, pid)| pid == root));
        let mut processes = Vec::with_capacity(members.len());
        let mut used = 0u64;
        for (name, pid) in &members {
            let bytes = reader.member_bytes(*pid, now, self.inner.periods);
            used = used.saturating_add(bytes);
            processes.push(ProcessMemory {
                pid: *pid,
                name: name.clone(),
                used_bytes: bytes,
            });
        }
        let total = self.inner.capacity_bytes;
        let device = DeviceSnapshot {
            index: 0,
            name: "host".to_string(),
            uuid: String::new(),
            total_bytes: total,
            used_bytes: used,
            free_bytes: total.saturating_sub(used),
            reserved_bytes: 0,
            utilization_percent: None,
            mig_enabled: None,
            processes,
        };
        reader.last = Some((now, members, device.clone()));
        device
    }

    fn members(&self) -> MutexGuard<'_, BTreeMap<String, u32>> {
        // A panic while holding this lock cannot leave the map half-written: keep going.
        self.inner
            .members
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn reader(&self) -> MutexGuard<'_, PoolReader> {
        self.inner
            .reader
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GpuProbe for HostPool {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        Ok(vec![self.device()])
    }
}

/// Process trees by root, walked again when older than `every`: for readers that need a tree's
/// PIDs at a sampler's rate (which processes of an NVML list are a backend's) without walking
/// `/proc` every time.
#[derive(Debug)]
pub struct TreeCache {
    every: Duration,
    trees: HashMap<u32, (Instant, Vec<u32>)>,
}

impl TreeCache {
    pub fn new(every: Duration) -> TreeCache {
        TreeCache {
            every,
            trees: HashMap::new(),
        }
    }

    /// `root`'s tree (see [`process_tree`]), at most `every` old.
    pub fn tree(&mut self, root: u32) -> &[u32] {
        let now = Instant::now();
        let every = self.every;
        let entry = self
            .trees
            .entry(root)
            .or_insert_with(|| (now, process_tree(root)));
        if now.saturating_duration_since(entry.0) >= every {
            *entry = (now, process_tree(root));
        }
        &entry.1
    }

    /// Forgets every tree whose root is not in `roots`.
    pub fn retain(&mut self, roots: &[u32]) {
        self.trees.retain(|root, _| roots.contains(root));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Child, Command, Stdio};

    const MIB: u64 = 1024 * 1024;

    /// A python3 (or, failing that, a shell) child that allocates and touches `mib` MiB when told
    /// to on stdin, then prints "ok". Python is in every CI image we use; the test fails loudly
    /// if it is not.
    struct Hog {
        child: Child,
    }

    impl Hog {
        fn spawn(with_grandchild: bool) -> Hog {
            let script = r#"
import sys, os, subprocess
kids = []
if len(sys.argv) > 1:
    kids.append(subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(600)"]))
held = []
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "child":
        kids.append(subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(48 << 20); b[::4096] = b'x' * len(b[::4096]); print('in', flush=True); time.sleep(600)"], stdout=subprocess.PIPE))
        kids[-1].stdout.readline()
        print("ok", flush=True)
        continue
    if line.startswith("map "):
        import mmap
        f = open(line[4:].strip(), "rb")
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sum(m[i] for i in range(0, len(m), 4096))
        held.append(m)
        print("ok", flush=True)
        continue
    if line.strip() == "end-children":
        for k in kids:
            k.kill()
            k.wait()
        kids.clear()
        print("ok", flush=True)
        continue
    n = int(line)
    b = bytearray(n << 20)
    for i in range(0, len(b), 4096):
        b[i] = 1
    held.append(b)
    print("ok", flush=True)
"#;
            let mut cmd = Command::new("python3");
            cmd.arg("-c").arg(script);
            if with_grandchild {
                cmd.arg("grandchild");
            }
            let child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("python3 is needed for the host pool tests");
            let mut hog = Hog { child };
            hog.expect_line("ready");
            hog
        }

        fn pid(&self) -> u32 {
            self.child.id()
        }

        fn alloc(&mut self, mib: u64) {
            self.say(&mib.to_string());
        }

        /// Starts a child that holds 48 MiB ("child") or ends every child ("end-children").
        fn say(&mut self, command: &str) {
            let stdin = self.child.stdin.as_mut().expect("stdin");
            writeln!(stdin, "{command}").expect("write");
            stdin.flush().expect("flush");
            self.expect_line("ok");
        }

        fn expect_line(&mut self, want: &str) {
            let stdout = self.child.stdout.as_mut().expect("stdout");
            let mut line = String::new();
            BufReader::new(stdout).read_line(&mut line).expect("read");
            assert_eq!(line.trim(), want);
        }
    }

    impl Drop for Hog {
        fn drop(&mut self) {
            for pid in process_tree(self.pid()).into_iter().skip(1) {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// Reads until `check` holds or 10 s pass (a busy machine can be slow to start a child).
    fn eventually<T>(mut read: impl FnMut() -> T, check: impl Fn(&T) -> bool) -> T {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let value = read();
            if check(&value) || std::time::Instant::now() > deadline {
                return value;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    #[test]
    fn tree_memory_follows_a_child_that_touches_memory() {
        let mut hog = Hog::spawn(false);
        let before = tree_memory(hog.pid()).expect("tree");
        hog.alloc(64);
        let after = tree_memory(hog.pid()).expect("tree");
        let grown = after.bytes().saturating_sub(before.bytes());
        // 64 MiB touched page by page: the tree grows by about that much (the interpreter
        // allocates a little besides).
        assert!(
            (60 * MIB..=80 * MIB).contains(&grown),
            "grew by {} MiB",
            grown / MIB
        );
        assert!(after.rss_bytes >= after.bytes() || after.pss_bytes.is_none());
        assert_eq!(after.pids, vec![hog.pid()]);
    }

    #[test]
    fn the_tree_includes_grandchildren_and_their_memory() {
        let hog = Hog::spawn(true);
        // The child touches its 48 MiB page by page after it starts: read until it has (the
        // reading is retried, the assertion is not).
        let root_bytes = || {
            let m = proc_memory(hog.pid()).unwrap().unwrap();
            m.pss.unwrap_or(m.rss)
        };
        let (tree, root) = eventually(
            || (tree_memory(hog.pid()).expect("tree"), root_bytes()),
            |(t, r)| t.pids.len() == 2 && t.bytes() >= r + 44 * MIB,
        );
        assert_eq!(tree.pids.len(), 2, "root and one child: {:?}", tree.pids);
        assert_eq!(tree.pids[0], hog.pid());
        // The child holds 48 MiB on its own.
        assert!(
            tree.bytes() >= root + 44 * MIB,
            "tree {} MiB, root {} MiB",
            tree.bytes() / MIB,
            root / MIB
        );
    }

    #[test]
    fn the_stat_scan_finds_the_same_tree() {
        let hog = Hog::spawn(true);
        let tree = eventually(|| process_tree(hog.pid()), |t| t.len() == 2);
        let mut scanned = tree_from_stat_scan(hog.pid());
        let mut walked = tree.clone();
        scanned.sort_unstable();
        walked.sort_unstable();
        assert_eq!(scanned, walked);
    }

    #[test]
    fn a_missing_process_is_not_found() {
        // PIDs are below 2^22 on Linux.
        let err = tree_memory(u32::MAX - 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
        assert!(process_tree(u32::MAX - 1).is_empty());
    }

    #[test]
    fn the_pool_sums_its_members_and_a_clone_steers_it() {
        let mut a = Hog::spawn(false);
        let b = Hog::spawn(false);
        let pool = HostPool::new(8 << 30);
        let handle = pool.handle();
        handle.set_member("a", a.pid());
        handle.set_member("b", b.pid());
        a.alloc(96);
        let device = &pool.snapshot().unwrap()[0];
        assert_eq!(device.index, 0);
        assert_eq!(device.name, "host");
        assert_eq!(device.total_bytes, 8 << 30);
        assert_eq!(device.processes.len(), 2);
        let a_row = device.processes.iter().find(|p| p.name == "a").unwrap();
        let b_row = device.processes.iter().find(|p| p.name == "b").unwrap();
        assert_eq!(a_row.pid, a.pid());
        assert!(a_row.used_bytes > b_row.used_bytes + 80 * MIB);
        assert_eq!(device.used_bytes, a_row.used_bytes + b_row.used_bytes);
        assert_eq!(device.free_bytes, device.total_bytes - device.used_bytes);

        handle.remove_member("a");
        let device = &pool.snapshot().unwrap()[0];
        assert_eq!(device.processes.len(), 1);
        assert_eq!(device.used_bytes, device.processes[0].used_bytes);
    }

    #[test]
    fn an_exited_member_counts_zero() {
        let pool = HostPool::new(1 << 30);
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        pool.set_member("gone", pid);
        let device = &pool.snapshot().unwrap()[0];
        assert_eq!(device.used_bytes, 0);
        assert_eq!(device.free_bytes, 1 << 30);
        assert_eq!(device.processes[0].used_bytes, 0);
    }

    #[test]
    fn a_snapshot_is_cheap_enough_for_20_hz() {
        let hog = Hog::spawn(true);
        let pool = HostPool::new(1 << 30);
        pool.set_member("hog", hog.pid());
        let _ = eventually(|| process_tree(hog.pid()), |t| t.len() == 2);
        // 20 snapshots must fit well inside one second of a 20 Hz sampler even on a busy box:
        // the best of three rounds, so one burst of outside load does not decide it.
        let best = (0..3)
            .map(|_| {
                let start = std::time::Instant::now();
                for _ in 0..20 {
                    pool.snapshot().unwrap();
                }
                start.elapsed()
            })
            .min()
            .unwrap();
        assert!(
            best < std::time::Duration::from_millis(500),
            "20 snapshots took {best:?} (best of three rounds)"
        );
    }

    /// Bytes, in MiB as a float, for messages.
    fn mib(bytes: u64) -> f64 {
        bytes as f64 / MIB as f64
    }

    #[test]
    fn growth_between_full_reads_shows_in_the_statm_readings() {
        let mut hog = Hog::spawn(false);
        let periods = Periods {
            walk: Duration::from_millis(100),
            pss: Duration::from_secs(2),
            // Growth alone never re-reads PSS here: the estimate is what is tested.
            reanchor: Duration::from_secs(60),
        };
        let pool = HostPool::with_periods(8 << 30, periods);
        pool.set_member("hog", hog.pid());
        let full = pool.device().used_bytes;
        let fast = pool.device().used_bytes;
        hog.alloc(64);
        let grown = pool.device().used_bytes;
        let stats = pool.read_stats();
        // One full read, then statm alone (a walk may come in between on a slow machine).
        assert_eq!((stats.full_reads, stats.fast_reads), (1, 2), "{stats:?}");
        // Right after the full read the statm figure is the same (PSS) figure, give or take the
        // interpreter's own allocations.
        assert!(
            full.abs_diff(fast) < 2 * MIB,
            "full {:.1} MiB, fast {:.1} MiB",
            mib(full),
            mib(fast)
        );
        let added = grown.saturating_sub(fast);
        assert!(
            (60 * MIB..=80 * MIB).contains(&added),
            "64 MiB touched, the statm reading grew by {:.1} MiB",
            mib(added)
        );
        // A walk that finds the same process keeps reading statm ...
        std::thread::sleep(periods.walk);
        pool.device();
        let stats = pool.read_stats();
        assert_eq!(stats.full_reads, 1, "{stats:?}");
        assert!(stats.walks >= 1, "{stats:?}");
        // ... and the next full read agrees with the estimate.
        std::thread::sleep(periods.pss);
        let again = pool.device().used_bytes;
        assert_eq!(pool.read_stats().full_reads, 2);
        assert!(
            again.abs_diff(grown) < 4 * MIB,
            "estimate {:.1} MiB, full read {:.1} MiB",
            mib(grown),
            mib(again)
        );
    }

    #[test]
    fn file_pages_shared_with_another_process_are_read_again_when_rss_moves() {
        // Two processes map the same 64 MiB file: RSS counts it whole in each, PSS half. The
        // member maps it after its first full read, so the statm estimate alone would say +64
        // MiB; a move that large makes the next reading after REANCHOR_AFTER a full one.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("weights.bin");
        std::fs::write(&file, vec![7u8; 64 << 20]).unwrap();
        let mut member = Hog::spawn(false);
        let mut other = Hog::spawn(false);
        let pool = HostPool::new(8 << 30);
        pool.set_member("m", member.pid());
        pool.device();
        other.say(&format!("map {}", file.display()));
        member.say(&format!("map {}", file.display()));
        std::thread::sleep(REANCHOR_AFTER + Duration::from_millis(50));
        let read = pool.device().used_bytes;
        let truth = tree_memory(member.pid()).unwrap();
        assert!(pool.read_stats().full_reads >= 2, "{:?}", pool.read_stats());
        assert!(
            read.abs_diff(truth.bytes()) < 6 * MIB,
            "pool {:.1} MiB, PSS {:.1} MiB, RSS {:.1} MiB",
            mib(read),
            mib(truth.bytes()),
            mib(truth.rss_bytes)
        );
    }

    #[test]
    fn shared_pages_are_counted_once_between_full_reads() {
        // A forked child shares the interpreter's pages with its parent: PSS splits them, RSS
        // would count them twice. The statm readings between full reads keep the PSS figure.
        let hog = Hog::spawn(true);
        let _ = eventually(|| process_tree(hog.pid()), |t| t.len() == 2);
        let pool = HostPool::new(8 << 30);
        pool.set_member("hog", hog.pid());
        let full = pool.device().used_bytes;
        let fast = pool.device().used_bytes;
        let tree = tree_memory(hog.pid()).expect("tree");
        assert_eq!(pool.read_stats().fast_reads, 1);
        assert!(
            full.abs_diff(fast) < 2 * MIB,
            "full {:.1} MiB, fast {:.1} MiB (RSS {:.1} MiB)",
            mib(full),
            mib(fast),
            mib(tree.rss_bytes)
        );
    }

    #[test]
    fn a_child_that_starts_or_ends_shows_within_a_full_read_period() {
        let mut hog = Hog::spawn(false);
        let pool = HostPool::new(8 << 30);
        pool.set_member("hog", hog.pid());
        let alone = pool.device().used_bytes;
        hog.say("child");
        // The new child is found at the next walk, at most TREE_WALK_EVERY later, and read in
        // full at once.
        let with_child = eventually(|| pool.device().used_bytes, |b| *b >= alone + 40 * MIB);
        assert!(
            with_child >= alone + 40 * MIB,
            "alone {:.1} MiB, with a 48 MiB child {:.1} MiB",
            mib(alone),
            mib(with_child)
        );
        let full_reads = pool.read_stats().full_reads;
        hog.say("end-children");
        // A process that has gone makes the next reading walk again at once.
        let after = pool.device().used_bytes;
        assert!(pool.read_stats().full_reads > full_reads);
        assert!(
            after < alone + 8 * MIB,
            "alone {:.1} MiB, after the child ended {:.1} MiB",
            mib(alone),
            mib(after)
        );
    }

    #[test]
    fn readers_within_the_sharing_window_get_the_same_reading() {
        let a = Hog::spawn(false);
        let b = Hog::spawn(false);
        let pool = HostPool::new(8 << 30);
        pool.share_readings_within(Duration::from_millis(300));
        pool.set_member("a", a.pid());
        let first = pool.device();
        let second = pool.handle().device();
        assert_eq!(first, second);
        assert_eq!(pool.read_stats().shared, 1);
        // A new member is read at once, not hidden behind the shared reading.
        pool.set_member("b", b.pid());
        assert_eq!(pool.device().processes.len(), 2);
        assert_eq!(pool.read_stats().shared, 1);
        std::thread::sleep(Duration::from_millis(350));
        let before = pool.read_stats();
        pool.device();
        assert_eq!(
            pool.read_stats().shared,
            before.shared,
            "a stale reading is read again"
        );
    }

    #[test]
    fn a_tree_cache_walks_again_only_when_its_reading_is_old() {
        let hog = Hog::spawn(false);
        let every = Duration::from_millis(1500);
        let mut cache = TreeCache::new(every);
        assert_eq!(cache.tree(hog.pid()), &[hog.pid()]);
        let mut with_child = Hog::spawn(false);
        // Another root is its own entry; forgetting keeps only the listed roots.
        // The walk happens somewhere between these two instants (a busy machine may stretch it).
        let before_walk = std::time::Instant::now();
        assert_eq!(cache.tree(with_child.pid()), &[with_child.pid()]);
        let after_walk = std::time::Instant::now();
        with_child.say("child");
        let cached = cache.tree(with_child.pid()).len();
        // A busy machine may take longer than the period to start the child: only then may the
        // tree have been walked again.
        if before_walk.elapsed() < every {
            assert_eq!(cached, 1, "cached");
        }
        // Past the period counted from the walk's latest possible instant, it is walked again.
        std::thread::sleep(
            (every + Duration::from_millis(20)).saturating_sub(after_walk.elapsed()),
        );
        assert_eq!(cache.tree(with_child.pid()).len(), 2, "walked again");
        cache.retain(&[hog.pid()]);
        assert_eq!(cache.trees.len(), 1);
    }

    #[test]
    fn kib_fields_parse() {
        let text = "Rss:              123 kB\nPss:               45 kB\n";
        assert_eq!(kib_field(text, "Rss:"), Some(123 * 1024));
        assert_eq!(kib_field(text, "Pss:"), Some(45 * 1024));
        assert_eq!(kib_field(text, "Swap:"), None);
    }

    #[test]
    fn mem_total_is_readable() {
        assert!(host_mem_total().unwrap() > 64 * MIB);
    }
}
