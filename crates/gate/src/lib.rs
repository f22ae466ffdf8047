//! headroom-gate: the gateway's core without HTTP. Lanes with bounded queues, admission that reads
//! GPU memory (a ledger of readings and reservations) and engine load as plain inputs, priorities with bounded yielding, a device-wide cap,
//! overload policies, Retry-After estimates from measured service time, and the rule-based
//! transcript cleaner used by the `fallback` policy. Nothing here knows about axum, hyper or reqwest.

pub mod admission;
pub mod cleanup;
pub mod lane;
pub mod ledger;
pub mod load;
pub mod pressure;
mod upstream;

/// The gate's own maps (keyed by configured upstream addresses and permit ids, never by client
/// input): a fast hasher, not SipHash, since every admission and release looks them up.
pub(crate) type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

pub use admission::{
    AdmitRequest, Gate, GateSnapshot, LaneMemorySnapshot, LaneSnapshot, Permit, PoolSnapshot,
    UpstreamSnapshot, WaitingFor,
};
pub use cleanup::clean_transcript;
pub use lane::{GateError, LaneSpec, PREEMPT_ALL, Policy, PreemptMode, RejectReason, Rejection};
pub use ledger::{LearnedNeed, LedgerSettings, MemoryReading, MemoryShortfall, PoolKind};
pub use load::{BoxLoad, LaneLoad, box_load};
pub use pressure::{EngineLimits, EngineLoad, GpuNeed};
pub use upstream::Outlier;
