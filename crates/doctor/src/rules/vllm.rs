//! vLLM messages, V0 and V1: the start-up free-memory check, "KV cache is needed, which is larger
//! than the available KV cache memory", "max seq len … larger than the maximum number of tokens
//! that can be stored in KV cache", "No available memory for the cache blocks", the sampler
//! warm-up OOM, CUDA-graph capture OOM, and the memory-profiling summary lines (all formats) that
//! a successful start prints, including the CPU backend's KV-space and KV-size lines.

use headroom_plan::advice::{
    self, blocks_for_tokens, kv_bytes_per_token_from_need, max_model_len_for_kv,
    sequences_that_fit, tokens_with_kv_ratio, utilization_after_shortfall, utilization_for_kv,
    utilization_within_free,
};

use super::{count, gib, plan_hint, size};
use crate::facts::{Facts, KvNeed, KvTokensShort, Phase, StartupFree, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{int_after, leading_number, leading_size, number_after, size_after};
use crate::text::{find, has, rfind, starts};

const MAX_STARTUP_EVIDENCE: usize = 24;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    if !facts.vllm_v1
        && (has(line, "EngineCore") || has(line, "gpu_worker.py") || has(line, "gpu_model_runner"))
    {
        facts.vllm_v1 = true;
    }
    if has(line, "Free memory on device") {
        let hit = startup_free(facts, line_no, line);
        return profiling_lines(facts, line_no, line) || hit;
    }
    if has(line, "Desired GPU memory utilization is (") {
        if let Some((util, budget)) = pair_after(line, "Desired GPU memory utilization is (") {
            let b = &mut facts.startup.breakdown;
            b.utilization.get_or_insert(util);
            b.budget_gib.get_or_insert(budget);
            push_startup_line(facts, line_no);
        }
        return true;
    }
    if has(line, "max seq len (") && has(line, "To serve at least one request") {
        // The length the check was made for; the sizes may follow on this line or the next.
        facts.kv_need_len = int_after(line, "max seq len (").map(|n| (n, line_no));
    }
    if has(line, "KV cache is needed") && has(line, "available KV cache memory") {
        // "… max seq len (L), (X GiB KV cache is needed, which is larger than the available KV
        // cache memory (Y GiB)", older and newer wordings (with or without the parenthesis).
        let max_len = int_after(line, "max seq len (").or_else(|| {
            facts
                .kv_need_len
                .filter(|(_, at)| line_no.saturating_sub(*at) <= 2)
                .map(|(n, _)| n)
        });
        let need = size_before(line, " KV cache is needed");
        let available = size_after(line, "available KV cache memory (");
        if let (Some(max_model_len), Some(need), Some(available)) = (max_len, need, available) {
            let estimated_max_len = int_after(line, "estimated maximum model length is ");
            facts.saw_engine(Engine::Vllm);
            facts.saw_oom(line_no);
            record(
                &mut facts.kv_need,
                KvNeed {
                    max_model_len,
                    need,
                    available,
                    estimated_max_len,
                },
                line_no,
            );
            return true;
        }
    }
    if has(line, "estimated maximum model length is")
        && let Some(seen) = facts.kv_need.as_mut()
        && seen.value.estimated_max_len.is_none()
        && seen
            .lines
            .last()
            .is_some_and(|l| line_no.saturating_sub(*l) <= 2)
    {
        seen.value.estimated_max_len = int_after(line, "estimated maximum model length is ");
        return true;
    }
    if has(
        line,
        "is larger than the maximum number of tokens that can be stored in KV cache",
    ) && let (Some(max_model_len), Some(kv_tokens)) = (
        int_after(line, "max seq len ("),
        int_after(line, "stored in KV cache ("),
    ) {
        facts.vllm_v0 = true;
        facts.saw_engine(Engine::Vllm);
        record(
            &mut facts.kv_tokens_short,
            KvTokensShort {
                max_model_len,
                kv_tokens,
            },
            line_no,
        );
        return true;
    }
    if has(line, "No available memory for the cache blocks") {
        facts.saw_engine(Engine::Vllm);
        record(&mut facts.no_cache_blocks, (), line_no);
        return true;
    }
    if has(line, "when warming up sampler with")
        && let Some(n) = int_after(line, "warming up sampler with ")
    {
        facts.saw_engine(Engine::Vllm);
        facts.saw_oom(line_no);
        record(&mut facts.sampler_warmup, n, line_no);
        return true;
    }
    if has(line, "CUDA error: out of memory") {
        let phase = facts.phase_at(line_no, phase_here);
        facts.saw_oom(line_no);
        record(&mut facts.cuda_error_oom, phase, line_no);
        return true;
    }
    if cpu_kv_lines(facts, line_no, line) {
        return true;
    }
    profiling_lines(facts, line_no, line)
}

/// vLLM's CPU backend: "Explicitly set (X/Y) GiB for KV cache on node N." (X from
/// VLLM_CPU_KVCACHE_SPACE, Y the node's memory) and "CPU KV cache size: N tokens, …".
fn cpu_kv_lines(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let b = &mut facts.startup.breakdown;
    let hit = if has(line, "GiB for KV cache on node") {
        set(&mut b.kv_cache_gib, number_after(line, "Explicitly set ("))
    } else if has(line, "CPU KV cache size:") {
        let tokens = set_count(&mut b.kv_tokens, int_after(line, "CPU KV cache size:"));
        // The same line carries "Maximum concurrency for L tokens per request: Cx".
        profiling_lines(facts, line_no, line) || tokens
    } else {
        return false;
    };
    if hit {
        push_startup_line(facts, line_no);
    }
    hit
}

