//! The box's memory cgroup (`[memory] enforce = true`): one cgroup, created inside `up`'s own
//! memory cgroup (so any limit `up` itself runs under still holds), whose hard limit
//! is the pool's capacity. Every backend runs inside it, the kernel OOM-kills inside it past the
//! limit (as a card refuses an allocation), and its charge is the pool's reading.
//!
//! - **Found by name.** `headroom-up-PID-START-BOX`: `up`'s PID, its start time in clock ticks
//!   after boot (`/proc/PID/stat` field 22, so a reused PID is told apart) and the box file's
//!   name. A cgroup so named whose `up` no longer runs is stale; one that does not parse is never
//!   touched.
//! - **Placed before it allocates.** A backend starts as `sh -c 'echo $$ > CGROUP/cgroup.procs
//!   && exec "$@"'`: the shell joins the cgroup and then execs the backend (through `setpriv`), so
//!   the backend's first page is charged to the cgroup, with no `unsafe` pre-exec hook and no
//!   window between spawn and placement (writing the PID from `up` after spawn leaves the child
//!   running outside for a moment; `CLONE_INTO_CGROUP` has no safe API in std or rustix).
//! - **Removed** when `up` stops (and when this value drops, on any error path): members still
//!   inside (a process that left its group) are killed, then the directory goes. After a crash of
//!   `up` (`kill -9`) its backends die with it (`process`), the empty cgroup stays, and the next
//!   `up` in the same cgroup removes it at start, killing anything still inside.
//! - **OOM kills** are the cgroup's own count; a backend that exits by SIGKILL while the count
//!   rose since the last exit was killed by the kernel (its `last_exit` is `oom_killed`).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use headroom_gpu::cgroup::{self, MemoryCgroup, MemoryHierarchy};
use headroom_server::admin_box::EnforceReport;
use rustix::process::{Pid, Signal, kill_process};

use crate::UpError;

/// The start of every name this module gives a cgroup.
pub(crate) const PREFIX: &str = "headroom-up-";

/// The box's memory cgroup while `up` runs.
#[derive(Debug)]
pub struct BoxCgroup {
    cgroup: MemoryCgroup,
    limit: u64,
    /// The OOM-kill count already put down to a backend's exit.
    attributed: Mutex<u64>,
    removed: AtomicBool,
}

/// How a backend ended, for its `last_exit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// SIGKILL from the kernel's OOM killer (the cgroup's count rose).
    OomKilled,
    /// Any other end: `exited (STATUS)`.
    Other(String),
}

impl Exit {
    pub fn reason(&self) -> String {
        match self {
            Exit::OomKilled => "oom_killed".into(),
            Exit::Other(s) => s.clone(),
        }
    }
}

/// The plain reason of an exit status: `exited (exit status: 1)`, `exited (signal: 9 (SIGKILL))`.
pub(crate) fn exit_reason(status: Option<ExitStatus>) -> String {
    match status {
        Some(s) => format!("exited ({s})"),
        None => "exited (unknown status)".into(),
    }
}

fn enforce_err(e: impl std::fmt::Display) -> UpError {
    UpError::Enforce(e.to_string())
}

impl BoxCgroup {
    /// Finds this process's memory cgroup, removes stale ones of earlier `up`s there (each one
    /// said through `say`), and creates the box's with `limit` as its hard limit.
    pub fn create(box_name: &str, limit: u64, say: &dyn Fn(&str)) -> Result<BoxCgroup, UpError> {
        let hierarchy = cgroup::locate().map_err(enforce_err)?;
        Self::create_in(&hierarchy, box_name, limit, say)
    }

