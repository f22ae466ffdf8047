//! The sequence: check everything that can be checked before starting anything (ports,
//! commands, files), start the audio backends in order and measure each (steady idle, warm-up
//! peak sampled at ≥ 20 Hz), compute the text engine's budget and flags, start it and compare its
//! start-up log with the plan, keep the figures in the calibration file, then serve with derived
//! lanes; meanwhile restart backends that exit (exponential backoff; their lane answers 503 +
//! Retry-After until healthy) and report memory drift; on shutdown stop the gateway first, then
//! the text engine, then the audio backends in reverse order, each by process group.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use headroom_gpu::calibration::{
    BackendCalibration, Calibration, ContentionFigures, calibration_path_for,
};
use headroom_gpu::{
    EnforcedPool, GpuProbe, HostPool, NvmlProbe, Sample, Sampler, SamplerConfig, process_tree,
};
use headroom_server::admin_box::{BackendReport, BackendState, BoxProvider, BoxReport};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::UpError;
use crate::audio_vllm;
use crate::boxfile::{BackendConfig, BoxConfig, Engine, ProbeKind, Warmup, resolve_model};
use crate::budget::{AudioFootprint, Budget, CoTenants, JobRoom, mib};
use crate::cgroup::{BoxCgroup, Exit, exit_reason};
use crate::contention::{self, Contention};
use crate::flags::{self, TextFlags};
use crate::kept::{kept_figures_apply, one_job_agrees};
use crate::lanes::{LaneFigures, serve_config, text_slots};
use crate::logs::LogDir;
use crate::process::{self, Group};
use crate::steady::{SteadyRule, judge};
use crate::warmup;

/// How `up` runs.
#[derive(Clone)]
pub struct UpOptions {
    /// The box file (the calibration file sits beside it).
    pub box_path: PathBuf,
    /// Measure again even when a calibration file exists.
    pub recalibrate: bool,
    /// Where backend logs go (default: a `NAME.log` per backend in a fresh private folder
    /// under the temporary directory, removed at a clean stop unless `keep_logs`).
    pub log_dir: Option<PathBuf>,
    /// Keep the default log folder after a clean stop.
    pub keep_logs: bool,
    /// Receives one line per step, as it happens.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}

/// The box's state as `/admin/box` shows it.
pub struct BoxStatus {
    report: Mutex<BoxReport>,
}

impl BoxStatus {
    fn lock(&self) -> MutexGuard<'_, BoxReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, name: &str, f: impl FnOnce(&mut BackendReport)) {
        let mut report = self.lock();
        if let Some(b) = report.backends.iter_mut().find(|b| b.name == name) {
            f(b);
        }
    }
}

impl BoxProvider for BoxStatus {
    fn report(&self) -> BoxReport {
        self.lock().clone()
    }
}

/// Memory readings of the pool: the probe, the sampler over it, and how a backend's bytes are
/// found in a sample.
struct Meter {
    kind: ProbeKind,
    device: u32,
    capacity: u64,
    /// The card as vLLM sees it (NVML total − reserved); the capacity on the host pool.
    device_total: u64,
    pool: Option<HostPool>,
    sampler: Sampler,
}

impl Meter {
    /// The backend rooted at `root` in one sample: its member row on the host pool, the sum of
    /// its tree's processes on a GPU.
    fn bytes_in(&self, sample: &Sample, tree: &[u32]) -> u64 {
        match self.kind {
            ProbeKind::Host => tree
                .first()
                .map_or(0, |&root| sample.process_used_bytes(root)),
            ProbeKind::Nvml => tree.iter().map(|&p| sample.process_used_bytes(p)).sum(),
        }
    }

    fn tree(&self, root: u32) -> Vec<u32> {
        match self.kind {
            ProbeKind::Host => vec![root],
            ProbeKind::Nvml => process_tree(root),
        }
    }

    /// `(ts_ms, bytes)` of the backend rooted at `root` since `since_ms`.
    fn series(&self, root: u32, since_ms: u64) -> Vec<(u64, u64)> {
        let tree = self.tree(root);
        self.sampler
            .since(since_ms)
            .iter()
            .filter(|s| s.gpu == self.device)
            .map(|s| (s.ts_ms, self.bytes_in(s, &tree)))
            .collect()
    }

    /// The highest reading of the backend rooted at `root` since `since_ms`.
    fn highest(&self, root: u32, since_ms: u64) -> Option<u64> {
        self.series(root, since_ms).iter().map(|p| p.1).max()
    }

    fn now_bytes(&self, root: u32) -> u64 {
        let tree = self.tree(root);
        self.sampler
            .latest()
            .iter()
            .find(|s| s.gpu == self.device)
            .map_or(0, |s| self.bytes_in(s, &tree))
    }

    /// Makes a backend a member of the host pool under its upstream URL, the name `serve`'s
    /// memory feed gives the same process tree (so the two never count it twice).
    fn join(&self, upstream: &str, pid: u32) {
        if let Some(pool) = &self.pool {
            pool.set_member(upstream, pid);
        }
    }
}

/// A backend started during bring-up: its config, its process group, and the extra
/// arguments and environment it was started with (kept for restarts).
type Started = (BackendConfig, Group, Vec<String>, Vec<(String, String)>);