fn startup_free(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let Some(at) = find(line, "Free memory on device") else {
        return false;
    };
    let rest = &line[at + "Free memory on device".len()..];
    let Some(open) = rest.find('(') else {
        return false;
    };
    let device = rest[..open].trim();
    let device = (!device.is_empty() && device.len() < 32).then(|| device.to_owned());
    let inner = &rest[open + 1..];
    let Some((free, used)) = leading_number(inner) else {
        return false;
    };
    let Some(total) = inner[used..]
        .strip_prefix('/')
        .and_then(leading_number)
        .map(|v| v.0)
    else {
        return false;
    };
    if has(line, "is less than desired GPU memory utilization (") {
        let Some((util, requested)) = pair_after(line, "desired GPU memory utilization (") else {
            return false;
        };
        facts.saw_engine(Engine::Vllm);
        let value = StartupFree {
            device,
            free,
            total,
            util,
            requested,
        };
        record(&mut facts.startup_free, value, line_no);
    } else {
        facts.startup.breakdown.total_gib.get_or_insert(total);
        if let Some((util, budget)) = pair_after(line, "Desired GPU memory utilization is (") {
            facts.startup.breakdown.utilization.get_or_insert(util);
            facts.startup.breakdown.budget_gib.get_or_insert(budget);
        }
        push_startup_line(facts, line_no);
    }
    true
}

/// The size written just before `marker`: `3.87 GiB` in "3.87 GiB for weights".
fn size_before(line: &str, marker: &str) -> Option<f64> {
    let at = find(line, marker)?;
    let head = line[..at].trim_end();
    let unit_start = head.rfind(' ')? + 1;
    let num_end = head[..unit_start].trim_end();
    let num_start = num_end
        .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or(0, |i| i + 1);
    let text = format!("{} {}", &num_end[num_start..], &head[unit_start..]);
    leading_size(&text).map(|v| v.0)
}

/// `(0.9, 19.84 GiB)` after `marker`.
fn pair_after(line: &str, marker: &str) -> Option<(f64, f64)> {
    let at = find(line, marker)? + marker.len();
    let (a, used) = leading_number(&line[at..])?;
    let rest = line[at + used..].strip_prefix(',')?.trim_start();
    let (b, _) = leading_number(rest)?;
    Some((a, b))
}

fn push_startup_line(facts: &mut Facts, line_no: u64) {
    let lines = &mut facts.startup.evidence_lines;
    if lines.len() < MAX_STARTUP_EVIDENCE && lines.last() != Some(&line_no) {
        lines.push(line_no);
    }
    facts.saw_engine(Engine::Vllm);
}

fn set(slot: &mut Option<f64>, v: Option<f64>) -> bool {
    match v {
        Some(v) => {
            slot.get_or_insert(v);
            true
        }
        None => false,
    }
}

fn set_count(slot: &mut Option<u64>, v: Option<u64>) -> bool {
    match v {
        Some(v) => {
            slot.get_or_insert(v);
            true
        }
        None => false,
    }
}

