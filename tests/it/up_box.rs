//! `headroom up` as the real binary, over a box of real processes on 127.0.0.1 (Python's
//! `http.server` as the backend, started through `sh` so a test can make its restarts fail):
//! restarts counted as they happen and a crash loop shown in `/admin/box` and `/metrics`, a
//! drain and an ordered stop when stderr is a broken pipe, SIGHUP ignored, `--check` refusing a
//! bad `[serve]` or calibration path before anything starts, and the backends' logs in a private
//! folder that a clean stop removes. `headroom serve` answers the same signals the same way.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A port free now (bound and released; the box file needs fixed ports).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A box with one audio backend: `http.server` on its port, started by `sh -c SCRIPT PORT`, so
/// the script decides what a start does (`$0` is the port).
pub(crate) struct TestBox {
    pub dir: tempfile::TempDir,
    pub path: PathBuf,
    pub backend_port: u16,
    pub port: u16,
}

/// The backend's start: serve on the port.
pub(crate) const SERVE: &str = "exec python3 -m http.server --bind 127.0.0.1 \"$0\"";

/// The first start serves; every later one exits at once with status 1 (a backend that can no
/// longer start: a broken model file, a port taken, a driver gone).
pub(crate) const FIRST_ONLY: &str = "if [ -e started ]; then echo 'cannot start again' >&2; exit 1; fi; touch started; exec python3 -m http.server --bind 127.0.0.1 \"$0\"";

impl TestBox {
    pub fn new(script: &str, extra_top: &str, extra_serve: &str) -> TestBox {
        let dir = tempfile::tempdir().unwrap();
        let (backend_port, port) = (free_port(), free_port());
        let text = format!(
            r#"{extra_top}
restart_backoff = "100ms"
restart_backoff_max = "200ms"

[memory]
probe = "host"
capacity = "4GiB"
margin = "64MiB"
sample_interval = "25ms"

[[backends]]
name = "tts"
role = "audio"
engine = "other"
command = "sh"
args = ["-c", {script:?}, "{{port}}"]
port = {backend_port}
health = "/"
ready_timeout = "20s"
steady_window = "300ms"
steady_timeout = "10s"
stop_grace = "3s"

[serve]
listen = "127.0.0.1:{port}"
shutdown_grace = "5s"
{extra_serve}
"#
        );
        let path = dir.path().join("box.up.toml");
        std::fs::write(&path, text).unwrap();
        TestBox {
            dir,
            path,
            backend_port,
            port,
        }
    }

    pub fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn command(&self, extra: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_headroom"));
        c.arg("up").arg("--config").arg(&self.path).args(extra);
        c.current_dir(self.dir.path());
        c
    }
}

