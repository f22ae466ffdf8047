//! Backend processes: each one started as the invoking user in its own process group (so the
//! whole tree it forks can be signalled at once), its output appended to a log file, and stopped
//! by group: SIGTERM, a grace period, then SIGKILL. [`Group`] kills its group when dropped, so
//! no error path (a failed start-up, a panic unwinding) leaves a backend behind.
//!
//! When `up` itself is killed (`kill -9`: no destructor runs) its backends are tied to it twice,
//! without `unsafe`: the backend is started through util-linux's `setpriv --pdeathsig KILL`, so
//! the kernel kills the direct child when `up` dies, and a small watchdog per group (`sh` waiting
//! on `up`'s PID with coreutils' `tail --pid`) then kills the whole process group, which reaches
//! the grandchildren (vLLM's engine core, worker processes) that the death signal does not. A
//! grandchild that leaves the group (its own `setsid`) escapes both.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
use tokio::process::{Child, Command};

use crate::UpError;
use crate::boxfile::BackendConfig;

/// A running backend: the direct child and its process group (PGID = the child's PID).
#[derive(Debug)]
pub struct Group {
    pub name: String,
    pub pid: u32,
    child: Option<Child>,
    pub log: PathBuf,
    /// Kills the group if `up` dies without stopping it (killed on drop).
    watchdog: Option<Child>,
}

/// How backends die with `up` when it is killed outright: the programs found for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeathTie {
    /// `setpriv` with `--pdeathsig` (util-linux 2.33+): SIGKILL to the direct child when `up` dies.
    pub setpriv: Option<PathBuf>,
    /// `sh` and a `tail` with `--pid` (coreutils): the group watchdog.
    pub watchdog: Option<(PathBuf, PathBuf)>,
}

impl DeathTie {
    /// One line for the log when either is missing.
    pub fn warning(&self) -> Option<String> {
        match (&self.setpriv, &self.watchdog) {
            (Some(_), Some(_)) => None,
            (None, Some(_)) => Some("setpriv with --pdeathsig (util-linux) was not found: if up is killed with SIGKILL, its backends are killed by the group watchdog only (within about a second)".into()),
            (Some(_), None) => Some("sh or a tail with --pid (coreutils) was not found: if up is killed with SIGKILL, only each backend's main process dies with it (setpriv --pdeathsig), not the processes it started".into()),
            (None, None) => Some("neither setpriv --pdeathsig (util-linux) nor sh + tail --pid (coreutils) was found: if up is killed with SIGKILL, its backends keep running".into()),
        }
    }
}

fn on_path(program: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|p| p.join(program))
        .find(|p| p.is_file())
}

/// Whether `program --help` mentions `option` (so it supports it).
fn supports(program: &Path, option: &str) -> bool {
    std::process::Command::new(program)
        .arg("--help")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(option))
        .unwrap_or(false)
}

/// The programs that tie backends to `up`'s life, looked up once.
pub fn death_tie() -> &'static DeathTie {
    static TIE: OnceLock<DeathTie> = OnceLock::new();
    TIE.get_or_init(|| DeathTie {
        setpriv: on_path("setpriv").filter(|p| supports(p, "--pdeathsig")),
        watchdog: on_path("sh").zip(on_path("tail").filter(|p| supports(p, "--pid"))),
    })
}