/// Resolves once the stop flag is set (and never when its sender is gone without setting it).
async fn stopped(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What was measured for one backend.
#[derive(Debug, Clone, PartialEq)]
struct Measured {
    /// Steady before its first job (now).
    idle: u64,
    /// The level it keeps between jobs.
    resident: u64,
    peak: u64,
    peak_per_audio_second: Option<f64>,
    /// A speech backend's seconds of speech per input character (its warm-up's answer).
    speech_seconds_per_char: Option<f64>,
    runs: u32,
    /// The figures (all but `idle`) are the calibration file's, unchanged.
    kept: Option<BackendCalibration>,
    /// The fastest warm-up job, when one ran now: the job alone.
    fastest_job: Option<Duration>,
}

struct Ctx {
    config: BoxConfig,
    opts: UpOptions,
    meter: Meter,
    status: Arc<BoxStatus>,
    client: reqwest::Client,
    logs: LogDir,
    started_ms: u64,
    /// The memory cgroup every backend runs in (`[memory] enforce`).
    enforced: Option<BoxCgroup>,
}

impl Ctx {
    fn say(&self, line: &str) {
        (self.opts.progress)(line);
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.logs.file(name)
    }

    /// A clean stop: the run's private log folder goes unless kept.
    fn finish_logs(&self) {
        match self.logs.finish() {
            None => self.say("up: backend logs removed (--keep-logs or --log-dir keeps them)"),
            Some(dir) => self.say(&format!("up: backend logs kept in {}", dir.display())),
        }
    }

    /// How a backend that exited during start-up ended: named as an OOM kill where the box's
    /// cgroup counted one.
    fn how_it_ended(&self, status: std::process::ExitStatus) -> String {
        match self.enforced.as_ref().map(|c| c.judge_exit(Some(status))) {
            Some(Exit::OomKilled) => format!(
                "was killed by the kernel's OOM killer (the box's memory cgroup reached its limit of {})",
                mib(self.meter.capacity)
            ),
            _ => format!("exited ({status})"),
        }
    }
}

/// Runs the box until `shutdown` resolves (or a start-up step fails), then stops it in order.
pub async fn run<F>(config: BoxConfig, opts: UpOptions, shutdown: F) -> Result<(), UpError>
where
    F: Future<Output = ()> + Send + 'static,
{
    let (stop_tx, stop_rx) = watch::channel(false);
    let stop_tx = Arc::new(stop_tx);
    let trigger = Arc::clone(&stop_tx);
    let signal_task = tokio::spawn(async move {
        shutdown.await;
        let _ = trigger.send(true);
    });
    let result = run_inner(config, opts, stop_rx).await;
    signal_task.abort();
    result
}

async fn run_inner(
    config: BoxConfig,
    opts: UpOptions,
    stop: watch::Receiver<bool>,
) -> Result<(), UpError> {
    crate::checks::before_start(&config, &opts.box_path)?;
    preflight(&config)?;
    let listener = tokio::net::TcpListener::bind(config.serve.listen)
        .await
        .map_err(|e| UpError::PortTaken {
            backend: "serve".into(),
            port: config.serve.listen.port(),
            reason: e.to_string(),
        })?;
    let enforced = enforce_capacity(&config, &opts)?;
    let (meter, probe) = open_meter(&config, enforced.as_ref())?;
    let logs = LogDir::create(opts.log_dir.as_deref(), opts.keep_logs)?;
    let mut report = initial_report(&config, meter.capacity);
    report.enforce = enforced.as_ref().and_then(BoxCgroup::report);
    let status = Arc::new(BoxStatus {
        report: Mutex::new(report),
    });
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .map_err(|e| UpError::Serve(e.to_string()))?;
    let ctx = Arc::new(Ctx {
        config,
        opts,
        meter,
        status,
        client,
        logs,
        started_ms: now_ms(),
        enforced,
    });
    ctx.say(&format!(
        "up: memory pool {} ({}), capacity {}, margin {}, sampling every {} ms; backend logs in {}",
        ctx.meter.kind.as_str(),
        if let Some(c) = &ctx.enforced {
            format!(
                "enforced: every backend in the memory cgroup {} ({}), hard limit = capacity; the pool's use is its working set",
                c.dir().display(),
                c.cgroup().version().as_str()
            )
        } else if ctx.meter.kind == ProbeKind::Host {
            "process-tree PSS from /proc".to_string()
        } else {
            format!("GPU {}", ctx.meter.device)
        },
        mib(ctx.meter.capacity),
        mib(ctx.config.memory.margin),
        ctx.config.memory.sample_interval.as_millis(),
        ctx.logs.path().display()
    ));

    if let Some(w) = process::death_tie().warning() {
        ctx.say(&format!("up: warning: {w}"));
    }

    // Start-up: every group started is held here until a keeper takes it, so an error or a
    // stop request drops (and so kills) them all.
    let mut started: Vec<Started> = Vec::new();
    let bring_up = bring_up(&ctx, &mut started);
    let mut stop_wait = stop.clone();
    let outcome = tokio::select! {
        r = bring_up => Some(r),
        _ = stopped(&mut stop_wait) => None,
    };
    let lanes = match outcome {
        None => {
            ctx.say("up: stopped during start-up; stopping what was started");
            stop_all_started(&ctx, &mut started).await;
            ctx.finish_logs();
            return Ok(());
        }
        Some(Err(e)) => {
            stop_all_started(&ctx, &mut started).await;
            return Err(e);
        }
        Some(Ok(lanes)) => lanes,
    };

    let mut for_serve = ctx.config.clone();
    for_serve.memory.calibration = Some(calibration_file(&ctx.config, &ctx.opts.box_path));
    let serve = match serve_config(&for_serve, &lanes) {
        Ok(s) => s,
        Err(e) => {
            stop_all_started(&ctx, &mut started).await;
            return Err(e);
        }
    };
    let paused_by_signal = signal_paused_lanes(&ctx.config, &serve);
    let gateway = match headroom_server::Gateway::new(serve, Some(probe)) {
        Ok(g) => {
            let mut g = g.with_box(ctx.status.clone());
            for name in paused_by_signal {
                g = g.with_pause_hook(&name, pause_by_signal(Arc::clone(&ctx.status), &name));
            }
            match &ctx.meter.pool {
                Some(pool) => g.with_pool(pool.clone()),
                None => g,
            }
        }
        Err(e) => {
            stop_all_started(&ctx, &mut started).await;
            return Err(UpError::Serve(e.to_string()));
        }
    };

    // Keepers: one per backend, restarting it when it exits, stopping it when told.
    let mut keepers: Vec<(String, watch::Sender<bool>, JoinHandle<()>)> = Vec::new();
    for (backend, group, args, env) in started.drain(..) {
        let (tx, rx) = watch::channel(false);
        let name = backend.name.clone();
        let handle = tokio::spawn(keep(Arc::clone(&ctx), backend, group, args, env, rx));
        keepers.push((name, tx, handle));
    }
    let monitor = tokio::spawn(monitor(Arc::clone(&ctx)));

    let addr = listener
        .local_addr()
        .map_err(|e| UpError::Serve(e.to_string()))?;
    ctx.say(&format!(
        "up: box ready; gateway on http://{addr} (GET /admin/box for the figures); SIGTERM or Ctrl-C stops it"
    ));
    let mut gateway_stop = stop.clone();
    let served = gateway
        .serve(listener, async move {
            stopped(&mut gateway_stop).await;
        })
        .await;
    ctx.say("up: gateway stopped; stopping the text engine, then the audio backends");
    monitor.abort();
    // Text engine first (it is last in the list), then the audio backends in reverse order.
    for (name, tx, handle) in keepers.into_iter().rev() {
        let _ = tx.send(true);
        let _ = handle.await;
        ctx.say(&format!("up: [{name}] stopped"));
    }
    if let Some(c) = &ctx.enforced {
        match c.remove() {
            Ok(killed) if killed.is_empty() => {
                ctx.say(&format!("up: memory cgroup {} removed", c.dir().display()))
            }
            Ok(killed) => ctx.say(&format!(
                "up: memory cgroup {} removed; killed the processes still inside: {killed:?}",
                c.dir().display()
            )),
            Err(e) => ctx.say(&format!(
                "up: warning: could not remove the memory cgroup {}: {e}",
                c.dir().display()
            )),
        }
    }
    let served = served.map_err(|e| UpError::Serve(e.to_string()));
    if served.is_ok() {
        ctx.finish_logs();
    }
    served
}

/// The text lanes whose engine `up` pauses by signal: `preempt_mode = "pause"` on a backend with
/// no pause call of its own (llama.cpp; vLLM has its HTTP one).
fn signal_paused_lanes(config: &BoxConfig, serve: &headroom_server::ServeSettings) -> Vec<String> {
    serve
        .lanes
        .iter()
        .filter(|l| l.spec.preempt_mode == headroom_gate::PreemptMode::Pause)
        .filter(|l| {
            config
                .backends
                .iter()
                .any(|b| b.name == l.spec.name && b.engine == Engine::LlamaCpp)
        })
        .map(|l| l.spec.name.clone())
        .collect()
}

/// Pauses `backend` by stopping its process group (SIGSTOP) and resumes it (SIGCONT): the engine
/// stops between two instructions, every request stays where it is and goes on after. The group
/// is the one running now (a restarted backend has a new one); a failed signal is said once per
/// change.
fn pause_by_signal(status: Arc<BoxStatus>, backend: &str) -> headroom_server::pause::PauseHook {
    let backend = backend.to_string();
    Arc::new(move |pause: bool| {
        let pid = status
            .lock()
            .backends
            .iter()
            .find(|b| b.name == backend)
            .and_then(|b| b.pid);
        let Some(pid) = pid else { return };
        if let Err(e) = process::signal_group(pid, pause) {
            let what = if pause {
                "pause (SIGSTOP)"
            } else {
                "resume (SIGCONT)"
            };
            headroom_server::stderr::line(&format!(
                "up: [{backend}] could not {what} process group {pid}: {e}"
            ));
        }
    })
}

/// With `[memory] enforce`: the box's memory cgroup, limited to the capacity (stale ones of
/// earlier `up`s removed first). Fails with what is missing and how to enable it.
fn enforce_capacity(config: &BoxConfig, opts: &UpOptions) -> Result<Option<BoxCgroup>, UpError> {
    let m = &config.memory;
    if !m.enforce {
        return Ok(None);
    }
    let capacity = m
        .capacity
        .ok_or_else(|| UpError::Enforce("needs a capacity to enforce".into()))?;
    let name = opts
        .box_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "box".into());
    let say = |line: &str| (opts.progress)(line);
    BoxCgroup::create(&name, capacity, &say).map(Some)
}

