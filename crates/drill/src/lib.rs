//! headroom-drill: runs a night against a box and reports what happened (`headroom drill`).
//!
//! The box runs under `headroom up` ([`upbox`]) or is set up by hand ([`handset`]: the same
//! engines, a fixed share for the text engine, clients straight to the engines, inside a memory
//! cgroup of the same limit, [`limit`]). The night file ([`scenario`]) gives the mix of requests
//! ([`payload`], sent by [`client`] as the OpenAI SDK sends them) and the faults ([`faults`]);
//! [`night`] keeps the clock — each stream measured alone first, then rounds of traffic with
//! quiet gaps — while [`watch`] reads memory once a second. [`report`] turns the records into
//! figures and verdicts (JSON, Markdown) and [`timeline`] draws the night.
//!
//! Arrows: drill → up (box file, process groups, flags), bench (SSE timing, arrivals, SVG),
//! gpu (process-tree memory, leak verdict), plan (units). Nothing points back.

pub mod boxes;
pub mod client;
pub mod cpu;
pub mod faults;
pub mod handset;
pub mod limit;
pub mod night;
pub mod payload;
pub mod report;
pub mod scenario;
pub mod timeline;
pub mod upbox;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_up::boxfile::{BoxConfig, ProbeKind};

use crate::boxes::{Mode, Running};
use crate::client::{Record, Shape, Target};
use crate::faults::{FaultContext, FaultRecord};
use crate::handset::{HandSetBox, HandSetPlan};
use crate::night::{Lane, Traffic};
use crate::report::{Evidence, ExitReport, Expect, MemoryReport, Report};
use crate::scenario::Night;
use crate::upbox::UpBox;

/// Why a drill could not run (a night that ran and broke a verdict is not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DrillError {
    /// Flags or files that cannot be used (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// The machine cannot run the drill (exit 2).
    #[error("{0}")]
    Environment(String),
    /// The box failed to start or broke down (exit 1).
    #[error("{0}")]
    Box(String),
}

impl DrillError {
    pub fn exit_code(&self) -> u8 {
        match self {
            DrillError::Box(_) => 1,
            _ => 2,
        }
    }
}

/// What to switch off in the box under `up`, to show the verdicts can fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Without {
    /// Memory admission: audio lanes admit without a memory need (`gpu_memory_per_job = 0`,
    /// nothing learned).
    Admission,
    /// The text engine's sizing: `up` starts it with the flags a user who sizes it by hand gives,
    /// the article's fixed share of the pool ([`handset::ARTICLE_SHARE`], the same arithmetic as
    /// the box set up by hand), instead of the ones it computes from what the audio backends
    /// need (`headroom up --text-sized-by-hand`).
    Sizing,
}

impl Without {
    pub fn as_str(self) -> &'static str {
        match self {
            Without::Admission => "without memory admission",
            Without::Sizing => "without sizing",
        }
    }
}

/// Everything one drill needs.
#[derive(Clone)]
pub struct DrillOptions {
    pub box_path: PathBuf,
    pub scenario_path: PathBuf,
    pub duration: Duration,
    pub report_dir: PathBuf,
    pub hand_set: Option<PathBuf>,
    /// Default: hold for `up`, the page for the box set up by hand.
    pub expect: Option<Expect>,
    /// The `headroom` binary (for `up` and the co-tenant).
    pub exe: PathBuf,
    /// More arguments for `headroom up`.
    pub up_args: Vec<String>,
    pub api_key: Option<String>,
    /// Parts of headroom switched off (one or more).
    pub without: Vec<Without>,
    /// Overrides the night file's `[idle] requests`.
    pub idle_requests: Option<u32>,
    /// Longest wait for the box to be ready.
    pub ready_timeout: Duration,
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}

impl std::fmt::Debug for DrillOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrillOptions")
            .field("box_path", &self.box_path)
            .field("scenario_path", &self.scenario_path)
            .field("duration", &self.duration)
            .finish_non_exhaustive()
    }
}

/// A finished drill: its report and the files written.
#[derive(Debug)]
pub struct DrillOutcome {
    pub report: Report,
    pub files: Vec<PathBuf>,
}

fn api_key_of(config: &BoxConfig) -> Option<String> {
    config
        .serve
        .top
        .get("api_keys")
        .and_then(|k| k.as_array())
        .and_then(|a| a.first())
        .and_then(|k| k.as_str())
        .map(str::to_string)
}