/// A watchdog in its own process group: waits for `up` (this process) to exit, checking every
/// 0.2 s, then kills group `pgid`. Stopped by the [`Group`] once the group is gone.
fn spawn_watchdog(pgid: u32) -> Option<Child> {
    let (sh, tail) = death_tie().watchdog.clone()?;
    let mut cmd = Command::new(sh);
    cmd.arg("-c")
        .arg("\"$0\" -s 0.2 --pid=\"$1\" -f /dev/null; kill -s KILL -- -\"$2\" 2>/dev/null")
        .arg(tail)
        .arg(std::process::id().to_string())
        .arg(pgid.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .kill_on_drop(true);
    cmd.spawn().ok()
}

/// Starts `backend` with `extra_args` and `extra_env` added, cwd = `dir`, output to `log`.
pub fn spawn(
    backend: &BackendConfig,
    extra_args: &[String],
    extra_env: &[(String, String)],
    dir: &Path,
    log: &Path,
) -> Result<Group, UpError> {
    spawn_in(backend, extra_args, extra_env, dir, log, None)
}

/// The shell that puts itself into a cgroup, then becomes the backend: `$0` is the cgroup's
/// `cgroup.procs`, the arguments are the command. Same PID throughout, so the process group,
/// the death signal and the watchdog work as without it.
const JOIN_SCRIPT: &str = "echo $$ > \"$0\" || { echo \"headroom up: cannot join the memory cgroup ($0)\" >&2; exit 125; }; exec \"$@\"";

/// [`spawn`], the backend placed in the cgroup whose `cgroup.procs` is `join` before it runs
/// (see [`crate::cgroup`]).
pub(crate) fn spawn_in(
    backend: &BackendConfig,
    extra_args: &[String],
    extra_env: &[(String, String)],
    dir: &Path,
    log: &Path,
    join: Option<&Path>,
) -> Result<Group, UpError> {
    let out = crate::logs::open_log(log).map_err(|e| UpError::Io {
        what: format!("log file {}", log.display()),
        source: e,
    })?;
    let err = out.try_clone().map_err(|e| UpError::Io {
        what: format!("log file {}", log.display()),
        source: e,
    })?;
    // Through setpriv when there is one: it sets the death signal and execs the backend, so the
    // PID (and process group) stay the backend's. Through the joining shell before that when
    // the backend runs in a cgroup.
    let mut program: Vec<std::ffi::OsString> = Vec::new();
    if let Some(procs) = join {
        let sh = on_path("sh").unwrap_or_else(|| PathBuf::from("/bin/sh"));
        program.extend([sh.into(), "-c".into(), JOIN_SCRIPT.into(), procs.into()]);
    }
    if let Some(setpriv) = &death_tie().setpriv {
        program.extend([
            setpriv.into(),
            "--pdeathsig".into(),
            "KILL".into(),
            "--".into(),
        ]);
    }
    program.push(backend.command.clone().into());
    let mut cmd = Command::new(&program[0]);
    cmd.args(&program[1..]);
    cmd.args(backend.expanded_args())
        .args(extra_args)
        .envs(&backend.env)
        .envs(extra_env.iter().map(|(k, v)| (k, v)))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        // Its own process group, so SIGTERM/SIGKILL reach every process it forks.
        .process_group(0)
        .kill_on_drop(false);
    let child = cmd.spawn().map_err(|e| UpError::Spawn {
        backend: backend.name.clone(),
        command: backend.command.display().to_string(),
        reason: if e.kind() == std::io::ErrorKind::NotFound {
            "no such program".to_string()
        } else {
            e.to_string()
        },
    })?;
    let pid = child.id().ok_or_else(|| UpError::Spawn {
        backend: backend.name.clone(),
        command: backend.command.display().to_string(),
        reason: "exited at once".into(),
    })?;
    Ok(Group {
        name: backend.name.clone(),
        pid,
        child: Some(child),
        log: log.to_path_buf(),
        watchdog: spawn_watchdog(pid),
    })
}

impl Group {
    fn pgid(&self) -> Option<Pid> {
        Pid::from_raw(self.pid as i32)
    }

    /// Whether any process of the group still exists (zombies of the direct child count until
    /// it is reaped, so reap first).
    pub fn group_alive(&mut self) -> bool {
        self.reap();
        match self.pgid() {
            Some(pgid) => test_kill_process_group(pgid).is_ok(),
            None => false,
        }
    }

    /// Reaps the direct child if it has exited; returns its status then.
    pub fn reap(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        match child.try_wait() {
            Ok(Some(status)) => {
                self.child = None;
                Some(status)
            }
            _ => None,
        }
    }

    /// Waits for the direct child to exit (the group may live on; see [`Group::stop`]).
    pub async fn wait(&mut self) -> Option<ExitStatus> {
        let child = self.child.as_mut()?;
        let status = child.wait().await.ok();
        self.child = None;
        status
    }

    fn signal(&self, sig: Signal) {
        if let Some(pgid) = self.pgid() {
            // ESRCH: the group is gone already.
            let _ = kill_process_group(pgid, sig);
        }
    }

    /// Stops the watchdog once the group is gone (so it never signals a reused PGID).
    fn end_watchdog(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.start_kill();
            let _ = w.try_wait();
        }
    }

    /// SIGTERM to the group, up to `grace` for every process of it to exit, then SIGKILL.
    /// Returns whether SIGKILL was needed.
    pub async fn stop(&mut self, grace: Duration) -> bool {
        let killed = self.stop_group(grace).await;
        if !self.group_alive() {
            self.end_watchdog();
        }
        killed
    }

    async fn stop_group(&mut self, grace: Duration) -> bool {
        if !self.group_alive() {
            return false;
        }
        self.signal(Signal::TERM);
        let deadline = tokio::time::Instant::now() + grace;
        while tokio::time::Instant::now() < deadline {
            if !self.group_alive() {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.signal(Signal::KILL);
        for _ in 0..100 {
            if !self.group_alive() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    /// The last `n` lines of the log, for error messages.
    pub fn log_tail(&self, n: usize) -> Vec<String> {
        log_tail(&self.log, n)
    }
}

/// Stops (`true`: SIGSTOP) or continues (`false`: SIGCONT) the process group led by `pgid`.
pub(crate) fn signal_group(pgid: u32, stop: bool) -> std::io::Result<()> {
    let pid = i32::try_from(pgid)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| std::io::Error::other(format!("{pgid} is not a process id")))?;
    let signal = if stop { Signal::STOP } else { Signal::CONT };
    kill_process_group(pid, signal).map_err(std::io::Error::from)
}

/// The last `n` non-empty lines of a log file.
pub fn log_tail(path: &Path, n: usize) -> Vec<String> {
    let text = std::fs::read(path).unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let lines: Vec<String> = text
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    lines[lines.len().saturating_sub(n)..].to_vec()
}

impl Drop for Group {
    fn drop(&mut self) {
        // The last line of defence (errors, panics): no grace beyond a short wait. The watchdog
        // (kill_on_drop) goes with the struct.
        if self.group_alive() {
            self.signal(Signal::TERM);
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(25));
                if !self.group_alive() {
                    return;
                }
            }
            self.signal(Signal::KILL);
            for _ in 0..40 {
                if !self.group_alive() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(25));
            }
        }
    }
}

