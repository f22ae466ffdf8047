//! llama.cpp / llama-cpp-python: `ggml_backend_cuda_buffer_type_alloc_buffer: allocating X MiB on
//! device N: cudaMalloc failed: out of memory` (and Vulkan's "Device memory allocation of size N
//! failed"), classified by the lines that follow (model buffer, compute buffer, KV buffer), plus
//! multi-device hints (pipeline parallelism, per-device buffers).

use super::size;
use crate::facts::{Facts, GgmlAlloc, GgmlBuffer, record};
use crate::finding::{Cause, Finding};
use crate::parse::{int_after, number_after};
use crate::text::{find, has, rfind, starts};

/// Lines after the failure that may still name the buffer kind.
const FOLLOW_WINDOW: u64 = 6;

/// The start-up line `llama_kv_cache: size = 90.00 MiB (2048 cells, 30 layers, 2/2 seqs), ...`:
/// the KV buffer and its tokens (cells per stream × streams), as start-up figures. The last such
/// line wins: `--fit` may size a trial context before the real one.
fn kv_cache_size(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    if !has(line, "llama_kv_cache: size =") {
        return false;
    }
    let Some(mib) = number_after(line, "size =") else {
        return false;
    };
    let b = &mut facts.startup.breakdown;
    b.kv_cache_gib = Some(mib / 1024.0);
    if let Some(cells) = int_after(line, "(") {
        let streams = int_after(line, "layers,").unwrap_or(1).max(1);
        b.kv_tokens = Some(cells * streams);
    }
    facts.startup.evidence_lines.push(line_no);
    true
}

/// True while lines right after an allocation failure may still name the buffer kind.
pub fn expects_follow_up(facts: &Facts, line_no: u64) -> bool {
    facts.ggml_alloc.as_ref().is_some_and(|seen| {
        seen.value.kind.is_none()
            && seen
                .lines
                .last()
                .is_some_and(|l| line_no - l <= FOLLOW_WINDOW)
    })
}

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    if kv_cache_size(facts, line_no, line) {
        return true;
    }
    if (has(line, "cudaMalloc failed: out of memory") || has(line, "hipMalloc failed"))
        && let Some(mib) = number_after(line, "allocating ")
    {
        let device = int_after(line, "on device ").unwrap_or(0);
        let kind = match facts.last_phase {
            Some((crate::facts::Phase::LoadWeights, at)) if line_no - at <= FOLLOW_WINDOW * 4 => {
                Some(GgmlBuffer::Model)
            }
            _ => None,
        };
        record(
            &mut facts.ggml_alloc,
            GgmlAlloc { mib, device, kind },
            line_no,
        );
        return true;
    }
    if has(line, "Device memory allocation of size")
        && has(line, "failed")
        && let Some(bytes) = number_after(line, "allocation of size ")
    {
        record(
            &mut facts.ggml_alloc,
            GgmlAlloc {
                mib: bytes / 1_048_576.0,
                device: 0,
                kind: None,
            },
            line_no,
        );
        return true;
    }
    if let Some(n) = setting(line, "n_ubatch") {
        facts.ggml_ubatch = Some(n);
        return true;
    }
    if let Some(n) = setting(line, "n_ctx") {
        facts.ggml_ctx = Some(n);
        return true;
    }
    if has(line, "pipeline parallelism enabled") {
        facts.ggml_pipeline_parallel = int_after(line, "n_copies=").or(Some(1));
        return true;
    }
    for marker in [
        " model buffer size",
        " KV buffer size",
        " compute buffer size",
    ] {
        if let Some(at) = find(line, marker) {
            let head = &line[..at];
            if let Some(cuda) = rfind(head, "CUDA").or_else(|| rfind(head, "ROCm"))
                && let Some(d) = int_after(
                    &head[cuda..],
                    if starts(&head[cuda..], "CUDA") {
                        "CUDA"
                    } else {
                        "ROCm"
                    },
                )
            {
                facts.ggml_devices = facts.ggml_devices.max(d + 1);
            }
            return true;
        }
    }
    if let Some(seen) = facts.ggml_alloc.as_mut() {
        let near = seen
            .lines
            .last()
            .is_some_and(|l| line_no - l <= FOLLOW_WINDOW);
        if near && seen.value.kind.is_none() {
            let kind = if has(line, "alloc_tensor_range")
                || has(line, "unable to allocate CUDA")
                || has(line, "unable to allocate backend buffer")
                || has(line, "error loading model")
            {
                Some(GgmlBuffer::Model)
            } else if has(line, "compute buffer")
                || has(line, "ggml_gallocr_reserve_n")
                || has(line, "failed to allocate graph")
            {
                Some(GgmlBuffer::Compute)
            } else if has(line, "kv_cache_init") || has(line, "KV buffer") || has(line, "KV cache")
            {
                Some(GgmlBuffer::Kv)
            } else {
                None
            };
            if kind.is_some() {
                seen.value.kind = kind;
                if seen.lines.len() < crate::facts::MAX_EVIDENCE {
                    seen.lines.push(line_no);
                }
                return true;
            }
        }
    }
    false
}

