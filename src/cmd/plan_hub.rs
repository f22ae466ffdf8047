//! `headroom plan --model ORG/NAME` for a model that is not on disk, not in the Hugging Face cache
//! and not in the catalog: its config.json and safetensors headers are read from the Hub into the
//! cache (`headroom-hub`), then the model is resolved from there like any cached one, so the next
//! plan of it needs no network.

use anyhow::bail;
use headroom_inspect::InspectError;
use headroom_inspect::resolve::{Env, Resolved, resolve_model};

/// Resolves `model` offline first; an unknown Hub id is then fetched (headers only) and resolved
/// from the cache. When that fails too, the error says where it looked and what it asked.
pub fn resolve(model: &str) -> anyhow::Result<Resolved> {
    let env = Env::from_process();
    let (name, closest) = match resolve_model(model, &env) {
        Ok(r) => return Ok(r),
        Err(InspectError::UnknownModel { name, closest }) if headroom_hub::is_hub_id(model) => {
            (name, closest)
        }
        Err(e) => return Err(e.into()),
    };
    let searched: Vec<String> = env
        .hub_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    let Some(cfg) = headroom_hub::HubConfig::from_process() else {
        bail!(
            "unknown model '{name}': not a local path, not in the catalog, and no Hugging Face cache folder can be named (HF_HUB_CACHE, HF_HOME and HOME are unset)"
        );
    };
    match headroom_hub::fetch_blocking(&cfg, model, "main") {
        Ok(f) => {
            eprintln!(
                "headroom: note: {model} read from {} (config.json and {} safetensors header{}, {} bytes) into {}",
                cfg.endpoint,
                f.shards.len(),
                if f.shards.len() == 1 { "" } else { "s" },
                f.header_bytes,
                f.snapshot.display()
            );
            Ok(resolve_model(model, &env)?)
        }
        Err(e) => bail!(
            "unknown model '{name}': not a local path, not in the Hugging Face cache ({}), not in the catalog, and {e}; closest catalog names: {}",
            searched.join(", "),
            closest.join(", ")
        ),
    }
}