/// Memory-profiling summaries of every vLLM generation, and the KV / graph lines.
fn profiling_lines(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let mut hit = false;
    {
        let b = &mut facts.startup.breakdown;
        if has(line, "Loading model weights took") || has(line, "Model loading took") {
            hit |= set(
                &mut b.weights_gib,
                size_after(line, "weights took").or_else(|| size_after(line, "loading took")),
            );
        }
        if has(line, "total_gpu_memory=") {
            // Late-2024 one-line format: peak_torch includes the weights.
            let total = size_after(line, "total_gpu_memory=");
            let peak_torch = size_after(line, "peak_torch_memory=");
            let non_torch = size_after(line, "non_torch_memory=");
            let kv = size_after(line, "kv_cache_size=");
            let util = number_after(line, "gpu_memory_utilization=");
            hit |= set(&mut b.total_gib, total);
            hit |= set(&mut b.non_torch_gib, non_torch);
            hit |= set(&mut b.kv_cache_gib, kv);
            hit |= set(&mut b.utilization, util);
            if let (Some(t), Some(u)) = (total, util) {
                set(&mut b.budget_gib, Some(t * u));
            }
            if let (Some(p), Some(w)) = (peak_torch, b.weights_gib) {
                set(&mut b.activation_peak_gib, Some((p - w).max(0.0)));
            }
        } else if has(line, "total_gpu_memory (") {
            hit |= set(&mut b.total_gib, size_after(line, "total_gpu_memory ("));
            hit |= set(
                &mut b.utilization,
                number_after(line, "gpu_memory_utilization ("),
            );
            hit |= set(
                &mut b.budget_gib,
                rfind(line, ") = ")
                    .and_then(|at| leading_size(&line[at + 4..]))
                    .map(|v| v.0),
            );
        } else if has(line, "total_gpu_memory") {
            hit |= set(&mut b.total_gib, size_after(line, "total_gpu_memory"));
        } else if has(line, "] gpu_memory_utilization") {
            hit |= set(
                &mut b.utilization,
                number_after(line, "gpu_memory_utilization"),
            );
        }
        if has(line, "the current vLLM instance can use") && !has(line, "total_gpu_memory") {
            hit |= set(
                &mut b.budget_gib,
                size_after(line, "the current vLLM instance can use"),
            );
        }
        if has(line, "model weights take") {
            hit |= set(&mut b.weights_gib, size_after(line, "model weights take"));
        }
        if has(line, "non_torch_memory") && !has(line, "non_torch_memory=") {
            let v = size_after(line, "non_torch_memory takes")
                .or_else(|| size_after(line, "non_torch_memory"));
            hit |= set(&mut b.non_torch_gib, v);
        }
        if has(line, "PyTorch activation peak memory") {
            let v = size_after(line, "activation peak memory takes")
                .or_else(|| size_after(line, "activation peak memory"));
            hit |= set(&mut b.activation_peak_gib, v);
        }
        if has(line, "reserved for KV Cache is") {
            hit |= set(
                &mut b.kv_cache_gib,
                size_after(line, "reserved for KV Cache is"),
            );
        }
        if has(line, "available_kv_cache_memory") {
            hit |= set(
                &mut b.kv_cache_gib,
                size_after(line, "available_kv_cache_memory"),
            );
        }
        if has(line, "Available KV cache memory:") {
            hit |= set(
                &mut b.kv_cache_gib,
                size_after(line, "Available KV cache memory:"),
            );
        }
        for marker in ["GPU blocks: ", "cuda blocks: ", "CUDA blocks: "] {
            if has(line, marker) {
                hit |= set_count(&mut b.gpu_blocks, int_after(line, marker));
            }
        }
        if has(line, "GPU KV cache size:") {
            hit |= set_count(&mut b.kv_tokens, int_after(line, "GPU KV cache size:"));
        }
        if has(line, "Maximum concurrency for") {
            hit |= set_count(
                &mut b.max_model_len,
                int_after(line, "Maximum concurrency for"),
            );
            hit |= set(
                &mut b.max_concurrency,
                number_after(line, "tokens per request:"),
            );
        }
        if has(line, "Actual usage") {
            // The start-up recommendation, in each version's words: "W GiB for weight, A GiB for
            // peak activation, N GiB for non-torch memory, and C GiB for CUDAGraph memory", or
            // "X GiB for consumed memory (weights + non-torch), A GiB for peak activation, and C
            // GiB for CUDAGraph memory", or "… for NPU graph memory".
            hit |= set(&mut b.weights_gib, size_before(line, " for weight"));
            hit |= set(
                &mut b.activation_peak_gib,
                size_before(line, " for peak activation"),
            );
            hit |= set(&mut b.non_torch_gib, size_before(line, " for non-torch"));
            hit |= set(
                &mut b.cuda_graph_gib,
                size_before(line, " for CUDAGraph").or_else(|| size_before(line, " graph memory")),
            );
        }
        // V1's debug summary: "Memory profiling takes N seconds. Total non KV cache memory: X;
        // torch peak memory increase: A; non-torch forward increase memory: N; weights memory: W."
        if has(line, "non-torch forward increase memory") {
            hit |= set(
                &mut b.non_torch_gib,
                size_after(line, "non-torch forward increase memory:"),
            );
            hit |= set(
                &mut b.activation_peak_gib,
                size_after(line, "torch peak memory increase:"),
            );
            hit |= set(&mut b.weights_gib, size_after(line, "weights memory:"));
        }
        if has(line, "Requested memory:") && has(line, "(util)") {
            hit |= set(&mut b.utilization, number_after(line, "Requested memory:"));
            hit |= set(&mut b.budget_gib, size_after(line, "(util),"));
        }
        if has(line, "kv cache memory in use is") {
            hit |= set(
                &mut b.kv_cache_gib,
                size_after(line, "kv cache memory in use is"),
            );
        }
        if has(line, "Graph capturing finished") {
            hit |= set(&mut b.cuda_graph_gib, size_after(line, ", took"));
        }
        if has(line, "CUDA graph pool memory:") {
            hit |= set(
                &mut b.cuda_graph_gib,
                size_after(line, "CUDA graph pool memory:"),
            );
            hit |= set(
                &mut facts.startup.cuda_graph_estimate_gib,
                size_after(line, "(actual),"),
            );
        }
    }
    if has(line, "Actual usage") && has(line, "for consumed memory") {
        hit |= set(
            &mut facts.startup.consumed_gib,
            size_before(line, " for consumed memory"),
        );
    }
    if has(line, "Estimated CUDA graph memory:") {
        hit |= set(
            &mut facts.startup.cuda_graph_estimate_gib,
            size_after(line, "Estimated CUDA graph memory:"),
        );
    }
    if has(line, "Memory profiling takes") || has(line, "Memory profiling results") {
        facts.vllm_v0 = true;
        hit = true;
    }
    if hit {
        push_startup_line(facts, line_no);
    }
    hit
}