    /// [`BoxCgroup::create`] in a given hierarchy.
    pub fn create_in(
        hierarchy: &MemoryHierarchy,
        box_name: &str,
        limit: u64,
        say: &dyn Fn(&str),
    ) -> Result<BoxCgroup, UpError> {
        for line in clean_stale(hierarchy) {
            say(&line);
        }
        let me = std::process::id();
        let start = start_time(me).ok_or_else(|| {
            enforce_err(format!(
                "cannot read this process's start time (/proc/{me}/stat)"
            ))
        })?;
        let dir = hierarchy.own.join(name_for(me, start, box_name));
        fs::create_dir(&dir).map_err(|source| {
            enforce_err(cgroup::CgroupError::NotWritable {
                dir: hierarchy.own.clone(),
                source,
            })
        })?;
        let made = BoxCgroup {
            cgroup: MemoryCgroup::new(&dir, hierarchy.version),
            limit,
            attributed: Mutex::new(0),
            removed: AtomicBool::new(false),
        };
        made.cgroup
            .set_limit(limit)
            .map_err(|e| enforce_err(format!("cannot set the limit of {}: {e}", dir.display())))?;
        // Fails loudly now rather than at the first sample or exit.
        let kills = made
            .cgroup
            .oom_kills()
            .and_then(|k| made.cgroup.working_set_bytes().map(|_| k))
            .map_err(|e| enforce_err(format!("cannot read {}: {e}", dir.display())))?;
        *made.lock() = kills;
        Ok(made)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.attributed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cgroup's files (a reader for the pool's probe).
    pub fn cgroup(&self) -> &MemoryCgroup {
        &self.cgroup
    }

    pub fn dir(&self) -> &Path {
        self.cgroup.dir()
    }

    /// Why a backend of the box ended: `OomKilled` when it died by SIGKILL and the cgroup's OOM
    /// count rose since the last exit was judged. Every exit takes the rise it saw, so a later
    /// `kill -9` by hand is not put down to an old OOM kill.
    pub fn judge_exit(&self, status: Option<ExitStatus>) -> Exit {
        use std::os::unix::process::ExitStatusExt;
        let mut attributed = self.lock();
        let now = self.cgroup.oom_kills().unwrap_or(*attributed);
        let rose = now > *attributed;
        *attributed = now.max(*attributed);
        let killed = status.and_then(|s| s.signal()) == Some(Signal::KILL.as_raw());
        if rose && killed {
            Exit::OomKilled
        } else {
            Exit::Other(exit_reason(status))
        }
    }

    /// The figures `/admin/box` shows; `None` when the cgroup cannot be read.
    pub fn report(&self) -> Option<EnforceReport> {
        let usage = self.cgroup.usage_bytes().ok()?;
        let inactive = self.cgroup.inactive_file_bytes().ok()?;
        Some(EnforceReport {
            cgroup: self.dir().display().to_string(),
            version: self.cgroup.version().as_str().into(),
            limit_bytes: self.limit,
            usage_bytes: usage,
            working_set_bytes: usage.saturating_sub(inactive),
            oom_kills: self.cgroup.oom_kills().ok()?,
        })
    }

