//! Everything before a process starts: the paths and ports the box names, and the box's memory
//! cgroup with `[memory] enforce`.

use crate::UpError;
use crate::boxfile::{BoxConfig, resolve_model};
use crate::cgroup::BoxCgroup;
use crate::options::UpOptions;
use crate::process::{self};
use crate::warmup;

/// With `[memory] enforce`: the box's memory cgroup, limited to the capacity (stale ones of
/// earlier `up`s removed first). Fails with what is missing and how to enable it.
pub(crate) fn enforce_capacity(
    config: &BoxConfig,
    opts: &UpOptions,
) -> Result<Option<BoxCgroup>, UpError> {
    let m = &config.memory;
    if !m.enforce {
        return Ok(None);
    }
    let capacity = m
        .capacity
        .ok_or_else(|| UpError::Enforce("needs a capacity to enforce".into()))?;
    let name = opts
        .box_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "box".into());
    let say = |line: &str| (opts.progress)(line);
    BoxCgroup::create(&name, capacity, &say).map(Some)
}

/// Everything that can fail before a process starts: paths (see [`check_paths`]), then ports.
pub(crate) fn preflight(config: &BoxConfig) -> Result<(), UpError> {
    check_paths(config)?;
    for b in &config.backends {
        process::check_port_free(&b.name, b.port)?;
    }
    Ok(())
}

/// Every path the box names, as `up --check` checks them: each backend's program, its warm-up
/// file (readable), the models. A relative path that is missing is reported with the folder it
/// was taken from (the box file's).
pub fn check_paths(config: &BoxConfig) -> Result<(), UpError> {
    for b in &config.backends {
        process::check_command(b, &config.dir)?;
        if let Some(w) = &b.warmup {
            warmup::prepare(b, w)?;
        }
        if let Some(t) = &b.text {
            resolve_model(&config.dir, &t.model)?;
        }
        if let Some(a) = &b.audio_vllm {
            resolve_model(&config.dir, &a.model)?;
        }
    }
    Ok(())
}