/// Fills what the profiling lines imply (budget from total × util, V0 KV tokens from blocks).
pub fn finish_startup(facts: &mut Facts) {
    let s = &mut facts.startup;
    s.tensor_parallel_size = facts.tp;
    s.pipeline_parallel_size = facts.pp;
    s.model = facts.model.clone();
    s.block_size = facts.block_size;
    if let Some(k) = facts.kv_cache_memory {
        s.kv_cache_memory_fits_bytes = k.fits_requested;
        s.kv_cache_memory_fills_bytes = k.fills_card;
        if !s.evidence_lines.contains(&k.line) {
            s.evidence_lines.push(k.line);
        }
    }
    if let Some(g) = facts.graph_profiling {
        if s.cuda_graph_estimate_gib.is_none()
            && let Some(t) = s.breakdown.total_gib
        {
            s.cuda_graph_estimate_gib = Some((g.utilization - g.equivalent).max(0.0) * t);
        }
        if !s.evidence_lines.contains(&g.line) {
            s.evidence_lines.push(g.line);
        }
        s.evidence_lines.sort_unstable();
    }
    let b = &mut s.breakdown;
    if b.utilization.is_none() {
        b.utilization = facts.utilization_config;
    }
    if b.max_model_len.is_none() {
        b.max_model_len = facts.max_model_len_config;
    }
    if b.budget_gib.is_none()
        && let (Some(t), Some(u)) = (b.total_gib, b.utilization)
    {
        b.budget_gib = Some(t * u);
    }
    if let (Some(t), Some(budget)) = (b.total_gib, b.budget_gib) {
        s.outside_budget_gib = Some((t - budget).max(0.0));
    }
    let block = facts.block_size.unwrap_or(advice::DEFAULT_BLOCK_SIZE);
    if b.kv_tokens.is_none()
        && let Some(blocks) = b.gpu_blocks
    {
        b.kv_tokens = Some(blocks.saturating_mul(block));
    }
    if let (Some(kv), Some(tokens)) = (b.kv_cache_gib, b.kv_tokens.filter(|t| *t > 0)) {
        s.kv_bytes_per_token = Some(kv * advice::GIB / tokens as f64);
    }
    if let (Some(tokens), Some(len)) = (b.kv_tokens, b.max_model_len) {
        s.concurrency_check = advice::concurrency(tokens / block, len, block);
    }
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    startup_free_finding(facts, out);
    kv_need_finding(facts, out);
    kv_tokens_short_finding(facts, out);
    no_cache_blocks_finding(facts, out);
    sampler_finding(facts, out);
    graph_finding(facts, out);
}

fn startup_free_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.startup_free else {
        return;
    };
    let s = &seen.value;
    let held = (s.total - s.free).max(0.0);
    let missing = (s.requested - s.free).max(0.0);
    let util = utilization_within_free(s.free, s.total);
    let where_ = s
        .device
        .as_deref()
        .map(|d| format!(" on {d}"))
        .unwrap_or_default();
    let mut fix = format!(
        "free {} GiB of {} GiB{where_}; at start vLLM needs util × total ≤ free: ",
        gib(s.free),
        gib(s.total)
    );
    match util {
        Some(u) => fix.push_str(&format!(
            "use `--gpu-memory-utilization {u:.2}` ({} GiB), or free {} GiB more on the device (something else holds {} GiB)",
            gib(u * s.total),
            gib(missing),
            gib(held)
        )),
        None => fix.push_str(&format!("no utilization fits; free {} GiB on the device", gib(missing))),
    }
    out.push(
        Finding::new(Cause::StartupFreeMemoryBelowUtilization, 1.0)
            .num("free_gib", Some(s.free))
            .num("total_gib", Some(s.total))
            .num("requested_utilization", Some(s.util))
            .num("requested_gib", Some(s.requested))
            .num("held_by_others_gib", Some(held))
            .num("utilization_that_fits", util)
            .fix(fix)
            .lines(seen.lines.iter().copied()),
    );
    if held > 0.0 {
        out.push(
            Finding::new(Cause::OtherProcessHoldsMemory, 0.6)
                .num("held_by_others_gib", Some(held))
                .num("missing_gib", Some(missing))
                .fix(format!(
                    "{} GiB of the device was in use before vLLM started (another process, or a previous instance not yet gone); \
                     to keep --gpu-memory-utilization {:.2}, at least {} GiB of it must be freed first \
                     (`nvidia-smi --query-compute-apps=pid,used_memory --format=csv` lists the holders)",
                    gib(held),
                    s.util,
                    gib(missing)
                ))
                .lines(seen.lines.iter().copied()),
        );
    }
    let device_index = s
        .device
        .as_deref()
        .and_then(|d| d.rsplit(':').next())
        .and_then(|d| d.parse::<u64>().ok());
    if device_index.is_some_and(|d| d > 0) || facts.tp.is_some_and(|t| t > 1) {
        out.push(
            Finding::new(Cause::MultiGpuWorkerLimit, 0.5)
                .count("device_index", device_index)
                .num("free_gib", Some(s.free))
                .fix(format!(
                    "each worker checks its own GPU; the one{where_} had {} GiB free, so the utilization for all ranks must satisfy that GPU: {}",
                    gib(s.free),
                    util.map(|u| format!("`--gpu-memory-utilization {u:.2}`")).unwrap_or_else(|| "none fits".into())
                ))
                .lines(seen.lines.iter().copied()),
        );
    }
}

fn total_and_util(facts: &Facts) -> (Option<f64>, Option<f64>) {
    let b = &facts.startup.breakdown;
    (b.total_gib, b.utilization.or(facts.utilization_config))
}

fn kv_fp8_applicable(facts: &Facts) -> bool {
    !facts
        .kv_cache_dtype
        .as_deref()
        .is_some_and(|d| starts(d, "fp8") || has(d, "fp4"))
}

fn block_size(facts: &Facts) -> u64 {
    facts.block_size.unwrap_or(advice::DEFAULT_BLOCK_SIZE)
}

