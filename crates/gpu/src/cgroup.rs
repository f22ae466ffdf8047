//! Memory cgroups: which hierarchy holds the `memory` controller for this process (cgroup v2 or
//! v1, whichever the machine has), the files a memory cgroup is read and limited through, and
//! [`EnforcedPool`], the host pool whose reading is one cgroup's charge instead of a sum over
//! process trees. Creating, filling and removing the cgroup is the supervisor's (`headroom-up`).
//!
//! The reading is the cgroup's *working set*: its usage (`memory.current` on v2,
//! `memory.usage_in_bytes` on v1) less its inactive file cache (`inactive_file` on v2,
//! `total_inactive_file` on v1, from `memory.stat`). The usage counts page cache, and a limited
//! cgroup fills with cache up to its limit (a backend writing its log, reading a model file):
//! the kernel reclaims that cache before it OOM-kills anything, so usage alone would show a
//! pool near full that still has room. Measured here on v1 with a 200 MiB limit: after writing
//! a 300 MiB file, usage 200 MiB of which 187 MiB inactive file cache, and a 150 MiB allocation
//! then succeeded without an OOM kill. Subtracting the inactive file cache is what the kubelet
//! calls the working set (and `docker stats` shows); active cache stays counted, which errs on
//! the side of refusing early. Two small files per sample (usage and `memory.stat`): no `/proc`
//! walk, a few microseconds.
//!
//! OOM kills are the `oom_kill` count of `memory.events` (v2) or `memory.oom_control` (v1).
//!
//! The mount table and `/proc/self/cgroup` are parsed by `procfs-core`; the selection is ours.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use procfs_core::FromBufRead;
use procfs_core::process::MountInfos;
use procfs_core::{ProcessCGroup, ProcessCGroups};

use crate::host::HostPool;
use crate::probe::{DeviceSnapshot, GpuProbe, ProbeError};

/// Which cgroup interface a hierarchy speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

impl Version {
    pub fn as_str(self) -> &'static str {
        match self {
            Version::V1 => "v1",
            Version::V2 => "v2",
        }
    }
}

/// Where this process's memory cgroup is: the hierarchy's version, where it is mounted, and the
/// directory of the cgroup this process belongs to (children are created there).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryHierarchy {
    pub version: Version,
    /// The hierarchy's mount point (`/sys/fs/cgroup/memory`, `/sys/fs/cgroup`).
    pub mount: PathBuf,
    /// This process's cgroup, as a directory under `mount`.
    pub own: PathBuf,
}

/// Why no memory cgroup can be used. Each message says what is missing and how to enable it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupError {
    #[error(
        "no memory cgroup controller is mounted (cgroup mounts: {mounted}): mount a cgroup2 tree offering `memory` (`mount -t cgroup2 none /sys/fs/cgroup`) or a cgroup v1 memory hierarchy (`mount -t cgroup -o memory none /sys/fs/cgroup/memory`), and boot with the memory controller on (not `cgroup_disable=memory`)"
    )]
    NoController { mounted: String },
    #[error(
        "the cgroup2 tree does not hand the memory controller to the children of {dir} (its cgroup.subtree_control: `{subtree}`): enable it as root with `echo +memory > {dir}/cgroup.subtree_control` (a cgroup other than the root must hold no processes itself for that), or start `up` in a unit with delegation (`systemd-run -p Delegate=yes ...`) that does"
    )]
    NotDelegated { dir: PathBuf, subtree: String },
    #[error(
        "this process's memory cgroup `{path}` is outside the part of the hierarchy mounted at {mount} (mount root `{root}`): mount the hierarchy's root, or run `up` in a cgroup inside the mounted part"
    )]
    OutsideMount {
        path: String,
        mount: PathBuf,
        root: String,
    },
    #[error(
        "cannot create a memory cgroup in {dir}: {source}; run `up` as root, or in a cgroup delegated to its user"
    )]
    NotWritable {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("{file}: cannot read `{text}`")]
    Parse { file: String, text: String },
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> CgroupError {
    let what = what.into();
    move |source| CgroupError::Io { what, source }
}