/// Everything that can fail before a process starts: paths (see [`check_paths`]), then ports.
fn preflight(config: &BoxConfig) -> Result<(), UpError> {
    check_paths(config)?;
    for b in &config.backends {
        process::check_port_free(&b.name, b.port)?;
    }
    Ok(())
}

/// Every path the box names, as `up --check` checks them: each backend's program, its warm-up
/// file (readable), the models. A relative path that is missing is reported with the folder it
/// was taken from (the box file's).
pub fn check_paths(config: &BoxConfig) -> Result<(), UpError> {
    for b in &config.backends {
        process::check_command(b, &config.dir)?;
        if let Some(w) = &b.warmup {
            warmup::prepare(b, w)?;
        }
        if let Some(t) = &b.text {
            resolve_model(&config.dir, &t.model)?;
        }
        if let Some(a) = &b.audio_vllm {
            resolve_model(&config.dir, &a.model)?;
        }
    }
    Ok(())
}

fn open_meter(
    config: &BoxConfig,
    enforced: Option<&BoxCgroup>,
) -> Result<(Meter, Arc<dyn GpuProbe>), UpError> {
    let m = &config.memory;
    let (probe, pool, capacity, device_total): (Arc<dyn GpuProbe>, Option<HostPool>, u64, u64) =
        match m.probe {
            ProbeKind::Host => {
                let capacity = match m.capacity {
                    Some(c) => c,
                    None => headroom_gpu::host::host_mem_total()
                        .map_err(|e| UpError::Probe(format!("cannot read /proc/meminfo: {e}")))?,
                };
                let pool = HostPool::new(capacity);
                // The meter's sampler and serve's memory feed both poll the pool every
                // sample_interval: within half of it they share one reading of /proc.
                pool.share_readings_within(m.sample_interval / 2);
                // Co-tenants: the processes listening on the watched upstreams, with their trees.
                let ours: Vec<String> = config.backends.iter().map(|b| b.upstream()).collect();
                for url in m.watch.iter().filter(|u| !ours.contains(u)) {
                    if let Ok(pid) = headroom_gpu::url_listener(url) {
                        pool.set_member(url, pid);
                    }
                }
                // Enforced: the pool's use is the cgroup's charge, one read per sample.
                let probe: Arc<dyn GpuProbe> = match enforced {
                    Some(c) => Arc::new(EnforcedPool::new(pool.clone(), c.cgroup().clone())),
                    None => Arc::new(pool.clone()),
                };
                (probe, Some(pool), capacity, capacity)
            }
            ProbeKind::Nvml => {
                let nvml = NvmlProbe::new().map_err(|e| UpError::Probe(e.to_string()))?;
                let devices = nvml.snapshot().map_err(|e| UpError::Probe(e.to_string()))?;
                let device = devices
                    .iter()
                    .find(|d| d.index == m.device)
                    .ok_or_else(|| UpError::Probe(format!("no GPU with index {}", m.device)))?;
                let total = device.total_bytes.saturating_sub(device.reserved_bytes);
                (
                    Arc::new(nvml),
                    None,
                    m.capacity.unwrap_or(total).min(total),
                    total,
                )
            }
        };
    let sampler = Sampler::start(
        Arc::clone(&probe),
        SamplerConfig::new(config.memory.sample_interval).with_ring_capacity(16_384),
    )
    .map_err(|e| UpError::Probe(e.to_string()))?;
    Ok((
        Meter {
            kind: m.probe,
            device: m.device,
            capacity,
            device_total,
            pool,
            sampler,
        },
        probe,
    ))
}

fn initial_report(config: &BoxConfig, capacity: u64) -> BoxReport {
    BoxReport {
        probe: config.memory.probe.as_str().into(),
        capacity_bytes: capacity,
        margin_bytes: config.memory.margin,
        text_budget_bytes: 0,
        backends: config
            .backends
            .iter()
            .map(|b| BackendReport {
                name: b.name.clone(),
                role: b.role.as_str().into(),
                engine: b.engine.as_str().into(),
                pid: None,
                state: BackendState::Stopped,
                upstream: b.upstream(),
                resident_bytes: 0,
                peak_bytes: 0,
                current_bytes: 0,
                restarts: 0,
                start_failures: 0,
                last_exit: None,
                drifted: false,
                retry_after_ms: None,
                flags: Vec::new(),
                plan_check: None,
            })
            .collect(),
        enforce: None,
    }
}

async fn stop_all_started(ctx: &Ctx, started: &mut Vec<Started>) {
    while let Some((b, mut g, _, _)) = started.pop() {
        g.stop(b.stop_grace).await;
        ctx.status.update(&b.name, |r| {
            r.state = BackendState::Stopped;
            r.pid = None;
        });
    }
}

