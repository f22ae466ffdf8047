//! headroom-server: the HTTP side of `headroom serve`. OpenAI-compatible routes in front of text
//! and audio upstreams, admission delegated to `headroom-gate`, SSE passed through byte for byte,
//! engine metrics scraped, Prometheus `/metrics` and the `/admin/lanes` snapshot. Admission
//! logic itself lives in the gate; this crate only turns HTTP into gate inputs and back.

pub(crate) mod admin;
pub mod admin_box;
pub mod audio;
pub(crate) mod balancer;
pub mod body_facts;
pub(crate) mod body_memory;
mod closed;
pub mod config;
pub(crate) mod core_state;
pub(crate) mod edge;
pub(crate) mod error;
pub(crate) mod headers;
pub(crate) mod health;
pub mod listen;
pub mod live_config;
pub mod memory_feed;
pub(crate) mod metrics;
pub mod multipart;
pub mod pause;
pub mod pools;
pub(crate) mod proxy;
pub(crate) mod readiness;
mod request;
pub(crate) mod retry_watch;
pub(crate) mod router;
pub mod scrape;
mod start_error;
pub(crate) mod state;
pub mod stderr;
pub mod telemetry;
pub mod tokens;
pub(crate) mod ui;
pub mod upstream;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use headroom_gate::Gate;
use headroom_gpu::{GpuProbe, HostPool};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use config::memory::{MemoryConfig, MemoryTable, ProbeKind};
pub use config::{ConfigError, EXAMPLE_CONFIG, ServeSettings};
pub use live_config::ServeConfig;
pub use start_error::ServeError;

/// A gateway ready to serve on a bound listener.
pub struct Gateway {
    state: Arc<state::AppState>,
    probe: Option<Arc<dyn GpuProbe>>,
    /// The host pool whose members (the watched upstreams) the memory feed keeps current.
    pool: Option<HostPool>,
    /// Lanes whose engines are paused by their owner (`up`, by signal) rather than over HTTP.
    pause_hooks: Vec<(String, pause::PauseHook)>,
}

impl Gateway {
    /// Builds the live configuration from `settings` ([`ServeConfig::build`]), then the gateway
    /// ([`Gateway::from_config`]).
    pub fn new(
        settings: ServeSettings,
        probe: Option<Arc<dyn GpuProbe>>,
    ) -> Result<Gateway, ServeError> {
        Gateway::from_config(ServeConfig::build(settings)?, probe)
    }

    /// Builds the gate, the upstream client and the metrics registry. With `[memory] probe =
    /// "host"` and no probe given, the host pool is built here; learned needs are read back from
    /// the calibration file.
    pub fn from_config(
        config: ServeConfig,
        probe: Option<Arc<dyn GpuProbe>>,
    ) -> Result<Gateway, ServeError> {
        let gate = Gate::new(
            config.lane_specs(),
            config.max_inflight_total,
            Some(config.ledger_settings()),
        )?;
        let mut pool = None;
        let probe = match (probe, config.memory.probe, config.memory.capacity) {
            (None, config::memory::ProbeKind::Host, Some(capacity)) => {
                let p = HostPool::new(capacity);
                pool = Some(p.clone());
                Some(Arc::new(p) as Arc<dyn GpuProbe>)
            }
            (probe, _, _) => probe,
        };
        if let Some(path) = &config.memory.calibration {
            for (name, learned) in memory_feed::load_learned(path)? {
                if let Some(lane) = gate.lane_index(&name) {
                    gate.set_learned(lane, learned);
                }
            }
        }
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            // A redirect would turn the POST into a GET at another address; the client gets the
            // upstream's 3xx as it is instead.
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .build()
            .map_err(ServeError::Client)?;
        let names: Vec<&str> = config.lanes.iter().map(|l| l.spec.name.as_str()).collect();
        let telemetry = Arc::new(telemetry::Telemetry::for_lanes(&names));
        telemetry.describe_lanes(&config.lane_specs());
        telemetry.describe_lane_kinds(&config.lanes);
        Ok(Gateway {
            state: Arc::new(state::AppState::new(config, gate, client, telemetry)),
            probe,
            pool,
            pause_hooks: Vec::new(),
        })
    }

