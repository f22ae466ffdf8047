//! headroom-inspect: turns what a user names with `--model` into a [`ModelSpec`]. It looks, in
//! order, at a local path (directory, `config.json`, `*.safetensors` headers, a sharded index,
//! `*.gguf`), the Hugging Face cache, and the built-in catalog. Nothing here touches the network
//! or reads tensor data.

pub mod catalog;
pub mod config;
pub mod gguf;
pub mod llamacpp;
pub mod resolve;
pub mod safetensors;

use std::path::Path;

pub use headroom_plan::ModelSpec;
pub use resolve::{Resolved, ResolvedFrom, resolve_model};

/// Why a model could not be described.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InspectError {
    #[error("unknown model '{name}': not a local path, not in the Hugging Face cache, not in the catalog; closest catalog names: {}", closest.join(", "))]
    UnknownModel { name: String, closest: Vec<String> },
    #[error("{file} has no '{field}', which the plan needs")]
    MissingField { field: String, file: String },
    #[error("{file}: {reason}")]
    Malformed { file: String, reason: String },
    #[error("cannot read {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path} holds no config.json, *.safetensors or *.gguf to describe a model")]
    NothingToRead { path: String },
    #[error(
        "cannot plan {name} ({architecture}, {file}): {piece}; the planner models attention KV caches only, and a plan without that piece would be a guess"
    )]
    Unsupported {
        name: String,
        architecture: String,
        file: String,
        /// What the planner lacks, in words ("36 of 48 layers are 'linear_attention' layers,
        /// whose recurrent state it does not size").
        piece: String,
    },
}

impl InspectError {
    pub(crate) fn io(path: &Path, err: std::io::Error) -> InspectError {
        InspectError::Io {
            path: path.display().to_string(),
            reason: err.to_string(),
        }
    }
}
