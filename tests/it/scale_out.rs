//! Several boxes behind a stock load balancer: the real HAProxy (Debian's package) with
//! `deploy/haproxy.cfg` as shipped, in front of three real `headroom serve` processes, each with
//! its own in-process fake engines on 127.0.0.1. HAProxy picks the box from headroom's agent
//! weight and `/readyz`; a box whose lanes are full gets less new work with the agent on than
//! off; a box killed mid-run loses no request that had not started streaming, and gets work
//! again once it is back. A smaller test checks `/readyz` under saturation and with its lane's
//! only upstream down, and the ORCA header of real responses against the ORCA TEXT syntax.
//!
//! Ports: 20800-20899 (this test's range). Loads are bounded in count and time.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::common::SERIAL;
use crate::serve::{client, gateway, multipart_body, text_lane};
use crate::serve_upstream::{self, Upstream};

const FRONT: u16 = 20800;
const FRONT_NO_AGENT: u16 = 20820;
const BOX_PORTS: [u16; 3] = [20801, 20802, 20803];
const AGENT_PORTS: [u16; 3] = [20811, 20812, 20813];
/// Every client request's bound: none may reach it.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(25);

fn haproxy_binary() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/sbin".into(), "/usr/local/sbin".into()])
        .map(|d| d.join("haproxy"))
        .find(|p| p.is_file())
}

/// HAProxy, or `None` outside CI when it is not installed (CI must have it: scripts/system-deps.sh).
fn require_haproxy() -> Option<PathBuf> {
    let found = haproxy_binary();
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "haproxy is not installed (scripts/system-deps.sh installs it); CI must run this test"
        );
        eprintln!("SKIP: haproxy not installed (apt-get install haproxy); not in CI");
    }
    found
}

/// A child process killed (SIGKILL) and reaped when dropped, also on panic.
struct Proc(Option<Child>);