/// Starts and measures every backend; returns the figures the lanes are derived from.
async fn bring_up(ctx: &Arc<Ctx>, started: &mut Vec<Started>) -> Result<Vec<LaneFigures>, UpError> {
    let calibration_path = calibration_file(&ctx.config, &ctx.opts.box_path);
    let previous = if ctx.opts.recalibrate {
        None
    } else {
        match Calibration::load_if_present(&calibration_path) {
            Ok(c) => c,
            Err(e) => {
                ctx.say(&format!("up: ignoring the calibration file: {e}"));
                None
            }
        }
    };
    if let Some(p) = &previous {
        ctx.say(&format!(
            "up: starting from the figures measured {} in {} (--recalibrate measures again)",
            p.date,
            calibration_path.display()
        ));
    }
    let mut calibration = Calibration::new(ctx.meter.kind.as_str(), ctx.meter.capacity);
    if let Some(p) = &previous {
        // Needs learned above the level before each job (older versions) are learned again.
        calibration.learned = p
            .learned
            .iter()
            .filter(|(_, l)| l.between_jobs)
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
    }
    let mut lanes = Vec::new();
    let mut footprints = Vec::new();
    let mut alone = BTreeMap::new();
    // Contention figures stand while the audio figures they were measured with do.
    let mut kept_contention = BTreeMap::new();
    for b in ctx.config.audio() {
        let saved = previous.as_ref().and_then(|p| {
            let kept = p.backends.get(&b.name)?;
            Some((kept, p.versions.get(&b.name).map(String::as_str)))
        });
        // An audio vLLM pre-allocates: its flags are planned from what the pool has left now.
        let planned = match &b.audio_vllm {
            Some(_) => Some(audio_vllm_flags(ctx, b, started, &footprints)?),
            None => None,
        };
        let (args, env) = planned
            .as_ref()
            .map(|f| (f.args.clone(), f.env.clone()))
            .unwrap_or_default();
        let (group, m) = bring_up_audio(ctx, b, saved, &args, &env)
            .await
            .map_err(|e| e.0)?;
        if let Some(f) = &planned {
            let check = checked_against_plan(ctx, b, f, &group, m.resident, m.peak);
            ctx.status.update(&b.name, |r| {
                r.flags = shown_flags(f);
                r.plan_check = Some(check);
            });
        }
        started.push((b.clone(), group, args, env));
        if let Some(fastest) = m.fastest_job {
            alone.insert(b.name.clone(), fastest);
        }
        if let (Some(_), Some(c)) = (
            &m.kept,
            previous.as_ref().and_then(|p| p.contention.get(&b.name)),
        ) {
            kept_contention.insert(b.name.clone(), c.clone());
        }
        lanes.push(LaneFigures {
            speech_seconds_per_char: m.speech_seconds_per_char,
            ..LaneFigures::new(
                &b.name,
                m.peak.saturating_sub(m.resident),
                // An audio vLLM runs as many jobs at once as it has whole sequences.
                planned.as_ref().map_or(1, |f| f.sequences),
            )
        });
        footprints.push(AudioFootprint {
            name: b.name.clone(),
            resident_bytes: m.resident,
            peak_bytes: m.peak,
        });
        match &m.kept {
            // Kept as they are: only figures measured the same way (a warm-up) replace them.
            Some(kept) => {
                calibration.backends.insert(b.name.clone(), kept.clone());
            }
            None => calibration.set_backend(
                &b.name,
                BackendCalibration {
                    role: "audio".into(),
                    engine: b.engine.as_str().into(),
                    idle_bytes: Some(m.idle),
                    resident_bytes: m.resident,
                    peak_bytes: m.peak,
                    peak_per_audio_second_bytes: m.peak_per_audio_second,
                    speech_seconds_per_char: m.speech_seconds_per_char,
                    warmup_runs: m.runs,
                    date: String::new(),
                },
            ),
        }
        calibration
            .versions
            .insert(b.name.clone(), versions_seen(b));
    }
    if let Some(t) = ctx.config.text() {
        let mut cotenants = CoTenants::default();
        let roots: Vec<u32> = started.iter().map(|(_, g, _, _)| g.pid).collect();
        let trees: Vec<Vec<u32>> = roots.iter().map(|&r| ctx.meter.tree(r)).collect();
        cotenants.observe_samples(&ctx.meter.sampler.since(ctx.started_ms), |s| {
            trees.iter().map(|t| ctx.meter.bytes_in(s, t)).sum()
        });
        let budget = Budget::new(
            ctx.meter.capacity,
            &footprints,
            cotenants.max_bytes(),
            ctx.config.memory.margin,
        );
        ctx.say(&format!("up: [{}] budget: {}", t.name, budget.describe()));
        ctx.status.lock().text_budget_bytes = budget.text_bytes;
        let slots = text_sequences(ctx, t, &lanes);
        let text_flags = text_flags(ctx, t, &budget, &footprints, slots)?;
        ctx.say(&format!(
            "up: [{}] flags: {}",
            t.name,
            text_flags.describe()
        ));
        let (group, m) = bring_up_text(ctx, t, &text_flags).await?;
        ctx.status
            .update(&t.name, |r| r.flags = shown_flags(&text_flags));
        started.push((
            t.clone(),
            group,
            text_flags.args.clone(),
            text_flags.env.clone(),
        ));
        // The text engine fills its pages as its cache is used: count it at its plan.
        let text_held = m.resident.max(text_flags.expected.total_bytes);
        let room = JobRoom::new(
            ctx.meter.capacity,
            &footprints,
            text_held,
            cotenants.max_bytes(),
        );
        check_audio_room(ctx, &room, &lanes, &mut calibration)?;
        let (gives_way_to, preempt_settle) = text_beside_audio(
            ctx,
            t,
            &text_flags,
            &alone,
            &kept_contention,
            &mut calibration,
        )
        .await;
        lanes.push(LaneFigures {
            gives_way_to,
            preempt_settle,
            ..LaneFigures::new(&t.name, 0, text_flags.sequences)
        });
        calibration.set_backend(
            &t.name,
            BackendCalibration {
                role: "text".into(),
                engine: t.engine.as_str().into(),
                idle_bytes: None,
                resident_bytes: m.resident,
                peak_bytes: m.peak,
                peak_per_audio_second_bytes: None,
                speech_seconds_per_char: None,
                warmup_runs: 0,
                date: String::new(),
            },
        );
        calibration
            .versions
            .insert(t.name.clone(), versions_seen(t));
    }
    calibration
        .versions
        .insert("headroom".into(), env!("CARGO_PKG_VERSION").into());
    match calibration.save(&calibration_path) {
        Ok(()) => ctx.say(&format!(
            "up: figures kept in {}",
            calibration_path.display()
        )),
        Err(e) => ctx.say(&format!("up: warning: could not keep the figures: {e}")),
    }
    Ok(lanes)
}

/// Refuses a box in which an audio lane could never admit a job: its need (learned, where a
/// learned figure is kept, else measured) and the margin above what the pool can ever have free
/// for it ([`JobRoom`]). A learned need that does not fit where the measured one does is dropped
/// (learned again from real jobs) and said so.
fn check_audio_room(
    ctx: &Ctx,
    room: &JobRoom,
    lanes: &[LaneFigures],
    calibration: &mut Calibration,
) -> Result<(), UpError> {
    let margin = ctx.config.memory.margin;
    for f in lanes.iter().filter(|f| f.per_job_bytes > 0) {
        if let Some(l) = calibration.learned.get(&f.backend)
            && !room.admits(l.bytes_per_job, margin)
        {
            ctx.say(&format!(
                "up: [{}] the learned need {} and the margin {} cannot fit the room an audio job can ever find ({}); it is learned again from the measured {}",
                f.backend,
                mib(l.bytes_per_job),
                mib(margin),
                room.describe(),
                mib(f.per_job_bytes)
            ));
            calibration.learned.remove(&f.backend);
        }
        if !room.admits(f.per_job_bytes, margin) {
            return Err(UpError::DoesNotFit(format!(
                "backend `{}`: its lane could never admit a job: a job needs {} and the margin {}, and at most {} can ever be free for it ({}); options: raise [memory] capacity by {}, lower [memory] margin, a smaller text `max_parallel` or `context`",
                f.backend,
                mib(f.per_job_bytes),
                mib(margin),
                mib(room.room_bytes),
                room.describe(),
                mib((f.per_job_bytes + margin).saturating_sub(room.room_bytes))
            )));
        }
        ctx.say(&format!(
            "up: [{}] a job needs {} + margin {}; the most an audio job can find free: {}",
            f.backend,
            mib(f.per_job_bytes),
            mib(margin),
            room.describe()
        ));
    }
    Ok(())
}

/// The box's calibration file: `[memory] calibration`, else beside the box file.
pub fn calibration_file(config: &BoxConfig, box_path: &Path) -> PathBuf {
    config
        .memory
        .calibration
        .clone()
        .unwrap_or_else(|| calibration_path_for(box_path))
}

/// An audio backend's start-up failure, with its group (already stopped) out of the way.
struct StartFailure(UpError);

async fn bring_up_audio(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    saved: Option<(&BackendCalibration, Option<&str>)>,
    args: &[String],
    env: &[(String, String)],
) -> Result<(Group, Measured), StartFailure> {
    let mut group = start(ctx, b, args, env).await.map_err(StartFailure)?;
    let result = measure_audio(ctx, b, &mut group, saved).await;
    match result {
        Ok(m) => Ok((group, m)),
        Err(e) => {
            group.stop(b.stop_grace).await;
            Err(StartFailure(e))
        }
    }
}

