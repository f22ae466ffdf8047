//! llama.cpp / llama-cpp-python: `ggml_backend_cuda_buffer_type_alloc_buffer: allocating X MiB on
//! device N: cudaMalloc failed: out of memory` (and Vulkan's "Device memory allocation of size N
//! failed"), classified by the lines that follow (model buffer, compute buffer, KV buffer), plus
//! multi-device hints (pipeline parallelism, per-device buffers).

use super::size;
use crate::facts::{Facts, GgmlAlloc, GgmlBuffer, record};
use crate::finding::{Cause, Engine, Finding};
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
        facts.saw_oom(line_no);
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
    if facts.ggml_alloc.is_none()
        && has(line, "failed to allocate")
        && has(line, " buffer of size ")
        && let Some(bytes) = number_after(line, "buffer of size ")
    {
        // "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 838447104" with no
        // "allocating … cudaMalloc failed" line before it (a runner's stderr cut to its last lines).
        let head = &line[..find(line, " buffer of size ").unwrap_or(0)];
        let device = head
            .rsplit(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|d| d.parse().ok())
            .unwrap_or(0);
        let kind = if has(line, "gallocr") || has(line, "graph") {
            Some(GgmlBuffer::Compute)
        } else if has(line, "alloc_tensor_range") {
            Some(GgmlBuffer::Model)
        } else {
            None
        };
        record(
            &mut facts.ggml_alloc,
            GgmlAlloc {
                mib: bytes / 1_048_576.0,
                device,
                kind,
            },
            line_no,
        );
        facts.saw_oom(line_no);
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

/// llama.cpp's default `--ubatch-size`; Ollama's default `num_batch`.
const DEFAULT_UBATCH: u64 = 512;

/// `llama_context: n_ubatch      = 512` → 512 (the key, spaces, `=`, a whole number).
fn setting(line: &str, key: &str) -> Option<u64> {
    let at = find(line, &format!("{key} "))? + key.len();
    let rest = line[at..].trim_start().strip_prefix('=')?.trim();
    rest.parse().ok()
}

/// The settings that move each lever in the engine that runs llama.cpp here: llama.cpp's own
/// flags, or Ollama's settings when Ollama runs it (an Ollama user has no `-ngl` or `-ub`), each
/// from the value the log shows, lowered.
struct Levers<'a> {
    facts: &'a Facts,
    ollama: bool,
}

