//! headroom-up: the box supervisor behind `headroom up`. It reads a box file ([`boxfile`]),
//! starts the audio backends in their own process groups ([`process`]), waits until each one's
//! memory is steady (`steady`), runs its warm-up job while sampling the pool at ≥ 20 Hz
//! ([`warmup`]), gives the text engine what the measured peaks leave (`budget`) as its own
//! memory flags ([`flags`]), starts it and checks its start-up log, then runs `serve` in the same
//! process with lanes derived from the same figures (`lanes`), restarts backends that exit and
//! stops everything in order ([`supervisor`]); with `[memory] enforce` every backend runs in one
//! memory cgroup limited to the capacity ([`cgroup`]). A later start uses the figures kept from an
//! earlier one while they still describe the backend (`kept`). An audio backend that is itself a
//! vLLM is planned before it starts (`audio_vllm`), then measured like the others. Planning comes
//! from `headroom-plan`, GGUF reading from `headroom-inspect`, log reading from `headroom-doctor`,
//! memory readings from `headroom-gpu` (NVML or the host pool), the gateway from
//! `headroom-server`.
//!
//! Reading the supervisor, top down: `supervisor` (the outline of a run) → `bringup` (the start
//! sequence) → `launch` (one backend started and healthy), `measure` (steady levels, warm-ups,
//! peaks), `plan_flags` (flags from the figures), `plan_check` (the start-up log against the
//! plan), `beside` (whether text slows audio) → `ctx` (what every step shares), `meter` (pool
//! readings), `report` (`/admin/box`); then `keeper` (restarts), `monitor` (drift) and `pause`
//! (llama.cpp paused by signal) while the gateway serves.

mod audio_vllm;
mod beside;
pub mod boxfile;
mod bringup;
mod budget;
pub mod cgroup;
pub mod checks;
mod contention;
mod ctx;
mod error;
pub mod example;
pub mod flags;
mod keeper;
mod kept;
mod lanes;
mod launch;
mod logs;
mod measure;
mod meter;
mod monitor;
mod options;
mod pause;
mod plan_check;
mod plan_flags;
mod preflight;
pub mod process;
mod report;
mod steady;
pub mod supervisor;
mod versions;
pub mod warmup;

pub use boxfile::BoxConfig;
pub use error::{GatewayFailure, ProbeFailure, UpError};
pub use options::{HandSized, UpOptions};
pub use supervisor::run;