/// Spawns a backend, makes it a member of the pool and waits until it is healthy.
async fn start(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    args: &[String],
    env: &[(String, String)],
) -> Result<Group, UpError> {
    // A crash loop stays visible while the next attempt runs (it may wait ready_timeout).
    ctx.status.update(&b.name, |r| {
        if r.state != BackendState::CrashLoop {
            r.state = BackendState::Starting;
        }
    });
    let procs = ctx.enforced.as_ref().map(|c| c.cgroup().procs_file());
    let log = ctx.log_path(&b.name);
    let mut group = process::spawn_in(b, args, env, &ctx.config.dir, &log, procs.as_deref())?;
    ctx.meter.join(&b.upstream(), group.pid);
    ctx.status.update(&b.name, |r| r.pid = Some(group.pid));
    ctx.say(&format!(
        "up: [{}] started pid {} ({} {}), waiting for {}{}",
        b.name,
        group.pid,
        b.command.display(),
        b.expanded_args()
            .into_iter()
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" "),
        b.upstream(),
        b.health
    ));
    let took = match wait_healthy(ctx, b, &mut group).await {
        Ok(t) => t,
        Err(e) => {
            group.stop(b.stop_grace).await;
            ctx.status.update(&b.name, |r| {
                r.state = BackendState::Failed;
                r.pid = None;
            });
            return Err(e);
        }
    };
    ctx.say(&format!(
        "up: [{}] healthy after {:.1} s",
        b.name,
        took.as_secs_f64()
    ));
    Ok(group)
}