fn kv_need_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.kv_need else { return };
    let k = &seen.value;
    let block = block_size(facts);
    let bpt = kv_bytes_per_token_from_need(k.need, k.max_model_len);
    let computed = bpt.map(|b| max_model_len_for_kv(k.available, b, block));
    let fits_len = k.estimated_max_len.or(computed);
    let fp8 = bpt
        .filter(|_| kv_fp8_applicable(facts))
        .map(|b| max_model_len_for_kv(k.available, b / 2.0, block));
    let (total, util) = total_and_util(facts);
    let util_fit = match (util, total) {
        (Some(u), Some(t)) => utilization_for_kv(u, t, k.need, k.available),
        _ => None,
    };
    let mut fix = format!(
        "{} tokens need {} GiB of KV, {} GiB available: ",
        count(k.max_model_len),
        gib(k.need),
        gib(k.available)
    );
    let mut options = Vec::new();
    match fits_len {
        Some(len) if len > 0 => options.push(format!("`--max-model-len {len}`")),
        _ => options.push("no max_model_len fits in the available KV memory".to_owned()),
    }
    if let Some(len) = fp8.filter(|l| *l > 0) {
        options.push(format!("or `--kv-cache-dtype fp8` for {}", count(len)));
    }
    match util_fit {
        Some(u) if u <= 1.0 => options.push(format!("or `--gpu-memory-utilization {u:.2}`")),
        Some(_) => options.push(format!(
            "no utilization ≤ 1.0 fits {} tokens on this card (needs {} GiB more KV)",
            count(k.max_model_len),
            gib(k.need - k.available)
        )),
        None => {}
    }
    fix.push_str(&options.join(", "));
    fix.push_str(&kv_fills_note(facts));
    if util_fit.is_none() {
        fix.push_str(&format!(
            "; the utilization that fits needs the card's total memory and the current utilization, which this log lacks ({} prints both)",
            plan_hint(facts)
        ));
    }
    if let (Some(est), Some(c)) = (k.estimated_max_len, computed)
        && est != c
    {
        fix.push_str(&format!(
                "; vLLM's own estimate {} is used (from the rounded GiB figures the block count gives {})",
                count(est),
                count(c)
            ));
    }
    out.push(
        Finding::new(Cause::KvCacheTooSmall, 1.0)
            .count("max_model_len", Some(k.max_model_len))
            .num("kv_needed_gib", Some(k.need))
            .num("kv_available_gib", Some(k.available))
            .count("estimated_max_model_len", k.estimated_max_len)
            .num("kv_bytes_per_token", bpt)
            .count("max_model_len_that_fits", fits_len)
            .count("max_model_len_fp8_kv", fp8)
            .num("utilization_that_fits", util_fit)
            .num("total_gib", total)
            .num("requested_utilization", util)
            .fix(fix)
            .lines(seen.lines.iter().copied()),
    );
}

fn kv_tokens_short_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.kv_tokens_short else {
        return;
    };
    let k = &seen.value;
    let block = block_size(facts);
    let fits = k.kv_tokens / block * block;
    let fp8 = kv_fp8_applicable(facts).then(|| tokens_with_kv_ratio(k.kv_tokens, 0.5, block));
    let b = &facts.startup.breakdown;
    let (total, util) = total_and_util(facts);
    let have_blocks = blocks_for_tokens(k.kv_tokens, block);
    let need_blocks = blocks_for_tokens(k.max_model_len, block);
    let kv_need = b
        .kv_cache_gib
        .filter(|_| have_blocks > 0)
        .map(|kv| kv * need_blocks as f64 / have_blocks as f64);
    let util_fit = match (util, total, kv_need, b.kv_cache_gib) {
        (Some(u), Some(t), Some(need), Some(avail)) => utilization_for_kv(u, t, need, avail),
        _ => None,
    };
    let mut fix = format!(
        "max_model_len {} needs {} KV blocks, the pool holds {} tokens ({} blocks): `--max-model-len {fits}`",
        count(k.max_model_len),
        count(need_blocks),
        count(k.kv_tokens),
        count(have_blocks)
    );
    if let Some(f) = fp8 {
        fix.push_str(&format!(", or `--kv-cache-dtype fp8` for {}", count(f)));
    }
    match util_fit {
        Some(u) if u <= 1.0 => fix.push_str(&format!(", or `--gpu-memory-utilization {u:.2}`")),
        Some(_) => fix.push_str(", and no utilization ≤ 1.0 makes the full length fit"),
        None => fix.push_str(&format!(
            "; the utilization that fits needs the KV pool size, the card's total and the current utilization, which this log lacks ({} prints them)",
            plan_hint(facts)
        )),
    }
    if facts.vllm_v0 {
        fix.push_str(
            "; note: this vLLM profiles activation memory with max_model_len, so changing --max-model-len also moves the pool size",
        );
    }
    out.push(
        Finding::new(Cause::KvCacheTooSmall, 1.0)
            .count("max_model_len", Some(k.max_model_len))
            .count("kv_tokens_available", Some(k.kv_tokens))
            .count("max_model_len_that_fits", Some(fits))
            .count("max_model_len_fp8_kv", fp8)
            .num("kv_available_gib", b.kv_cache_gib)
            .num("kv_needed_gib", kv_need)
            .num("utilization_that_fits", util_fit)
            .num("total_gib", total)
            .num("requested_utilization", util)
            .fix(fix)
            .lines(seen.lines.iter().copied()),
    );
}