    /// For `lane` (a `preempt_mode = "pause"` lane): `hook(true)` pauses its engines and
    /// `hook(false)` resumes them, instead of vLLM's HTTP calls. `up` passes one for an engine
    /// with no pause call of its own (llama.cpp): it stops and continues the process group.
    pub fn with_pause_hook(mut self, lane: &str, hook: pause::PauseHook) -> Gateway {
        self.pause_hooks.push((lane.to_string(), hook));
        self
    }

    /// Names the host pool behind the probe (e.g. when the probe wraps it), so the memory feed
    /// keeps its members, the watched upstreams, current.
    pub fn with_pool(mut self, pool: HostPool) -> Gateway {
        self.pool = Some(pool);
        self
    }

    fn memory_feed(&self) -> Result<Option<memory_feed::MemoryFeed>, ServeError> {
        let config = &self.state.core.config;
        let Some(probe) = self.probe.clone() else {
            return Ok(None);
        };
        if !config.needs_gpu_probe() {
            return Ok(None);
        }
        let mut owners = config.memory.watch.clone();
        let mut learn_lanes = Vec::new();
        for (i, lane) in config.lanes.iter().enumerate() {
            let Some(need) = &lane.spec.gpu else { continue };
            if need.learn {
                learn_lanes.push((i, lane.spec.name.clone()));
            }
            for u in &lane.spec.upstreams {
                if !owners.contains(u) {
                    owners.push(u.clone());
                }
            }
        }
        memory_feed::MemoryFeed::start(memory_feed::FeedSetup {
            probe,
            pool: self.pool.clone(),
            memory: config.memory.clone(),
            owners,
            learn_lanes,
            gate: self.state.core.gate.clone(),
            telemetry: self.state.core.telemetry.clone(),
            names: self.state.pool_names.clone(),
        })
        .map(Some)
        .map_err(ServeError::Io)
    }

    /// Hands the gateway the supervisor's view of its backends (`/admin/box`, 503 while one
    /// restarts). Call before [`Gateway::serve`]; a second call is ignored.
    pub fn with_box(self, provider: Arc<dyn admin_box::BoxProvider>) -> Gateway {
        let _ = self.state.core.box_provider.set(provider);
        self
    }

    pub fn gate(&self) -> &Gate {
        &self.state.core.gate
    }