async fn wait_healthy(
    ctx: &Ctx,
    b: &BackendConfig,
    group: &mut Group,
) -> Result<Duration, UpError> {
    let url = format!("{}{}", b.upstream(), b.health);
    let begin = Instant::now();
    loop {
        if let Some(status) = group.reap() {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "{} before it became healthy; last log line: {}",
                    ctx.how_it_ended(status),
                    last_line(group)
                ),
            });
        }
        if warmup::healthy(&ctx.client, &url, Duration::from_secs(2)).await {
            return Ok(begin.elapsed());
        }
        if begin.elapsed() > b.ready_timeout {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "did not become healthy at {url} within {} s (ready_timeout); last log line: {}",
                    b.ready_timeout.as_secs(),
                    last_line(group)
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn last_line(group: &Group) -> String {
    group
        .log_tail(1)
        .pop()
        .unwrap_or_else(|| format!("(empty; see {})", group.log.display()))
}

/// Waits until the backend's memory is steady; returns `(level, steady)`. On timeout the
/// latest level is used and `steady` is false (logged as a warning by the caller).
async fn wait_steady(
    ctx: &Ctx,
    b: &BackendConfig,
    group: &mut Group,
) -> Result<(u64, bool), UpError> {
    let rule = SteadyRule::new(b.steady_window);
    let begin = Instant::now();
    let from = now_ms();
    loop {
        if let Some(status) = group.reap() {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "{} while being measured; last log line: {}",
                    ctx.how_it_ended(status),
                    last_line(group)
                ),
            });
        }
        let points = ctx.meter.series(group.pid, from);
        if let Some(v) = judge(&points, &rule) {
            if v.steady {
                return Ok((v.level, true));
            }
            if begin.elapsed() > b.steady_timeout {
                ctx.say(&format!(
                    "up: [{}] warning: memory not steady after {} s (moved {} over the last {} s); using the latest level",
                    b.name,
                    b.steady_timeout.as_secs(),
                    mib(v.drift.abs() as u64),
                    b.steady_window.as_secs_f64()
                ));
                return Ok((v.level, false));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn measure_audio(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    saved: Option<(&BackendCalibration, Option<&str>)>,
) -> Result<Measured, UpError> {
    ctx.status
        .update(&b.name, |r| r.state = BackendState::Measuring);
    let t0 = now_ms();
    let (idle, _) = wait_steady(ctx, b, group).await?;
    ctx.say(&format!("up: [{}] steady at {} idle", b.name, mib(idle)));
    // Kept figures stand for a warm-up only while they describe the backend as it starts now
    // and as it runs one job.
    let mut fastest_job = None;
    let kept = match (&b.warmup, saved) {
        (Some(w), Some((kept, kept_version))) => {
            let agrees = match kept_figures_apply(kept, kept_version, &versions_seen(b), idle) {
                Ok(()) => one_job(ctx, b, group, w)
                    .await?
                    .and_then(|(took, after, peak)| {
                        fastest_job = Some(took);
                        one_job_agrees(kept, after, peak)
                    }),
                Err(why) => Err(why),
            };
            match agrees {
                Ok(()) => Some(kept),
                Err(why) => {
                    ctx.say(&format!(
                        "up: [{}] measuring again (the calibration file's figures are not used): {why}",
                        b.name
                    ));
                    None
                }
            }
        }
        _ => None,
    };
    let measured = match (&b.warmup, kept) {
        (Some(_), Some(kept)) => {
            ctx.say(&format!(
                "up: [{}] warm-up skipped: peak {}, {} between jobs, {} before the first job, measured {} (the calibration file; --recalibrate measures again)",
                b.name,
                mib(kept.peak_bytes),
                mib(kept.resident_bytes),
                mib(kept.idle_bytes.unwrap_or(idle)),
                kept.date
            ));
            Measured {
                idle,
                resident: kept.resident_bytes,
                peak: kept.peak_bytes,
                peak_per_audio_second: kept.peak_per_audio_second_bytes,
                speech_seconds_per_char: kept.speech_seconds_per_char,
                runs: kept.warmup_runs,
                kept: Some(kept.clone()),
                fastest_job,
            }
        }
        (Some(w), None) => {
            let job = warmup::prepare(b, w)?;
            let begin = now_ms();
            let mut runs = 0;
            let mut fastest = Duration::MAX;
            let mut speech_rate = None;
            for i in 1..=w.runs {
                let answer =
                    warmup::run(&ctx.client, &job)
                        .await
                        .map_err(|e| UpError::Backend {
                            backend: b.name.clone(),
                            what: format!(
                                "failed its warm-up job {i}/{} ({}): {e}",
                                w.runs, job.url
                            ),
                        })?;
                runs += 1;
                fastest = fastest.min(answer.took);
                let rate = job
                    .speech
                    .zip(answer.audio_seconds)
                    .and_then(|(input, secs)| input.seconds_per_char(secs));
                speech_rate = rate.or(speech_rate);
                let peak = ctx.meter.highest(group.pid, begin).unwrap_or(0);
                ctx.say(&format!(
                    "up: [{}] warm-up {i}/{}: {}done in {:.2} s, peak so far {}",
                    b.name,
                    w.runs,
                    warmup_audio(&job, answer.audio_seconds, rate),
                    answer.took.as_secs_f64(),
                    mib(peak)
                ));
            }
            if let (Some(input), None) = (job.speech, speech_rate) {
                ctx.say(&format!(
                    "up: [{}] the speech warm-up ({} characters) answered with no audio of a readable length: the speech lane estimates {} s per character (serve's default)",
                    b.name,
                    input.chars,
                    headroom_server::config::DEFAULT_SPEECH_SECONDS_PER_CHAR
                ));
            }
            let (resident, _) = wait_steady(ctx, b, group).await?;
            let peak = ctx
                .meter
                .highest(group.pid, t0)
                .unwrap_or(resident)
                .max(resident);
            let per_second = job
                .audio_seconds
                .filter(|s| *s > 0.0)
                .map(|secs| peak.saturating_sub(idle) as f64 / secs);
            Measured {
                idle,
                resident,
                peak,
                peak_per_audio_second: per_second,
                speech_seconds_per_char: speech_rate,
                runs,
                kept: None,
                fastest_job: (runs > 0).then_some(fastest),
            }
        }
        (None, _) => {
            let peak = ctx.meter.highest(group.pid, t0).unwrap_or(idle).max(idle);
            Measured {
                idle,
                resident: idle,
                peak,
                peak_per_audio_second: None,
                speech_seconds_per_char: None,
                runs: 0,
                kept: None,
                fastest_job: None,
            }
        }
    };
    ctx.say(&format!(
        "up: [{}] resident {}, peak {}{}",
        b.name,
        mib(measured.resident),
        mib(measured.peak),
        measured
            .peak_per_audio_second
            .map(|p| format!(", {} per audio second above idle", mib(p as u64)))
            .unwrap_or_default()
    ));
    ctx.status.update(&b.name, |r| {
        r.resident_bytes = measured.resident;
        r.peak_bytes = measured.peak;
        r.current_bytes = measured.idle;
        r.state = BackendState::Ready;
    });
    Ok(measured)
}

/// What a warm-up job's log line says of its audio: the clip's length, or the speech it made and
/// the rate that gives.
fn warmup_audio(job: &warmup::Job, answered: Option<f64>, rate: Option<f64>) -> String {
    match (job.speech, answered, rate) {
        (Some(input), Some(secs), Some(rate)) => format!(
            "{} characters to {secs:.1} s of speech ({rate:.4} s per character), ",
            input.chars
        ),
        _ => job
            .audio_seconds
            .map(|s| format!("{s:.1} s of audio "))
            .unwrap_or_default(),
    }
}

/// Runs the warm-up job once on a backend started from kept figures, then waits for steady
/// memory: `Ok(Ok((time taken, level after, highest reading)))`, or `Ok(Err(why))` when the job
/// failed (the full warm-up will say so again).
async fn one_job(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    w: &crate::boxfile::Warmup,
) -> Result<Result<(Duration, u64, u64), String>, UpError> {
    let job = warmup::prepare(b, w)?;
    let begin = now_ms();
    let took = match warmup::run(&ctx.client, &job).await {
        Ok(a) => a.took,
        Err(e) => return Ok(Err(format!("its warm-up job failed ({e})"))),
    };
    let (after, _) = wait_steady(ctx, b, group).await?;
    let peak = ctx.meter.highest(group.pid, begin).unwrap_or(after);
    ctx.say(&format!(
        "up: [{}] one warm-up job: {:.2} s, peak {}, {} after it",
        b.name,
        took.as_secs_f64(),
        mib(peak),
        mib(after)
    ));
    Ok(Ok((took, after, peak)))
}

/// The flags as `/admin/box` shows them: the arguments, then the environment as `KEY=VALUE`.
fn shown_flags(f: &TextFlags) -> Vec<String> {
    let mut shown = f.args.clone();
    shown.extend(f.env.iter().map(|(k, v)| format!("{k}={v}")));
    shown
}

/// Plans an audio vLLM before it starts: `--max-model-len` from the longest audio, its sequences
/// and pool share from what the pool has left after the audio backends already measured (their
/// peaks) and the co-tenants seen so far, less the margin.
fn audio_vllm_flags(
    ctx: &Ctx,
    b: &BackendConfig,
    started: &[Started],
    footprints: &[AudioFootprint],
) -> Result<TextFlags, UpError> {
    let a = b.audio_vllm.as_ref().expect("called for audio vLLMs only");
    let model = resolve_model(&ctx.config.dir, &a.model)?;
    let env = headroom_inspect::resolve::Env::from_process();
    let spec = headroom_inspect::resolve_model(&model, &env)
        .map_err(|e| UpError::Model(e.to_string()))?
        .spec;
    let len = audio_vllm::audio_length(&spec, a).map_err(|e| match e {
        UpError::Config { key, message } => UpError::Config {
            key: format!("backends ({}).{key}", b.name),
            message,
        },
        other => other,
    })?;
    let mut cotenants = CoTenants::default();
    let trees: Vec<Vec<u32>> = started
        .iter()
        .map(|(_, g, _, _)| ctx.meter.tree(g.pid))
        .collect();
    cotenants.observe_samples(&ctx.meter.sampler.since(ctx.started_ms), |s| {
        trees.iter().map(|t| ctx.meter.bytes_in(s, t)).sum()
    });
    let earlier = Budget::new(
        ctx.meter.capacity,
        footprints,
        cotenants.max_bytes(),
        ctx.config.memory.margin,
    );
    ctx.say(&format!(
        "up: [{}] audio vLLM: {} s of audio at {} tokens/s (from the {}) = {} audio + {} transcript tokens: --max-model-len {}; the pool has {} left",
        b.name,
        len.max_audio_seconds,
        len.tokens_per_second,
        len.rate_from,
        len.audio_tokens,
        len.transcript_tokens,
        len.max_model_len,
        mib(earlier.text_bytes)
    ));
    let result = if ctx.meter.kind == ProbeKind::Nvml {
        let pool = audio_vllm::GpuPool {
            device_total: ctx.meter.device_total,
            capacity: ctx.meter.capacity,
            held: earlier.audio_peak_bytes + earlier.cotenant_bytes,
            margin: earlier.margin_bytes,
        };
        audio_vllm::gpu_flags(&spec, a, &len, &pool)
    } else {
        audio_vllm::cpu_flags(&spec, a, &len, earlier.text_bytes)
    };
    let f = result.map_err(|e| {
        UpError::DoesNotFit(format!(
            "backend `{}`: {}",
            b.name,
            e.message_for("the audio vLLM")
        ))
    })?;
    ctx.say(&format!("up: [{}] flags: {}", b.name, f.describe()));
    Ok(f)
}

/// The text engine's sequences: its `max_parallel`, kept below `[serve] max_inflight_total`
/// less the audio lanes' slots ([`text_slots`]); said when that lowers it.
fn text_sequences(ctx: &Ctx, t: &BackendConfig, lanes: &[LaneFigures]) -> u64 {
    let max_parallel = t.text.as_ref().map_or(1, |p| p.max_parallel);
    let total = ctx
        .config
        .serve
        .top
        .get("max_inflight_total")
        .and_then(toml::Value::as_integer)
        .and_then(|n| u64::try_from(n).ok());
    let audio: u64 = lanes.iter().map(|l| l.max_inflight).sum();
    let slots = text_slots(max_parallel, total, audio);
    if slots < max_parallel {
        ctx.say(&format!(
            "up: [{}] {slots} sequence(s), not {max_parallel}: [serve] max_inflight_total {} less the audio lanes' {audio} slot(s), so an audio job never waits for a generation to end",
            t.name,
            total.unwrap_or(0)
        ));
    }
    slots
}

/// Measures whether one generation of the text engine slows each audio backend's job
/// ([`contention`]); returns the audio lanes text gives way to and the settle for their jobs.
/// A measurement that fails is said and derives nothing (the box file's settings stand).
async fn text_beside_audio(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    alone: &BTreeMap<String, Duration>,
    kept: &BTreeMap<String, ContentionFigures>,
    calibration: &mut Calibration,
) -> (Vec<String>, Option<Duration>) {
    let mut gives_way_to = Vec::new();
    let mut settle: Option<Duration> = None;
    // Long enough to outlast an audio job, short enough for the context of one sequence.
    let max_tokens = f.context_per_sequence.saturating_sub(128).clamp(16, 1024);
    let flags = shown_flags(f);
    for b in ctx.config.audio() {
        let Some(w) = &b.warmup else { continue };
        // Kept with the audio figures and measured beside the same text engine flags.
        if let Some(k) = kept.get(&b.name).filter(|k| k.text_flags == flags) {
            let c = Contention::from_kept(&b.name, k);
            ctx.say(&format!(
                "up: [{}] beside [{}] (measured {}, the calibration file):",
                t.name, b.name, k.date
            ));
            say_contention(ctx, t, &c);
            if c.text_gives_way() {
                settle = settle.max(Some(c.settle()));
                gives_way_to.push(b.name.clone());
            }
            calibration.contention.insert(b.name.clone(), k.clone());
            continue;
        }
        let known = alone.get(&b.name).copied();
        let measured = lane_contention(ctx, t, b, w, known, max_tokens).await;
        match measured {
            Ok(c) => {
                say_contention(ctx, t, &c);
                if c.text_gives_way() {
                    settle = settle.max(Some(c.settle()));
                    gives_way_to.push(b.name.clone());
                }
                calibration.contention.insert(b.name.clone(), c.kept(&flags));
            }
            Err(e) => ctx.say(&format!(
                "up: [{}] warning: could not measure whether text slows [{}]'s jobs ({e}); the box file's lane settings stand",
                t.name, b.name
            )),
        }
    }
    (gives_way_to, settle)
}

/// Times `b`'s warm-up job beside the text engine and, when that job does not already make text
/// give way and the lane has a shorter one ([`warmup::prepare_shortest`]), its shortest job too;
/// the lane's figure is the one text slows most ([`contention::worse`]).
async fn lane_contention(
    ctx: &Ctx,
    t: &BackendConfig,
    b: &BackendConfig,
    w: &Warmup,
    known: Option<Duration>,
    max_tokens: u64,
) -> Result<Contention, String> {
    let job = warmup::prepare(b, w).map_err(|e| e.to_string())?;
    let shortest = warmup::prepare_shortest(b, w).map_err(|e| e.to_string())?;
    let text = t.upstream();
    let whole = contention::measure(&ctx.client, &b.name, &job, known, &text, max_tokens).await?;
    let Some(short) = shortest.filter(|_| !whole.text_gives_way()) else {
        return Ok(whole);
    };
    ctx.say(&format!(
        "up: [{}] beside [{}], its warm-up job: {}; and its shortest job:",
        t.name,
        b.name,
        whole.describe()
    ));
    let short = contention::measure(&ctx.client, &b.name, &short, None, &text, max_tokens).await?;
    Ok(contention::worse(whole, short))
}

fn say_contention(ctx: &Ctx, t: &BackendConfig, c: &Contention) {
    let verdict = if c.text_gives_way() && t.engine == Engine::LlamaCpp {
        "text yields to it and llama.cpp is paused while its jobs run (its process group stopped, then continued)".to_string()
    } else if c.text_gives_way() {
        format!(
            "text yields to it and stops every running generation for its jobs (preempt, all; settle {} ms)",
            c.settle().as_millis()
        )
    } else {
        format!(
            "within {:.1} x: text runs on beside it",
            contention::SLOWDOWN_LIMIT
        )
    };
    ctx.say(&format!(
        "up: [{}] beside [{}]: {}; {verdict}",
        t.name,
        c.backend,
        c.describe()
    ));
}

fn text_flags(
    ctx: &Ctx,
    t: &BackendConfig,
    budget: &Budget,
    audio: &[AudioFootprint],
    sequences: u64,
) -> Result<TextFlags, UpError> {
    let plan = &crate::boxfile::TextPlan {
        max_parallel: sequences,
        ..t.text
            .clone()
            .expect("validated: text backends have a plan")
    };
    let model = resolve_model(&ctx.config.dir, &plan.model)?;
    let gpu = ctx.meter.kind == ProbeKind::Nvml;
    let result = match t.engine {
        Engine::LlamaCpp => {
            let shape = flags::llamacpp_model(Path::new(&model))?;
            flags::llamacpp_flags(&shape, plan, budget.text_bytes, gpu)
        }
        _ => {
            let env = headroom_inspect::resolve::Env::from_process();
            let spec = headroom_inspect::resolve_model(&model, &env)
                .map_err(|e| UpError::Model(e.to_string()))?
                .spec;
            if gpu {
                flags::vllm_gpu_flags(&spec, plan, budget, audio, ctx.meter.device_total)
            } else {
                flags::vllm_cpu_flags(&spec, plan, budget.text_bytes)
            }
        }
    };
    result.map_err(|e| UpError::DoesNotFit(format!("backend `{}`: {}", t.name, e.message())))
}

async fn bring_up_text(
    ctx: &Arc<Ctx>,
    t: &BackendConfig,
    f: &TextFlags,
) -> Result<(Group, Measured), UpError> {
    let t0 = now_ms();
    let mut group = start(ctx, t, &f.args, &f.env).await?;
    ctx.status
        .update(&t.name, |r| r.state = BackendState::Measuring);
    let steady = wait_steady(ctx, t, &mut group).await;
    let (resident, _) = match steady {
        Ok(s) => s,
        Err(e) => {
            group.stop(t.stop_grace).await;
            return Err(e);
        }
    };
    let peak = ctx
        .meter
        .highest(group.pid, t0)
        .unwrap_or(resident)
        .max(resident);
    let check = checked_against_plan(ctx, t, f, &group, resident, peak);
    ctx.status.update(&t.name, |r| {
        r.resident_bytes = resident;
        r.peak_bytes = peak;
        r.current_bytes = resident;
        r.plan_check = Some(check);
        r.state = BackendState::Ready;
    });
    Ok((
        group,
        Measured {
            idle: resident,
            resident,
            peak,
            peak_per_audio_second: None,
            speech_seconds_per_char: None,
            runs: 0,
            kept: None,
            fastest_job: None,
        },
    ))
}

/// [`plan_check`], with its warnings and the measured-against-planned line logged.
fn checked_against_plan(
    ctx: &Ctx,
    b: &BackendConfig,
    f: &TextFlags,
    group: &Group,
    resident: u64,
    peak: u64,
) -> serde_json::Value {
    let check = plan_check(ctx, b, f, group, resident);
    for w in check["warnings"].as_array().into_iter().flatten() {
        ctx.say(&format!(
            "up: [{}] warning: {}",
            b.name,
            w.as_str().unwrap_or("")
        ));
    }
    ctx.say(&format!(
        "up: [{}] resident {} (planned {}), peak {}",
        b.name,
        mib(resident),
        mib(f.expected.total_bytes),
        mib(peak)
    ));
    check
}

/// Compares the plan with what the engine's start-up log says (through doctor's reader) and
/// with the memory measured; a difference above 10 % is a warning naming both figures.
fn plan_check(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    group: &Group,
    resident: u64,
) -> serde_json::Value {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let mut warnings = Vec::new();
    let mut compare = |what: &str, planned: f64, seen: f64, unit: &str| {
        if planned > 0.0 && (seen - planned).abs() / planned > 0.10 {
            warnings.push(format!(
                "{what}: the plan says {planned:.0}{unit}, {seen:.0}{unit} seen ({:+.0} %)",
                (seen / planned - 1.0) * 100.0
            ));
        }
    };
    let log = std::fs::File::open(&group.log)
        .ok()
        .and_then(|file| headroom_doctor::diagnose(std::io::BufReader::new(file)).ok());
    let startup = log.as_ref().and_then(|d| d.startup.clone());
    let mut from_log = serde_json::Map::new();
    if let Some(s) = &startup {
        let b = &s.breakdown;
        if let Some(kv) = b.kv_cache_gib {
            from_log.insert("kv_cache_bytes".into(), ((kv * GIB) as u64).into());
            compare(
                "KV cache",
                f.expected.kv_cache_bytes as f64 / 1048576.0,
                kv * 1024.0,
                " MiB",
            );
        }
        if let Some(tokens) = b.kv_tokens {
            from_log.insert("kv_tokens".into(), tokens.into());
            compare("KV tokens", f.expected.kv_tokens as f64, tokens as f64, "");
        }
        if let Some(w) = b.weights_gib {
            from_log.insert("weights_bytes".into(), ((w * GIB) as u64).into());
            compare(
                "weights",
                f.expected.weights_bytes as f64 / 1048576.0,
                w * 1024.0,
                " MiB",
            );
        }
    }
    compare(
        "memory after start-up",
        f.expected.total_bytes as f64 / 1048576.0,
        resident as f64 / 1048576.0,
        " MiB",
    );
    if startup.is_none() {
        let _ = ctx;
        warnings.push(format!(
            "its start-up log ({}) shows no memory figures doctor reads; only the measured memory was compared",
            t.name
        ));
    }
    serde_json::json!({
        "planned": f.expected,
        "log": from_log,
        "measured_resident_bytes": resident,
        "warnings": warnings,
    })
}

/// Package versions next to a backend's program (a virtualenv's `site-packages/*.dist-info`
/// whose name mentions the engine), else the program's path.
fn versions_seen(b: &BackendConfig) -> String {
    let keys: &[&str] = match b.engine {
        Engine::Whisper => &["whisper", "ctranslate2"],
        Engine::LlamaCpp => &["llama", "llm_"],
        Engine::Vllm => &["vllm", "torch-"],
        Engine::Other => &[],
    };
    let mut found = Vec::new();
    if let Some(bin) = b.command.parent() {
        let pattern = bin.join("../lib/python*/site-packages/*.dist-info");
        if let Ok(paths) = glob::glob(&pattern.display().to_string()) {
            for p in paths.flatten() {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let lower = name.to_ascii_lowercase();
                if keys.iter().any(|k| lower.contains(k)) {
                    found.push(name.trim_end_matches(".dist-info").to_string());
                }
            }
        }
    }
    found.sort();
    if found.is_empty() {
        b.command.display().to_string()
    } else {
        found.join(", ")
    }
}

/// A life of a backend shorter than this (from healthy to exit) counts as ended early, and a
/// longer one restarts the backoff from `restart_backoff`.
const STAYED_UP: Duration = Duration::from_secs(60);

/// Lives in a row that ended early (a restart that never got healthy, or an exit within
/// [`STAYED_UP`]) that make a crash loop.
pub const CRASH_LOOP_AFTER: u32 = 3;

/// Keeps one backend running: waits for it to exit (restarts it with exponential backoff) or
/// to be told to stop (stops its process group). Every restart attempt is counted as it begins
/// (`restarts`), every one that does not come up healthy as a start failure, and the state says
/// `crash_loop` once [`CRASH_LOOP_AFTER`] lives in a row ended early, with the last exit's
/// reason beside it: a backend that can no longer start is visible at once, not only when a
/// restart succeeds.
async fn keep(
    ctx: Arc<Ctx>,
    b: BackendConfig,
    mut group: Group,
    args: Vec<String>,
    env: Vec<(String, String)>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = ctx.config.restart_backoff;
    let mut healthy_since = Instant::now();
    let mut early_in_a_row = 0u32;
    let down_state = |in_a_row: u32| {
        if in_a_row >= CRASH_LOOP_AFTER {
            BackendState::CrashLoop
        } else {
            BackendState::Restarting
        }
    };
    loop {
        let exited = tokio::select! {
            status = group.wait() => status,
            _ = stopped(&mut stop) => {
                group.stop(b.stop_grace).await;
                ctx.status.update(&b.name, |r| { r.state = BackendState::Stopped; r.pid = None; });
                return;
            }
        };
        if healthy_since.elapsed() > STAYED_UP {
            backoff = ctx.config.restart_backoff;
            early_in_a_row = 0;
        }
        early_in_a_row += 1;
        let exit = match &ctx.enforced {
            Some(c) => c.judge_exit(exited),
            None => Exit::Other(exit_reason(exited)),
        };
        ctx.say(&format!(
            "up: [{}] {}; restarting in {:.1} s",
            b.name,
            match &exit {
                Exit::OomKilled => format!(
                    "was killed by the kernel's OOM killer: the box's memory cgroup reached its limit of {}",
                    mib(ctx.meter.capacity)
                ),
                Exit::Other(_) => exit.reason(),
            },
            backoff.as_secs_f64()
        ));
        let retry_ms = (backoff + Duration::from_secs(1)).as_millis() as u64;
        ctx.status.update(&b.name, |r| {
            r.state = down_state(early_in_a_row);
            r.pid = None;
            r.retry_after_ms = Some(retry_ms);
            r.last_exit = Some(exit.reason());
        });
        // Whatever the group forked goes with it.
        group.stop(Duration::from_secs(2)).await;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stopped(&mut stop) => {
                    ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                    return;
                }
            }
            backoff = (backoff * 2).min(ctx.config.restart_backoff_max);
            ctx.status.update(&b.name, |r| r.restarts += 1);
            let attempt = tokio::select! {
                r = start(&ctx, &b, &args, &env) => r,
                _ = stopped(&mut stop) => {
                    ctx.status.update(&b.name, |r| r.state = BackendState::Stopped);
                    return;
                }
            };
            match attempt {
                Ok(g) => {
                    group = g;
                    break;
                }
                Err(e) => {
                    early_in_a_row += 1;
                    let state = down_state(early_in_a_row);
                    ctx.say(&format!(
                        "up: [{}] restart failed{}: {e}; next try in {:.1} s",
                        b.name,
                        if state == BackendState::CrashLoop {
                            format!(" ({early_in_a_row} in a row: crash loop)")
                        } else {
                            String::new()
                        },
                        backoff.as_secs_f64()
                    ));
                    let retry_ms = (backoff + Duration::from_secs(1)).as_millis() as u64;
                    let reason = one_line(&e.to_string());
                    ctx.status.update(&b.name, |r| {
                        r.state = state;
                        r.start_failures += 1;
                        r.retry_after_ms = Some(retry_ms);
                        r.last_exit = Some(reason);
                    });
                }
            }
        }
        healthy_since = Instant::now();
        ctx.status.update(&b.name, |r| {
            r.state = BackendState::Ready;
            r.retry_after_ms = None;
        });
        ctx.say(&format!(
            "up: [{}] running again (pid {})",
            b.name, group.pid
        ));
    }
}