impl Proc {
    fn kill9(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn repo_file(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn wait_port(port: u16, within: Duration) {
    let until = std::time::Instant::now() + within;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < until,
            "nothing listens on {port} after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One box: `headroom serve` (the real binary) with a text and an audio lane, each on its own
/// fake engine, and the agent listener on.
struct HeadroomBox {
    index: usize,
    config: PathBuf,
    proc: Proc,
    text: Upstream,
    audio: Upstream,
}

fn box_config(i: usize, text: &Upstream, audio: &Upstream) -> String {
    format!(
        r#"listen = "127.0.0.1:{port}"
[balancer]
agent_listen = "127.0.0.1:{agent}"
load_header = true
interval = "200ms"
# HAProxy 2.6 retries 503 on another box but cannot retry 429.
overload_status = 503

[[lanes]]
name = "text"
paths = ["/v1/chat/completions"]
upstreams = ["{text}"]
max_inflight = 3
max_queue = 3
policy = "queue"
queue_timeout = "20s"
request_timeout = "60s"

[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions"]
upstreams = ["{audio}"]
max_inflight = 1
max_queue = 1
policy = "queue"
queue_timeout = "20s"
request_timeout = "60s"
"#,
        port = BOX_PORTS[i],
        agent = AGENT_PORTS[i],
        text = text.url(),
        audio = audio.url(),
    )
}

fn spawn_box(config: &Path, port: u16) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .arg("serve")
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("headroom serve starts");
    let p = Proc(Some(child));
    wait_port(port, Duration::from_secs(20));
    p
}

impl HeadroomBox {
    async fn start(index: usize, dir: &Path) -> HeadroomBox {
        let text = serve_upstream::start().await;
        let audio = serve_upstream::start().await;
        let config = dir.join(format!("box{}.toml", index + 1));
        std::fs::write(&config, box_config(index, &text, &audio)).unwrap();
        let proc = spawn_box(&config, BOX_PORTS[index]);
        wait_port(AGENT_PORTS[index], Duration::from_secs(10));
        HeadroomBox {
            index,
            config,
            proc,
            text,
            audio,
        }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", BOX_PORTS[self.index])
    }

    fn restart(&mut self) {
        self.proc.kill9();
        self.proc = spawn_box(&self.config, BOX_PORTS[self.index]);
        wait_port(AGENT_PORTS[self.index], Duration::from_secs(10));
    }

    /// Requests its engines have seen (admitted by this box), with start times.
    fn seen(&self) -> Vec<serve_upstream::Seen> {
        let mut v = self.text.log.all();
        v.extend(self.audio.log.all());
        v
    }
}

/// The agent's line, asked the way HAProxy asks (connect, read one line).
fn agent_line(port: u16) -> String {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return "unreachable".into();
    };
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut line = String::new();
    let _ = s.read_to_string(&mut line);
    line.trim().to_string()
}

/// The weight in an `up ready W%` line, 0 for anything else.
fn agent_weight(line: &str) -> u32 {
    line.strip_prefix("up ready ")
        .and_then(|w| w.strip_suffix('%'))
        .and_then(|w| w.parse().ok())
        .unwrap_or(0)
}

/// A running HAProxy with its stats socket.
struct Haproxy {
    _proc: Proc,
    stats: PathBuf,
    front: u16,
}

/// `deploy/haproxy.cfg` with the agent check stripped (the "agent off" comparison).
fn without_agent(cfg: &str) -> String {
    let mut out = String::new();
    let mut stripped = 0;
    for line in cfg.lines() {
        let mut l = line.to_string();
        if l.trim_start().starts_with("default-server") && l.contains(" agent-check") {
            l = l
                .replace(" agent-check", "")
                .replace(" agent-inter 500ms", "");
            stripped += 1;
        }
        if l.trim_start().starts_with("server ")
            && let Some(at) = l.find(" agent-port")
        {
            l.truncate(at);
            stripped += 1;
        }
        out.push_str(&l);
        out.push('\n');
    }
    assert_eq!(stripped, 4, "deploy/haproxy.cfg changed shape:\n{cfg}");
    assert!(
        !out.lines()
            .any(|l| !l.trim_start().starts_with('#') && l.contains("agent")),
        "{out}"
    );
    out
}

/// The environment `deploy/haproxy.cfg` reads; returns the stats socket's path.
fn haproxy_env(cmd: &mut Command, dir: &Path, front: u16) -> PathBuf {
    static STARTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stats = dir.join(format!("haproxy-{front}-{n}.sock"));
    cmd.env("HEADROOM_FRONT", format!("127.0.0.1:{front}"))
        .env("HEADROOM_STATS", &stats);
    for i in 0..3 {
        cmd.env(
            format!("BOX{}", i + 1),
            format!("127.0.0.1:{}", BOX_PORTS[i]),
        )
        .env(format!("AGENT{}", i + 1), AGENT_PORTS[i].to_string());
    }
    stats
}

impl Haproxy {
    fn start(bin: &Path, cfg: &Path, dir: &Path, front: u16) -> Haproxy {
        let mut cmd = Command::new(bin);
        cmd.arg("-db")
            .arg("-f")
            .arg(cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let stats = haproxy_env(&mut cmd, dir, front);
        let p = Proc(Some(cmd.spawn().expect("haproxy starts")));
        wait_port(front, Duration::from_secs(10));
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while std::os::unix::net::UnixStream::connect(&stats).is_err() {
            assert!(std::time::Instant::now() < until, "no stats socket");
            std::thread::sleep(Duration::from_millis(20));
        }
        Haproxy {
            _proc: p,
            stats,
            front,
        }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.front)
    }

    fn command(&self, cmd: &str) -> String {
        let mut s = std::os::unix::net::UnixStream::connect(&self.stats).expect("stats socket");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(format!("{cmd}\n").as_bytes()).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    /// `show stat` as rows of (svname → column → value) for the `boxes` backend.
    fn stat(&self) -> BTreeMap<String, BTreeMap<String, String>> {
        let text = self.command("show stat");
        let mut lines = text.lines();
        let header: Vec<String> = lines
            .next()
            .unwrap_or_default()
            .trim_start_matches("# ")
            .split(',')
            .map(String::from)
            .collect();
        let mut rows = BTreeMap::new();
        for l in lines {
            let cols: Vec<&str> = l.split(',').collect();
            if cols.first() != Some(&"boxes") {
                continue;
            }
            let row: BTreeMap<String, String> = header
                .iter()
                .zip(cols.iter())
                .map(|(h, v)| (h.clone(), v.to_string()))
                .collect();
            rows.insert(cols[1].to_string(), row);
        }
        rows
    }

    fn num(&self, server: &str, col: &str) -> u64 {
        self.stat()
            .get(server)
            .and_then(|r| r.get(col))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    /// Waits until HAProxy sees every box `UP` (bounded).
    fn wait_all_up(&self, within: Duration) {
        let until = std::time::Instant::now() + within;
        loop {
            let s = self.stat();
            let up = (1..=3).all(|i| {
                s.get(&format!("box{i}"))
                    .is_some_and(|r| r.get("status").is_some_and(|v| v.starts_with("UP")))
            });
            if up {
                return;
            }
            assert!(std::time::Instant::now() < until, "boxes not UP: {s:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The printed summary: each line is printed as it comes (so a failing run shows it too) and
/// again at the end.
#[derive(Default)]
struct Table(Vec<String>);

impl Table {
    fn push(&mut self, line: String) {
        println!("{line}");
        self.0.push(line);
    }
}

/// What one client request ended as.
#[derive(Debug, Clone)]
struct Outcome {
    kind: &'static str,
    status: Option<u16>,
    retry_after: bool,
    /// Some body bytes had arrived when it ended (a stream that had started).
    started: bool,
    complete: bool,
    timed_out: bool,
    error: Option<String>,
}

const KINDS: [&str; 3] = ["chat", "stream", "audio"];

async fn one_request(c: &reqwest::Client, base: &str, kind: &'static str, id: &str) -> Outcome {
    let rb = match kind {
        "chat" => c
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-test-chunks", "4")
            .header("x-test-interval-ms", "60")
            .body(crate::serve::chat_body(false)),
        "stream" => c
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("x-test-chunks", "6")
            .header("x-test-interval-ms", "50")
            .body(crate::serve::chat_body(true)),
        _ => {
            // A tenth of a second of audio (1.6 kB): well inside HAProxy's buffer, so an L7 retry
            // can replay it.
            let (ct, body) = multipart_body(Some(&crate::serve::wav(0.1)), "whisper-1");
            c.post(format!("{base}/v1/audio/transcriptions"))
                .header("content-type", ct)
                .header("x-test-delay-ms", "200")
                .body(body)
        }
    };
    let rb = rb.header("x-test-id", id);
    let mut out = Outcome {
        kind,
        status: None,
        retry_after: false,
        started: false,
        complete: false,
        timed_out: false,
        error: None,
    };
    let run = async {
        let mut r = match rb.send().await {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(format!("send: {e:?}"));
                return;
            }
        };
        out.status = Some(r.status().as_u16());
        out.retry_after = r.headers().contains_key("retry-after");
        let mut body = Vec::new();
        loop {
            match r.chunk().await {
                Ok(Some(b)) => {
                    out.started = true;
                    body.extend_from_slice(&b);
                }
                Ok(None) => break,
                Err(e) => {
                    out.error = Some(format!("body: {e}"));
                    return;
                }
            }
        }
        let text = String::from_utf8_lossy(&body);
        out.complete = match (out.status, kind) {
            (Some(200), "stream") => text.contains("data: [DONE]"),
            (Some(200), _) => text.trim_end().ends_with('}'),
            _ => true,
        };
    };
    if tokio::time::timeout(CLIENT_TIMEOUT, run).await.is_err() {
        out.timed_out = true;
    }
    out
}

/// `workers` clients in a loop through `base` until `for_` has passed (or `max` requests),
/// kinds in turn.
async fn load(base: &str, workers: usize, for_: Duration, max: usize, tag: &str) -> Vec<Outcome> {
    let c = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let until = Instant::now() + for_;
    let out = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for w in 0..workers {
        let (c, base, out, tag) = (c.clone(), base.to_string(), out.clone(), tag.to_string());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < until && n < max / workers {
                let kind = KINDS[(w + n) % KINDS.len()];
                let o = one_request(&c, &base, kind, &format!("{tag}-{w}-{n}")).await;
                out.lock().unwrap().push(o);
                n += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    Arc::try_unwrap(out).unwrap().into_inner().unwrap()
}

/// Fills box `b`'s lanes by sending it long requests directly (bypassing HAProxy); the returned
/// tasks hold them until aborted.
fn fill_box(b: &HeadroomBox) -> Vec<tokio::task::JoinHandle<()>> {
    let c = client();
    let mut tasks = Vec::new();
    // text: 3 in flight + 3 queued; audio: 1 + 1. Each held for up to 40 s.
    for i in 0..8 {
        let (c, base) = (c.clone(), b.base());
        tasks.push(tokio::spawn(async move {
            let rb = if i < 6 {
                c.post(format!("{base}/v1/chat/completions"))
                    .header("content-type", "application/json")
                    .header("x-test-delay-ms", "40000")
                    .body(crate::serve::chat_body(false))
            } else {
                let (ct, body) = multipart_body(Some(&crate::serve::wav(0.5)), "whisper-1");
                c.post(format!("{base}/v1/audio/transcriptions"))
                    .header("content-type", ct)
                    .header("x-test-delay-ms", "40000")
                    .body(body)
            };
            let _ = tokio::time::timeout(Duration::from_secs(45), rb.send()).await;
        }));
    }
    tasks
}

/// Seconds since the start, and each box's agent line then.
type AgentSample = (f64, [String; 3]);

/// Polls every agent port every 250 ms until stopped.
struct AgentPoller {
    samples: Arc<Mutex<Vec<AgentSample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: Option<std::thread::JoinHandle<()>>,
}

impl AgentPoller {
    fn start(t0: std::time::Instant) -> AgentPoller {
        let samples = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, st) = (samples.clone(), stop.clone());
        let task = std::thread::spawn(move || {
            while !st.load(std::sync::atomic::Ordering::Relaxed) {
                let lines = AGENT_PORTS.map(agent_line);
                s.lock().unwrap().push((t0.elapsed().as_secs_f64(), lines));
                std::thread::sleep(Duration::from_millis(250));
            }
        });
        AgentPoller {
            samples,
            stop,
            task: Some(task),
        }
    }

    fn finish(mut self) -> Vec<AgentSample> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.task.take() {
            let _ = t.join();
        }
        self.samples.lock().unwrap().clone()
    }
}

impl Drop for AgentPoller {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Waits until box `i`'s agent says a weight within `ok` (bounded), returning the last line.
async fn wait_agent(i: usize, within: Duration, ok: impl Fn(u32) -> bool) -> String {
    let until = Instant::now() + within;
    loop {
        let line = tokio::task::spawn_blocking(move || agent_line(AGENT_PORTS[i]))
            .await
            .unwrap();
        if ok(agent_weight(&line)) || Instant::now() >= until {
            return line;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// HAProxy's `stot` (sessions sent) per box.
fn sent_per_box(h: &Haproxy) -> [u64; 3] {
    [1, 2, 3].map(|i| h.num(&format!("box{i}"), "stot"))
}

fn delta(after: [u64; 3], before: [u64; 3]) -> [u64; 3] {
    [0, 1, 2].map(|i| after[i].saturating_sub(before[i]))
}

fn summarise(name: &str, outcomes: &[Outcome]) -> String {
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for o in outcomes {
        let what = if o.timed_out {
            "TIMEOUT".to_string()
        } else if let Some(e) = &o.error {
            format!(
                "error({})",
                if e.starts_with("send") {
                    "send"
                } else {
                    "body"
                }
            )
        } else {
            format!("{}", o.status.unwrap_or(0))
        };
        *by.entry(format!("{}:{what}", o.kind)).or_default() += 1;
    }
    format!("{name}: {} requests {by:?}", outcomes.len())
}

/// A non-streamed request that failed on its way (not a clean HTTP answer, or a 5xx without
/// Retry-After, or anything but 200 for a `chat`/`audio` in a phase that must lose nothing).
fn non_stream_errors(outcomes: &[Outcome]) -> usize {
    outcomes
        .iter()
        .filter(|o| o.kind != "stream")
        .filter(|o| o.timed_out || o.error.is_some() || o.status != Some(200) || !o.complete)
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn haproxy_picks_the_box_with_room_and_loses_nothing_when_a_box_dies() {
    let _serial = SERIAL.lock().await;
    let Some(bin) = require_haproxy() else {
        return;
    };
    let t0 = std::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let shipped = repo_file("deploy/haproxy.cfg");
    let no_agent_cfg = dir.path().join("haproxy-no-agent.cfg");
    std::fs::write(
        &no_agent_cfg,
        without_agent(&std::fs::read_to_string(&shipped).unwrap()),
    )
    .unwrap();
    // `haproxy -c` accepts both files with the environment the test gives them.
    for cfg in [&shipped, &no_agent_cfg] {
        let mut check = Command::new(&bin);
        check.arg("-c").arg("-f").arg(cfg);
        haproxy_env(&mut check, dir.path(), FRONT);
        let out = check.output().unwrap();
        assert!(
            out.status.success(),
            "haproxy -c {}: {}",
            cfg.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut boxes = Vec::new();
    for i in 0..3 {
        boxes.push(HeadroomBox::start(i, dir.path()).await);
    }
    let poller = AgentPoller::start(t0);
    let h = Haproxy::start(&bin, &shipped, dir.path(), FRONT);
    h.wait_all_up(Duration::from_secs(15));
    let mut table = Table::default();

    // Warm-up: mixed work over all three boxes.
    let before = sent_per_box(&h);
    let warm = load(&h.base(), 6, Duration::from_secs(3), 120, "warm").await;
    let warm_sent = delta(sent_per_box(&h), before);
    table.push(summarise("warm-up (agent on)", &warm));
    table.push(format!("warm-up sent per box: {warm_sent:?}"));
    assert_eq!(non_stream_errors(&warm), 0, "{warm:?}");
    assert!(
        warm_sent.iter().all(|&n| n > 0),
        "every idle box gets work: {warm_sent:?}"
    );

    // a) Box 1 made busy (lanes full, by direct requests): its agent weight drops to ~1 %, and
    // new work goes to the others.
    let fill = fill_box(&boxes[0]);
    let line = wait_agent(0, Duration::from_secs(10), |w| w > 0 && w <= 5).await;
    assert!(
        agent_weight(&line) <= 5 && agent_weight(&line) > 0,
        "box1 full, agent says {line:?}"
    );
    // HAProxy has taken the weight (agent-inter 500 ms).
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while h.num("box1", "weight") > 5 && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    let weight_seen = h.num("box1", "weight");
    let before = sent_per_box(&h);
    let busy_on = load(&h.base(), 6, Duration::from_secs(4), 160, "on").await;
    let on_sent = delta(sent_per_box(&h), before);
    table.push(format!(
        "box1 full, agent ON  (HAProxy weight of box1 {weight_seen}): sent per box {on_sent:?}"
    ));
    table.push(summarise("  agent ON", &busy_on));

    // The same with the agent check off (a copy of the file without the agent options).
    drop(h);
    let h_off = Haproxy::start(&bin, &no_agent_cfg, dir.path(), FRONT_NO_AGENT);
    h_off.wait_all_up(Duration::from_secs(15));
    let before = sent_per_box(&h_off);
    let busy_off = load(&h_off.base(), 6, Duration::from_secs(4), 160, "off").await;
    let off_sent = delta(sent_per_box(&h_off), before);
    table.push(format!(
        "box1 full, agent OFF (HAProxy weight of box1 {}): sent per box {off_sent:?}",
        h_off.num("box1", "weight")
    ));
    table.push(summarise("  agent OFF", &busy_off));
    let off_retries = (
        h_off.num("BACKEND", "wretr"),
        h_off.num("BACKEND", "wredis"),
    );
    drop(h_off);
    for t in &fill {
        t.abort();
    }
    let share = |s: [u64; 3]| s[0] as f64 / (s.iter().sum::<u64>().max(1)) as f64;
    table.push(format!(
        "share of new work to the full box1: agent ON {:.1} %, agent OFF {:.1} % (HAProxy retried {} and redispatched {} of its 503s with the agent off)",
        100.0 * share(on_sent),
        100.0 * share(off_sent),
        off_retries.0,
        off_retries.1
    ));
    assert_eq!(
        non_stream_errors(&busy_on),
        0,
        "with the agent on, no client sees the full box: {busy_on:?}"
    );
    assert!(
        share(on_sent) < 0.10,
        "the full box gets little new work with the agent on: {on_sent:?}"
    );
    assert!(
        share(off_sent) > 2.0 * share(on_sent) + 0.10,
        "the full box gets measurably more new work with the agent off: on {on_sent:?}, off {off_sent:?}"
    );
    // Box 1 empties again (the held requests were dropped) and its weight comes back.
    let line = wait_agent(0, Duration::from_secs(15), |w| w >= 90).await;
    assert!(agent_weight(&line) >= 90, "box1 idle again: {line:?}");

    // b) Box 2 killed with SIGKILL mid-run, then restarted on the same ports.
    let h = Haproxy::start(&bin, &shipped, dir.path(), FRONT);
    h.wait_all_up(Duration::from_secs(15));
    let base = h.base();
    let run =
        tokio::spawn(async move { load(&base, 6, Duration::from_secs(5), 300, "kill").await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let inflight_on_box2 = boxes[1].seen().iter().filter(|s| s.ended.is_none()).count();
    boxes[1].proc.kill9();
    let killed_at = Instant::now();
    let killed = run.await.unwrap();
    table.push(format!(
        "box2 killed (SIGKILL) with {inflight_on_box2} requests on its engines"
    ));
    table.push(summarise("  during the kill", &killed));
    let lost: Vec<&Outcome> = killed
        .iter()
        .filter(|o| !(o.kind == "stream" && o.started))
        .filter(|o| {
            o.timed_out
                || o.error.is_some()
                || !(o.status == Some(200) && o.complete || o.status == Some(503) && o.retry_after)
        })
        .collect();
    let timeouts = killed.iter().filter(|o| o.timed_out).count();
    let cut_streams = killed
        .iter()
        .filter(|o| o.kind == "stream" && o.started && !o.complete)
        .count();
    table.push(format!(
        "  lost before streaming: {}, streams cut after their first byte: {cut_streams}, timeouts: {timeouts}",
        lost.len()
    ));
    assert_eq!(timeouts, 0, "no request hung: {killed:?}");
    assert!(
        lost.is_empty(),
        "every request that had not started streaming was retried or answered 503 + Retry-After: {lost:?}"
    );
    let backend = |h: &Haproxy, c: &str| h.num("BACKEND", c);
    table.push(format!(
        "  HAProxy retries (wretr) {}, redispatches (wredis) {}, box2 status {:?}",
        backend(&h, "wretr"),
        backend(&h, "wredis"),
        h.stat().get("box2").and_then(|r| r.get("status").cloned())
    ));

    boxes[1].restart();
    let restarted = Instant::now();
    h.wait_all_up(Duration::from_secs(15));
    let before = sent_per_box(&h);
    let back = load(&h.base(), 6, Duration::from_secs(3), 120, "back").await;
    let back_sent = delta(sent_per_box(&h), before);
    let box2_engine_after = boxes[1]
        .seen()
        .iter()
        .filter(|s| s.started > restarted)
        .count();
    table.push(format!(
        "box2 back after {:.1} s: sent per box {back_sent:?}, box2's engines saw {box2_engine_after} new requests",
        restarted.duration_since(killed_at).as_secs_f64()
    ));
    table.push(summarise("  after the restart", &back));
    assert_eq!(non_stream_errors(&back), 0, "{back:?}");
    assert!(
        back_sent[1] > 0 && box2_engine_after > 0,
        "the restarted box gets work again: {back_sent:?}"
    );
    let retries_total = backend(&h, "wretr") + backend(&h, "wredis");

    // Requests per box as their engines saw them, against what clients sent.
    let engine_counts: Vec<usize> = boxes.iter().map(|b| b.seen().len()).collect();
    drop(h);
    let samples = poller.finish();
    println!(
        "\n=== scale-out through HAProxy ({:.1} s) ===",
        t0.elapsed().as_secs_f64()
    );
    for l in &table.0 {
        println!("{l}");
    }
    println!(
        "requests seen by each box's engines (incl. direct fill): {engine_counts:?}; HAProxy retries+redispatches since the restart of HAProxy: {retries_total}"
    );
    println!(
        "agent weights over time ({} samples; s: box1 | box2 | box3):",
        samples.len()
    );
    // One sample per second (the poller asks every 250 ms).
    let mut last_second = -1;
    for (t, lines) in &samples {
        if (*t as i64) > last_second {
            last_second = *t as i64;
            println!("  {t:6.2}: {}", lines.join(" | "));
        }
    }
    for b in &mut boxes {
        b.proc.kill9();
    }
}

/// The ORCA TEXT syntax (as Envoy's ORCA parser reads the `endpoint-load-metrics` header):
/// `TEXT ` then comma-separated `key=value`, keys among the ORCA load report's fields or
/// `named_metrics.<name>`, values numbers; utilisations in 0..1.
fn check_orca(value: &str) -> Result<BTreeMap<String, f64>, String> {
    let rest = value
        .strip_prefix("TEXT ")
        .ok_or_else(|| format!("not TEXT format: {value:?}"))?;
    const KNOWN: [&str; 5] = [
        "cpu_utilization",
        "mem_utilization",
        "application_utilization",
        "rps_fractional",
        "eps",
    ];
    let mut out = BTreeMap::new();
    for pair in rest.split(',') {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| format!("{pair:?} is not key=value"))?;
        let known = KNOWN.contains(&k)
            || k.strip_prefix("named_metrics.").is_some_and(|n| {
                !n.is_empty()
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            });
        if !known {
            return Err(format!("unknown key {k:?}"));
        }
        let x: f64 = v
            .parse()
            .map_err(|_| format!("{k}={v:?} is not a number"))?;
        if !x.is_finite() || x < 0.0 {
            return Err(format!("{k}={x} is not a finite non-negative number"));
        }
        if k.ends_with("_utilization") && x > 1.0 {
            return Err(format!("{k}={x} is outside 0..1"));
        }
        if out.insert(k.to_string(), x).is_some() {
            return Err(format!("{k} twice"));
        }
    }
    Ok(out)
}

#[test]
fn the_orca_checker_rejects_what_envoy_would_not_read() {
    assert!(check_orca("TEXT application_utilization=0.5,named_metrics.q=3").is_ok());
    assert!(check_orca("application_utilization=0.5").is_err());
    assert!(check_orca("TEXT application_utilization=1.5").is_err());
    assert!(check_orca("TEXT utilization=0.5").is_err());
    assert!(check_orca("TEXT named_metrics.q=three").is_err());
    assert!(check_orca("TEXT rps_fractional=1;eps=2").is_err());
}

async fn wait_for(within: Duration, mut ok: impl AsyncFnMut() -> bool) -> Option<Duration> {
    let t = Instant::now();
    while t.elapsed() < within {
        if ok().await {
            return Some(t.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// c) `/readyz` is "can serve", not "is busy": 200 throughout while the lane answers 429, and
/// 503 within one check interval (HAProxy's `inter 1s`) once the lane's only upstream is down.
/// The ORCA header on real responses follows the ORCA TEXT syntax and shows the full lane.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_stays_up_under_saturation_and_drops_when_the_lane_cannot_serve() {
    let _serial = SERIAL.lock().await;
    // An engine that can be taken down: graceful shutdown closes idle keep-alive connections too.
    let up_log = serve_upstream::start().await;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let engine_addr = listener.local_addr().unwrap();
    let forward = up_log.url();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .fallback(move |req: axum::extract::Request| {
            // Everything else goes to the logging fake engine (delays, chunks).
            let forward = forward.clone();
            async move {
                let (parts, body) = req.into_parts();
                let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
                let c = reqwest::Client::builder().no_proxy().build().unwrap();
                let mut rb = c.post(format!("{forward}{}", parts.uri.path()));
                for (k, v) in parts.headers.iter() {
                    if k.as_str().starts_with("x-test") || k == "content-type" {
                        rb = rb.header(k, v);
                    }
                }
                let r = rb.body(body).send().await.unwrap();
                let status = r.status();
                (status, r.bytes().await.unwrap())
            }
        });
    let engine = tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = stop_rx.await;
            })
            .await;
    });
    let fake = Upstream {
        addr: engine_addr,
        log: up_log.log.clone(),
        metrics_text: up_log.metrics_text.clone(),
    };
    let agent_port = 20850;
    let g = gateway(&format!(
        "{}[balancer]\nagent_listen = \"127.0.0.1:{agent_port}\"\nload_header = true\ninterval = \"200ms\"\n",
        text_lane(
            &fake,
            "max_inflight = 1\nmax_queue = 0\npolicy = \"reject\"\nrequest_timeout = \"30s\""
        )
    ))
    .await;
    let base = format!("http://{}", g.addr);
    let c = client();
    let hold = {
        let (c, base) = (c.clone(), base.clone());
        tokio::spawn(async move {
            c.post(format!("{base}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("x-test-delay-ms", "2500")
                .body(crate::serve::chat_body(false))
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    crate::serve::wait_lane(&c, &base, "text", Duration::from_secs(5), |l| {
        l["inflight"] == 1
    })
    .await;
    // Saturated: new work is 429, /readyz stays 200 on every probe, the agent says the box is
    // full but up, and the ORCA header says so too.
    let mut rejected = 0;
    let mut orca_full = None;
    for _ in 0..10 {
        let r = c
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(crate::serve::chat_body(false))
            .send()
            .await
            .unwrap();
        if r.status() == 429 {
            rejected += 1;
            assert!(r.headers().contains_key("retry-after"));
        }
        let header = r
            .headers()
            .get("endpoint-load-metrics")
            .expect("ORCA header on a 429")
            .to_str()
            .unwrap()
            .to_string();
        let fields = check_orca(&header).unwrap_or_else(|e| panic!("{e}: {header}"));
        assert!(fields.contains_key("application_utilization"), "{header}");
        assert!(fields.contains_key("rps_fractional"), "{header}");
        assert!(fields.contains_key("named_metrics.queue_depth"), "{header}");
        orca_full = Some(fields);
        let ready = c.get(format!("{base}/readyz")).send().await.unwrap();
        assert_eq!(ready.status(), 200, "/readyz flapped under saturation");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(rejected, 10, "the lane was full");
    let full = orca_full.unwrap();
    assert!(
        full["application_utilization"] >= 0.99,
        "full lane: {full:?}"
    );
    let line = tokio::task::spawn_blocking(move || agent_line(agent_port))
        .await
        .unwrap();
    assert_eq!(line, "up ready 1%", "full but serving");
    assert_eq!(hold.await.unwrap().unwrap(), 200);
    // Idle again: the header on a real 200 response parses and shows room.
    let r = crate::serve::chat(&c, &base, "idle", &[], false).await;
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = crate::serve::chat(&c, &base, "idle2", &[], true).await;
    let header = r.headers()["endpoint-load-metrics"]
        .to_str()
        .unwrap()
        .to_string();
    let idle = check_orca(&header).unwrap_or_else(|e| panic!("{e}: {header}"));
    assert!(idle["application_utilization"] < 0.5, "{header}");
    r.bytes().await.unwrap();

    // The lane's only engine goes down: /readyz 503 within one check interval (1 s).
    let _ = stop_tx.send(());
    tokio::time::timeout(Duration::from_secs(5), engine)
        .await
        .expect("engine stops")
        .unwrap();
    let down_in = wait_for(Duration::from_secs(1), async || {
        c.get(format!("{base}/readyz"))
            .send()
            .await
            .unwrap()
            .status()
            == 503
    })
    .await;
    let agent_down_in = wait_for(Duration::from_secs(1), async || {
        tokio::task::spawn_blocking(move || agent_line(agent_port))
            .await
            .unwrap()
            .starts_with("down#")
    })
    .await;
    println!("readyz 503 after {down_in:?}, agent down# after {agent_down_in:?}");
    assert!(down_in.is_some(), "/readyz did not go 503 within 1 s");
    assert!(
        agent_down_in.is_some(),
        "agent did not say down# within 1 s: {}",
        agent_line(agent_port)
    );
    g.shutdown().await.unwrap();
}
