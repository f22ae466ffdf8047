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
//! Cost: one `children` read per thread of each tree member plus one `smaps_rollup` read per
//! process per snapshot — well under a millisecond for a few small trees, so a 20 Hz sampler is
//! fine. Where `/proc/PID/task/TID/children` is missing (kernels without
//! `CONFIG_PROC_CHILDREN`), the tree is found by scanning every `/proc/*/stat` instead.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::fs;
use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

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

/// A pool of host RAM of a configured capacity, shared by named members (process trees). As a
/// [`GpuProbe`] it answers one device, index 0, named `host`. Cloning is cheap and every clone
/// sees the same members, so the supervisor can add a backend after a sampler took the probe.
#[derive(Debug, Clone)]
pub struct HostPool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    capacity_bytes: u64,
    members: Mutex<BTreeMap<String, u32>>,
}

impl HostPool {
    /// A pool of `capacity_bytes` with no members yet.
    pub fn new(capacity_bytes: u64) -> Self {
        HostPool {
            inner: Arc::new(PoolInner {
                capacity_bytes,
                members: Mutex::new(BTreeMap::new()),
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

    /// Adds `name` with root `root_pid`, or moves it to a new root (e.g. after a restart).
    pub fn set_member(&self, name: &str, root_pid: u32) {
        self.members().insert(name.to_string(), root_pid);
    }

    /// Removes `name`; unknown names are ignored.
    pub fn remove_member(&self, name: &str) {
        self.members().remove(name);
    }

    /// The members, by name, with their root PIDs.
    pub fn member_list(&self) -> Vec<(String, u32)> {
        self.members()
            .iter()
            .map(|(name, pid)| (name.clone(), *pid))
            .collect()
    }

    /// The pool's device right now. A member whose root has exited counts 0 bytes and is still
    /// listed (with 0), so a reader sees that it is gone rather than a missing row.
    pub fn device(&self) -> DeviceSnapshot {
        // Copy the members out so /proc is never read under the lock.
        let members = self.member_list();
        let mut processes = Vec::with_capacity(members.len());
        let mut used = 0u64;
        for (name, pid) in members {
            let bytes = tree_memory(pid).map(|t| t.bytes()).unwrap_or(0);
            used = used.saturating_add(bytes);
            processes.push(ProcessMemory {
                pid,
                name,
                used_bytes: bytes,
            });
        }
        let total = self.inner.capacity_bytes;
        DeviceSnapshot {
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
        }
    }

    fn members(&self) -> MutexGuard<'_, BTreeMap<String, u32>> {
        // A panic while holding this lock cannot leave the map half-written: keep going.
        self.inner
            .members
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GpuProbe for HostPool {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        Ok(vec![self.device()])
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
            let stdin = self.child.stdin.as_mut().expect("stdin");
            writeln!(stdin, "{mib}").expect("write");
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