/// Writes a copy of the box file beside it with memory admission switched off; returns its path.
fn variant_box(config: &BoxConfig, box_path: &Path) -> Result<PathBuf, DrillError> {
    let text = std::fs::read_to_string(box_path)
        .map_err(|e| DrillError::BadInput(format!("cannot read {}: {e}", box_path.display())))?;
    let mut doc: toml::Table = text
        .parse()
        .map_err(|e| DrillError::BadInput(format!("{}: {e}", box_path.display())))?;
    let serve = doc
        .entry("serve")
        .or_insert_with(|| toml::Value::Table(Default::default()));
    let lanes = serve
        .as_table_mut()
        .ok_or_else(|| DrillError::BadInput("[serve] is not a table".into()))?
        .entry("lanes")
        .or_insert_with(|| toml::Value::Table(Default::default()));
    let lanes = lanes
        .as_table_mut()
        .ok_or_else(|| DrillError::BadInput("[serve.lanes] is not a table".into()))?;
    for b in config.audio() {
        let t = lanes
            .entry(b.name.clone())
            .or_insert_with(|| toml::Value::Table(Default::default()));
        if let Some(t) = t.as_table_mut() {
            t.insert("gpu_memory_per_job".into(), toml::Value::Integer(0));
            t.insert(
                "gpu_memory_per_audio_second".into(),
                toml::Value::Integer(0),
            );
            t.insert("max_audio_seconds".into(), toml::Value::Float(3600.0));
            t.insert("learn".into(), toml::Value::Boolean(false));
        }
    }
    let stem = box_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "box".into());
    // Beside the original: relative paths in it resolve from the same folder.
    let path = box_path.with_file_name(format!(".{stem}.drill-without-admission.toml"));
    std::fs::write(&path, toml::to_string(&doc).unwrap_or_default())
        .map_err(|e| DrillError::Environment(format!("{}: {e}", path.display())))?;
    Ok(path)
}

/// `up`'s arguments that switch its sizing off: the text engine's flags for the article's share
/// of the pool.
fn sized_by_hand(config: &BoxConfig) -> Result<Vec<String>, DrillError> {
    let text = config.text().ok_or_else(|| {
        DrillError::BadInput("--without sizing: the box has no text engine to size".into())
    })?;
    let (args, env) = handset::share_flags(config, text, handset::ARTICLE_SHARE)?;
    // One argument each (`--flag=value`): the value starts with a dash.
    let mut up = vec![format!("--text-sized-by-hand={}", args.join(" "))];
    for (k, v) in env {
        up.push(format!("--text-sized-by-hand-env={k}={v}"));
    }
    Ok(up)
}

/// Requests of `stream` measured idle: the night file's count for a stream judged against its
/// idle figure (`p99_vs_idle`: every audio stream), one for a stream whose idle figure is only
/// shown (a text stream's p99 beside its idle figure is reported, not judged), which spares a
/// night minutes of long prompts on a quiet box.
fn idle_requests(stream: &scenario::Stream, requested: u32) -> u32 {
    if stream.p99_vs_idle.is_some() {
        requested
    } else {
        requested.min(1)
    }
}

fn shapes(night: &Night) -> Result<Vec<Shape>, DrillError> {
    night
        .streams
        .iter()
        .map(|s| {
            Ok(Shape {
                kind: s.kind,
                model: s.model.clone(),
                body: payload::body_of(s).map_err(DrillError::BadInput)?,
                streamed: s.payload.streams(),
            })
        })
        .collect()
}

