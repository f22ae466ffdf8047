//! Why the gateway could not start: one error type for every step of building and binding it
//! (lanes, the upstream client, tokenizers, calibration, the listener).

use std::net::SocketAddr;

use crate::tokens;

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
    Client(#[source] reqwest::Error),
    #[error("{0}")]
    Tokenizer(#[source] tokens::LoadError),
    #[error("{0}")]
    Calibration(#[from] headroom_gpu::CalibrationError),
    #[error("server failed: {0}")]
    Io(#[from] std::io::Error),
}
