//! Ollama's scheduler: "gpu has too little memory to allocate any layers" (with total, available,
//! minimum memory, layer size, partial and full offload sizes), "model requires more system
//! memory (X) than is available (Y)", and the `msg=offload` summary (layers offloaded of the
//! model's, memory available per GPU, memory required for full and partial offload).

use super::gib;
use crate::facts::{Facts, MAX_EVIDENCE, OllamaOffload, OllamaTooLittle, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{int_after, leading_size, logfmt_size, logfmt_value, size_list};
use crate::text::{find, has};

/// Ollama's settings as the log shows them: the server's env map (`OLLAMA_NUM_PARALLEL:4`), the
/// runner's command line (`--ctx-size 8192 --batch-size 512 --n-gpu-layers 29 --parallel 4`) and
/// the new engine's load request (`Parallel:4 BatchSize:512 KvSize:8192 GPULayers:29`).
fn config(facts: &mut Facts, line: &str) -> bool {
    let c = &mut facts.ollama_config;
    let mut hit = false;
    let mut take = |slot: &mut Option<u64>, keys: &[&str]| {
        if let Some(v) = keys
            .iter()
            .find_map(|k| int_after(line, k))
            .filter(|v| *v > 0)
        {
            *slot = Some(v);
            hit = true;
        }
    };
    take(
        &mut c.num_parallel,
        &["OLLAMA_NUM_PARALLEL:", "--parallel ", "Parallel:"],
    );
    take(&mut c.context_length, &["OLLAMA_CONTEXT_LENGTH:"]);
    take(&mut c.ctx_size, &["--ctx-size ", "KvSize:"]);
    take(&mut c.batch_size, &["--batch-size ", "BatchSize:"]);
    take(&mut c.gpu_layers, &["--n-gpu-layers ", "GPULayers:"]);
    take(&mut c.gpu_overhead, &["OLLAMA_GPU_OVERHEAD:"]);
    if let Some(at) = find(line, "OLLAMA_KV_CACHE_TYPE:") {
        let v: String = line[at + 21..]
            .chars()
            .take_while(|ch| ch.is_ascii_alphanumeric() || *ch == '_')
            .collect();
        c.kv_cache_type = (!v.is_empty()).then_some(v);
        hit = true;
    }
    if let Some(at) = find(line, "OLLAMA_FLASH_ATTENTION:") {
        c.flash_attention =
            Some(crate::text::starts(&line[at + 23..], "true") || line[at + 23..].starts_with('1'));
        hit = true;
    }
    hit
}

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let configured = config(facts, line);
    if has(line, "gpu has too little memory to allocate any layers") {
        let v = OllamaTooLittle {
            name: logfmt_value(line, "name").map(str::to_owned),
            total: logfmt_size(line, "total"),
            available: logfmt_size(line, "available"),
            minimum: logfmt_size(line, "minimum_memory"),
            layer_size: logfmt_size(line, "layer_size"),
            partial_offload: logfmt_size(line, "partial_offload"),
            full_offload: logfmt_size(line, "full_offload"),
        };
        record(&mut facts.ollama_too_little, v, line_no);
        mark(facts);
        return true;
    }
    if has(line, "model requires more system memory (") {
        let at = find(line, "model requires more system memory (").unwrap_or(0) + 35;
        let required = leading_size(&line[at..]).map(|v| v.0);
        let available = find(&line[at..], "than is available (")
            .and_then(|p| leading_size(&line[at + p + 19..]))
            .map(|v| v.0);
        if let (Some(r), Some(a)) = (required, available) {
            record(&mut facts.ollama_system_memory, (r, a), line_no);
            mark(facts);
            return true;
        }
    }
    if has(line, "layers.offload=")
        || has(line, "layers.model=")
        || has(line, "memory.required.full=")
        || has(line, "memory.available=")
        || has(line, "memory.required.allocations=")
        || has(line, "memory.graph.full=")
    {
        let o = facts
            .ollama_offload
            .get_or_insert_with(OllamaOffload::default);
        if o.lines.len() < MAX_EVIDENCE {
            o.lines.push(line_no);
        }
        let first = |slot: &mut Option<u64>, key: &str| {
            if slot.is_none() {
                *slot = logfmt_value(line, key).and_then(|v| v.parse().ok());
            }
        };
        first(&mut o.layers_model, "layers.model");
        first(&mut o.layers_offload, "layers.offload");
        if facts.ollama_config.gpu_layers.is_none() {
            facts.ollama_config.gpu_layers = o.layers_offload;
        }
        let size_first = |slot: &mut Option<f64>, key: &str| {
            if slot.is_none() {
                *slot = logfmt_size(line, key);
            }
        };
        size_first(&mut o.required_full, "memory.required.full");
        size_first(&mut o.required_partial, "memory.required.partial");
        size_first(&mut o.required_kv, "memory.required.kv");
        size_first(&mut o.graph_full, "memory.graph.full");
        if o.available.is_empty() {
            o.available = logfmt_value(line, "memory.available")
                .map(size_list)
                .unwrap_or_default();
        }
        if o.allocations.is_empty() {
            o.allocations = logfmt_value(line, "memory.required.allocations")
                .map(size_list)
                .unwrap_or_default();
        }
        mark(facts);
        return true;
    }
    if has(line, "memory.weights.total=") || has(line, "projector.weights=") {
        return true;
    }
    configured
}