fn no_cache_blocks_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.no_cache_blocks else {
        return;
    };
    let b = &facts.startup.breakdown;
    let (total, util) = total_and_util(facts);
    let budget = b.budget_gib.or(match (total, util) {
        (Some(t), Some(u)) => Some(t * u),
        _ => None,
    });
    let lines: Vec<u64> = seen
        .lines
        .iter()
        .copied()
        .chain(facts.startup.evidence_lines.iter().copied())
        .collect();
    if let (Some(w), Some(budget)) = (b.weights_gib, budget)
        && w >= budget
    {
        let t = total.unwrap_or(0.0);
        let need_util = if t > 0.0 {
            Some(advice::ceil_to(w / t, 2))
        } else {
            None
        };
        out.push(
                Finding::new(Cause::WeightsDoNotFit, 0.95)
                    .num("weights_gib", Some(w))
                    .num("budget_gib", Some(budget))
                    .num("total_gib", total)
                    .fix(format!(
                        "weights alone take {} GiB of a {} GiB budget; {}",
                        gib(w),
                        gib(budget),
                        match need_util {
                            Some(u) if u < 1.0 => format!(
                                "weights need at least `--gpu-memory-utilization {u:.2}` before any KV cache, or more GPUs (`--tensor-parallel-size`) or a quantized checkpoint"
                            ),
                            _ => "the weights do not fit this card: more GPUs (`--tensor-parallel-size`) or a quantized checkpoint".into(),
                        }
                    ))
                    .lines(lines.clone()),
            );
    }
    let non_kv = match (b.weights_gib, b.activation_peak_gib, b.non_torch_gib) {
        (Some(w), Some(a), Some(n)) => Some(w + a + n),
        _ => None,
    };
    let mut fix = String::from(
        "the KV pool got 0 blocks: util × total minus weights, activation peak and non-torch memory left nothing; ",
    );
    match (non_kv, total) {
        (Some(nk), Some(t)) if t > 0.0 => fix.push_str(&format!(
            "non-KV memory is {} GiB, so `--gpu-memory-utilization` must exceed {:.2} plus the KV share of one sequence",
            gib(nk),
            advice::ceil_to(nk / t, 2)
        )),
        _ => fix.push_str(&format!(
            "this log lacks weights/activation/total figures to compute the utilization that fits; {} prints them. \
             `--gpu-memory-utilization` is a fraction of the whole card, so values below the weights' share leave no KV cache{}",
            plan_hint(facts),
            if facts.vllm_v1 { "" } else { "; older vLLM (V0 before v0.6.5) also charged other processes' memory to this budget" }
        )),
    }
    out.push(
        Finding::new(Cause::KvCacheTooSmall, 0.9)
            .count("gpu_blocks", Some(0))
            .num("weights_gib", b.weights_gib)
            .num("activation_peak_gib", b.activation_peak_gib)
            .num("non_torch_gib", b.non_torch_gib)
            .num("total_gib", total)
            .num("requested_utilization", util)
            .fix(fix)
            .lines(lines.clone()),
    );
    if let Some(estimate) = facts.startup.cuda_graph_estimate_gib {
        out.push(
            Finding::new(Cause::CudaGraphCapture, if estimate >= 2.0 { 0.95 } else { 0.5 })
                .num("cuda_graph_estimate_gib", Some(estimate))
                .fix(format!(
                    "this vLLM charges its CUDA-graph estimate ({} GiB) to the KV budget before sizing the pool; with the estimate removed \
                     (`VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0`) the graphs' real pool must fit outside the budget, so lower \
                     --gpu-memory-utilization by its size / total, or capture fewer sizes (`--cudagraph-capture-sizes`, `--max-num-seqs`)",
                    gib(estimate)
                ))
                .lines(lines.iter().copied()),
        );
    }
    if !facts.vllm_v1 {
        out.push(
            Finding::new(Cause::OtherProcessHoldsMemory, 0.4)
                .fix("if another process shares the GPU, older vLLM counted its memory against this instance's budget: check `nvidia-smi` before starting")
                .lines(seen.lines.iter().copied()),
        );
    }
}

fn sampler_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.sampler_warmup else {
        return;
    };
    let n = seen.value;
    let torch = facts.torch_oom.as_ref().map(|t| &t.value);
    let fit = torch.and_then(|t| sequences_that_fit(n, t.request, t.free.unwrap_or(0.0)));
    let mut lines: Vec<u64> = seen.lines.clone();
    if let Some(t) = &facts.torch_oom {
        lines.extend(t.lines.iter().copied());
    }
    let fix = match (fit, torch) {
        (Some(k), Some(t)) => format!(
            "the sampler warm-up with {n} sequences asked for {} with {} free; memory for it grows with the sequence count: `--max-num-seqs {k}` fits, or lower --gpu-memory-utilization to leave that room",
            size(t.request),
            size(t.free.unwrap_or(0.0))
        ),
        _ => format!(
            "the sampler warm-up with {n} sequences (max_num_seqs) ran out; the size of the failed allocation is not in this log, so the count that fits cannot be computed: \
             `--max-num-seqs {}` halves the warm-up, or lower --gpu-memory-utilization to leave room; {} computes it from the model's vocabulary",
            (n / 2).max(1),
            plan_hint(facts)
        ),
    };
    out.push(
        Finding::new(Cause::TooManySequences, 0.97)
            .count("warmup_sequences", Some(n))
            .count("max_num_seqs_that_fits", fit)
            .num("tried_to_allocate_gib", torch.map(|t| t.request))
            .num("free_gib", torch.and_then(|t| t.free))
            .fix(fix)
            .lines(lines),
    );
}