    /// Serves on `listener` until `shutdown` resolves; then stops accepting, refuses new work
    /// with 503 `shutting_down`, and lets in-flight work finish for at most `shutdown_grace`.
    pub async fn serve<F>(self, listener: TcpListener, shutdown: F) -> Result<(), ServeError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let state = self.state.clone();
        let mut background = vec![tokio::spawn(
            state
                .core
                .telemetry
                .clone()
                .upkeep_loop(telemetry::UPKEEP_INTERVAL),
        )];
        let targets: Vec<scrape::ScrapeTarget> = {
            let mut t: Vec<scrape::ScrapeTarget> = Vec::new();
            for lane in &state.core.config.lanes {
                let Some(kind) = lane.engine else { continue };
                for u in &lane.spec.upstreams {
                    if !t.iter().any(|x| &x.upstream == u) {
                        t.push(scrape::ScrapeTarget {
                            upstream: u.clone(),
                            kind,
                            metrics_path: lane.metrics_path.clone(),
                        });
                    }
                }
            }
            t
        };
        if !targets.is_empty() {
            background.push(tokio::spawn(scrape::scrape_loop(
                state.core.client.clone(),
                targets,
                state.core.gate.clone(),
                state.core.telemetry.clone(),
                state.core.config.scrape_interval,
                state.core.config.scrape_timeout,
            )));
        }
        let pausing = pause::pausing_lanes(&state.core.gate, &state.core.config.lanes);
        let hook_of = |lane: &live_config::LaneConfig| {
            self.pause_hooks
                .iter()
                .find(|(name, _)| *name == lane.spec.name)
                .map(|(_, hook)| hook.clone())
        };
        for (lane, signal) in &pausing {
            background.push(match hook_of(lane) {
                Some(hook) => tokio::spawn(pause::hook_loop(hook, signal.clone())),
                None => tokio::spawn(pause::pause_loop(
                    state.core.client.clone(),
                    lane.clone(),
                    signal.clone(),
                )),
            });
        }
        let feed = self.memory_feed()?;
        if let (Some(probe), None) = (self.probe.clone(), &feed) {
            background.push(tokio::spawn(scrape::gpu_loop(
                probe,
                state.core.telemetry.clone(),
                state.pool_names.clone(),
                state.core.config.scrape_interval,
            )));
        }
        background.push(tokio::spawn(ui::sample_loop(
            state.ui.clone(),
            state.core.gate.clone(),
            state.core.telemetry.clone(),
        )));
        let balancing = &state.core.config.balancer;
        if balancing.agent_listen.is_some() || balancing.load_header {
            background.push(tokio::spawn(balancer::signal_loop(state.clone())));
        }
        if let Some(addr) = balancing.agent_listen {
            let agent = balancer::bind_agent(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })?;
            background.push(tokio::spawn(balancer::agent_loop(agent, state.clone())));
        }
        background.push(tokio::spawn(health::check_loop(state.clone())));
        let gate = state.core.gate.clone();
        let grace = state.core.config.shutdown_grace;
        let app = router::router(state.clone());
        // Stops accepting at the shutdown, drains for `shutdown_grace`, then cuts what is left
        // (503 `shutting_down`, or a stream's error event) and returns.
        listen::serve(
            listener,
            state.clone(),
            app,
            async move {
                shutdown.await;
                gate.start_draining();
            },
            grace,
        )
        .await;
        let result = Ok(());
        for task in background {
            task.abort();
        }
        // Never leave an engine paused behind (the grace may end while audio still runs).
        for (lane, _) in &pausing {
            match hook_of(lane) {
                Some(hook) => hook(false),
                None => pause::set_all(&state.core.client, lane, false).await,
            }
        }
        if let Some(feed) = feed {
            feed.stop();
        }
        result
    }
}

/// A gateway running on a background task (tests and embedding).
pub struct Running {
    pub addr: SocketAddr,
    pub gate: Gate,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), ServeError>>,
}

impl Running {
    /// Triggers shutdown and waits for the drain to finish.
    pub async fn shutdown(mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(r) => r,
            Err(e) => Err(ServeError::Io(std::io::Error::other(e.to_string()))),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.stop.is_some() {
            self.task.abort();
        }
    }
}

/// Binds `settings.listen` (port 0 picks a free port) and serves on a background task.
pub async fn spawn(
    config: ServeSettings,
    probe: Option<Arc<dyn GpuProbe>>,
) -> Result<Running, ServeError> {
    spawn_with_pool(config, probe, None).await
}

/// [`spawn`], naming the host pool a given probe reads (see [`Gateway::with_pool`]).
pub async fn spawn_with_pool(
    config: ServeSettings,
    probe: Option<Arc<dyn GpuProbe>>,
    pool: Option<HostPool>,
) -> Result<Running, ServeError> {
    let addr = config.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let addr = listener.local_addr()?;
    let mut gateway = Gateway::new(config, probe)?;
    if let Some(pool) = pool {
        gateway = gateway.with_pool(pool);
    }
    let gate = gateway.gate().clone();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(gateway.serve(listener, async move {
        let _ = stopped.await;
    }));
    Ok(Running {
        addr,
        gate,
        stop: Some(stop),
        task,
    })
}