/// Runs the drill; `cancel` turning true ends the night after the current round.
pub async fn run(
    opts: DrillOptions,
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<DrillOutcome, DrillError> {
    let say = Arc::clone(&opts.progress);
    let mut night = Night::load(&opts.scenario_path).map_err(|e| DrillError::BadInput(e.0))?;
    if let Some(n) = opts.idle_requests {
        night.idle_requests = n;
    }
    let night = Arc::new(night);
    let config =
        BoxConfig::load(&opts.box_path).map_err(|e| DrillError::BadInput(e.to_string()))?;
    let plan = match &opts.hand_set {
        Some(p) => Some(HandSetPlan::load(p)?),
        None => None,
    };
    if !opts.without.is_empty() && plan.is_some() {
        return Err(DrillError::BadInput(
            "--without switches off a part of headroom: it applies to the box under up, not the one set up by hand".into(),
        ));
    }
    let mut backend_names = Vec::new();
    for s in &night.streams {
        backend_names.push(
            boxes::backend_for(&config, s)
                .map_err(DrillError::BadInput)?
                .name
                .clone(),
        );
    }
    let shapes = Arc::new(shapes(&night)?);
    std::fs::create_dir_all(&opts.report_dir)
        .map_err(|e| DrillError::Environment(format!("{}: {e}", opts.report_dir.display())))?;
    let log_dir = opts.report_dir.join("logs");
    std::fs::create_dir_all(&log_dir)
        .map_err(|e| DrillError::Environment(format!("{}: {e}", log_dir.display())))?;
    let capacity = config.memory.capacity.unwrap_or(0);
    let host_pool = config.memory.probe == ProbeKind::Host;
    let clock = Instant::now();

    // The box.
    let mut variant_file = None;
    let running = match &plan {
        Some(plan) => {
            let limit: Arc<dyn limit::MemoryLimit> = if host_pool {
                let name = opts
                    .box_path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default();
                Arc::new(
                    limit::hand_set_cgroup(&name, capacity, say.as_ref())
                        .map_err(DrillError::Environment)?,
                )
            } else {
                return Err(DrillError::BadInput(
                    "the box set up by hand is drilled on the host pool (probe = \"host\"); on a GPU the card itself is the limit: run the engines there by hand and drill through their ports".into(),
                ));
            };
            say(&format!("drill: [hand-set] {}", limit.describe()));
            Running::HandSet(
                HandSetBox::start(&config, plan.clone(), limit, &log_dir, clock, say.as_ref())
                    .await?,
            )
        }
        None => {
            let box_path = if opts.without.contains(&Without::Admission) {
                let p = variant_box(&config, &opts.box_path)?;
                say(&format!(
                    "drill: [up] {}: box file {}",
                    Without::Admission.as_str(),
                    p.display()
                ));
                variant_file = Some(p.clone());
                p
            } else {
                opts.box_path.clone()
            };
            let key = opts.api_key.clone().or_else(|| api_key_of(&config));
            // The same limit as the box set up by hand: on the host pool, up enforces capacity
            // (a memory cgroup) whether or not the box file says so.
            let mut up_args = opts.up_args.clone();
            if host_pool && !config.memory.enforce && !up_args.iter().any(|a| a == "--enforce") {
                say("drill: [up] the host pool's capacity enforced (headroom up --enforce)");
                up_args.push("--enforce".into());
            }
            if opts.without.contains(&Without::Sizing) {
                let hand = sized_by_hand(&config)?;
                say(&format!(
                    "drill: [up] {}: the text engine sized by hand, the article's share ({}) of the pool: headroom up {}",
                    Without::Sizing.as_str(),
                    handset::ARTICLE_SHARE,
                    hand.join(" ")
                ));
                up_args.extend(hand);
            }
            let started = UpBox::start(
                &opts.exe,
                &box_path,
                &up_args,
                format!("http://{}", config.serve.listen),
                key,
                &log_dir,
                opts.ready_timeout,
                say.as_ref(),
            )
            .await;
            if let Some(p) = &variant_file
                && started.is_err()
            {
                let _ = std::fs::remove_file(p);
            }
            Running::Up(started?)
        }
    };
    let running = Arc::new(running);
    let mode = running.mode();
    say(&format!(
        "drill: [{}] box ready after {:.0} s",
        mode.as_str(),
        clock.elapsed().as_secs_f64()
    ));
    let result = drive(
        &opts,
        &night,
        &config,
        &running,
        &shapes,
        &backend_names,
        clock,
        cancel,
    )
    .await;
    // Stop the box whatever happened.
    let view = running.view().await;
    let mut box_pids: Vec<u32> = Vec::new();
    for b in &view.backends {
        if let Some(p) = b.pid {
            box_pids.extend(headroom_gpu::process_tree(p));
        }
    }
    let running =
        Arc::try_unwrap(running).map_err(|_| DrillError::Box("the box is still in use".into()))?;
    let (details, left_behind, exits) = match running {
        Running::Up(u) => {
            let stop = u.stop(&box_pids, Duration::from_secs(90)).await;
            say(&format!("drill: [up] stopped: {}", stop.exit));
            let left = stop.left_behind.clone();
            (serde_json::json!({"up": stop}), left, Vec::new())
        }
        Running::HandSet(h) => {
            let exits: Vec<ExitReport> = h
                .exits
                .lock()
                .expect("exits lock")
                .iter()
                .map(|e| ExitReport {
                    backend: e.backend.clone(),
                    at_s: e.at_s,
                    how: e.how.clone(),
                })
                .collect();
            let details = serde_json::json!({"hand_set": {
                "text_flags": h.text_flags,
                "restart": h.plan.restart,
                "restart_delay_s": h.plan.restart_delay.as_secs_f64(),
                "rationale": h.plan.rationale,
                "limit": h.limit().describe(),
            }});
            h.stop().await;
            (details, Vec::new(), exits)
        }
    };
    if let Some(p) = &variant_file {
        let _ = std::fs::remove_file(p);
    }
    let mut driven = result?;
    driven.exits.extend(exits);
    let report = finish(
        &opts,
        &night,
        mode,
        host_pool,
        driven,
        details,
        &left_behind,
        &backend_names,
    );
    let files = write(&opts.report_dir, &report.0, &report.1, &report.2, &night)?;
    Ok(DrillOutcome {
        report: report.0,
        files,
    })
}

/// What the night produced, before the figures.
struct Driven {
    records: Vec<Record>,
    faults: Vec<FaultRecord>,
    recorded: watch::Recorded,
    gaps: Vec<(f64, f64)>,
    /// The active part of a round, seconds.
    active_s: f64,
    night_start_s: f64,
    night_s: f64,
    oom_at_start: Option<u64>,
    busy_after_night: Vec<String>,
    exits: Vec<ExitReport>,
}

#[allow(clippy::too_many_arguments)]
async fn drive(
    opts: &DrillOptions,
    night: &Arc<Night>,
    config: &BoxConfig,
    running: &Arc<Running>,
    shapes: &Arc<Vec<Shape>>,
    backend_names: &[String],
    clock: Instant,
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<Driven, DrillError> {
    let say = Arc::clone(&opts.progress);
    let client = reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .build()
        .map_err(|e| DrillError::Environment(format!("HTTP client: {e}")))?;
    let api_key = match running.as_ref() {
        Running::Up(u) => u.api_key.clone(),
        Running::HandSet(_) => None,
    };
    let targets: Arc<Vec<Target>> = Arc::new(
        night
            .streams
            .iter()
            .zip(backend_names)
            .map(|(_, b)| {
                let backend = config
                    .backends
                    .iter()
                    .find(|x| &x.name == b)
                    .expect("mapped above");
                Target {
                    base: running.base_for(backend),
                    api_key: api_key.clone(),
                }
            })
            .collect(),
    );
    let co_tenant_pid = Arc::new(Mutex::new(None));
    let recorded = Arc::new(Mutex::new(watch::Recorded::default()));
    let (stop_watch, stop_rx) = tokio::sync::watch::channel(false);
    let watcher = tokio::spawn(watch::run(
        Arc::clone(running),
        clock,
        Duration::from_secs(1),
        Arc::clone(&co_tenant_pid),
        Arc::clone(&recorded),
        stop_rx,
    ));
    let oom_at_start = running.view().await.oom_kills;
    let records = Arc::new(Mutex::new(Vec::new()));
    let traffic = Traffic {
        client: client.clone(),
        clock,
        policy: night.client,
        records: Arc::clone(&records),
        seed: night.seed,
    };
    let lanes: Vec<Lane> = night
        .streams
        .iter()
        .enumerate()
        .map(|(i, s)| Lane {
            index: i,
            target: targets[i].clone(),
            shape: shapes[i].clone(),
            arrivals: s.arrivals,
            deadline: s.deadline,
            seq: Arc::new(AtomicU64::new(0)),
            sent: Arc::new(AtomicU64::new(0)),
            due: Arc::new(Mutex::new(match s.arrivals {
                scenario::Arrivals::Workers { workers, .. } => vec![None; workers as usize],
                scenario::Arrivals::Poisson { .. } | scenario::Arrivals::After { .. } => Vec::new(),
            })),
        })
        .collect();

    // Idle: each stream alone, one unmeasured warm-up per backend first.
    let mut warmed = std::collections::BTreeSet::new();
    for (i, lane) in lanes.iter().enumerate() {
        if *cancel.borrow() {
            break;
        }
        let warmup = u32::from(warmed.insert(backend_names[i].clone()));
        let n = idle_requests(&night.streams[i], night.idle_requests);
        say(&format!(
            "drill: idle {} ({n} request(s) one at a time)",
            night.streams[i].name
        ));
        traffic.idle(lane, warmup, n).await;
    }

    // The night.
    let schedule = night::schedule(night, opts.duration);
    let night_start = Instant::now();
    let night_start_s = clock.elapsed().as_secs_f64();
    say(&format!(
        "drill: night of {:.0} s: {} rounds of {:.0} s traffic + {:.0} s quiet",
        opts.duration.as_secs_f64(),
        schedule.rounds,
        schedule.active.as_secs_f64(),
        schedule.gap.as_secs_f64()
    ));
    let ctx = FaultContext {
        running: Arc::clone(running),
        client,
        night: Arc::clone(night),
        targets: Arc::clone(&targets),
        shapes: Arc::clone(shapes),
        clock,
        exe: opts.exe.clone(),
        capacity_bytes: config.memory.capacity.unwrap_or(0),
        night_length: opts.duration,
        co_tenant_pid: Arc::clone(&co_tenant_pid),
    };
    let fault_records = Arc::new(Mutex::new(Vec::new()));
    let mut fault_tasks = tokio::task::JoinSet::new();
    let mut gaps = Vec::new();
    let mut pending = Vec::new();
    for round in 0..schedule.rounds {
        if *cancel.borrow() {
            say("drill: interrupted; ending the night here");
            break;
        }
        let round_start = Instant::now();
        for &(r, offset, fi) in &schedule.faults {
            if r != round {
                continue;
            }
            let ctx = ctx.clone();
            let out = Arc::clone(&fault_records);
            let action = night.faults[fi].action.clone();
            let say = Arc::clone(&say);
            fault_tasks.spawn(async move {
                tokio::time::sleep_until((round_start + offset).into()).await;
                say(&format!("drill: fault {}", action.name()));
                let rec = ctx.run(&action).await;
                say(&format!("drill: fault {}: {}", rec.kind, rec.outcome));
                out.lock().expect("faults lock").push(rec);
            });
        }
        // The round's traffic runs on its own; the night waits for its answers at most a
        // third of a round, so a box that stalls cannot stretch the night without end. A gap's
        // floor is read once the last request in flight has its answer.
        let round_traffic = {
            let traffic = traffic.clone();
            let lanes = lanes.clone();
            let last = round + 1 == schedule.rounds;
            let active = schedule.active;
            tokio::spawn(async move { traffic.round(&lanes, round, active, last).await })
        };
        tokio::time::sleep(schedule.active).await;
        let drain = (schedule.active + schedule.gap) / 3;
        let mut round_traffic = round_traffic;
        if tokio::time::timeout(drain, &mut round_traffic)
            .await
            .is_err()
        {
            pending.push(round_traffic);
        }
        let quiet = clock.elapsed().as_secs_f64();
        tokio::time::sleep(schedule.gap).await;
        gaps.push((quiet, clock.elapsed().as_secs_f64()));
        say(&format!(
            "drill: round {}/{} done at {:.0} s ({} requests answered so far)",
            round + 1,
            schedule.rounds,
            night_start.elapsed().as_secs_f64(),
            records.lock().expect("records lock").len()
        ));
    }
    // The last answers (each bounded by its stream's deadline).
    for p in pending {
        let _ = p.await;
    }
    while fault_tasks.join_next().await.is_some() {}
    let night_s = night_start.elapsed().as_secs_f64();
    let busy_after_night = match running.as_ref() {
        Running::Up(u) => busy_lanes(u).await,
        Running::HandSet(_) => Vec::new(),
    };
    // A last reading, then the watcher stops.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let _ = stop_watch.send(true);
    let _ = watcher.await;
    let recorded = std::mem::take(&mut *recorded.lock().expect("recorder lock"));
    let records = std::mem::take(&mut *records.lock().expect("records lock"));
    let faults = std::mem::take(&mut *fault_records.lock().expect("faults lock"));
    let exits = recorded
        .changes
        .iter()
        .filter(|c| c.from.is_some())
        .map(|c| ExitReport {
            backend: c.backend.clone(),
            at_s: c.t_s,
            how: format!(
                "PID {} replaced by {:?} (restarted)",
                c.from.unwrap_or(0),
                c.to
            ),
        })
        .filter(|_| matches!(running.as_ref(), Running::Up(_)))
        .collect();
    Ok(Driven {
        records,
        faults,
        recorded,
        gaps,
        active_s: schedule.active.as_secs_f64(),
        night_start_s,
        night_s,
        oom_at_start,
        busy_after_night,
        exits,
    })
}

/// Lanes of the gateway with requests in flight or queued, and memory reservations left, once
/// every request of the night is answered.
async fn busy_lanes(u: &UpBox) -> Vec<String> {
    // The gateway releases a slot as the answer ends; give it a moment.
    for _ in 0..10 {
        let Ok(v) = u.lanes().await else {
            return Vec::new();
        };
        let mut busy = Vec::new();
        for l in v
            .get("lanes")
            .and_then(|l| l.as_array())
            .into_iter()
            .flatten()
        {
            let n = |k: &str| l.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
            if n("inflight") > 0 || n("queued") > 0 {
                busy.push(format!(
                    "{} (inflight {}, queued {})",
                    l.get("name").and_then(|x| x.as_str()).unwrap_or("?"),
                    n("inflight"),
                    n("queued")
                ));
            }
        }
        for m in v
            .get("memory")
            .and_then(|m| m.as_array())
            .into_iter()
            .flatten()
        {
            let r = m.get("reservations").and_then(|x| x.as_u64()).unwrap_or(0);
            if r > 0 {
                busy.push(format!("memory reservations {r}"));
            }
        }
        if busy.is_empty() {
            return busy;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        if u.lanes().await.is_err() {
            return busy;
        }
    }
    match u.lanes().await {
        Ok(_) => vec!["lanes still busy 5 s after the night".into()],
        Err(_) => Vec::new(),
    }
}

#[allow(clippy::too_many_arguments)]
fn finish(
    opts: &DrillOptions,
    night: &Night,
    mode: Mode,
    host_pool: bool,
    d: Driven,
    details: serde_json::Value,
    left_behind: &[u32],
    backend_names: &[String],
) -> (Report, Vec<Record>, Vec<(f64, f64)>) {
    let lanes = report::lanes(night, backend_names, &d.records);
    let (refusals, bare, served_after, lost) = report::refusal_counts(&d.records);
    let samples = &d.recorded.samples;
    let oom_end = samples
        .iter()
        .rev()
        .find_map(|s| s.oom_kills)
        .or(d.recorded.last.oom_kills);
    let oom_kills = match (oom_end, d.oom_at_start) {
        (Some(e), Some(s)) => Some(e.saturating_sub(s)),
        (Some(e), None) => Some(e),
        _ => None,
    };
    let enforced =
        d.recorded.limit_bytes.is_some() && samples.iter().any(|s| s.pool_bytes.is_some());
    // The quiet part of each gap: from the last answer of a request still in flight when it
    // began (none is sent in a gap) to its end; empty when a request outlived the gap.
    let quiet: Vec<(f64, f64)> = d
        .gaps
        .iter()
        .map(|&(a, b)| {
            let from = d
                .records
                .iter()
                .filter(|r| r.round.is_some() && r.sent_s() < b && r.ended_s() > a)
                .map(Record::ended_s)
                .fold(a, f64::max);
            if from < b {
                (from, b)
            } else {
                (f64::NAN, f64::NAN)
            }
        })
        .collect();
    let stitched = watch::stitched_floors(samples, &d.recorded.changes, &quiet);
    let floors: Vec<u64> = stitched.iter().map(|(_, f, _)| *f).collect();
    let floors_f: Vec<f64> = stitched
        .iter()
        .map(|(_, f, shift)| *f as f64 + *shift as f64)
        .collect();
    // Each round's throughput: its completed requests per second of its active part.
    let thr: Vec<f64> = stitched
        .iter()
        .map(|(i, _, _)| {
            let ok = d
                .records
                .iter()
                .filter(|r| r.round == Some(*i as u32) && r.outcome == client::Final::Ok)
                .count();
            ok as f64 / d.active_s.max(1e-9)
        })
        .collect();
    let (leak_verdict, leak, leak_reason) = match headroom_gpu::verdict(&floors_f, &thr) {
        Ok(l) => (l.verdict.to_string(), Some(l.clone()), l.reason.clone()),
        Err(e) => ("inconclusive".to_string(), None, e.to_string()),
    };
    let goodput = report::text_goodput(night, &d.records, d.night_s);
    let ev = Evidence {
        mode,
        host_pool,
        enforced,
        oom_kills,
        lost,
        refusals,
        refusals_without_retry_after: bare,
        leak_verdict: &leak_verdict,
        leak_reason: &leak_reason,
        night_s: d.night_s,
        text_goodput: goodput,
        lanes: &lanes,
        left_behind,
        busy_after_night: &d.busy_after_night,
    };
    let verdicts = report::verdicts(&ev);
    let page = report::page_shown(&ev);
    let expect = opts.expect.unwrap_or(match mode {
        Mode::Up => Expect::Hold,
        Mode::HandSet => Expect::Page,
    });
    let passed = match expect {
        Expect::Hold => verdicts.iter().all(|v| v.holds),
        Expect::Page => page,
    };
    let night_samples: Vec<_> = samples
        .iter()
        .filter(|s| s.t_s >= d.night_start_s)
        .collect();
    let slowest = report::slowest(
        night,
        &d.records,
        &lanes,
        &d.faults,
        &d.exits,
        d.night_start_s,
    );
    let report = Report {
        schema_version: 1,
        tool: "headroom drill",
        mode,
        variant: (!opts.without.is_empty()).then(|| {
            opts.without
                .iter()
                .map(|w| w.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        }),
        box_file: opts.box_path.display().to_string(),
        scenario: night.name.clone(),
        scenario_file: opts.scenario_path.display().to_string(),
        duration_s: opts.duration.as_secs_f64(),
        night_s: d.night_s,
        night_start_s: d.night_start_s,
        expect,
        passed,
        page_shown: page,
        verdicts,
        oom_kills,
        lost,
        refusals,
        refusals_without_retry_after: bare,
        retries_after_retry_after_served: served_after,
        leak_verdict,
        leak,
        leak_reason,
        text_goodput_tokens_per_second: goodput,
        lanes,
        memory: MemoryReport {
            limit_bytes: d.recorded.limit_bytes,
            enforced,
            peak_pool_bytes: night_samples.iter().filter_map(|s| s.pool_bytes).max(),
            peak_backends_bytes: night_samples
                .iter()
                .filter_map(|s| s.backends_total())
                .max(),
            floors_bytes: floors,
            restarts: d.recorded.changes.clone(),
        },
        slowest,
        exits: d.exits,
        faults: d.faults,
        busy_after_night: d.busy_after_night,
        box_details: details,
        samples: d.recorded.samples,
        windows: report::windows(
            night,
            &d.records,
            cpu::windows(
                &d.recorded.cpu,
                &cpu::bounds(d.night_start_s, d.night_s),
                cpu::ticks_per_second(),
            ),
            d.night_start_s,
        ),
        cores: std::thread::available_parallelism().map_or(1, usize::from),
        cpu_samples: d.recorded.cpu,
    };
    (report, d.records, d.gaps)
}

fn write(
    dir: &Path,
    report: &Report,
    records: &[Record],
    gaps: &[(f64, f64)],
    night: &Night,
) -> Result<Vec<PathBuf>, DrillError> {
    let io = |p: &Path, e: std::io::Error| DrillError::Environment(format!("{}: {e}", p.display()));
    let json = dir.join("report.json");
    let text =
        serde_json::to_string_pretty(report).map_err(|e| DrillError::Environment(e.to_string()))?;
    std::fs::write(&json, text).map_err(|e| io(&json, e))?;
    let md = dir.join("report.md");
    std::fs::write(&md, report::markdown(report)).map_err(|e| io(&md, e))?;
    let svg = dir.join("timeline.svg");
    let names: Vec<String> = night.streams.iter().map(|s| s.name.clone()).collect();
    std::fs::write(&svg, timeline::svg(report, records, gaps, &names)).map_err(|e| io(&svg, e))?;
    let jsonl = dir.join("requests.jsonl");
    let mut lines = String::new();
    for r in records {
        let mut v = serde_json::to_value(r).unwrap_or_default();
        v["lane"] = serde_json::Value::String(names.get(r.stream).cloned().unwrap_or_default());
        lines.push_str(&v.to_string());
        lines.push('\n');
    }
    std::fs::write(&jsonl, lines).map_err(|e| io(&jsonl, e))?;
    Ok(vec![json, md, svg, jsonl])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Attempt, End, Final};

    fn opts() -> DrillOptions {
        DrillOptions {
            box_path: "box.toml".into(),
            scenario_path: "night.toml".into(),
            duration: Duration::from_secs(60),
            report_dir: "out".into(),
            hand_set: None,
            expect: None,
            exe: "headroom".into(),
            up_args: Vec::new(),
            api_key: None,
            without: Vec::new(),
            idle_requests: None,
            ready_timeout: Duration::from_secs(1),
            progress: Arc::new(|_| {}),
        }
    }

    #[test]
    fn streams_judged_on_their_idle_figure_are_measured_idle_as_often_as_asked() {
        let night = Night::parse(
            r#"
name = "n"
[[stream]]
name = "speech"
kind = "speech"
chars = 80
per_minute = 4
[[stream]]
name = "rewrite"
kind = "chat"
input_tokens = 1800
max_tokens = 256
per_minute = 1
[[stream]]
name = "judged"
kind = "chat"
input_tokens = 10
max_tokens = 10
per_minute = 1
p99_vs_idle = 3
"#,
            Path::new("/"),
        )
        .unwrap();
        let counts: Vec<u32> = night.streams.iter().map(|s| idle_requests(s, 5)).collect();
        assert_eq!(counts, [5, 1, 5]);
        assert_eq!(idle_requests(&night.streams[1], 0), 0);
    }

    fn ok(stream: usize, round: Option<u32>, start: f64, secs: f64) -> Record {
        Record {
            stream,
            seq: 0,
            round,
            attempts: vec![Attempt {
                start_s: start,
                secs,
                end: End::Ok {
                    tokens: Some(20),
                    first_s: Some(0.1),
                },
            }],
            outcome: Final::Ok,
        }
    }

    /// The issue's top-level fields, and each lane's, are in report.json under these names.
    #[test]
    fn the_report_json_has_the_stable_fields() {
        let night = Night::parse(
            r#"
name = "n"
rounds = 6
[[stream]]
name = "dictation"
kind = "transcription"
clip = "c.wav"
per_minute = 6
[[stream]]
name = "cleanup"
kind = "chat"
workers = 1
"#,
            Path::new("/"),
        )
        .unwrap();
        let mut records = vec![ok(0, None, 0.0, 0.3), ok(1, None, 1.0, 2.0)];
        let mut samples = Vec::new();
        let mut gaps = Vec::new();
        for r in 0..6u32 {
            let t = 10.0 + 10.0 * f64::from(r);
            records.push(ok(0, Some(r), t, 0.35));
            records.push(ok(1, Some(r), t, 2.5));
            for k in 0..3 {
                samples.push(watch::MemSample {
                    t_s: t + 7.0 + f64::from(k),
                    backends: [
                        ("whisper".to_string(), Some(200 << 20)),
                        ("llm".to_string(), Some(500 << 20)),
                    ]
                    .into_iter()
                    .collect(),
                    pool_bytes: Some(720 << 20),
                    co_tenant_bytes: None,
                    oom_kills: Some(0),
                });
            }
            gaps.push((t + 6.5, t + 9.5));
        }
        // CPU read every 10 s: whisper uses half a second of it each time (5 % of a core), the
        // machine one second (10 %), of which 2 % stolen.
        let tps = cpu::ticks_per_second() as u64;
        let cpu_samples: Vec<cpu::CpuSample> = (0..8u64)
            .map(|i| cpu::CpuSample {
                t_s: 5.0 + 10.0 * i as f64,
                trees: [(
                    "whisper".to_string(),
                    Some(cpu::TreeCpu {
                        root: 7,
                        ticks: i * tps / 2,
                        major_faults: 0,
                        minor_faults: 0,
                    }),
                )]
                .into_iter()
                .collect(),
                machine: Some(cpu::MachineCpu {
                    busy: i * tps,
                    idle: i * tps * 18,
                    iowait: 0,
                    steal: i * tps / 5,
                }),
                cgroup: None,
            })
            .collect();
        let driven = Driven {
            records,
            faults: Vec::new(),
            recorded: watch::Recorded {
                samples,
                changes: Vec::new(),
                last: boxes::View::default(),
                limit_bytes: Some(1 << 30),
                cpu: cpu_samples,
            },
            gaps,
            active_s: 6.0,
            night_start_s: 9.0,
            night_s: 60.0,
            oom_at_start: Some(0),
            busy_after_night: Vec::new(),
            exits: Vec::new(),
        };
        let names = ["whisper".to_string(), "llm".to_string()];
        let (report, _, _) = finish(
            &opts(),
            &night,
            Mode::Up,
            true,
            driven,
            serde_json::json!({}),
            &[],
            &names,
        );
        let v = serde_json::to_value(&report).unwrap();
        for k in [
            "oom_kills",
            "lost",
            "refusals",
            "refusals_without_retry_after",
            "retries_after_retry_after_served",
            "leak_verdict",
            "text_goodput_tokens_per_second",
            "lanes",
            "verdicts",
            "passed",
        ] {
            assert!(v.get(k).is_some(), "{k} missing");
        }
        for lane in ["dictation", "cleanup"] {
            for k in [
                "requests",
                "ok",
                "p50_s",
                "p95_s",
                "p99_s",
                "idle_p50_s",
                "p99_ratio_to_idle",
            ] {
                assert!(v["lanes"][lane].get(k).is_some(), "{lane}.{k} missing");
            }
        }
        assert_eq!(v["oom_kills"], 0);
        assert_eq!(v["lanes"]["dictation"]["requests"], 6);
        assert_eq!(v["leak_verdict"], "no_leak", "{}", v["leak_reason"]);
        // 6 rounds × 20 tokens over a 60 s night.
        assert!((v["text_goodput_tokens_per_second"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert_eq!(
            v["passed"],
            true,
            "{}",
            serde_json::to_string_pretty(&v["verdicts"]).unwrap()
        );
        // The Markdown and the timeline are drawn from it.
        let md = report::markdown(&report);
        assert!(md.contains("| dictation | transcription | 6 | 6 |"), "{md}");
        // The night (60 s from 9 s) in three windows of 20 s: each lane's median in each, and
        // whisper's 5 % of a core beside the machine's other 5 % and 2 % stolen.
        let w = &v["windows"];
        assert_eq!(w.as_array().unwrap().len(), 3, "{w}");
        assert_eq!(w[0]["from_s"], 0.0);
        assert_eq!(w[2]["to_s"], 60.0);
        assert_eq!(w[1]["lanes_p50_s"]["dictation"], 0.35);
        assert_eq!(w[1]["lanes_p50_s"]["cleanup"], 2.5);
        assert!((w[1]["cpu"]["percent_of_core"]["whisper"].as_f64().unwrap() - 5.0).abs() < 1e-9);
        assert!((w[1]["cpu"]["other_percent"].as_f64().unwrap() - 5.0).abs() < 1e-9);
        assert!((w[1]["cpu"]["steal_percent"].as_f64().unwrap() - 2.0).abs() < 1e-9);
        assert!(md.contains("## By window of the night"), "{md}");
        assert!(md.contains("| 20–40 s | 2.50 | 0.35 |"), "{md}");
        let svg = timeline::svg(&report, &[], &[], &["dictation".into(), "cleanup".into()]);
        assert!(svg.starts_with("<?xml") && svg.trim_end().ends_with("</svg>"));
    }
}
