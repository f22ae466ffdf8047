//! The box's outline: check, measure the pool, bring every backend up
//! ([`crate::bringup`]), serve with derived lanes, keep the backends running
//! ([`crate::keeper`], [`crate::monitor`]) and stop everything in order. On shutdown the gateway
//! stops first, then the text engine, then the audio backends in reverse order, each by process
//! group.

use std::future::Future;
use std::sync::{Arc, Mutex};

use headroom_gpu::GpuProbe;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::UpError;
use crate::boxfile::{BoxConfig, ProbeKind};
use crate::bringup::bring_up;
use crate::budget::mib;
use crate::cgroup::BoxCgroup;
use crate::ctx::{Ctx, now_ms, stopped};
use crate::keeper::keep;
use crate::kept::calibration_file;
use crate::lanes::serve_config;
use crate::launch::{Started, stop_all_started};
use crate::logs::LogDir;
use crate::meter::open_meter;
use crate::monitor::monitor;
use crate::options::UpOptions;
use crate::pause::{pause_by_signal, signal_paused_lanes};
pub use crate::preflight::check_paths;
use crate::preflight::{enforce_capacity, preflight};
use crate::process;
use crate::report::{BoxStatus, initial_report};

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

/// The run, with the stop flag `stop`: open the box, bring it up (a stop request or an error
/// stops what was started), serve, then stop everything in order.
async fn run_inner(
    config: BoxConfig,
    opts: UpOptions,
    stop: watch::Receiver<bool>,
) -> Result<(), UpError> {
    let (ctx, listener, probe) = open_box(config, opts).await?;

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
                g = g.with_pause_hook(
                    &name,
                    pause_by_signal(Arc::clone(&ctx.status), Arc::clone(&ctx.pauses), &name),
                );
            }
            match &ctx.meter.pool {
                Some(pool) => g.with_pool(pool.clone()),
                None => g,
            }
        }
        Err(e) => {
            stop_all_started(&ctx, &mut started).await;
            return Err(UpError::Serve(e.into()));
        }
    };

    let keepers = spawn_keepers(&ctx, started.drain(..));
    let monitor = tokio::spawn(monitor(Arc::clone(&ctx)));

    let addr = listener
        .local_addr()
        .map_err(|e| UpError::Serve(e.into()))?;
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
    stop_keepers(&ctx, keepers).await;
    remove_cgroup(&ctx);
    let served = served.map_err(|e| UpError::Serve(e.into()));
    if served.is_ok() {
        ctx.finish_logs();
    }
    served
}

/// Checks what can be checked before anything starts, binds the gateway's port, creates the
/// box's cgroup (`[memory] enforce`), opens the meter, the log folder and the report, and says
/// how the pool is read: what every later step shares, the listener and the gateway's probe.
async fn open_box(
    config: BoxConfig,
    opts: UpOptions,
) -> Result<(Arc<Ctx>, TcpListener, Arc<dyn GpuProbe>), UpError> {
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
        .map_err(|e| UpError::Serve(e.into()))?;
    let ctx = Arc::new(Ctx {
        config,
        opts,
        meter,
        status,
        client,
        logs,
        started_ms: now_ms(),
        enforced,
        pauses: Arc::default(),
    });
    say_pool(&ctx);
    if let Some(w) = process::death_tie().warning() {
        ctx.say(&format!("up: warning: {w}"));
    }
    Ok((ctx, listener, probe))
}

/// The first line `up` says: how the pool is read, its capacity and margin, the sampling
/// interval and where the backend logs go.
fn say_pool(ctx: &Ctx) {
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
}

/// Keepers: one per backend, restarting it when it exits, stopping it when told; each with its
/// name and stop flag.
fn spawn_keepers(
    ctx: &Arc<Ctx>,
    started: impl Iterator<Item = Started>,
) -> Vec<(String, watch::Sender<bool>, JoinHandle<()>)> {
    let mut keepers = Vec::new();
    for s in started {
        let (tx, rx) = watch::channel(false);
        let name = s.backend.name.clone();
        let handle = tokio::spawn(keep(Arc::clone(ctx), s, rx));
        keepers.push((name, tx, handle));
    }
    keepers
}

/// Stops the backends through their keepers, the text engine first (it is last in the list),
/// then the audio backends in reverse order.
async fn stop_keepers(ctx: &Ctx, keepers: Vec<(String, watch::Sender<bool>, JoinHandle<()>)>) {
    for (name, tx, handle) in keepers.into_iter().rev() {
        let _ = tx.send(true);
        let _ = handle.await;
        ctx.say(&format!("up: [{name}] stopped"));
    }
}

/// Removes the box's memory cgroup (`[memory] enforce`), killing what is still inside (said).
fn remove_cgroup(ctx: &Ctx) {
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
}