/// Finds this process's memory cgroup on this machine (`/proc/self/mountinfo`,
/// `/proc/self/cgroup` and the hierarchy's own files).
pub fn locate() -> Result<MemoryHierarchy, CgroupError> {
    let mountinfo =
        fs::read_to_string("/proc/self/mountinfo").map_err(io_err("/proc/self/mountinfo"))?;
    let cgroup = fs::read_to_string("/proc/self/cgroup").map_err(io_err("/proc/self/cgroup"))?;
    locate_in(&mountinfo, &cgroup, &|p: &Path| fs::read_to_string(p))
}

/// [`locate`] from the texts of `/proc/self/mountinfo` and `/proc/self/cgroup`; `read` reads a
/// cgroup file (`cgroup.controllers`, `cgroup.subtree_control`). The cgroup2 tree is used when
/// its root offers `memory`; otherwise the v1 hierarchy that has the `memory` controller. The
/// kernel binds a controller to one hierarchy at a time, so at most one of them has it.
pub fn locate_in(
    mountinfo: &str,
    proc_cgroup: &str,
    read: &dyn Fn(&Path) -> io::Result<String>,
) -> Result<MemoryHierarchy, CgroupError> {
    let mounts =
        MountInfos::from_buf_read(mountinfo.as_bytes()).map_err(|e| CgroupError::Parse {
            file: "/proc/self/mountinfo".into(),
            text: e.to_string(),
        })?;
    let groups =
        ProcessCGroups::from_buf_read(proc_cgroup.as_bytes()).map_err(|e| CgroupError::Parse {
            file: "/proc/self/cgroup".into(),
            text: e.to_string(),
        })?;
    let has = |text: &str, word: &str| text.split_ascii_whitespace().any(|w| w == word);
    // cgroup v2: one unified tree; this process's line is `0::PATH`.
    let unified = groups.0.iter().find(|g| g.hierarchy == 0);
    for m in mounts.iter().filter(|m| m.fs_type == "cgroup2") {
        let offered = read(&m.mount_point.join("cgroup.controllers")).unwrap_or_default();
        if !has(&offered, "memory") {
            continue;
        }
        let Some(g) = unified else { continue };
        let own = own_dir(&m.mount_point, &m.root, g)?;
        // Children of `own` get the controller only when `own` hands it down.
        let subtree = read(&own.join("cgroup.subtree_control")).unwrap_or_default();
        if has(&subtree, "memory") {
            return Ok(MemoryHierarchy {
                version: Version::V2,
                mount: m.mount_point.clone(),
                own,
            });
        }
        let own_offered = read(&own.join("cgroup.controllers")).unwrap_or_default();
        // Where it stops: `own` itself when it is offered the controller, else its parent.
        let dir = if has(&own_offered, "memory") || own == m.mount_point {
            own
        } else {
            own.parent().map_or(own.clone(), Path::to_path_buf)
        };
        let subtree = read(&dir.join("cgroup.subtree_control")).unwrap_or_default();
        return Err(CgroupError::NotDelegated {
            dir,
            subtree: subtree.trim().to_string(),
        });
    }
    // cgroup v1: the hierarchy mounted with the `memory` option.
    let v1 = mounts
        .iter()
        .find(|m| m.fs_type == "cgroup" && m.super_options.contains_key("memory"));
    let line = groups
        .0
        .iter()
        .find(|g| g.controllers.iter().any(|c| c == "memory"));
    if let (Some(m), Some(g)) = (v1, line) {
        return Ok(MemoryHierarchy {
            version: Version::V1,
            mount: m.mount_point.clone(),
            own: own_dir(&m.mount_point, &m.root, g)?,
        });
    }
    let mounted: Vec<String> = mounts
        .iter()
        .filter(|m| m.fs_type == "cgroup" || m.fs_type == "cgroup2")
        .map(|m| {
            let mut opts: Vec<&str> = m
                .super_options
                .keys()
                .map(String::as_str)
                .filter(|o| !matches!(*o, "rw" | "ro" | "relatime" | "nsdelegate"))
                .collect();
            opts.sort_unstable();
            format!(
                "{} {}{}",
                m.fs_type,
                m.mount_point.display(),
                if opts.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", opts.join(","))
                }
            )
        })
        .collect();
    Err(CgroupError::NoController {
        mounted: if mounted.is_empty() {
            "none".into()
        } else {
            mounted.join("; ")
        },
    })
}