/// llama.cpp's default `--ubatch-size`.
const DEFAULT_UBATCH: u64 = 512;

/// `llama_context: n_ubatch      = 512` → 512 (the key, spaces, `=`, a whole number).
fn setting(line: &str, key: &str) -> Option<u64> {
    let at = line.find(&format!("{key} "))? + key.len();
    let rest = line[at..].trim_start().strip_prefix('=')?.trim();
    rest.parse().ok()
}

/// `-ub N` at half the micro-batch the log shows (or half the default, said so).
fn half_ubatch(facts: &Facts) -> String {
    match facts.ggml_ubatch {
        Some(ub) => format!(
            "`-ub {}` (--ubatch-size, half the log's n_ubatch {ub})",
            (ub / 2).max(1)
        ),
        None => format!(
            "`-ub {}` (--ubatch-size, half llama.cpp's default {DEFAULT_UBATCH}; the log does not show n_ubatch)",
            DEFAULT_UBATCH / 2
        ),
    }
}

/// `-c N` at half the context the log shows, or the flag alone when it does not show one.
fn half_context(facts: &Facts) -> String {
    match facts.ggml_ctx {
        Some(c) => format!("`-c {}` (half the log's n_ctx {c})", (c / 2).max(1)),
        None => "a smaller `-c/--ctx-size` (the log does not show n_ctx)".to_string(),
    }
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.ggml_alloc else {
        return;
    };
    let a = &seen.value;
    let gib = a.mib / 1024.0;
    let lines = seen.lines.iter().copied();
    let missing = "the device's free memory is not in this log (`nvidia-smi --query-gpu=memory.free --format=csv` shows it)";
    let base = |cause, likelihood| {
        Finding::new(cause, likelihood)
            .num("tried_to_allocate_gib", Some(gib))
            .count("device_index", Some(a.device))
            .count("pipeline_copies", facts.ggml_pipeline_parallel)
            .lines(lines.clone())
    };
    match a.kind {
        Some(GgmlBuffer::Model) | None if a.kind.is_some() || a.mib >= 4096.0 => out.push(base(Cause::WeightsDoNotFit, 0.9).fix(format!(
            "the model buffer for device {} is {}: the layers offloaded to it do not fit; offload fewer layers (`-ngl`; layers that fit ≈ free memory / per-layer size), \
             split across GPUs (`--tensor-split`), or use a smaller quantization; {missing}",
            a.device,
            size(gib)
        ))),
        Some(GgmlBuffer::Compute) => out.push(base(Cause::ActivationPeak, 0.85).fix(format!(
            "the compute buffer for device {} needs {}: it grows with the micro-batch and context; {} roughly halves it, \
             a smaller `-c` shrinks it, or offload fewer layers (`-ngl`); {missing}",
            a.device,
            size(gib),
            half_ubatch(facts)
        ))),
        Some(GgmlBuffer::Kv) => out.push(base(Cause::KvCacheTooSmall, 0.85).fix(format!(
            "the KV buffer ({}) for the context does not fit device {}: {} halves it, or quantize the cache (`-ctk q8_0 -ctv q8_0` halves it); {missing}",
            size(gib),
            a.device,
            half_context(facts)
        ))),
        _ => out.push(base(Cause::ActivationPeak, 0.5).fix(format!(
            "a {} buffer on device {} did not fit and the log does not say which kind; {missing}",
            size(gib),
            a.device
        ))),
    }
    if a.device > 0 || facts.ggml_pipeline_parallel.is_some_and(|c| c > 1) {
        let copies = facts.ggml_pipeline_parallel.unwrap_or(1);
        out.push(base(Cause::MultiGpuWorkerLimit, if a.device > 0 { 0.92 } else { 0.5 }).fix(format!(
            "device {} ran out of its own memory ({} requested) while others may have room; {}move layers off it with `--tensor-split` (give it a smaller share) or exclude it",
            a.device,
            size(gib),
            if copies > 1 { format!("pipeline parallelism keeps {copies} copies of the compute buffer per device ({} or `--split-mode row` reduces it); ", half_ubatch(facts)) } else { String::new() }
        )));
    }
}
