//! The memory limit the box set up by hand runs inside: a Linux memory cgroup whose limit is the
//! box's `capacity`, so an over-commit costs what it costs on a card (the kernel kills a process).
//! The drill needs four things of it, named by [`MemoryLimit`]: a way to put a process inside, its
//! usage, its limit, and how many processes the kernel killed in it. [`Cgroup`] is the
//! implementation on cgroup v1 (`memory.limit_in_bytes`, `memory.oom_control`) and v2
//! (`memory.max`, `memory.events`); a machine with neither is told what is missing.
//!
//! A drill that crashed leaves an empty cgroup named after its PID; the next drill removes it.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// What the drill asks of an enforced memory limit.
pub trait MemoryLimit: Send + Sync + std::fmt::Debug {
    /// Writing a PID here moves that process inside (its children follow).
    fn procs_file(&self) -> PathBuf;
    /// Bytes charged inside now.
    fn usage_bytes(&self) -> io::Result<u64>;
    /// The limit.
    fn limit_bytes(&self) -> u64;
    /// Processes the kernel killed inside for lack of memory, since it was made.
    fn oom_kills(&self) -> io::Result<u64>;
    /// One line: where it is and what kind.
    fn describe(&self) -> String;
}

/// Which cgroup version a limit lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// A memory cgroup made by the drill, removed when dropped (after its processes are gone).
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
    version: Version,
    limit: u64,
}

const PREFIX: &str = "headroom-drill-";

/// A controller's mount point and this process's cgroup path under it.
type Mount = Option<(PathBuf, String)>;

/// Where the memory controller is mounted and the cgroup this process is in: (v1, v2).
fn mounts() -> (Mount, Mount) {
    let cgroup = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v1 = None;
    let mut v2 = None;
    for line in mountinfo.lines() {
        // `ID PARENT MAJ:MIN ROOT MOUNTPOINT OPTIONS ... - FSTYPE SOURCE SUPEROPTIONS`
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let tail: Vec<&str> = right.split(' ').collect();
        let (Some(mount), Some(fstype)) = (fields.get(4), tail.first()) else {
            continue;
        };
        let supers = tail.get(2).copied().unwrap_or("");
        if *fstype == "cgroup" && supers.split(',').any(|o| o == "memory") && v1.is_none() {
            let own = cgroup
                .lines()
                .find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let _ = parts.next();
                    let ctrl = parts.next()?;
                    ctrl.split(',')
                        .any(|c| c == "memory")
                        .then(|| parts.next().map(str::to_string))?
                })
                .unwrap_or_else(|| "/".into());
            v1 = Some((PathBuf::from(mount), own));
        } else if *fstype == "cgroup2" && v2.is_none() {
            let own = cgroup
                .lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
                .unwrap_or_else(|| "/".into());
            v2 = Some((PathBuf::from(mount), own));
        }
    }
    (v1, v2)
}

fn join(mount: &Path, cgroup_path: &str) -> PathBuf {
    mount.join(cgroup_path.trim_start_matches('/'))
}

fn write(path: &Path, value: &str) -> io::Result<()> {
    fs::write(path, value).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Removes empty cgroups left by drills that are no longer running.
fn sweep_stale(parent: &Path) {
    let Ok(entries) = fs::read_dir(parent) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|p| p.split('-').next()?.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = fs::remove_dir(e.path());
        }
    }
}

impl Cgroup {
    /// Makes a memory cgroup limited to `limit` bytes under this process's own cgroup (v1) or at
    /// the cgroup2 root with the memory controller enabled (v2). `tag` tells two apart.
    pub fn create(tag: &str, limit: u64) -> Result<Cgroup, String> {
        let (v1, v2) = mounts();
        let name = format!("{PREFIX}{}-{tag}", std::process::id());
        let mut why = Vec::new();
        if let Some((mount, own)) = v1 {
            let parent = join(&mount, &own);
            sweep_stale(&parent);
            let dir = parent.join(&name);
            match Self::make_v1(&dir, limit) {
                Ok(()) => {
                    return Ok(Cgroup {
                        dir,
                        version: Version::V1,
                        limit,
                    });
                }
                Err(e) => why.push(format!("cgroup v1 memory at {}: {e}", mount.display())),
            }
        }
        if let Some((mount, _)) = v2 {
            let controllers =
                fs::read_to_string(mount.join("cgroup.controllers")).unwrap_or_default();
            if controllers.split_whitespace().any(|c| c == "memory") {
                sweep_stale(&mount);
                let dir = mount.join(&name);
                match Self::make_v2(&mount, &dir, limit) {
                    Ok(()) => {
                        return Ok(Cgroup {
                            dir,
                            version: Version::V2,
                            limit,
                        });
                    }
                    Err(e) => why.push(format!("cgroup v2 at {}: {e}", mount.display())),
                }
            } else {
                why.push(format!(
                    "cgroup v2 at {} has no memory controller (it lists: {})",
                    mount.display(),
                    controllers.trim()
                ));
            }
        }
        if why.is_empty() {
            why.push("no memory cgroup is mounted (mount the v1 memory controller or a cgroup2 tree with memory enabled)".into());
        }
        Err(format!(
            "cannot make a memory cgroup for the box set up by hand: {} (run as root, or give this user a delegated cgroup)",
            why.join("; ")
        ))
    }