/// Fails when something already listens on 127.0.0.1:`port` (or it cannot be bound).
pub fn check_port_free(name: &str, port: u16) -> Result<(), UpError> {
    std::net::TcpListener::bind(("127.0.0.1", port))
        .map(drop)
        .map_err(|e| UpError::PortTaken {
            backend: name.to_string(),
            port,
            reason: e.to_string(),
        })
}

/// Finds `command` the way the shell would (a path with `/` as is, else on `PATH`).
/// Whether the backend's program exists: a path (relative ones were taken from `dir`, the box
/// file's folder, which the error names) or a name found on `PATH`.
pub fn check_command(backend: &BackendConfig, dir: &Path) -> Result<(), UpError> {
    let cmd = &backend.command;
    let is_path = cmd.components().count() > 1 || cmd.is_absolute();
    let found = if is_path {
        cmd.is_file()
    } else {
        std::env::var_os("PATH")
            .map(|paths| std::env::split_paths(&paths).any(|p| p.join(cmd).is_file()))
            .unwrap_or(false)
    };
    if found {
        Ok(())
    } else {
        Err(UpError::Spawn {
            backend: backend.name.clone(),
            command: cmd.display().to_string(),
            reason: if is_path {
                format!("no such program ({})", crate::boxfile::relative_to(dir))
            } else {
                "no such program on PATH".into()
            },
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A backend config running `command args` (for tests of starting processes).
    pub(crate) fn backend(command: &str, args: &[&str]) -> BackendConfig {
        BackendConfig {
            name: "t".into(),
            role: crate::boxfile::Role::Audio,
            engine: crate::boxfile::Engine::Other,
            command: command.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::new(),
            port: 1,
            health: "/health".into(),
            ready_timeout: Duration::from_secs(1),
            steady_window: Duration::from_secs(1),
            steady_timeout: Duration::from_secs(1),
            warmup: None,
            text: None,
            audio_vllm: None,
            stop_grace: Duration::from_secs(1),
        }
    }

    fn alive(pid: u32) -> bool {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z")
    }

    #[tokio::test]
    async fn stop_kills_the_whole_group_even_a_child_that_ignores_sigterm() {
        let dir = tempfile::tempdir().unwrap();
        // The shell starts a child that ignores SIGTERM, prints its PID, and waits.
        let b = backend(
            "sh",
            &[
                "-c",
                "sh -c 'trap \"\" TERM; echo $$; while :; do sleep 1; done' & wait",
            ],
        );
        let mut g = spawn(&b, &[], &[], dir.path(), &dir.path().join("t.log")).unwrap();
        let mut grandchild = None;
        for _ in 0..100 {
            if let Some(line) = g.log_tail(1).first() {
                grandchild = line.trim().parse::<u32>().ok();
                if grandchild.is_some() {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let grandchild = grandchild.expect("the grandchild printed its pid");
        assert!(alive(grandchild));
        let killed = g.stop(Duration::from_millis(300)).await;
        assert!(killed, "SIGTERM alone cannot stop it");
        assert!(!g.group_alive());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!alive(grandchild), "grandchild {grandchild} survived");
    }

    #[tokio::test]
    async fn dropping_a_group_kills_it() {
        let dir = tempfile::tempdir().unwrap();
        let b = backend("sleep", &["600"]);
        let g = spawn(&b, &[], &[], dir.path(), &dir.path().join("t.log")).unwrap();
        let pid = g.pid;
        assert!(alive(pid));
        drop(g);
        assert!(!alive(pid));
    }

    #[tokio::test]
    async fn a_backend_runs_under_its_own_pid_with_a_watchdog_that_ends_with_its_group() {
        let tie = death_tie();
        // Debian's essential packages: util-linux's setpriv and coreutils' tail.
        assert!(tie.setpriv.is_some() && tie.watchdog.is_some(), "{tie:?}");
        let dir = tempfile::tempdir().unwrap();
        let mut g = spawn(
            &backend("sleep", &["600"]),
            &[],
            &[],
            dir.path(),
            &dir.path().join("t.log"),
        )
        .unwrap();
        // setpriv exec'd the backend: same PID, the backend's own command line.
        let mut cmd = String::new();
        for _ in 0..100 {
            cmd = std::fs::read_to_string(format!("/proc/{}/cmdline", g.pid)).unwrap_or_default();
            if cmd.starts_with("sleep") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(cmd, "sleep\u{0}600\u{0}");
        let watchdog = g.watchdog.as_ref().and_then(|w| w.id()).unwrap();
        assert!(alive(watchdog));
        g.stop(Duration::from_secs(2)).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !alive(g.pid) && !alive(watchdog),
            "watchdog {watchdog} outlived its group"
        );
    }

    #[test]
    fn a_missing_command_is_named() {
        let e = check_command(&backend("no-such-program-xyz", &[]), Path::new("/")).unwrap_err();
        assert!(e.to_string().contains("no-such-program-xyz"), "{e}");
        assert!(check_command(&backend("sh", &[]), Path::new("/")).is_ok());
    }

    #[test]
    fn a_taken_port_is_refused() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let e = check_port_free("stt", port).unwrap_err();
        assert!(e.to_string().contains(&port.to_string()), "{e}");
    }
}
