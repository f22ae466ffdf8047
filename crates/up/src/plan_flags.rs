//! Planning flags before an engine starts: the text engine's sequences and memory flags, and an
//! audio vLLM's, from the measured figures.

use std::path::Path;

use crate::UpError;
use crate::audio_vllm;
use crate::boxfile::{BackendConfig, Engine, ProbeKind, resolve_model};
use crate::budget::{AudioFootprint, Budget, mib};
use crate::ctx::Ctx;
use crate::flags::{self, TextFlags};
use crate::lanes::{LaneFigures, text_slots};
use crate::launch::Started;

/// Plans an audio vLLM before it starts: `--max-model-len` from the longest audio, its sequences
/// and pool share from what the pool has left after the audio backends already measured (their
/// peaks) and the co-tenants seen so far, less the margin.
pub(crate) fn audio_vllm_flags(
    ctx: &Ctx,
    b: &BackendConfig,
    started: &[Started],
    footprints: &[AudioFootprint],
) -> Result<TextFlags, UpError> {
    let a = b.audio_vllm.as_ref().expect("called for audio vLLMs only");
    let model = resolve_model(&ctx.config.dir, &a.model)?;
    let env = headroom_inspect::resolve::Env::from_process();
    let spec = headroom_inspect::resolve_model(&model, &env)
        .map_err(UpError::Model)?
        .spec;
    let len = audio_vllm::audio_length(&spec, a).map_err(|e| match e {
        UpError::Config { key, message } => UpError::Config {
            key: format!("backends ({}).{key}", b.name),
            message,
        },
        other => other,
    })?;
    let cotenants = ctx
        .meter
        .cotenants(started.iter().map(|s| s.group.pid), ctx.started_ms);
    let earlier = Budget::new(
        ctx.meter.capacity,
        footprints,
        cotenants.max_bytes(),
        ctx.config.memory.margin,
    );
    ctx.say(&format!(
        "up: [{}] audio vLLM: {} s of audio at {} tokens/s (from the {}) = {} audio + {} transcript tokens: --max-model-len {}; the pool has {} left",
        b.name,
        len.max_audio_seconds,
        len.tokens_per_second,
        len.rate_from,
        len.audio_tokens,
        len.transcript_tokens,
        len.max_model_len,
        mib(earlier.text_bytes)
    ));
    let result = if ctx.meter.kind == ProbeKind::Nvml {
        let pool = audio_vllm::GpuPool {
            device_total: ctx.meter.device_total,
            capacity: ctx.meter.capacity,
            held: earlier.audio_peak_bytes + earlier.cotenant_bytes,
            margin: earlier.margin_bytes,
        };
        audio_vllm::gpu_flags(&spec, a, &len, &pool)
    } else {
        audio_vllm::cpu_flags(&spec, a, &len, earlier.text_bytes)
    };
    let f = result.map_err(|e| {
        UpError::DoesNotFit(format!(
            "backend `{}`: {}",
            b.name,
            e.message_for("the audio vLLM")
        ))
    })?;
    ctx.say(&format!("up: [{}] flags: {}", b.name, f.describe()));
    Ok(f)
}

/// The text engine's sequences: its `max_parallel`, kept below `[serve] max_inflight_total`
/// less the audio lanes' slots ([`text_slots`]); said when that lowers it.
pub(crate) fn text_sequences(ctx: &Ctx, t: &BackendConfig, lanes: &[LaneFigures]) -> u64 {
    let max_parallel = t.text.as_ref().map_or(1, |p| p.max_parallel);
    let total = ctx
        .config
        .serve
        .top
        .get("max_inflight_total")
        .and_then(toml::Value::as_integer)
        .and_then(|n| u64::try_from(n).ok());
    let audio: u64 = lanes.iter().map(|l| l.max_inflight).sum();
    let slots = text_slots(max_parallel, total, audio);
    if slots < max_parallel {
        ctx.say(&format!(
            "up: [{}] {slots} sequence(s), not {max_parallel}: [serve] max_inflight_total {} less the audio lanes' {audio} slot(s), so an audio job never waits for a generation to end",
            t.name,
            total.unwrap_or(0)
        ));
    }
    slots
}

/// The text engine's flags for `sequences` sequences within its `budget`, from its model's shape
/// (llama.cpp: the GGUF; vLLM: inspect's model spec) and, on a GPU, the `audio` footprints.
pub(crate) fn text_flags(
    ctx: &Ctx,
    t: &BackendConfig,
    budget: &Budget,
    audio: &[AudioFootprint],
    sequences: u64,
) -> Result<TextFlags, UpError> {
    let plan = &crate::boxfile::TextPlan {
        max_parallel: sequences,
        ..t.text
            .clone()
            .expect("validated: text backends have a plan")
    };
    let model = resolve_model(&ctx.config.dir, &plan.model)?;
    let gpu = ctx.meter.kind == ProbeKind::Nvml;
    let result = match t.engine {
        Engine::LlamaCpp => {
            let shape = flags::llamacpp_model(Path::new(&model))?;
            flags::llamacpp_flags(&shape, plan, budget.text_bytes, gpu)
        }
        _ => {
            let env = headroom_inspect::resolve::Env::from_process();
            let spec = headroom_inspect::resolve_model(&model, &env)
                .map_err(UpError::Model)?
                .spec;
            if gpu {
                flags::vllm_gpu_flags(&spec, plan, budget, audio, ctx.meter.device_total)
            } else {
                flags::vllm_cpu_flags(&spec, plan, budget.text_bytes)
            }
        }
    };
    result.map_err(|e| UpError::DoesNotFit(format!("backend `{}`: {}", t.name, e.message())))
}
