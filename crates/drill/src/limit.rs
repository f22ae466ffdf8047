//! The memory limit the box set up by hand runs inside: the same kind of memory cgroup `up` makes
//! for `[memory] enforce = true` (`headroom-up`'s [`BoxCgroup`]: limited to the box's `capacity`,
//! stale ones of dead processes removed, what is left inside killed on drop), so an over-commit
//! costs the same on both boxes — the kernel kills a process, as a card would refuse it. The drill
//! needs four things of it, named by [`MemoryLimit`]: a way to put a process inside, the pool's
//! reading (the working set, as `up` reads it), the limit, and the OOM kills inside.

use std::io;
use std::path::PathBuf;

use headroom_up::cgroup::BoxCgroup;

/// What the drill asks of an enforced memory limit.
pub trait MemoryLimit: Send + Sync + std::fmt::Debug {
    /// Writing a PID here moves that process inside (its children follow).
    fn procs_file(&self) -> PathBuf;
    /// The pool's reading: the charge less inactive file cache.
    fn usage_bytes(&self) -> io::Result<u64>;
    /// The limit.
    fn limit_bytes(&self) -> u64;
    /// Processes the kernel killed inside for lack of memory, since it was made.
    fn oom_kills(&self) -> io::Result<u64>;
    /// One line: where it is and what kind.
    fn describe(&self) -> String;
}

/// A memory cgroup for the box set up by hand, named after the drill and the box.
pub fn hand_set_cgroup(
    box_name: &str,
    limit: u64,
    say: &dyn Fn(&str),
) -> Result<BoxCgroup, String> {
    BoxCgroup::create(&format!("drill-hand-set-{box_name}"), limit, say)
        .map_err(|e| format!("the box set up by hand needs a memory cgroup like up's: {e}"))
}

impl MemoryLimit for BoxCgroup {
    fn procs_file(&self) -> PathBuf {
        self.cgroup().procs_file()
    }

    fn usage_bytes(&self) -> io::Result<u64> {
        self.cgroup().working_set_bytes()
    }

    fn limit_bytes(&self) -> u64 {
        self.report().map(|r| r.limit_bytes).unwrap_or(0)
    }

    fn oom_kills(&self) -> io::Result<u64> {
        self.cgroup().oom_kills()
    }

    fn describe(&self) -> String {
        format!(
            "memory cgroup {} ({}), limit {} MiB",
            self.dir().display(),
            self.cgroup().version().as_str(),
            self.limit_bytes() >> 20
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The limit is real: a process inside that touches more than the limit is killed by the
    /// kernel and counted. Needs a memory cgroup this user may make (root on our machines); CI
    /// sets HEADROOM_REQUIRE_CGROUP so it cannot pass by skipping.
    #[test]
    fn a_process_over_the_limit_is_killed_and_counted() {
        let cg = match hand_set_cgroup("test", 64 << 20, &|_| {}) {
            Ok(c) => c,
            Err(e) if std::env::var_os("HEADROOM_REQUIRE_CGROUP").is_none() => {
                eprintln!("skipped (set HEADROOM_REQUIRE_CGROUP=1 to require it): {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(cg.oom_kills().unwrap(), 0);
        assert_eq!(cg.limit_bytes(), 64 << 20);
        // sh puts itself inside, then holds 256 MiB of text in a variable.
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(
                "echo $$ > \"$0\" && x=$(head -c 268435456 /dev/zero | tr '\\000' a) && echo ${#x}",
            )
            .arg(cg.procs_file())
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        let kills = cg.oom_kills().unwrap();
        assert!(kills >= 1, "no OOM kill counted (status {status:?})");
        assert!(cg.usage_bytes().unwrap() <= 64 << 20);
        assert!(cg.describe().contains("limit 64 MiB"), "{}", cg.describe());
    }
}