    fn make_v1(dir: &Path, limit: u64) -> io::Result<()> {
        fs::create_dir(dir).or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        })?;
        let r = (|| {
            write(&dir.join("memory.limit_in_bytes"), &limit.to_string())?;
            // Swap would turn an over-commit into slowness instead of a kill, unlike a card.
            let _ = write(&dir.join("memory.memsw.limit_in_bytes"), &limit.to_string());
            let _ = write(&dir.join("memory.swappiness"), "0");
            // Charges follow a process moved in (the moment between its start and its move).
            let _ = write(&dir.join("memory.move_charge_at_immigrate"), "3");
            Ok(())
        })();
        if r.is_err() {
            let _ = fs::remove_dir(dir);
        }
        r
    }

    fn make_v2(mount: &Path, dir: &Path, limit: u64) -> io::Result<()> {
        let subtree = fs::read_to_string(mount.join("cgroup.subtree_control")).unwrap_or_default();
        if !subtree.split_whitespace().any(|c| c == "memory") {
            write(&mount.join("cgroup.subtree_control"), "+memory")?;
        }
        fs::create_dir(dir).or_else(|e| {
            if e.kind() == io::ErrorKind::AlreadyExists {
                Ok(())
            } else {
                Err(e)
            }
        })?;
        let r = (|| {
            write(&dir.join("memory.max"), &limit.to_string())?;
            let _ = write(&dir.join("memory.swap.max"), "0");
            Ok(())
        })();
        if r.is_err() {
            let _ = fs::remove_dir(dir);
        }
        r
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// PIDs inside now.
    pub fn pids(&self) -> Vec<u32> {
        fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

/// `oom_kill N` from v1's `memory.oom_control` or v2's `memory.events`.
pub fn parse_oom_kills(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next()? == "oom_kill").then(|| it.next()?.parse().ok())?
    })
}

impl MemoryLimit for Cgroup {
    fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn usage_bytes(&self) -> io::Result<u64> {
        let file = match self.version {
            Version::V1 => "memory.usage_in_bytes",
            Version::V2 => "memory.current",
        };
        let text = fs::read_to_string(self.dir.join(file))?;
        text.trim().parse().map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{file}: `{}`", text.trim()),
            )
        })
    }

    fn limit_bytes(&self) -> u64 {
        self.limit
    }

    fn oom_kills(&self) -> io::Result<u64> {
        let file = match self.version {
            Version::V1 => "memory.oom_control",
            Version::V2 => "memory.events",
        };
        let text = fs::read_to_string(self.dir.join(file))?;
        parse_oom_kills(&text).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{file} has no oom_kill line (a kernel older than 4.13?)"),
            )
        })
    }

    fn describe(&self) -> String {
        format!(
            "memory cgroup {} ({}), limit {} MiB",
            self.dir.display(),
            match self.version {
                Version::V1 => "v1",
                Version::V2 => "v2",
            },
            self.limit >> 20
        )
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        // The processes inside were stopped by their owner; a cgroup with none left can go.
        for _ in 0..50 {
            if fs::remove_dir(&self.dir).is_ok() || !self.dir.exists() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kills_are_read_from_both_versions() {
        assert_eq!(
            parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            Some(3)
        );
        assert_eq!(
            parse_oom_kills("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n"),
            Some(1)
        );
        assert_eq!(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n"), None);
    }

    /// The limit is real: a process inside that touches more than the limit is killed by the
    /// kernel and counted. Needs a memory cgroup this user may make (root on our machines).
    #[test]
    fn a_process_over_the_limit_is_killed_and_counted() {
        let cg = match Cgroup::create("test", 64 << 20) {
            Ok(c) => c,
            Err(e) if std::env::var_os("HEADROOM_REQUIRE_CGROUP").is_none() => {
                eprintln!("skipped (set HEADROOM_REQUIRE_CGROUP=1 to require it): {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(cg.oom_kills().unwrap(), 0);
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
    }
}