fn mark(facts: &mut Facts) {
    facts.saw_engine(Engine::Ollama);
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    if let Some(seen) = &facts.ollama_too_little {
        let t = &seen.value;
        let need = t
            .full_offload
            .into_iter()
            .chain(t.partial_offload)
            .fold(f64::NAN, f64::min);
        let need = need.is_finite().then_some(need);
        let base = |cause, likelihood| {
            Finding::new(cause, likelihood)
                .num("total_gib", t.total)
                .num("available_gib", t.available)
                .num("minimum_memory_gib", t.minimum)
                .num("layer_size_gib", t.layer_size)
                .num("partial_offload_gib", t.partial_offload)
                .num("full_offload_gib", t.full_offload)
                .lines(seen.lines.iter().copied())
        };
        let name = t.name.as_deref().unwrap_or("the GPU");
        match (t.available, need) {
            (Some(avail), Some(need)) if avail >= need => out.push(base(Cause::NotOutOfMemory, 0.9).fix(format!(
                "Ollama says {name} has too little memory, but its own numbers show {} GiB available against {} GiB for full offload: \
                 memory is not what stopped it; look at the lines around it (driver, compute capability, library) instead",
                gib(avail),
                gib(need)
            ))),
            (Some(avail), Some(need)) => out.push(base(Cause::WeightsDoNotFit, 0.9).fix(format!(
                "{name} has {} GiB available; even partial offload needs {} GiB (graph, projector and at least one layer): {} GiB short — \
                 lower `num_ctx` (the KV and graph shrink with it), use a smaller quantization, or run on CPU",
                gib(avail),
                gib(need),
                gib(need - avail)
            ))),
            _ => out.push(base(Cause::WeightsDoNotFit, 0.6).fix(format!(
                "{name} could not take any layer; the available or required sizes are missing from the line"
            ))),
        }
        if facts
            .ollama_offload
            .as_ref()
            .is_some_and(|o| o.available.len() > 1)
        {
            out.push(base(Cause::MultiGpuWorkerLimit, 0.4).fix(
                "Ollama places whole layers per GPU; a GPU below the per-GPU minimum gets none",
            ));
        }
    }
    if let Some(seen) = &facts.ollama_system_memory {
        let (required, available) = seen.value;
        out.push(
            Finding::new(Cause::WeightsDoNotFit, 0.95)
                .num("required_gib", Some(required))
                .num("available_gib", Some(available))
                .fix(format!(
                    "the model needs {} GiB of host memory for the layers not on GPU, {} GiB is available: {} GiB short — a smaller quantization, \
                     more layers on GPU, or more RAM/swap",
                    gib(required),
                    gib(available),
                    gib(required - available)
                ))
                .lines(seen.lines.iter().copied()),
        );
    }
    if let Some(o) = &facts.ollama_offload
        && let (Some(model), Some(off)) = (o.layers_model, o.layers_offload)
    {
        let largest = o.available.iter().copied().fold(0.0, f64::max);
        let idle: Vec<usize> = o
            .allocations
            .iter()
            .enumerate()
            .filter(|(i, a)| **a == 0.0 && o.available.get(*i).is_some_and(|v| *v > 0.0))
            .map(|(i, _)| i)
            .collect();
        let base = |cause, likelihood| {
            Finding::new(cause, likelihood)
                .count("layers_model", Some(model))
                .count("layers_offloaded", Some(off))
                .num("required_full_gib", o.required_full)
                .num("required_partial_gib", o.required_partial)
                .num("required_kv_gib", o.required_kv)
                .num(
                    "largest_gpu_available_gib",
                    (largest > 0.0).then_some(largest),
                )
                .lines(o.lines.iter().copied())
        };
        if off < model {
            let short = o.required_full.map(|f| f - largest);
            out.push(base(Cause::WeightsDoNotFit, 0.7).fix(format!(
                    "{off} of {model} layers went to GPU (the rest run on CPU): full offload needs {} GiB, the largest GPU has {} GiB{}",
                    o.required_full.map(gib).unwrap_or_else(|| "?".into()),
                    gib(largest),
                    match (short, o.required_kv) {
                        (Some(s), Some(kv)) if s > 0.0 => format!(
                            "; {} GiB short — the KV cache is {} GiB at this num_ctx (halving num_ctx saves about {} GiB), or a smaller quantization",
                            gib(s),
                            gib(kv),
                            gib(kv / 2.0)
                        ),
                        _ => String::new(),
                    }
                )));
        }
        if !idle.is_empty() {
            let gpus = idle
                .iter()
                .map(|i| format!("GPU {i} ({} GiB)", gib(o.available[*i])))
                .collect::<Vec<_>>()
                .join(", ");
            out.push(base(Cause::MultiGpuWorkerLimit, 0.75).fix(format!(
                    "{gpus} received no layers: each GPU must hold the graph ({} GiB), the projector and at least two layers before Ollama uses it; \
                     lower `num_ctx`/`num_batch` (smaller graph), or set `OLLAMA_FLASH_ATTENTION=1` with `OLLAMA_KV_CACHE_TYPE=q8_0` (half the KV cache; q4_0 a quarter) in the server's environment to get under that minimum",
                    o.graph_full.map(gib).unwrap_or_else(|| "?".into())
                )));
        }
    }
}
