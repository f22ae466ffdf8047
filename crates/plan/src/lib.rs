//! headroom-plan: pure GPU-memory arithmetic. Given a [`ModelSpec`] and engine settings it predicts
//! what vLLM will spend (weights, activation peak, non-torch memory, CUDA graphs, KV cache), the
//! blocks, tokens and concurrency it will log, its start-up failures, and the flags that fit a card
//! shared with other tenants. No I/O lives here: callers hand in plain values.

pub mod advice;
mod facade;
pub mod kv;
pub mod llamacpp;
pub mod overhead;
pub mod spec;
pub mod units;
pub mod vllm;
pub mod weights;

#[cfg(test)]
mod fixtures;
#[cfg(test)]
mod properties;

pub use facade::plan;
pub use kv::{KvCacheDtype, KvLayout, KvSettings};
pub use spec::*;
pub use vllm::{Failure, Plan, PlanError, PlanRequest, Reservation, VllmVersion};
