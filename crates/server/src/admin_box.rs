//! The supervisor's report on the box it runs behind this gateway (`headroom up`): its backends,
//! their state and memory, and the box's memory cgroup when capacity is enforced; handed in
//! through a [`BoxProvider`]. `/admin/box` ([`crate::admin`]) shows it, `/metrics`
//! ([`crate::metrics`]) renders it, and a lane whose every upstream is a backend that is not
//! serving answers 503 with Retry-After ([`crate::core_state::Core::backend_unavailable`]).

use serde::Serialize;

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
