//! headroom-server: the HTTP side of `headroom serve`. OpenAI-compatible routes in front of text
//! and audio upstreams, admission delegated to `headroom-gate`, SSE passed through byte for byte,
//! engine metrics scraped, Prometheus `/metrics` and the `/admin/lanes` snapshot. Admission
//! logic itself lives in the gate; this crate only turns HTTP into gate inputs and back.

pub mod app;
pub mod audio;
pub mod config;
pub mod error;
pub mod inspect;
pub mod multipart;
pub mod proxy;
mod request;
pub mod scrape;
pub mod telemetry;
pub mod tokens;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use headroom_gate::Gate;
use headroom_gpu::GpuProbe;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub use config::{ConfigError, EXAMPLE_CONFIG, ServeConfig};
pub use error::ApiError;

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("invalid lanes: {0}")]
    Gate(#[from] headroom_gate::GateError),
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(String),
    #[error("{0}")]
    Tokenizer(String),
    #[error("server failed: {0}")]
    Io(#[from] std::io::Error),
}

/// A gateway ready to serve on a bound listener.
pub struct Gateway {
    state: Arc<app::AppState>,
    probe: Option<Arc<dyn GpuProbe>>,
}

impl Gateway {
    /// Builds the gate, the upstream client and the metrics registry.
    pub fn new(
        mut config: ServeConfig,
        probe: Option<Arc<dyn GpuProbe>>,
    ) -> Result<Gateway, ServeError> {
        for lane in &mut config.lanes {
            if let (Some(path), None) = (&lane.tokenizer_path, &lane.tokenizer) {
                lane.tokenizer =
                    Some(tokens::TokenCounter::load(path).map_err(ServeError::Tokenizer)?);
            }
        }
        let gate = Gate::new(
            config.lane_specs(),
            config.max_inflight_total,
            probe.clone(),
        )?;
        let client = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            // A redirect would turn the POST into a GET at another address; the client gets the
            // upstream's 3xx as it is instead.
            .redirect(reqwest::redirect::Policy::none())
            .tcp_nodelay(true)
            .build()
            .map_err(|e| ServeError::Client(e.to_string()))?;
        let names: Vec<&str> = config.lanes.iter().map(|l| l.spec.name.as_str()).collect();
        let telemetry = Arc::new(telemetry::Telemetry::for_lanes(&names));
        Ok(Gateway {
            state: Arc::new(app::AppState::new(config, gate, client, telemetry)),
            probe,
        })
    }

    pub fn gate(&self) -> &Gate {
        &self.state.gate
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
                .telemetry
                .clone()
                .upkeep_loop(telemetry::UPKEEP_INTERVAL),
        )];
        let targets: Vec<scrape::ScrapeTarget> = {
            let mut t: Vec<scrape::ScrapeTarget> = Vec::new();
            for lane in &state.config.lanes {
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
                state.client.clone(),
                targets,
                state.gate.clone(),
                state.telemetry.clone(),
                state.config.scrape_interval,
            )));
        }
        if let Some(probe) = self.probe.clone() {
            background.push(tokio::spawn(scrape::gpu_loop(
                probe,
                state.telemetry.clone(),
                state.config.scrape_interval,
            )));
        }
        let (fired_tx, fired_rx) = oneshot::channel::<()>();
        let gate = state.gate.clone();
        let grace = state.config.shutdown_grace;
        let app = app::router(state.clone());
        // Responses are written whole (head and body together) or as SSE events that must leave
        // at once: Nagle's algorithm would only hold small writes back for the client's ACK.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = axum::serve(listener, app).with_graceful_shutdown(async move {
            shutdown.await;
            gate.start_draining();
            let _ = fired_tx.send(());
        });
        let result = tokio::select! {
            r = server => r.map_err(ServeError::from),
            _ = async move {
                if fired_rx.await.is_ok() {
                    tokio::time::sleep(grace).await;
                } else {
                    std::future::pending::<()>().await;
                }
            } => Ok(()),
        };
        for task in background {
            task.abort();
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

/// Binds `config.listen` (port 0 picks a free port) and serves on a background task.
pub async fn spawn(
    config: ServeConfig,
    probe: Option<Arc<dyn GpuProbe>>,
) -> Result<Running, ServeError> {
    let addr = config.listen;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })?;
    let addr = listener.local_addr()?;
    let gateway = Gateway::new(config, probe)?;
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