impl Levers<'_> {
    fn of(facts: &Facts) -> Levers<'_> {
        Levers {
            facts,
            ollama: facts.engine == Some(Engine::Ollama),
        }
    }

    /// Fewer layers on the GPU.
    fn layers(&self) -> String {
        let shown = self.facts.ollama_config.gpu_layers;
        match (self.ollama, shown) {
            (true, Some(n)) if n > 1 => format!(
                "`num_gpu {}` (from the {n} layers the log shows on the GPU; set in the Modelfile or the request's options)",
                n - n.div_ceil(4)
            ),
            (true, _) => "a lower `num_gpu` (layers on the GPU; set in the Modelfile or the request's options)".into(),
            (false, Some(n)) if n > 1 => format!("`-ngl {}` (from {n})", n - n.div_ceil(4)),
            (false, _) => "fewer layers on the GPU (`-ngl`; layers that fit ≈ free memory / per-layer size)".into(),
        }
    }

    /// Half the micro-batch (the compute buffer grows with it).
    fn micro_batch(&self) -> String {
        let f = self.facts;
        if self.ollama {
            let b = f.ollama_config.batch_size.or(f.ggml_ubatch);
            return match b {
                Some(b) => format!("`num_batch {}` (half the log's {b})", (b / 2).max(1)),
                None => format!(
                    "`num_batch {}` (half Ollama's default {DEFAULT_UBATCH}; the log does not show it)",
                    DEFAULT_UBATCH / 2
                ),
            };
        }
        match f.ggml_ubatch {
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

    /// Half the context (the KV buffer and the compute buffer grow with it).
    fn context(&self) -> String {
        let f = self.facts;
        if self.ollama {
            let c = &f.ollama_config;
            let parallel = c.num_parallel.unwrap_or(1).max(1);
            let whole = c.ctx_size.or(f.ggml_ctx);
            let per_request = whole.map(|w| w / parallel).or(c.context_length);
            let mut text = match per_request {
                Some(n) => format!(
                    "`num_ctx {}` (or `OLLAMA_CONTEXT_LENGTH={}`; half the {n} tokens per request the log shows)",
                    (n / 2).max(1),
                    (n / 2).max(1)
                ),
                None => {
                    "a smaller `num_ctx` (or `OLLAMA_CONTEXT_LENGTH`; the log does not show it)"
                        .into()
                }
            };
            if parallel > 1 {
                text.push_str(&format!(
                    ", and `OLLAMA_NUM_PARALLEL=1` (each of the {parallel} parallel slots holds its own context)"
                ));
            }
            return text;
        }
        match f.ggml_ctx {
            Some(c) => format!("`-c {}` (half the log's n_ctx {c})", (c / 2).max(1)),
            None => "a smaller `-c/--ctx-size` (the log does not show n_ctx)".to_string(),
        }
    }

    /// A quantized KV cache.
    fn kv_quant(&self) -> &'static str {
        if self.ollama {
            "`OLLAMA_FLASH_ATTENTION=1` with `OLLAMA_KV_CACHE_TYPE=q8_0` in the server's environment (half the KV cache)"
        } else {
            "`-ctk q8_0 -ctv q8_0` (half the KV cache; needs `-fa`)"
        }
    }

    /// Spreading the layers over every GPU.
    fn spread(&self) -> &'static str {
        if self.ollama {
            "`OLLAMA_SCHED_SPREAD=1`"
        } else {
            "`--tensor-split`"
        }
    }

    /// Moving work off one device.
    fn split(&self) -> &'static str {
        if self.ollama {
            "hide that GPU from Ollama (`CUDA_VISIBLE_DEVICES`), or let it place fewer layers there by lowering `num_gpu`"
        } else {
            "move layers off it with `--tensor-split` (give it a smaller share) or exclude it"
        }
    }

    /// How to see the free memory the log lacks, and (Ollama) how to make its estimate leave room.
    fn missing(&self) -> &'static str {
        if self.ollama {
            "the device's free memory is not in this log (`nvidia-smi` shows it); `OLLAMA_GPU_OVERHEAD=<bytes>` makes Ollama's placement leave room it does not see"
        } else {
            "the device's free memory is not in this log (`nvidia-smi --query-gpu=memory.free --format=csv` shows it)"
        }
    }
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.ggml_alloc else {
        return;
    };
    let a = &seen.value;
    let gib = a.mib / 1024.0;
    let lines = seen.lines.iter().copied();
    let levers = Levers::of(facts);
    let missing = levers.missing();
    let base = |cause, likelihood| {
        Finding::new(cause, likelihood)
            .num("tried_to_allocate_gib", Some(gib))
            .count("device_index", Some(a.device))
            .count("pipeline_copies", facts.ggml_pipeline_parallel)
            .lines(lines.clone())
    };
    match a.kind {
        Some(GgmlBuffer::Model) | None if a.kind.is_some() || a.mib >= 4096.0 => out.push(base(Cause::WeightsDoNotFit, 0.9).fix(format!(
            "the model buffer for device {} is {}: the layers offloaded to it do not fit; {}, split across GPUs ({}), or use a smaller quantization; {missing}",
            a.device,
            size(gib),
            levers.layers(),
            levers.spread()
        ))),
        Some(GgmlBuffer::Compute) => out.push(base(Cause::ActivationPeak, 0.85).fix(format!(
            "the compute buffer for device {} needs {}: it grows with the micro-batch and context; {} roughly halves it, \
             {} shrinks it, or {}; {missing}",
            a.device,
            size(gib),
            levers.micro_batch(),
            levers.context(),
            levers.layers()
        ))),
        Some(GgmlBuffer::Kv) => out.push(base(Cause::KvCacheTooSmall, 0.85).fix(format!(
            "the KV buffer ({}) for the context does not fit device {}: {} halves it, or {}; {missing}",
            size(gib),
            a.device,
            levers.context(),
            levers.kv_quant()
        ))),
        _ => out.push(base(Cause::ActivationPeak, 0.5).fix(format!(
            "a {} buffer on device {} did not fit and the log does not say which kind: {}, {}, or {}; {missing}",
            size(gib),
            a.device,
            levers.layers(),
            levers.micro_batch(),
            levers.context()
        ))),
    }
    if a.device > 0 || facts.ggml_pipeline_parallel.is_some_and(|c| c > 1) {
        let copies = facts.ggml_pipeline_parallel.unwrap_or(1);
        out.push(base(Cause::MultiGpuWorkerLimit, if a.device > 0 { 0.92 } else { 0.5 }).fix(format!(
            "device {} ran out of its own memory ({} requested) while others may have room; {}{}",
            a.device,
            size(gib),
            if copies > 1 {
                format!(
                    "pipeline parallelism keeps {copies} copies of the compute buffer per device ({} or `--split-mode row` reduces it); ",
                    levers.micro_batch()
                )
            } else {
                String::new()
            },
            levers.split()
        )));
    }
}