/// A running `headroom up` whose stderr lines are collected by a thread.
pub(crate) struct Up {
    pub child: Child,
    pub lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Up {
    pub fn start(b: &TestBox, extra: &[&str]) -> Up {
        let mut child = b
            .command(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let err = child.stderr.take().unwrap();
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Up { child, lines }
    }

    pub fn stderr(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// Waits for the "box ready" line (the gateway is listening then).
    pub fn wait_ready(&mut self, within: Duration) {
        let until = Instant::now() + within;
        while Instant::now() < until {
            if self.stderr().contains("up: box ready") {
                return;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!(
                    "up exited ({s}) before the box was ready:\n{}",
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("up not ready within {within:?}:\n{}", self.stderr());
    }

    pub fn signal(&self, sig: &str) {
        send_signal(u64::from(self.child.id()), sig);
    }

    pub fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        wait_child(&mut self.child, within)
            .unwrap_or_else(|| panic!("up did not exit within {within:?}:\n{}", self.stderr()))
    }
}

/// Sends `sig` (`TERM`, `HUP`, `KILL`) to process `pid`.
pub(crate) fn send_signal(pid: u64, sig: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(ok.success(), "kill -{sig} {pid}");
}

/// The child's exit status once it exits within `within`; killed and `None` otherwise.
pub(crate) fn wait_child(child: &mut Child, within: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A blocking GET on the box's gateway; the body as text.
pub(crate) fn get(base: &str, path: &str) -> String {
    let url = format!("{base}{path}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .get(&url)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .unwrap_or_else(|e| panic!("GET {url}: {e}"))
            .text()
            .await
            .unwrap()
    })
}

pub(crate) fn box_backend(base: &str) -> Value {
    let report: Value = serde_json::from_str(&get(base, "/admin/box")).unwrap();
    report["backends"][0].clone()
}

/// Whether a process with this PID exists (a zombie counts until reaped).
pub(crate) fn alive(pid: u64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

#[test]
fn a_backend_that_can_no_longer_start_is_counted_and_shown_as_a_crash_loop() {
    let b = TestBox::new(FIRST_ONLY, "", "");
    let mut up = Up::start(
        &b,
        &["--log-dir", b.dir.path().join("logs").to_str().unwrap()],
    );
    up.wait_ready(Duration::from_secs(60));
    let base = b.base();
    let first = box_backend(&base);
    assert_eq!(first["state"], "ready", "{first}");
    assert_eq!(first["restarts"], 0, "{first}");
    let pid = first["pid"].as_u64().unwrap();
    // The backend dies; every restart exits at once.
    send_signal(pid, "KILL");
    let until = Instant::now() + Duration::from_secs(30);
    let mut seen = first;
    while Instant::now() < until {
        seen = box_backend(&base);
        if seen["restarts"].as_u64().unwrap_or(0) >= 4 && seen["state"] == "crash_loop" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("/admin/box while the backend cannot start: {seen}");
    let restarts = seen["restarts"].as_u64().unwrap_or(0);
    assert!(
        restarts >= 4,
        "restart attempts are not counted as they happen: restarts = {restarts}"
    );
    assert_eq!(seen["state"], "crash_loop", "{seen}");
    let failures = seen["start_failures"].as_u64().unwrap();
    assert!(
        failures + 1 >= restarts && failures <= restarts,
        "every attempt failed: {seen}"
    );
    let last = seen["last_exit"].as_str().unwrap();
    assert!(last.contains("exit status: 1"), "{last}");
    let metrics = get(&base, "/metrics");
    let series = |name: &str| -> f64 {
        let prefix = format!("{name}{{backend=\"tts\",role=\"audio\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("{name} missing:\n{metrics}"))
            .parse()
            .unwrap()
    };
    assert!(series("headroom_box_backend_restarts_total") >= 4.0);
    assert!(series("headroom_box_backend_start_failures_total") >= 3.0);
    assert!(
        metrics.contains("headroom_box_backend_up{backend=\"tts\",state=\"crash_loop\"} 0"),
        "{metrics}"
    );
    // The lane answers 503 with Retry-After meanwhile, and a stop still stops cleanly.
    up.signal("TERM");
    let status = up.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{}", up.stderr());
    assert!(!alive(pid));
}

/// A backend that writes `stopped` into the box folder when it gets SIGTERM (and is then
/// stopped in order), and nothing when it is killed.
const NOTES_ITS_STOP: &str = "trap 'echo by-sigterm > stopped; kill $p 2>/dev/null; exit 0' TERM; python3 -m http.server --bind 127.0.0.1 \"$0\" & p=$!; wait $p";

#[test]
fn sigterm_with_a_broken_stderr_pipe_drains_and_stops_the_backends_in_order() {
    let b = TestBox::new(NOTES_ITS_STOP, "", "");
    let logs = b.dir.path().join("logs");
    let mut child = b
        .command(&["--log-dir", logs.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read stderr until the box is ready, then close the read end: every later write to
    // stderr meets a broken pipe.
    let mut err = child.stderr.take().unwrap();
    let mut seen = String::new();
    let until = Instant::now() + Duration::from_secs(60);
    let mut buf = [0u8; 4096];
    while !seen.contains("up: box ready") {
        assert!(Instant::now() < until, "not ready:\n{seen}");
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "up exited before it was ready:\n{seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let backend = box_backend(&b.base());
    let pid = backend["pid"].as_u64().unwrap();
    drop(err);
    send_signal(u64::from(child.id()), "TERM");
    let status = wait_child(&mut child, Duration::from_secs(30)).expect("up stops");
    eprintln!("up with a closed stderr, on SIGTERM: {status}");
    assert_eq!(
        status.code(),
        Some(0),
        "a closed stderr ended up instead of its drain"
    );
    assert!(!alive(pid), "the backend outlived up");
    assert_eq!(
        std::fs::read_to_string(b.dir.path().join("stopped")).unwrap_or_default(),
        "by-sigterm\n",
        "the backend was not stopped in order (SIGTERM, then its grace)"
    );
    assert!(logs.join("tts.log").exists(), "--log-dir keeps the logs");
}

#[test]
fn sighup_neither_kills_up_nor_its_backends() {
    let b = TestBox::new(SERVE, "", "");
    let mut up = Up::start(&b, &[]);
    up.wait_ready(Duration::from_secs(60));
    let pid = box_backend(&b.base())["pid"].as_u64().unwrap();
    up.signal("HUP");
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        up.child.try_wait().unwrap().is_none(),
        "SIGHUP ended up:\n{}",
        up.stderr()
    );
    assert_eq!(box_backend(&b.base())["state"], "ready");
    assert!(alive(pid));
    assert!(up.stderr().contains("SIGHUP"), "{}", up.stderr());
    up.signal("TERM");
    assert_eq!(up.wait_exit(Duration::from_secs(30)).code(), Some(0));
    assert!(!alive(pid));
}

/// `up` run to its end; its exit code and stderr.
fn run_to_end(b: &TestBox, extra: &[&str]) -> (Option<i32>, String) {
    let out = b.command(extra).stdin(Stdio::null()).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_refuses_a_bad_serve_table_and_calibration_path_before_anything_starts() {
    // A gateway on every interface without API keys.
    let open = TestBox::new(SERVE, "", "");
    let text = std::fs::read_to_string(&open.path)
        .unwrap()
        .replace("listen = \"127.0.0.1:", "listen = \"0.0.0.0:");
    std::fs::write(&open.path, text).unwrap();
    let (code, err) = run_to_end(&open, &["--check"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("API keys are required"), "{err}");
    let (code, err) = run_to_end(&open, &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        !err.contains("started pid"),
        "a backend started first:\n{err}"
    );
    // An agent listener the same.
    let agent = TestBox::new(
        SERVE,
        "",
        &format!(
            "[serve.balancer]\nagent_listen = \"0.0.0.0:{}\"",
            free_port()
        ),
    );
    let (code, err) = run_to_end(&agent, &["--check"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("agent_listen"), "{err}");
    // A calibration path that is a folder, and one nobody can write.
    for (calibration, says) in [
        ("box.up.calibration.json", "is a folder"),
        ("/proc/headroom.calibration.json", "cannot write beside"),
    ] {
        let b = TestBox::new(SERVE, "", "");
        let text = std::fs::read_to_string(&b.path).unwrap().replace(
            "sample_interval = \"25ms\"",
            &format!("sample_interval = \"25ms\"\ncalibration = \"{calibration}\""),
        );
        std::fs::write(&b.path, text).unwrap();
        std::fs::create_dir(b.dir.path().join("box.up.calibration.json")).unwrap();
        let (code, err) = run_to_end(&b, &["--check"]);
        assert_eq!(code, Some(2), "{calibration}: {err}");
        assert!(err.contains(says), "{calibration}: {err}");
        let started = Instant::now();
        let (code, err) = run_to_end(&b, &[]);
        assert_eq!(code, Some(2), "{calibration}: {err}");
        assert!(
            !err.contains("started pid"),
            "a backend started first:\n{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "refused only after a bring-up"
        );
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", b.backend_port)).is_err(),
            "the backend is running"
        );
    }
    let fine = TestBox::new(SERVE, "", "");
    let (code, err) = run_to_end(&fine, &["--check"]);
    assert_eq!(code, Some(0), "{err}");
}

/// The "backend logs in DIR" folder of a run.
fn log_folder(stderr: &str) -> PathBuf {
    let at = stderr
        .find("backend logs in ")
        .expect("names its log folder");
    PathBuf::from(
        stderr[at + "backend logs in ".len()..]
            .lines()
            .next()
            .unwrap()
            .trim(),
    )
}

#[test]
fn backend_logs_go_to_a_private_folder_removed_at_a_clean_stop_unless_kept() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for keep in [false, true] {
        let b = TestBox::new(SERVE, "", "");
        let mut up = Up::start(&b, if keep { &["--keep-logs"] } else { &[] });
        up.wait_ready(Duration::from_secs(60));
        let dir = log_folder(&up.stderr());
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.contains(&up.child.id().to_string()),
            "{name}: named after up's PID"
        );
        assert_eq!(mode(&dir), 0o700, "{}", dir.display());
        assert_eq!(mode(&dir.join("tts.log")), 0o600);
        up.signal("TERM");
        assert_eq!(up.wait_exit(Duration::from_secs(30)).code(), Some(0));
        assert_eq!(dir.exists(), keep, "keep = {keep}:\n{}", up.stderr());
        if keep {
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}

#[test]
fn serve_ignores_sighup_and_drains_on_sigterm_with_a_closed_stderr() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"http://127.0.0.1:{}\"]\n",
            free_port()
        ),
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let addr = first
        .trim()
        .strip_prefix("listening on ")
        .unwrap()
        .to_string();
    drop(child.stderr.take());
    let pid = u64::from(child.id());
    send_signal(pid, "HUP");
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP ended serve: {:?}",
        child.try_wait()
    );
    assert!(get(&format!("http://{addr}"), "/healthz").contains("ok"));
    send_signal(pid, "TERM");
    let status = wait_child(&mut child, Duration::from_secs(20)).expect("serve stops");
    assert_eq!(status.code(), Some(0), "{status}");
}

/// A backend that answers every POST with `{}` and counts it in `warmups` (its folder).
const COUNTS_ITS_POSTS: &str = r#"exec python3 -c '
import http.server as h, sys
class H(h.SimpleHTTPRequestHandler):
    def do_POST(s):
        s.rfile.read(int(s.headers.get("Content-Length", 0)))
        open("warmups", "a").write("1\n")
        s.send_response(200)
        s.send_header("Content-Type", "application/json")
        s.send_header("Content-Length", "2")
        s.end_headers()
        s.wfile.write(b"{}")
h.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
' "$0""#;

#[test]
fn a_backend_started_again_runs_its_warm_up_before_it_is_given_requests() {
    let b = TestBox::new(COUNTS_ITS_POSTS, "", "");
    let text = std::fs::read_to_string(&b.path).unwrap().replace(
        "\n[serve]\n",
        "\n[backends.warmup]\npath = \"/v1/audio/speech\"\njson = '{\"x\": 1}'\nruns = 1\n\n[serve]\n",
    );
    std::fs::write(&b.path, text).unwrap();
    let warmups = || {
        std::fs::read_to_string(b.dir.path().join("warmups"))
            .unwrap_or_default()
            .lines()
            .count()
    };
    let mut up = Up::start(&b, &[]);
    up.wait_ready(Duration::from_secs(60));
    let at_start = warmups();
    assert!(
        at_start >= 1,
        "the warm-up at the box's start: {}",
        up.stderr()
    );
    let pid = box_backend(&b.base())["pid"].as_u64().unwrap();
    send_signal(pid, "KILL");
    let until = Instant::now() + Duration::from_secs(30);
    while !up.stderr().contains("running again") && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Read as soon as `up` says the backend runs again: the warm-up came before.
    let after_restart = warmups();
    up.signal("TERM");
    up.wait_exit(Duration::from_secs(30));
    assert!(up.stderr().contains("running again"), "{}", up.stderr());
    assert_eq!(
        after_restart,
        at_start + 1,
        "one warm-up after the restart, before it runs again: {}",
        up.stderr()
    );
}