/// The directory of `g`'s cgroup in a hierarchy mounted at `mount` from `root`.
fn own_dir(mount: &Path, root: &str, g: &ProcessCGroup) -> Result<PathBuf, CgroupError> {
    let path = g.pathname.trim_end_matches(" (deleted)");
    let outside = || CgroupError::OutsideMount {
        path: path.to_string(),
        mount: mount.to_path_buf(),
        root: root.to_string(),
    };
    let rel = if root == "/" {
        path
    } else {
        let rest = path.strip_prefix(root).ok_or_else(outside)?;
        if !(rest.is_empty() || rest.starts_with('/')) {
            return Err(outside());
        }
        rest
    };
    let rel = rel.trim_start_matches('/');
    if rel.split('/').any(|part| part == "..") {
        return Err(outside());
    }
    Ok(if rel.is_empty() {
        mount.to_path_buf()
    } else {
        mount.join(rel)
    })
}

/// One memory cgroup, read and limited through its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: Version,
}

/// A limit at or above this (v1 writes 2^63 rounded down to a page for "none") is no limit.
const UNLIMITED: u64 = 1 << 62;

impl MemoryCgroup {
    pub fn new(dir: impl Into<PathBuf>, version: Version) -> Self {
        MemoryCgroup {
            dir: dir.into(),
            version,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn version(&self) -> Version {
        self.version
    }

    /// The file a process joins the cgroup through (its PID written there).
    pub fn procs_file(&self) -> PathBuf {
        self.dir.join("cgroup.procs")
    }

    fn read(&self, name: &str) -> io::Result<String> {
        fs::read_to_string(self.dir.join(name))
    }

    fn write(&self, name: &str, value: &str) -> io::Result<()> {
        fs::write(self.dir.join(name), value)
    }

    /// What the kernel charges to the cgroup now, page cache included.
    pub fn usage_bytes(&self) -> io::Result<u64> {
        let file = match self.version {
            Version::V2 => "memory.current",
            Version::V1 => "memory.usage_in_bytes",
        };
        parse_number(&self.read(file)?)
    }

    /// The inactive file cache in the charge (reclaimed before any OOM kill).
    pub fn inactive_file_bytes(&self) -> io::Result<u64> {
        let key = match self.version {
            Version::V2 => "inactive_file",
            Version::V1 => "total_inactive_file",
        };
        stat_field(&self.read("memory.stat")?, key)
    }

    /// The pool's reading: usage less the inactive file cache (see the module doc).
    pub fn working_set_bytes(&self) -> io::Result<u64> {
        let usage = self.usage_bytes()?;
        let inactive = self.inactive_file_bytes()?;
        Ok(usage.saturating_sub(inactive))
    }

    /// How many processes of the cgroup the kernel's OOM killer has killed.
    pub fn oom_kills(&self) -> io::Result<u64> {
        let file = match self.version {
            Version::V2 => "memory.events",
            Version::V1 => "memory.oom_control",
        };
        stat_field(&self.read(file)?, "oom_kill")
    }

    /// The hard limit; `None` when there is none.
    pub fn limit_bytes(&self) -> io::Result<Option<u64>> {
        let text = match self.version {
            Version::V2 => self.read("memory.max")?,
            Version::V1 => self.read("memory.limit_in_bytes")?,
        };
        if text.trim() == "max" {
            return Ok(None);
        }
        let n = parse_number(&text)?;
        Ok((n < UNLIMITED).then_some(n))
    }

    /// Sets the hard limit to `bytes`, and swap to none where the kernel accounts it (a card has
    /// no swap: past the limit a process is killed, never paged out).
    pub fn set_limit(&self, bytes: u64) -> io::Result<()> {
        match self.version {
            Version::V2 => {
                self.write("memory.max", &bytes.to_string())?;
                if self.dir.join("memory.swap.max").exists() {
                    self.write("memory.swap.max", "0")?;
                }
            }
            Version::V1 => {
                // memory+swap may not go below memory: the memory limit first.
                self.write("memory.limit_in_bytes", &bytes.to_string())?;
                if self.dir.join("memory.memsw.limit_in_bytes").exists() {
                    self.write("memory.memsw.limit_in_bytes", &bytes.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The processes in the cgroup now.
    pub fn procs(&self) -> io::Result<Vec<u32>> {
        Ok(self
            .read("cgroup.procs")?
            .split_ascii_whitespace()
            .filter_map(|p| p.parse().ok())
            .collect())
    }
}

fn invalid(text: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("not a number: `{}`", text.trim()),
    )
}

fn parse_number(text: &str) -> io::Result<u64> {
    text.trim().parse().map_err(|_| invalid(text))
}

/// The value of a `key value` line (`memory.stat`, `memory.events`, `memory.oom_control`).
fn stat_field(text: &str, key: &str) -> io::Result<u64> {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no `{key}` line")))
}

/// The host pool of a box whose backends run in one memory cgroup: the members (each backend's
/// process tree) are listed as on a plain [`HostPool`], but the pool's use is the cgroup's
/// working set, so it counts what the kernel counts against the limit (and nothing outside it).
#[derive(Debug, Clone)]
pub struct EnforcedPool {
    pool: HostPool,
    cgroup: MemoryCgroup,
}

impl EnforcedPool {
    pub fn new(pool: HostPool, cgroup: MemoryCgroup) -> Self {
        EnforcedPool { pool, cgroup }
    }

    pub fn cgroup(&self) -> &MemoryCgroup {
        &self.cgroup
    }
}

impl GpuProbe for EnforcedPool {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        let mut device = self.pool.device();
        let used = self
            .cgroup
            .working_set_bytes()
            .map_err(|e| ProbeError::Cgroup(format!("{}: {e}", self.cgroup.dir.display())))?;
        device.used_bytes = used;
        device.free_bytes = device.total_bytes.saturating_sub(used);
        Ok(vec![device])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// This machine's kind: the v1 controllers (memory among them) and a cgroup2 tree that
    /// offers only hugetlb.
    const HYBRID_MOUNTS: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const HYBRID_CGROUP: &str = "\
9:name=systemd:/
4:memory:/process_api/01ee
1:cpu:/
0::/
";
    /// A systemd machine on the unified hierarchy alone.
    const UNIFIED_MOUNTS: &str = "\
25 1 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";
    const UNIFIED_CGROUP: &str = "0::/system.slice/headroom.service/up\n";

    fn files(pairs: &[(&str, &str)]) -> impl Fn(&Path) -> io::Result<String> + use<> {
        let map: HashMap<PathBuf, String> = pairs
            .iter()
            .map(|(p, t)| (PathBuf::from(p), t.to_string()))
            .collect();
        move |p: &Path| {
            map.get(p)
                .cloned()
                .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
        }
    }

    #[test]
    fn the_v1_memory_hierarchy_is_used_where_the_cgroup2_tree_lacks_memory() {
        let read = files(&[("/sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n")]);
        let h = locate_in(HYBRID_MOUNTS, HYBRID_CGROUP, &read).unwrap();
        assert_eq!(h.version, Version::V1);
        assert_eq!(h.mount, PathBuf::from("/sys/fs/cgroup/memory"));
        assert_eq!(
            h.own,
            PathBuf::from("/sys/fs/cgroup/memory/process_api/01ee")
        );
    }

    #[test]
    fn the_cgroup2_tree_is_used_where_it_hands_memory_down() {
        let read = files(&[
            (
                "/sys/fs/cgroup/cgroup.controllers",
                "cpuset cpu io memory pids\n",
            ),
            (
                "/sys/fs/cgroup/system.slice/headroom.service/up/cgroup.subtree_control",
                "memory pids\n",
            ),
        ]);
        let h = locate_in(UNIFIED_MOUNTS, UNIFIED_CGROUP, &read).unwrap();
        assert_eq!(h.version, Version::V2);
        assert_eq!(
            h.own,
            PathBuf::from("/sys/fs/cgroup/system.slice/headroom.service/up")
        );
    }

    #[test]
    fn a_cgroup2_tree_that_keeps_memory_from_our_children_says_where_to_enable_it() {
        let own = "/sys/fs/cgroup/system.slice/headroom.service/up";
        let read = files(&[
            ("/sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n"),
            (&format!("{own}/cgroup.controllers"), "cpu memory pids\n"),
            (&format!("{own}/cgroup.subtree_control"), "pids\n"),
        ]);
        let e = locate_in(UNIFIED_MOUNTS, UNIFIED_CGROUP, &read).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(&format!("echo +memory > {own}/cgroup.subtree_control")),
            "{text}"
        );
        assert!(text.contains("`pids`"), "{text}");
        // Not offered to our cgroup at all: the parent is where it stops.
        let read = files(&[
            ("/sys/fs/cgroup/cgroup.controllers", "cpu io memory pids\n"),
            (&format!("{own}/cgroup.controllers"), "pids\n"),
            (
                "/sys/fs/cgroup/system.slice/headroom.service/cgroup.subtree_control",
                "pids\n",
            ),
        ]);
        let text = locate_in(UNIFIED_MOUNTS, UNIFIED_CGROUP, &read)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("children of /sys/fs/cgroup/system.slice/headroom.service "),
            "{text}"
        );
    }

    #[test]
    fn no_memory_controller_anywhere_names_the_mounts_and_how_to_mount_one() {
        let mounts = "\
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
        let read = files(&[("/sys/fs/cgroup/unified/cgroup.controllers", "hugetlb\n")]);
        let e = locate_in(mounts, "1:cpu:/\n0::/\n", &read).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, CgroupError::NoController { .. }), "{text}");
        assert!(text.contains("cgroup /sys/fs/cgroup/cpu (cpu)"), "{text}");
        assert!(text.contains("cgroup2 /sys/fs/cgroup/unified"), "{text}");
        assert!(text.contains("mount -t cgroup2"), "{text}");
        let e = locate_in("", "", &read).unwrap_err();
        assert!(e.to_string().contains("mounts: none"), "{e}");
    }

    #[test]
    fn a_container_mount_root_is_stripped_and_a_cgroup_outside_it_is_refused() {
        let mounts =
            "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n";
        let read = files(&[]);
        let h = locate_in(mounts, "4:memory:/docker/abc/inner\n", &read).unwrap();
        assert_eq!(h.own, PathBuf::from("/sys/fs/cgroup/memory/inner"));
        let h = locate_in(mounts, "4:memory:/docker/abc\n", &read).unwrap();
        assert_eq!(h.own, PathBuf::from("/sys/fs/cgroup/memory"));
        for outside in ["4:memory:/docker/abcdef\n", "4:memory:/other\n"] {
            let e = locate_in(mounts, outside, &read).unwrap_err();
            assert!(matches!(e, CgroupError::OutsideMount { .. }), "{e}");
        }
        let e = locate_in(mounts, "4:memory:/docker/abc/../x\n", &read).unwrap_err();
        assert!(matches!(e, CgroupError::OutsideMount { .. }), "{e}");
    }

    /// A fake cgroup directory with the files a v1 or v2 memory cgroup has.
    fn fake(version: Version, files: &[(&str, &str)]) -> (tempfile::TempDir, MemoryCgroup) {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            fs::write(dir.path().join(name), text).unwrap();
        }
        let cg = MemoryCgroup::new(dir.path(), version);
        (dir, cg)
    }

    #[test]
    fn v1_files_are_read_as_the_kernel_writes_them() {
        let (_d, cg) = fake(
            Version::V1,
            &[
                ("memory.usage_in_bytes", "209666048\n"),
                (
                    "memory.stat",
                    "cache 196096000\nrss 8077312\ninactive_file 1\ntotal_cache 196096000\ntotal_inactive_file 196083712\n",
                ),
                (
                    "memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
                ),
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("cgroup.procs", "12\n345\n"),
            ],
        );
        assert_eq!(cg.usage_bytes().unwrap(), 209_666_048);
        // The hierarchical figure (total_), not the cgroup's own.
        assert_eq!(cg.inactive_file_bytes().unwrap(), 196_083_712);
        assert_eq!(cg.working_set_bytes().unwrap(), 209_666_048 - 196_083_712);
        assert_eq!(cg.oom_kills().unwrap(), 3);
        assert_eq!(cg.limit_bytes().unwrap(), None);
        assert_eq!(cg.procs().unwrap(), vec![12, 345]);
        fs::write(cg.dir().join("memory.memsw.limit_in_bytes"), "").unwrap();
        cg.set_limit(200 << 20).unwrap();
        assert_eq!(cg.limit_bytes().unwrap(), Some(200 << 20));
        let memsw = fs::read_to_string(cg.dir().join("memory.memsw.limit_in_bytes")).unwrap();
        assert_eq!(memsw, (200u64 << 20).to_string());
    }

    #[test]
    fn v2_files_are_read_as_the_kernel_writes_them() {
        let (_d, cg) = fake(
            Version::V2,
            &[
                ("memory.current", "104857600\n"),
                (
                    "memory.stat",
                    "anon 50000000\nfile 40000000\nactive_file 10000000\ninactive_file 30000000\n",
                ),
                (
                    "memory.events",
                    "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n",
                ),
                ("memory.max", "max\n"),
                ("memory.swap.max", "max\n"),
            ],
        );
        assert_eq!(cg.working_set_bytes().unwrap(), 104_857_600 - 30_000_000);
        assert_eq!(cg.oom_kills().unwrap(), 2);
        assert_eq!(cg.limit_bytes().unwrap(), None);
        cg.set_limit(1 << 30).unwrap();
        assert_eq!(cg.limit_bytes().unwrap(), Some(1 << 30));
        assert_eq!(
            fs::read_to_string(cg.dir().join("memory.swap.max")).unwrap(),
            "0"
        );
    }

    #[test]
    fn a_missing_or_garbled_file_is_an_error_not_zero() {
        let (_d, cg) = fake(
            Version::V1,
            &[
                ("memory.usage_in_bytes", "lots\n"),
                ("memory.stat", "cache 1\n"),
            ],
        );
        assert!(cg.usage_bytes().is_err());
        assert!(cg.inactive_file_bytes().is_err());
        assert!(cg.oom_kills().is_err());
        let pool = EnforcedPool::new(HostPool::new(1 << 30), cg);
        let e = pool.snapshot().unwrap_err();
        assert_eq!(e.label(), "cgroup");
    }

    #[test]
    fn the_enforced_pool_reads_the_working_set_as_its_use() {
        let (_d, cg) = fake(
            Version::V2,
            &[
                ("memory.current", "300000000\n"),
                ("memory.stat", "inactive_file 100000000\n"),
            ],
        );
        let pool = EnforcedPool::new(HostPool::new(1 << 30), cg);
        let d = &pool.snapshot().unwrap()[0];
        assert_eq!(d.used_bytes, 200_000_000);
        assert_eq!(d.free_bytes, (1 << 30) - 200_000_000);
        assert_eq!(d.total_bytes, 1 << 30);
    }
}
