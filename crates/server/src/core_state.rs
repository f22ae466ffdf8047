//! What the request path reads, and nothing more: the configuration, the gate, the upstream
//! client and endpoints, telemetry, the early-retry watch, the body-memory budget, the shutdown
//! cut, and the supervisor's box (for the 503 a lane whose backends are all down answers). The
//! surface ([`crate::state`]) holds a [`Core`] beside what only it reads.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use headroom_gate::Gate;

use crate::admin_box::{BackendState, BoxProvider};
use crate::body_memory::BodyMemory;
use crate::error::{ApiError, ErrorCode};
use crate::live_config::ServeConfig;
use crate::retry_watch::RetryWatch;
use crate::telemetry::Telemetry;
use crate::upstream::Endpoint;

/// The request path's state of one gateway.
pub(crate) struct Core {
    /// Each lane's upstreams (by lane, then upstream index as the gate numbers them), parsed
    /// once, with their keep-alive pools; lanes that name the same upstream share one.
    pub(crate) endpoints: Vec<Vec<Option<Arc<Endpoint>>>>,
    pub(crate) config: ServeConfig,
    pub(crate) gate: Gate,
    pub(crate) client: reqwest::Client,
    pub(crate) telemetry: Arc<Telemetry>,
    /// Set by `headroom up`: the box's backends, for `/admin/box` and 503s while one restarts.
    pub(crate) box_provider: OnceLock<Arc<dyn BoxProvider>>,
    /// The next fallback answer's id.
    pub(crate) fallback_ids: AtomicU64,
    /// Clients refused with a Retry-After, to notice the ones that come back before it.
    pub(crate) retries: RetryWatch,
    /// Set when `shutdown_grace` ran out: what is still in flight ends with `shutting_down`.
    pub(crate) cut: Arc<AtomicBool>,
    /// Request-body bytes held in memory, under `max_body_memory`.
    pub(crate) body_memory: BodyMemory,
}

impl Core {
    pub(crate) fn new(
        config: ServeConfig,
        gate: Gate,
        client: reqwest::Client,
        telemetry: Arc<Telemetry>,
    ) -> Core {
        let endpoints = endpoints_of(&config);
        let body_memory = BodyMemory::new(config.body_memory_cap(crate::body_memory::mem_total()));
        Core {
            endpoints,
            config,
            gate,
            client,
            telemetry,
            box_provider: OnceLock::new(),
            fallback_ids: AtomicU64::new(1),
            retries: Default::default(),
            cut: Arc::default(),
            body_memory,
        }
    }

    /// The shutdown's grace ran out: every request still in flight ends now.
    pub(crate) fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }

    /// A request whose exchange with its upstream failed (`failed`, the 502) on a lane whose every
    /// upstream is a backend of the box that `up` runs: the backend died under it (a crash, the
    /// kernel's OOM killer, `kill -9`) and `up` is starting it again, so the client is told to
    /// come back (503 with the backend's Retry-After, at least 1 s) rather than that the gateway
    /// failed. Outside `up`, or for an upstream not of the box, the 502 stands.
    pub(crate) fn restarting_backend(
        &self,
        lane: &str,
        upstreams: &[String],
        failed: ApiError,
    ) -> ApiError {
        if failed.status != StatusCode::BAD_GATEWAY {
            return failed;
        }
        let Some(retry) = self.box_retry_after(upstreams, false) else {
            return failed;
        };
        let mut err = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BackendUnavailable,
            format!(
                "lane `{lane}`: its backend stopped before it answered and is being started again; retry shortly"
            ),
        );
        err.retry_after = Some(retry);
        err
    }

    /// The 503 for a lane whose every upstream is a backend of the box that is not serving now.
    pub(crate) fn backend_unavailable(&self, lane: &str, upstreams: &[String]) -> Option<ApiError> {
        let retry = self.box_retry_after(upstreams, true)?;
        let mut err = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::BackendUnavailable,
            format!("lane `{lane}`: its backend is restarting; retry shortly"),
        );
        err.retry_after = Some(retry);
        Some(err)
    }

    /// The longest Retry-After (at least 1 s) of the box backends behind `upstreams`; `None` when
    /// one is not a backend of the box (or there is no box), or, with `unless_ready`, when one is
    /// serving now.
    fn box_retry_after(&self, upstreams: &[String], unless_ready: bool) -> Option<Duration> {
        let report = self.box_provider.get()?.report();
        let mut retry = Duration::from_secs(1);
        for upstream in upstreams {
            let backend = report.backends.iter().find(|b| &b.upstream == upstream)?;
            if unless_ready && backend.state == BackendState::Ready {
                return None;
            }
            retry = retry.max(Duration::from_millis(
                backend.retry_after_ms.unwrap_or(1000),
            ));
        }
        Some(retry)
    }
}

/// One [`Endpoint`](Endpoint) per distinct upstream address, laid out by lane
/// and upstream index; an address that does not parse has none (its requests answer 502).
fn endpoints_of(config: &ServeConfig) -> Vec<Vec<Option<Arc<Endpoint>>>> {
    let mut seen: Vec<Arc<Endpoint>> = Vec::new();
    let mut endpoint = |u: &str| {
        if let Some(e) = seen.iter().find(|e| e.address() == u) {
            return Some(e.clone());
        }
        let e = Arc::new(Endpoint::parse(u).ok()?);
        seen.push(e.clone());
        Some(e)
    };
    config
        .lanes
        .iter()
        .map(|l| l.spec.upstreams.iter().map(|u| endpoint(u)).collect())
        .collect()
}