/// A message on one line (a backend's last log line may bring its own line breaks).
fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Whether `now` is past the measured `peak` by more than `margin` (a fraction of the peak).
/// A backend never measured (peak 0) never drifts.
pub fn drifted(now: u64, peak: u64, margin: f64) -> bool {
    peak > 0 && now as f64 > peak as f64 * (1.0 + margin)
}

/// Every 250 ms: each backend's current memory into the report, and a log line the first time
/// one grows past its measured peak by more than the drift margin.
async fn monitor(ctx: Arc<Ctx>) {
    let mut reported: BTreeMap<String, bool> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(c) = &ctx.enforced {
            ctx.status.lock().enforce = c.report();
        }
        let rows: Vec<(String, Option<u32>, u64, BackendState)> = ctx
            .status
            .report()
            .backends
            .iter()
            .map(|b| (b.name.clone(), b.pid, b.peak_bytes, b.state))
            .collect();
        for (name, pid, peak, state) in rows {
            let Some(pid) = pid else { continue };
            let now = ctx.meter.now_bytes(pid);
            let drifted =
                state == BackendState::Ready && drifted(now, peak, ctx.config.drift_margin);
            if drifted && !reported.get(&name).copied().unwrap_or(false) {
                ctx.say(&format!(
                    "up: [{name}] warning: memory {} is past its measured peak {} by more than {:.0} %: the measured residency drifted",
                    mib(now),
                    mib(peak),
                    ctx.config.drift_margin * 100.0
                ));
                reported.insert(name.clone(), true);
            }
            ctx.status.update(&name, |r| {
                r.current_bytes = now;
                if drifted {
                    r.drifted = true;
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::drifted;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn drift_is_growth_past_the_peak_by_more_than_the_margin() {
        // Peak 200 MiB, margin 10 %: 220 MiB is the line.
        assert!(!drifted(150 * MIB, 200 * MIB, 0.1));
        assert!(!drifted(220 * MIB, 200 * MIB, 0.1));
        assert!(drifted(221 * MIB, 200 * MIB, 0.1));
        assert!(drifted(201 * MIB, 200 * MIB, 0.0));
        assert!(!drifted(900 * MIB, 0, 0.1), "never measured");
    }
}