    /// Kills whatever is still inside and removes the cgroup; returns the PIDs it had to kill.
    /// Once only: later calls do nothing.
    pub fn remove(&self) -> io::Result<Vec<u32>> {
        if self.removed.swap(true, Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        remove_cgroup(&self.cgroup)
    }
}

impl Drop for BoxCgroup {
    fn drop(&mut self) {
        let _ = self.remove();
    }
}

/// `headroom-up-PID-START-BOX`, the box's name cut to what a directory name takes.
pub(crate) fn name_for(pid: u32, start: u64, box_name: &str) -> String {
    let tidy: String = box_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(48)
        .collect();
    format!("{PREFIX}{pid}-{start}-{tidy}")
}

/// The `up` a cgroup name says made it: `(pid, start)`; `None` for any other name.
pub(crate) fn maker_of(name: &str) -> Option<(u32, u64)> {
    let rest = name.strip_prefix(PREFIX)?;
    let mut parts = rest.splitn(3, '-');
    let pid = parts.next()?.parse().ok()?;
    let start = parts.next()?.parse().ok()?;
    parts.next()?;
    Some((pid, start))
}

/// A process's start time in clock ticks after boot (`/proc/PID/stat` field 22); `None` when
/// there is no such process.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is field 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// Removes the cgroups of `up`s that no longer run from this process's memory cgroup (killing
/// what is still inside them); returns one line per cgroup removed or left.
pub(crate) fn clean_stale(hierarchy: &MemoryHierarchy) -> Vec<String> {
    let mut lines = Vec::new();
    let Ok(entries) = fs::read_dir(&hierarchy.own) else {
        return lines;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((pid, start)) = maker_of(&name) else {
            continue;
        };
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || start_time(pid) == Some(start) {
            continue;
        }
        let path: PathBuf = entry.path();
        let cg = MemoryCgroup::new(&path, hierarchy.version);
        let kills = cg.oom_kills().unwrap_or(0);
        match remove_cgroup(&cg) {
            Ok(killed) => lines.push(format!(
                "up: removed the memory cgroup {} left by an up that no longer runs (pid {pid}; {kills} OOM kill(s) in it){}",
                path.display(),
                if killed.is_empty() {
                    String::new()
                } else {
                    format!("; killed the processes still inside: {killed:?}")
                }
            )),
            Err(e) => lines.push(format!(
                "up: warning: could not remove the stale memory cgroup {}: {e}",
                path.display()
            )),
        }
    }
    lines
}

/// SIGKILL to every process inside until none is left (at most about 5 s), then `rmdir`.
fn remove_cgroup(cg: &MemoryCgroup) -> io::Result<Vec<u32>> {
    let mut killed = Vec::new();
    for _ in 0..250 {
        let procs = match cg.procs() {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(killed),
            Err(e) => return Err(e),
        };
        if procs.is_empty() {
            match fs::remove_dir(cg.dir()) {
                Ok(()) => return Ok(killed),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(killed),
                // EBUSY: a process still leaving; try again.
                Err(e) if e.raw_os_error() == Some(16) => {}
                Err(e) => return Err(e),
            }
        }
        for pid in procs {
            if let Some(p) = Pid::from_raw(pid as i32) {
                // A PID listed in cgroup.procs is inside this cgroup: never another's process.
                if kill_process(p, Signal::KILL).is_ok() && !killed.contains(&pid) {
                    killed.push(pid);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(io::Error::other(format!(
        "{} still has processes or cannot be removed",
        cg.dir().display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_their_maker_and_other_names_are_never_ours() {
        let n = name_for(4242, 987654, "cpu-box.up");
        assert_eq!(n, "headroom-up-4242-987654-cpu-box.up");
        assert_eq!(maker_of(&n), Some((4242, 987654)));
        assert_eq!(
            name_for(1, 2, "my box/ä"),
            "headroom-up-1-2-my_box__",
            "odd characters become _"
        );
        for other in [
            "headroom-up-",
            "headroom-up-12",
            "headroom-up-12-34",
            "headroom-up-x-34-box",
            "headroom-12-34-box",
            "process_api",
            "01eeaa85f42d58e64676674174851321",
        ] {
            assert_eq!(maker_of(other), None, "{other}");
        }
    }

    #[test]
    fn this_process_has_a_start_time_and_a_missing_one_has_none() {
        let mine = start_time(std::process::id()).expect("own stat");
        assert!(mine > 0);
        assert_eq!(start_time(std::process::id()), Some(mine));
        assert_eq!(start_time(u32::MAX - 1), None);
    }

    #[test]
    fn exit_reasons_name_codes_and_signals() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            exit_reason(Some(ExitStatus::from_raw(1 << 8))),
            "exited (exit status: 1)"
        );
        assert_eq!(
            exit_reason(Some(ExitStatus::from_raw(9))),
            "exited (signal: 9 (SIGKILL))"
        );
        assert_eq!(exit_reason(None), "exited (unknown status)");
    }

    // ---- real cgroups (CI runs as root on a machine with a memory controller) ----------------

    use crate::process::tests::backend;
    use crate::process::{Group, spawn_in};

    const MIB: u64 = 1024 * 1024;

    /// This machine's memory hierarchy. A machine without a usable one fails these tests with the
    /// reason; `HEADROOM_SKIP_CGROUP=1` skips them, saying so.
    fn hierarchy() -> Option<MemoryHierarchy> {
        if std::env::var("HEADROOM_SKIP_CGROUP").as_deref() == Ok("1") {
            eprintln!("HEADROOM_SKIP_CGROUP=1: the real-cgroup test is NOT run");
            return None;
        }
        Some(cgroup::locate().unwrap_or_else(|e| {
            panic!("no usable memory cgroup here ({e}); HEADROOM_SKIP_CGROUP=1 skips this test")
        }))
    }

    fn made(h: &MemoryHierarchy, name: &str, limit: u64) -> BoxCgroup {
        BoxCgroup::create_in(h, name, limit, &|_| {}).expect("a memory cgroup")
    }

    fn run_in(cg: &BoxCgroup, dir: &Path, command: &str, args: &[&str]) -> Group {
        let procs = cg.cgroup().procs_file();
        spawn_in(
            &backend(command, args),
            &[],
            &[],
            dir,
            &dir.join("t.log"),
            Some(&procs),
        )
        .expect("spawn")
    }

    /// Waits (10 s at most) until the log's last line is `want`.
    async fn log_says(g: &Group, want: &str) {
        for _ in 0..500 {
            if g.log_tail(1).first().is_some_and(|l| l == want) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("log never said {want:?}: {:?}", g.log_tail(5));
    }

    #[tokio::test]
    async fn a_backend_runs_in_the_cgroup_from_its_first_instruction_and_its_removal_leaves_nothing()
     {
        let Some(h) = hierarchy() else { return };
        let cg = made(&h, "t-place", 256 * MIB);
        assert_eq!(cg.cgroup().limit_bytes().unwrap(), Some(256 * MIB));
        let dir = tempfile::tempdir().unwrap();
        // The backend's own first read of /proc/self/cgroup already shows the box's cgroup.
        let mut g = run_in(&cg, dir.path(), "cat", &["/proc/self/cgroup"]);
        g.wait().await;
        let log = std::fs::read_to_string(dir.path().join("t.log")).unwrap();
        let name = cg.dir().file_name().unwrap().to_string_lossy().into_owned();
        let line = log
            .lines()
            .find(|l| {
                l.split(':').nth(1).is_some_and(|c| {
                    c.split(',').any(|c| c == "memory")
                        || c.is_empty() && h.version == cgroup::Version::V2
                })
            })
            .unwrap_or_default();
        assert!(line.ends_with(&format!("/{name}")), "{log}");
        // A process still inside at removal is killed, and the directory goes.
        let mut g = run_in(&cg, dir.path(), "sleep", &["600"]);
        let pid = g.pid;
        for _ in 0..250 {
            if cg.cgroup().procs().unwrap().contains(&pid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(cg.cgroup().procs().unwrap(), vec![pid]);
        assert_eq!(cg.remove().unwrap(), vec![pid]);
        assert!(!cg.dir().exists());
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(g.wait().await.and_then(|s| s.signal()), Some(9));
    }

    #[tokio::test]
    async fn the_pools_reading_is_the_cgroups_charge_less_its_inactive_file_cache() {
        let Some(h) = hierarchy() else { return };
        let cg = made(&h, "t-reading", 512 * MIB);
        let dir = tempfile::tempdir().unwrap();
        // 64 MiB held and touched, then 96 MiB written to a file (page cache charged here).
        let file = dir.path().join("cache.bin");
        let script = format!(
            "import os, time\nb = bytearray(64 << 20)\nb[::4096] = b'x' * len(b[::4096])\n\
             f = open({:?}, 'wb')\nfor _ in range(96): f.write(b'y' * (1 << 20))\n\
             f.flush(); os.fsync(f.fileno()); f.close()\nprint('ready', flush=True)\ntime.sleep(600)\n",
            file.display().to_string()
        );
        let g = run_in(&cg, dir.path(), "python3", &["-c", &script]);
        log_says(&g, "ready").await;
        let pool = headroom_gpu::EnforcedPool::new(
            headroom_gpu::HostPool::new(512 * MIB),
            cg.cgroup().clone(),
        );
        use headroom_gpu::GpuProbe;
        // Retried as a measurement: the three reads must be taken while nothing moves.
        let mut seen = Vec::new();
        for _ in 0..20 {
            let before = cg.cgroup().working_set_bytes().unwrap();
            let used = pool.snapshot().unwrap()[0].used_bytes;
            let after = cg.cgroup().working_set_bytes().unwrap();
            let usage = cg.cgroup().usage_bytes().unwrap();
            seen.push((before, used, after, usage));
            if before == used && used == after {
                break;
            }
        }
        let (_, used, _, usage) = *seen.last().unwrap();
        assert!(
            seen.iter().any(|(b, u, a, _)| b == u && u == a),
            "the pool's reading is not the cgroup's working set: {seen:?}"
        );
        // The held 64 MiB count; the file's cache (reclaimable) does not.
        assert!(used >= 60 * MIB, "reading {} MiB", used / MIB);
        assert!(
            usage >= used + 80 * MIB,
            "usage {} MiB, reading {} MiB: the file cache should be charged but not read as used",
            usage / MIB,
            used / MIB
        );
        drop(g);
    }

    #[tokio::test]
    async fn past_the_limit_the_kernel_kills_and_the_exit_is_put_down_to_it() {
        let Some(h) = hierarchy() else { return };
        let cg = made(&h, "t-oom", 96 * MIB);
        let dir = tempfile::tempdir().unwrap();
        let hog = "b = bytearray(256 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('survived')";
        let mut g = run_in(&cg, dir.path(), "python3", &["-c", hog]);
        let status = g.wait().await;
        assert_eq!(
            cg.judge_exit(status),
            Exit::OomKilled,
            "{status:?}: {:?}",
            g.log_tail(3)
        );
        assert_eq!(cg.report().unwrap().oom_kills, 1);
        // A SIGKILL by hand with no new OOM kill is not put down to the old one.
        let mut g = run_in(&cg, dir.path(), "sleep", &["600"]);
        tokio::time::sleep(Duration::from_millis(100)).await;
        kill_process(Pid::from_raw(g.pid as i32).unwrap(), Signal::KILL).unwrap();
        let status = g.wait().await;
        assert_eq!(
            cg.judge_exit(status),
            Exit::Other("exited (signal: 9 (SIGKILL))".into())
        );
        assert_eq!(cg.report().unwrap().oom_kills, 1);
    }

    #[tokio::test]
    async fn a_stale_cgroup_goes_with_what_is_inside_and_no_other_is_touched() {
        let Some(h) = hierarchy() else { return };
        // An `up` that no longer runs: a process that has exited.
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let dead = gone.id();
        gone.wait().unwrap();
        let stale = h.own.join(name_for(dead, 1, "t-stale"));
        fs::create_dir(&stale).unwrap();
        let me = std::process::id();
        let live = h.own.join(name_for(me, start_time(me).unwrap(), "t-live"));
        fs::create_dir(&live).unwrap();
        let other = h.own.join(format!("headroom-test-not-ours-{dead}"));
        fs::create_dir(&other).unwrap();
        // Something left inside the stale one (a backend that escaped its group).
        let stale_cg = BoxCgroup {
            cgroup: MemoryCgroup::new(&stale, h.version),
            limit: 0,
            attributed: Mutex::new(0),
            removed: AtomicBool::new(true),
        };
        let dir = tempfile::tempdir().unwrap();
        let mut left = run_in(&stale_cg, dir.path(), "sleep", &["600"]);
        for _ in 0..250 {
            if stale_cg
                .cgroup()
                .procs()
                .unwrap_or_default()
                .contains(&left.pid)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let lines = clean_stale(&h);
        let gone_dir = !stale.exists();
        let (live_kept, other_kept) = (live.exists(), other.exists());
        let _ = fs::remove_dir(&live);
        let _ = fs::remove_dir(&other);
        assert!(gone_dir, "stale cgroup still there; {lines:?}");
        assert!(live_kept, "the cgroup of a running up was removed");
        assert!(other_kept, "a cgroup not named by up was removed");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(left.wait().await.and_then(|s| s.signal()), Some(9));
        // Parallel tests may have cleaned it first; when this call did, it said so.
        if let Some(line) = lines
            .iter()
            .find(|l| l.contains(&stale.display().to_string()))
        {
            assert!(line.contains(&format!("pid {dead}")), "{line}");
            assert!(line.contains(&format!("[{}]", left.pid)), "{line}");
        }
    }
}