fn graph_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.cuda_error_oom else {
        return;
    };
    if seen.value != Some(Phase::GraphCapture) {
        return;
    }
    let s = &facts.startup;
    let (total, util) = total_and_util(facts);
    let graph = s.breakdown.cuda_graph_gib.or(s.cuda_graph_estimate_gib);
    let new_util = match (util, graph, total) {
        (Some(u), Some(g), Some(t)) => utilization_after_shortfall(u, g, t),
        _ => None,
    };
    let fix = match new_util {
        Some(u) => format!(
            "capturing CUDA graphs needs about {} GiB outside the KV budget in this vLLM; `--gpu-memory-utilization {u:.2}` leaves it, or `--enforce-eager` skips graphs",
            gib(graph.unwrap_or(0.0))
        ),
        None => format!(
            "out of memory while capturing CUDA graphs: this vLLM keeps the graph pool outside the utilization budget. The pool size is missing here \
             (a successful start logs \"Graph capturing finished …, took X GiB\"); lower --gpu-memory-utilization by X / total{}, \
             capture fewer sizes (`--max-num-seqs` / `--cudagraph-capture-sizes`), or `--enforce-eager`",
            match (total, util) {
                (Some(t), Some(u)) => format!(" (total {} GiB, utilization {u:.2})", gib(t)),
                _ => String::new(),
            }
        ),
    };
    let multi_gpu = facts.max_worker_rank > 0 || facts.tp.is_some_and(|t| t > 1);
    let mut fix = fix;
    if multi_gpu {
        // A capture OOM on one rank of a multi-GPU run is still the graph pool, not a per-worker
        // limit: every rank captures the same graphs within the same per-GPU budget.
        fix.push_str(&multi_gpu_capture_note(facts));
    }
    out.push(
        Finding::new(Cause::CudaGraphCapture, 0.97)
            .num("cuda_graph_gib", graph)
            .num("total_gib", total)
            .num("requested_utilization", util)
            .num("utilization_that_fits", new_util)
            .count("worker_rank", multi_gpu.then_some(facts.max_worker_rank))
            .count("tensor_parallel_size", facts.tp.filter(|_| multi_gpu))
            .fix(fix)
            .lines(seen.lines.iter().copied()),
    );
}

/// The log's own `--kv-cache-memory` figure that fits the requested memory, when it shrinks the
/// KV cache this start-up used (a fix for memory that ran out after the pool was sized).
pub(crate) fn kv_fits_note(facts: &Facts) -> String {
    let Some(bytes) = facts.kv_cache_memory.and_then(|k| k.fits_requested) else {
        return String::new();
    };
    let g = bytes as f64 / advice::GIB;
    if facts
        .startup
        .breakdown
        .kv_cache_gib
        .is_some_and(|kv| g >= kv)
    {
        return String::new();
    }
    format!(
        "; this log printed its own budget: `--kv-cache-memory={bytes}` ({} GiB) keeps the KV cache inside the requested memory \
         (it replaces --gpu-memory-utilization)",
        gib(g)
    )
}

/// The log's own `--kv-cache-memory` figure that fills the card's free memory, when it grows the
/// KV cache this start-up got (a fix for a pool that was too small).
fn kv_fills_note(facts: &Facts) -> String {
    let Some(bytes) = facts.kv_cache_memory.and_then(|k| k.fills_card) else {
        return String::new();
    };
    let g = bytes as f64 / advice::GIB;
    if facts
        .startup
        .breakdown
        .kv_cache_gib
        .is_some_and(|kv| g <= kv)
    {
        return String::new();
    }
    format!(
        ", or `--kv-cache-memory={bytes}` ({} GiB; the log's own figure for all the memory that was free)",
        gib(g)
    )
}

/// Why a graph-capture OOM on one rank is not the multi-GPU worker limit, and what applies.
pub(crate) fn multi_gpu_capture_note(facts: &Facts) -> String {
    format!(
        "; this happened on {} of a multi-GPU run, but it is the graph pool, not a per-worker limit: every rank captures the same graphs \
         in its own GPU's room outside the budget, so the same setting applies to all ranks (a larger --tensor-parallel-size does not shrink the pool)",
        if facts.max_worker_rank > 0 {
            format!("worker rank {}", facts.max_worker_rank)
        } else {
            "one worker".to_owned()
        }
    )
}

#[cfg(test)]
mod tests {
    use crate::{Cause, diagnose_str};

    fn first(text: &str) -> crate::Finding {
        diagnose_str(text)
            .findings
            .into_iter()
            .next()
            .expect("a finding")
    }

    #[test]
    fn kv_need_with_budget_figures_computes_the_utilization() {
        // Same wording as vLLM V1; total and utilization come from the profiling lines.
        let log = "INFO [gpu_worker.py:1] Free memory on device (78.00/79.22 GiB) on startup. Desired GPU memory utilization is (0.90, 71.29 GiB).\n\
                   ValueError: To serve at least one request with the models's max seq len (32768), (4.00 GiB KV cache is needed, which is larger than the available KV cache memory (1.10 GiB). Based on the available memory, the estimated maximum model length is 9008. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.\n";
        let f = first(log);
        assert_eq!(f.cause, Cause::KvCacheTooSmall);
        assert_eq!(f.numbers["max_model_len_that_fits"], 9008.0);
        assert_eq!(f.numbers["max_model_len_fp8_kv"], 18_016.0);
        // 0.90 + 2.9 / 79.22 = 0.9366 → 0.94
        assert_eq!(f.numbers["utilization_that_fits"], 0.94);
        assert!(
            f.fix.contains("`--gpu-memory-utilization 0.94`"),
            "{}",
            f.fix
        );
        assert_eq!(f.evidence_lines, vec![2]);
    }

    #[test]
    fn kv_need_that_no_utilization_fixes_says_so() {
        let log = "the current vLLM instance can use total_gpu_memory (23.58GiB) x gpu_memory_utilization (0.90) = 21.22GiB\n\
                   ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV cache is needed, which is larger than the available KV cache memory (0.71 GiB).\n";
        let f = first(log);
        assert!(f.fix.contains("no utilization ≤ 1.0 fits"), "{}", f.fix);
        assert!(!f.numbers.contains_key("estimated_max_model_len"));
        assert_eq!(f.numbers["max_model_len_that_fits"], 5808.0);
    }

