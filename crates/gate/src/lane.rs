//! What a lane is (its limits, policy and neighbours) and why admission can say no.

use std::time::Duration;

use crate::pressure::{EngineLimits, GpuNeed};
use crate::upstream::Outlier;

/// What a lane does when it cannot admit a request at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Answer at once (429) without waiting.
    Reject,
    /// Wait in a bounded FIFO queue for at most `queue_timeout`.
    Queue,
    /// Like `queue`, but every refusal is answered by a cheaper local fallback instead of an error.
    Fallback,
}

impl Policy {
    pub fn parse(text: &str) -> Option<Policy> {
        match text {
            "reject" => Some(Policy::Reject),
            "queue" => Some(Policy::Queue),
            "fallback" => Some(Policy::Fallback),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Reject => "reject",
            Policy::Queue => "queue",
            Policy::Fallback => "fallback",
        }
    }
}

/// `preempt_per_job` that stops every running request of the lane (`preempt_per_job = "all"`).
pub const PREEMPT_ALL: usize = usize::MAX;

/// How a `preempt` lane makes room for the work of a lane it yields to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PreemptMode {
    /// Stop running requests (`preempt_per_job` per admitted job, youngest first): the client
    /// sees them end and retries.
    #[default]
    Abort,
    /// Pause the lane's engines while the yielded-to lanes have work in flight and resume them
    /// when the last job ends (vLLM's `POST /sleep?level=0&mode=keep` and
    /// `POST /wake_up?tags=scheduling`): running requests are kept, frozen, and go on after.
    /// The gate only publishes when to pause ([`crate::Gate::pause_signal`]); the caller talks
    /// to the engines.
    Pause,
}

impl PreemptMode {
    pub fn parse(text: &str) -> Option<PreemptMode> {
        match text {
            "abort" => Some(PreemptMode::Abort),
            "pause" => Some(PreemptMode::Pause),
            _ => None,
        }
    }
}

/// One lane's admission settings. Request-shape limits (body size, tokens, audio seconds) are
/// enforced by the HTTP side before admission; the ones here decide *when* work may start.
#[derive(Debug, Clone)]
pub struct LaneSpec {
    pub name: String,
    /// Higher runs first when lanes compete for the device-wide cap.
    pub priority: i32,
    pub max_inflight: usize,
    pub max_queue: usize,
    pub queue_timeout: Duration,
    pub request_timeout: Duration,
    pub policy: Policy,
    /// Names of lanes this lane gives way to while they have work queued or in flight.
    pub yield_to: Vec<String>,
    /// Longest a lane keeps yielding before it admits one request anyway.
    pub max_yield: Duration,
    /// How long a lane it yields to still counts as busy after its last request ended. Interactive
    /// audio arrives in bursts (one utterance after another); without a linger, text slips in
    /// between two clips and is still running when the next one arrives.
    pub yield_linger: Duration,
    /// When a lane this lane yields to admits work, this lane's in-flight requests are told to
    /// stop (see [`crate::Permit::preemption`]): a running generation would otherwise keep
    /// competing with the interactive work for the device until it ends.
    pub preempt: bool,
    /// With `preempt`: how many running requests (youngest first) one admitted job of a lane
    /// this lane yields to stops. One by default: an audio job needs room, not an empty lane.
    /// [`PREEMPT_ALL`] stops every running request: where both engines share the same cores, a
    /// generation left running competes with the job as much as one slot of it does.
    pub preempt_per_job: usize,
    /// With `preempt`: stop running requests, or pause the lane's engines instead.
    pub preempt_mode: PreemptMode,
    /// Upstream identifiers (URLs); admission picks the least loaded one that is not saturated.
    pub upstreams: Vec<String>,
    pub gpu: Option<GpuNeed>,
    pub engine: Option<EngineLimits>,
    /// Passive health: when an upstream of the lane is ejected, for how long, and how many at once.
    pub outlier: Outlier,
}

impl LaneSpec {
    /// A lane with the given name and upstreams and conservative defaults for everything else.
    pub fn new(name: &str, upstreams: &[&str]) -> LaneSpec {
        LaneSpec {
            name: name.to_string(),
            priority: 0,
            max_inflight: 1,
            max_queue: 0,
            queue_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(60),
            policy: Policy::Reject,
            yield_to: Vec::new(),
            max_yield: Duration::from_secs(10),
            yield_linger: Duration::ZERO,
            preempt: false,
            preempt_per_job: 1,
            preempt_mode: PreemptMode::Abort,
            upstreams: upstreams.iter().map(|u| u.to_string()).collect(),
            gpu: None,
            engine: None,
            outlier: Outlier::default(),
        }
    }
}

/// Invalid gate settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum GateError {
    #[error("lane `{lane}`: {message}")]
    Lane { lane: String, message: String },
    #[error("{0}")]
    Config(String),
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The lane's queue is full (or zero-length).
    QueueFull,
    /// Every in-flight slot of the lane is taken and the policy does not wait.
    Saturated,
    /// Free GPU memory, less what admitted jobs have reserved, does not cover the job plus the
    /// margin (or could not be read).
    GpuMemory,
    /// The same for the host memory pool.
    HostMemory,
    /// The engine's own queue or KV-cache usage is above the lane's threshold, or its metrics are stale.
    EngineSaturated,
    /// A lane this one yields to has work queued or in flight.
    Yielding,
    /// The device-wide `max_inflight_total` is reached.
    DeviceSaturated,
    /// The request waited in the queue for `queue_timeout` without being admitted.
    QueueTimeout,
    /// The gateway is shutting down.
    ShuttingDown,
}

impl RejectReason {
    /// The OpenAI `code` field and the `reason` metric label.
    pub fn code(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "lane_queue_full",
            RejectReason::Saturated => "lane_saturated",
            RejectReason::GpuMemory => "gpu_memory",
            RejectReason::HostMemory => "host_memory",
            RejectReason::EngineSaturated => "engine_saturated",
            RejectReason::Yielding => "lane_yielding",
            RejectReason::DeviceSaturated => "device_saturated",
            RejectReason::QueueTimeout => "queue_timeout",
            RejectReason::ShuttingDown => "shutting_down",
        }
    }

    /// Human-readable sentence for the error message.
    pub fn describe(self) -> &'static str {
        match self {
            RejectReason::QueueFull => "the lane's queue is full",
            RejectReason::Saturated => "every in-flight slot of the lane is busy",
            RejectReason::GpuMemory => "free GPU memory does not cover this job",
            RejectReason::HostMemory => "free memory of the host pool does not cover this job",
            RejectReason::EngineSaturated => "the inference engine reports it is saturated",
            RejectReason::Yielding => "the lane is yielding to a higher-priority lane",
            RejectReason::DeviceSaturated => "the device-wide in-flight cap is reached",
            RejectReason::QueueTimeout => "the request waited in the queue too long",
            RejectReason::ShuttingDown => "the gateway is shutting down",
        }
    }
}

/// A refusal, with an estimate of when trying again makes sense.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub lane: String,
    pub reason: RejectReason,
    /// Estimated time until a slot frees for a new arrival, from measured service time and queue length.
    pub retry_after: Duration,
    /// True when the lane's policy is `fallback`: the caller should answer with the fallback.
    pub fallback: bool,
    /// For memory refusals: the free figure, the reservations outstanding and the need.
    pub memory: Option<crate::ledger::MemoryShortfall>,
    /// How long the request waited in the queue before this refusal (`None`: refused on
    /// arrival). A memory refusal after waiting is the queue timeout of a request held for
    /// memory.
    pub queued_for: Option<Duration>,
}
