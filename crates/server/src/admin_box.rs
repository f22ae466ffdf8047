//! `GET /admin/box`: the state of the backends a supervisor (`headroom up`) runs behind this
//! gateway, fed by a [`BoxProvider`] the supervisor hands in. Without a provider the route
//! answers 404, as any unknown route. The same figures are rendered into `/metrics`, and a lane
//! whose every upstream belongs to a backend that is not serving (restarting, starting, failed)
//! answers 503 with Retry-After at once instead of a 502 from a refused connection. A box whose
//! capacity is enforced (`[memory] enforce`) also reports its memory cgroup: the limit, what the
//! kernel charges to it, and how many of its processes the kernel's OOM killer killed.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::app::AppState;
use crate::error::{ApiError, ErrorCode};

/// What a backend is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendState {
    Starting,
    Measuring,
    Ready,
    Restarting,
    /// Restarting after several lives in a row that each ended early (a start that never got
    /// healthy, or an exit soon after it did): the backend may never come back by itself.
    CrashLoop,
    Failed,
    Stopped,
}

impl BackendState {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Starting => "starting",
            BackendState::Measuring => "measuring",
            BackendState::Ready => "ready",
            BackendState::Restarting => "restarting",
            BackendState::CrashLoop => "crash_loop",
            BackendState::Failed => "failed",
            BackendState::Stopped => "stopped",
        }
    }
}

/// One backend as `/admin/box` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendReport {
    pub name: String,
    /// `audio` or `text`.
    pub role: String,
    pub engine: String,
    pub pid: Option<u32>,
    pub state: BackendState,
    /// `http://127.0.0.1:PORT`: the upstream the gateway's lanes use.
    pub upstream: String,
    /// Steady idle memory measured after the warm-up.
    pub resident_bytes: u64,
    /// The highest memory seen while measuring.
    pub peak_bytes: u64,
    /// Memory of the process tree now.
    pub current_bytes: u64,
    /// Restarts attempted after the backend exited, counted when each attempt begins (whether
    /// it comes up or not).
    pub restarts: u64,
    /// Restart attempts that did not come up healthy.
    pub start_failures: u64,
    /// Why the backend last stopped serving: its exit status (`oom_killed` when the kernel's
    /// OOM killer killed it inside the box's memory cgroup), or why a restart failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_exit: Option<String>,
    /// Set when memory grew past the measured peak by more than the drift margin.
    pub drifted: bool,
    /// While restarting: how long until the next attempt is healthy at the earliest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
    /// For the text engine: the memory flags `up` computed (and the environment it set).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub flags: Vec<String>,
    /// For the text engine: what the plan said against what the engine's start-up log says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan_check: Option<serde_json::Value>,
}

/// The whole box.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoxReport {
    /// `host` or `nvml`.
    pub probe: String,
    pub capacity_bytes: u64,
    pub margin_bytes: u64,
    /// Memory the text engine was given: capacity − audio peaks − co-tenants − margin.
    pub text_budget_bytes: u64,
    pub backends: Vec<BackendReport>,
    /// The memory cgroup every backend runs in, when capacity is enforced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enforce: Option<EnforceReport>,
}

/// The box's memory cgroup (`[memory] enforce = true`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EnforceReport {
    /// Its directory (a process joins it by writing its PID to `cgroup.procs` there).
    pub cgroup: String,
    /// `v1` or `v2`.
    pub version: String,
    /// The hard limit: the pool's capacity.
    pub limit_bytes: u64,
    /// What the kernel charges to it (`memory.current` / `memory.usage_in_bytes`).
    pub usage_bytes: u64,
    /// The pool's reading: the charge less inactive file cache.
    pub working_set_bytes: u64,
    /// Processes in it the kernel's OOM killer killed since it was made.
    pub oom_kills: u64,
}

/// Hands the gateway the box's current state. Implemented by the supervisor; must be cheap
/// (it is read on every request that would go to a backend the box runs).
pub trait BoxProvider: Send + Sync {
    fn report(&self) -> BoxReport;
}

/// The 503 for a lane whose every upstream is a backend of the box that is not serving now.
pub fn unavailable(state: &AppState, lane: &str, upstreams: &[String]) -> Option<ApiError> {
    let provider = state.box_provider.get()?;
    let report = provider.report();
    let mut retry = Duration::ZERO;
    for upstream in upstreams {
        let backend = report.backends.iter().find(|b| &b.upstream == upstream)?;
        if backend.state == BackendState::Ready {
            return None;
        }
        let ms = backend.retry_after_ms.unwrap_or(1000);
        retry = retry.max(Duration::from_millis(ms));
    }
    let mut err = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::BackendUnavailable,
        format!("lane `{lane}`: its backend is restarting; retry shortly"),
    );
    err.retry_after = Some(retry.max(Duration::from_secs(1)));
    Some(err)
}