    #[test]
    fn fp8_is_not_offered_when_the_cache_already_is_fp8() {
        let log = "Initializing a V0 LLM engine with config: model='m', kv_cache_dtype=fp8,\n\
                   ValueError: The model's max seq len (29000) is larger than the maximum number of tokens that can be stored in KV cache (23648).\n";
        let f = first(log);
        assert!(!f.numbers.contains_key("max_model_len_fp8_kv"));
        assert!(!f.fix.contains("fp8"), "{}", f.fix);
    }

    #[test]
    fn sampler_warmup_with_allocation_sizes_computes_the_sequence_count() {
        let log = "(VllmWorker rank=0 pid=1) ERROR [multiproc_executor.py:1]   File \"/x/vllm/v1/worker/gpu_model_runner.py\", line 1544, in _dummy_sampler_run\n\
                   torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.57 GiB of which 512.00 MiB is free. Including non-PyTorch memory, this process has 22.97 GiB memory in use. Of the allocated memory 20.21 GiB is allocated by PyTorch, and 185.98 MiB is reserved by PyTorch but unallocated.\n\
                   RuntimeError: CUDA out of memory occurred when warming up sampler with 256 dummy requests. Please try lowering `max_num_seqs` or `gpu_memory_utilization` when initializing the engine.\n";
        let f = first(log);
        assert_eq!(f.cause, Cause::TooManySequences);
        // 256 × 0.5 / 2.0 = 64
        assert_eq!(f.numbers["max_num_seqs_that_fits"], 64.0);
        assert!(f.fix.contains("`--max-num-seqs 64`"), "{}", f.fix);
        assert_eq!(f.evidence_lines, vec![2, 3]);
    }

    #[test]
    fn graph_capture_with_known_pool_size_computes_the_utilization() {
        let log = "the current vLLM instance can use total_gpu_memory (23.58GiB) x gpu_memory_utilization (0.95) = 22.40GiB\n\
                   Estimated CUDA graph memory: 0.50 GiB total\n\
                   File \"/x/torch/cuda/graphs.py\", line 84, in capture_end\n\
                   RuntimeError: CUDA error: out of memory\n";
        let f = first(log);
        assert_eq!(f.cause, Cause::CudaGraphCapture);
        // 0.95 − 0.5 / 23.58 = 0.9288 → 0.92
        assert_eq!(f.numbers["utilization_that_fits"], 0.92);
        assert!(
            f.fix.contains("`--gpu-memory-utilization 0.92`"),
            "{}",
            f.fix
        );
    }

    #[test]
    fn zero_blocks_with_weights_over_budget_blames_the_weights() {
        let log = "INFO Loading model weights took 14.9888 GB\n\
                   the current vLLM instance can use total_gpu_memory (23.58GiB) x gpu_memory_utilization (0.40) = 9.43GiB\n\
                   ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.\n";
        let d = diagnose_str(log);
        assert_eq!(d.findings[0].cause, Cause::WeightsDoNotFit);
        // 14.9888 / 23.58 = 0.6357 → 0.64
        assert!(
            d.findings[0]
                .fix
                .contains("`--gpu-memory-utilization 0.64`"),
            "{}",
            d.findings[0].fix
        );
        assert_eq!(d.findings[1].cause, Cause::KvCacheTooSmall);
    }

    #[test]
    fn cpu_backend_kv_space_and_tokens_fill_the_breakdown() {
        let log = "(EngineCore pid=7) INFO 12-01 08:50:01 [cpu_worker.py:120] Explicitly set (1.0/14.96) GiB for KV cache on node 0.\n\
                   (EngineCore pid=7) INFO 12-01 08:50:02 [kv_cache_utils.py:1300] CPU KV cache size: 23,296 tokens, Maximum concurrency for 512 tokens per request: 45.50x\n";
        let d = crate::diagnose_str(log);
        let s = d.startup.expect("start-up figures");
        assert_eq!(s.breakdown.kv_cache_gib, Some(1.0));
        assert_eq!(s.breakdown.kv_tokens, Some(23_296));
        assert_eq!(s.breakdown.max_model_len, Some(512));
        assert_eq!(s.breakdown.max_concurrency, Some(45.5));
        assert_eq!(s.evidence_lines, vec![1, 2]);
        assert_eq!(d.engine, Some(crate::Engine::Vllm));
        assert!(d.findings.is_empty(), "{:?}", d.findings);
    }

    #[test]
    fn v1_recommendation_line_fills_the_breakdown() {
        let log = "INFO [gpu_worker.py:1] Free memory on device (23.21/23.55 GiB) on startup. Desired GPU memory utilization is (0.9, 21.19 GiB). \
                   Actual usage is 14.99 GiB for weight, 1.23 GiB for peak activation, 0.25 GiB for non-torch memory, and 0.48 GiB for CUDAGraph memory. \
                   Replace gpu_memory_utilization config with `--kv-cache-memory=5009042636` (4.66 GiB) to fit into requested memory, or \
                   `--kv-cache-memory=7060938752` (6.58 GiB) to fully utilize gpu memory. Current kv cache memory in use is 4.72 GiB.\n";
        let d = diagnose_str(log);
        assert!(d.findings.is_empty());
        let b = d.startup.expect("figures").breakdown;
        assert_eq!(b.total_gib, Some(23.55));
        assert_eq!(b.utilization, Some(0.9));
        assert_eq!(b.budget_gib, Some(21.19));
        assert_eq!(b.weights_gib, Some(14.99));
        assert_eq!(b.activation_peak_gib, Some(1.23));
        assert_eq!(b.non_torch_gib, Some(0.25));
        assert_eq!(b.cuda_graph_gib, Some(0.48));
        assert_eq!(b.kv_cache_gib, Some(4.72));
    }
}
