//! headroom-up: the box supervisor behind `headroom up`. It reads a box file ([`boxfile`]),
//! starts the audio backends in their own process groups ([`process`]), waits until each one's
//! memory is steady ([`steady`]), runs its warm-up job while sampling the pool at ≥ 20 Hz
//! ([`warmup`]), gives the text engine what the measured peaks leave ([`budget`]) as its own
//! memory flags ([`flags`]), starts it and checks its start-up log, then runs `serve` in the same
//! process with lanes derived from the same figures ([`lanes`]), restarts backends that exit and
//! stops everything in order ([`supervisor`]); with `[memory] enforce` every backend runs in one
//! memory cgroup limited to the capacity ([`cgroup`]). A later start uses the figures kept from an
//! earlier one while they still describe the backend ([`kept`]). An audio backend that is itself a vLLM is planned
//! before it starts ([`audio_vllm`]), then measured like the others. Planning comes from `headroom-plan`, GGUF reading
//! from `headroom-inspect`, log reading from `headroom-doctor`, memory readings from
//! `headroom-gpu` (NVML or the host pool), the gateway from `headroom-server`.

pub mod audio_vllm;
mod beside;
pub mod boxfile;
mod bringup;
pub mod budget;
pub mod cgroup;
pub mod checks;
pub mod contention;
mod ctx;
pub mod example;
pub mod flags;
mod keeper;
pub mod kept;
pub mod lanes;
mod launch;
pub mod logs;
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
pub mod steady;
pub mod supervisor;
mod versions;
pub mod warmup;

pub use boxfile::BoxConfig;
pub use options::UpOptions;
pub use supervisor::run;

/// Why `up` stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpError {
    #[error("box file is not valid TOML: {0}")]
    Toml(String),
    #[error("box file {0}")]
    Memory(String),
    #[error("box file `{key}`: {message}")]
    Config { key: String, message: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("backend `{backend}`: cannot start `{command}`: {reason}")]
    Spawn {
        backend: String,
        command: String,
        reason: String,
    },
    #[error("backend `{backend}`: port {port} on 127.0.0.1 is already in use ({reason})")]
    PortTaken {
        backend: String,
        port: u16,
        reason: String,
    },
    #[error("model: {0}")]
    Model(String),
    #[error("memory probe: {0}")]
    Probe(String),
    #[error("[memory] enforce: {0}")]
    Enforce(String),
    #[error("backend `{backend}` {what}")]
    Backend { backend: String, what: String },
    #[error("{0}")]
    DoesNotFit(String),
    #[error("gateway: {0}")]
    Serve(String),
}

impl UpError {
    /// The process exit code: 2 bad input or unusable environment, 3 the box does not fit,
    /// 1 a backend that failed while starting or measuring.
    pub fn exit_code(&self) -> u8 {
        match self {
            UpError::DoesNotFit(_) => 3,
            UpError::Backend { .. } | UpError::Serve(_) => 1,
            _ => 2,
        }
    }
}