/// The pool as the gateway's memory feed last read it: `name`, `device`, `total_bytes`,
/// `used_bytes`, `free_bytes`, `reading_age_seconds` (a tool without NVML, such as `top` on a CPU
/// box, reads the pool from here). Without a reading: the capacity and the backends' memory now.
fn pool_figures(s: &AppState, report: &BoxReport) -> serde_json::Value {
    let device = s.config.memory.device;
    let reading = s
        .gate
        .snapshot()
        .memory
        .into_iter()
        .find(|p| p.device == device)
        .and_then(|p| Some((p.total_bytes?, p.free_bytes?, p.reading_age_seconds)));
    let (total, used, age) = match reading {
        Some((total, free, age)) => (total, total.saturating_sub(free), age),
        None => (
            report.capacity_bytes,
            report.backends.iter().map(|b| b.current_bytes).sum(),
            None,
        ),
    };
    serde_json::json!({
        "name": s.pool_names.name(device),
        "device": device,
        "total_bytes": total,
        "used_bytes": used,
        "free_bytes": total.saturating_sub(used),
        "reading_age_seconds": age,
    })
}

/// The `/admin/box` handler: the supervisor's report, with the pool's figures now (`pool`).
pub async fn handler(State(s): State<Arc<AppState>>) -> Response {
    match s.box_provider.get() {
        Some(provider) => {
            let report = provider.report();
            let pool = pool_figures(&s, &report);
            let mut doc = serde_json::to_value(&report).unwrap_or_default();
            doc["pool"] = pool;
            axum::Json(doc).into_response()
        }
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::UnknownRoute,
            "no route GET /admin/box (this gateway does not run under headroom up)",
        )
        .into_response(),
    }
}

/// A metric name, its help text and how to read it off a backend.
type Gauge = (&'static str, &'static str, fn(&BackendReport) -> f64);

/// The box's figures in Prometheus text format (appended to `/metrics`); empty without a provider.
pub fn render_metrics(state: &AppState) -> String {
    let Some(provider) = state.box_provider.get() else {
        return String::new();
    };
    let report = provider.report();
    let mut out = String::new();
    let gauges: [Gauge; 6] = [
        (
            "headroom_box_backend_resident_bytes",
            "Steady idle memory measured after warm-up",
            |b| b.resident_bytes as f64,
        ),
        (
            "headroom_box_backend_peak_bytes",
            "Highest memory seen while measuring",
            |b| b.peak_bytes as f64,
        ),
        (
            "headroom_box_backend_memory_bytes",
            "Memory of the backend's process tree now",
            |b| b.current_bytes as f64,
        ),
        (
            "headroom_box_backend_restarts_total",
            "Restarts attempted after the backend exited, counted as each begins",
            |b| b.restarts as f64,
        ),
        (
            "headroom_box_backend_start_failures_total",
            "Restart attempts that did not come up healthy",
            |b| b.start_failures as f64,
        ),
        (
            "headroom_box_backend_drifted",
            "1 when memory grew past the measured peak by more than the margin",
            |b| if b.drifted { 1.0 } else { 0.0 },
        ),
    ];
    for (name, help, value) in gauges {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for b in &report.backends {
            let _ = writeln!(
                out,
                "{name}{{backend=\"{}\",role=\"{}\"}} {}",
                b.name,
                b.role,
                value(b)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP headroom_box_backend_up 1 when the backend is ready\n# TYPE headroom_box_backend_up gauge"
    );
    for b in &report.backends {
        let _ = writeln!(
            out,
            "headroom_box_backend_up{{backend=\"{}\",state=\"{}\"}} {}",
            b.name,
            b.state.as_str(),
            u8::from(b.state == BackendState::Ready)
        );
    }
    let _ = writeln!(
        out,
        "# HELP headroom_box_text_budget_bytes Memory given to the text engine\n# TYPE headroom_box_text_budget_bytes gauge\nheadroom_box_text_budget_bytes {}",
        report.text_budget_bytes
    );
    if let Some(e) = &report.enforce {
        render_enforce(&mut out, e);
    }
    out
}

/// The memory cgroup's figures: OOM kills (a counter), its limit and its charge.
fn render_enforce(out: &mut String, e: &EnforceReport) {
    let rows: [(&str, &str, &str, u64); 4] = [
        (
            "headroom_box_oom_kills_total",
            "counter",
            "Processes of the box the kernel's OOM killer killed inside its memory cgroup",
            e.oom_kills,
        ),
        (
            "headroom_box_memory_limit_bytes",
            "gauge",
            "Hard memory limit of the box's cgroup (the enforced capacity)",
            e.limit_bytes,
        ),
        (
            "headroom_box_memory_usage_bytes",
            "gauge",
            "Memory the kernel charges to the box's cgroup, page cache included",
            e.usage_bytes,
        ),
        (
            "headroom_box_memory_working_set_bytes",
            "gauge",
            "The box's cgroup charge less inactive file cache: the pool's reading",
            e.working_set_bytes,
        ),
    ];
    for (name, kind, help, value) in rows {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
}
