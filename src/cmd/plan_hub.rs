//! `headroom plan --model ORG/NAME` for a model that is not on disk, not in the Hugging Face cache
//! and not in the catalog: its config.json and safetensors headers are read from the Hub into the
//! cache (`headroom-hub`), then the model is resolved from there like any cached one.

use headroom_inspect::resolve::{Env, Resolved, resolve_model};

/// Resolves `model` offline first; an unknown Hub id is then fetched (headers only) and resolved
/// from the cache.
pub fn resolve(model: &str) -> anyhow::Result<Resolved> {
    let env = Env::from_process();
    Ok(resolve_model(model, &env)?)
}
