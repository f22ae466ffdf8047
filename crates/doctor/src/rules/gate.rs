//! One-pass keyword gate: a single Aho-Corasick automaton over every engine marker and every
//! keyword a rule needs, matched without regard to ASCII case. Each line is searched once; lines
//! with no rule keyword skip the rules, which keeps a 50 MB log of routine request lines close to
//! the speed of a plain line count.

use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, AhoCorasickKind, MatchKind};

use crate::finding::Engine;

/// Engine markers: seeing one marks the engine as present in the log.
const ENGINE_MARKERS: &[(&str, Engine)] = &[
    ("vllm", Engine::Vllm),
    ("EngineCore", Engine::Vllm),
    ("LLMEngine", Engine::Vllm),
    ("[core.py:", Engine::Vllm),
    ("core_client.py", Engine::Vllm),
    ("model_runner", Engine::Vllm),
    ("multiproc_executor", Engine::Vllm),
    ("gpu_worker.py", Engine::Vllm),
    ("kv_cache_utils.py", Engine::Vllm),
    ("worker.py:", Engine::Vllm),
    ("[engine.py:", Engine::Vllm),
    ("text_generation", Engine::Tgi),
    ("ollama", Engine::Ollama),
    ("source=sched.go", Engine::Ollama),
    ("source=memory.go", Engine::Ollama),
    ("ggml_", Engine::LlamaCpp),
    ("llama_", Engine::LlamaCpp),
    ("load_tensors:", Engine::LlamaCpp),
    ("ctranslate2", Engine::Ctranslate2),
    ("faster_whisper", Engine::Ctranslate2),
    ("whisper", Engine::Whisper),
    ("torch", Engine::PyTorch),
    ("sglang", Engine::Sglang),
    ("sgl_kernel", Engine::Sglang),
    ("llama runner", Engine::Ollama),
    ("llama-runner", Engine::Ollama),
    ("source=server.go", Engine::Ollama),
    ("source=ggml.go", Engine::Ollama),
    ("source=runner.go", Engine::Ollama),
];

/// Rule groups a keyword can wake; a line runs only the rules whose group matched.
pub const TORCH: u32 = 1 << 0;
pub const VLLM: u32 = 1 << 1;
pub const TGI: u32 = 1 << 2;
pub const LLAMA: u32 = 1 << 3;
pub const OLLAMA: u32 = 1 << 4;
pub const CT2: u32 = 1 << 5;
pub const NOT_MEMORY: u32 = 1 << 6;
/// Tensor / pipeline parallel sizes.
pub const CONTEXT: u32 = 1 << 7;
pub const PHASE: u32 = 1 << 8;
pub const ERROR: u32 = 1 << 9;
/// GPU name.
pub const GPU: u32 = 1 << 10;
/// Worker rank tags on multi-GPU lines.
pub const RANK: u32 = 1 << 11;
/// Configured limits and the model name.
pub const CONFIG: u32 = 1 << 12;
/// The v2 families: negative KV budget, TGI warm-up wrapper and limits, ROCm wording.
pub const EXTRA: u32 = 1 << 13;
/// Platform wordings: MPS, XPU, Vulkan, Metal, driver and library out-of-memory codes.
pub const PLATFORM: u32 = 1 << 14;
/// SGLang's start-up figures, limits and messages.
pub const SGLANG: u32 = 1 << 15;
/// 2026 vLLM start-ups: the profiling race check, CUDA-graph profiling, `--kv-cache-memory`
/// advice, multi-stage (omni) budgets.
pub const STARTUP26: u32 = 1 << 16;
/// Words that say an engine caught an out-of-memory and went on.
pub const ABSORB: u32 = 1 << 17;
/// Lines that show an engine serving or past its start-up.
pub const READY: u32 = 1 << 18;

/// Every substring some rule needs before it can match (a necessary condition, not sufficient).
const RULE_KEYWORDS: &[(&str, u32)] = &[
    // PyTorch
    ("Tried to allocate", TORCH),
    // vLLM
    ("Free memory on device", VLLM),
    ("Desired GPU memory", VLLM),
    ("KV cache is needed", VLLM),
    ("To serve at least one request", VLLM),
    ("estimated maximum model length", VLLM),
    ("non-torch forward increase memory", VLLM),
    ("Requested memory:", VLLM),
    ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", VLLM | STARTUP26),
    ("dummy_sampler", PHASE),
    ("EngineDeadError", PHASE),
    ("serving_chat", PHASE),
    ("dummy_metadata", PHASE),
    ("init_cuda_graphs", PHASE),
    ("cuda_graph_runner", PHASE),
    ("stored in KV cache", VLLM),
    ("GPU KV cache size", VLLM),
    ("CPU KV cache size", VLLM),
    ("GiB for KV cache on node", VLLM),
    ("Available KV cache memory", VLLM),
    ("reserved for KV Cache", VLLM),
    ("max seq len", VLLM),
    ("No available memory", VLLM),
    ("warming up sampler", VLLM),
    ("CUDA error: out of memory", VLLM),
    ("weights took", VLLM),
    ("loading took", VLLM),
    ("total_gpu_memory", VLLM),
    ("gpu_memory_utilization", VLLM | CONFIG),
    ("the current vLLM instance", VLLM),
    ("model weights take", VLLM),
    ("non_torch_memory", VLLM),
    ("activation peak", VLLM),
    ("available_kv_cache_memory", VLLM),
    ("blocks: ", VLLM),
    ("Maximum concurrency", VLLM),
    ("Graph capturing finished", VLLM),
    ("CUDA graph pool memory", VLLM),
    ("Estimated CUDA graph memory", VLLM),
    ("Memory profiling", VLLM),
    ("Actual usage is", VLLM),
    ("kv cache memory in use", VLLM),
    // TGI
    ("Not enough memory to handle", TGI),
    ("would exceed allowed memory", TGI),
    // llama.cpp
    ("cudaMalloc failed", LLAMA),
    ("hipMalloc failed", LLAMA),
    ("Device memory allocation of size", LLAMA),
    ("pipeline parallelism enabled", LLAMA),
    (" buffer size", LLAMA),
    ("alloc_tensor_range", LLAMA),
    ("unable to allocate", LLAMA),
    ("error loading model", LLAMA),
    ("compute buffer", LLAMA),
    ("ggml_gallocr_reserve_n", LLAMA),
    ("failed to allocate graph", LLAMA),
    ("kv_cache_init", LLAMA),
    ("n_ubatch", LLAMA),
    ("n_ctx ", LLAMA),
    ("KV buffer", LLAMA),
    ("llama_kv_cache: size", LLAMA),
    // Ollama
    ("gpu has too little memory", OLLAMA),
    ("model requires more system memory", OLLAMA),
    ("layers.offload=", OLLAMA),
    ("layers.model=", OLLAMA),
    ("memory.required", OLLAMA),
    ("memory.available=", OLLAMA),
    ("memory.graph.full=", OLLAMA),
    ("memory.weights.total=", OLLAMA),
    ("projector.weights=", OLLAMA),
    // CTranslate2
    ("CUDA failed with error", CT2),
    // not memory
    ("no kernel image is available", NOT_MEMORY),
    ("No CUDA GPUs are available", NOT_MEMORY),
    ("CUDA driver version is insufficient", NOT_MEMORY),
    ("Found no NVIDIA driver", NOT_MEMORY),
    ("illegal memory access", NOT_MEMORY),
    ("NCCL error", NOT_MEMORY),
    ("ModuleNotFoundError", NOT_MEMORY),
    ("Address already in use", NOT_MEMORY),
    // context: GPU name, parallelism, configuration, model
    ("Device ", GPU),
    ("library=", GPU),
    ("GPU: ", GPU),
    ("GPU 0: ", GPU),
    ("tensor_parallel", CONTEXT),
    ("--tensor-parallel", CONTEXT),
    ("--tensor_parallel", CONTEXT),
    (" -tp ", CONTEXT),
    ("pipeline_parallel", CONTEXT),
    ("--pipeline-parallel", CONTEXT),
    (" -pp ", CONTEXT),
    ("VllmWorker rank=", RANK),
    ("Worker_PP", RANK),
    ("Worker_TP", RANK),
    ("max_seq_len=", CONFIG),
    ("--max-model-len", CONFIG),
    ("max_model_len=", CONFIG),
    ("--max_model_len", CONFIG),
    ("--gpu-memory-utilization", CONFIG),
    ("kv_cache_dtype=", CONFIG),
    ("--kv-cache-dtype", CONFIG),
    ("block_size=", CONFIG),
    ("--block-size", CONFIG),
    ("model='", CONFIG),
    ("--model", CONFIG),
    ("model_id: \"", CONFIG),
    // phase markers
    ("_dummy_sampler_run", PHASE),
    ("capture_model", PHASE),
    ("capture_end", PHASE),
    ("torch.cuda.graph(", PHASE),
    ("Capturing cudagraphs", PHASE),
    ("Capturing CUDA graph", PHASE),
    ("profile_run", PHASE),
    ("determine_available_memory", PHASE),
    ("determine_num_available_blocks", PHASE),
    ("Unable to warmup model", PHASE | EXTRA),
    ("in warmup", PHASE),
    ("initialize_kv_cache", PHASE),
    ("_allocate_kv_cache", PHASE),
    ("load_model", PHASE),
    ("load_weights", PHASE),
    ("load_state_dict", PHASE),
    ("from_pretrained", PHASE),
    ("model.to(device)", PHASE),
    ("Error in model execution", PHASE),
    ("execute_model", PHASE),
    ("Request failed during generation", PHASE),
    ("generate_with_fallback", PHASE),
    ("in generate_token", PHASE),
    ("in __init__", PHASE),
    // v2 families
    ("max_num_batched_tokens=", EXTRA),
    ("--max-num-batched-tokens", EXTRA),
    ("max_num_seqs=", EXTRA),
    ("--max-num-seqs", EXTRA),
    ("chunked_prefill", EXTRA),
    ("enc_dec_model_runner", EXTRA),
    ("profile run for multi-modal", EXTRA),
    ("Method Warmup", EXTRA),
    ("max_batch_prefill_tokens", EXTRA),
    ("--max-batch-prefill-tokens", EXTRA),
    ("max_input_tokens: ", EXTRA),
    ("max_input_length: ", EXTRA),
    ("--max-input-tokens", EXTRA),
    ("--max-input-length", EXTRA),
    ("max_total_tokens: ", EXTRA),
    ("--max-total-tokens", EXTRA),
    ("max_batch_total_tokens", EXTRA),
    ("--max-batch-total-tokens", EXTRA),
    ("Setting max batch total tokens", EXTRA),
    ("ROCm", EXTRA),
    ("HIP out of memory", EXTRA),
    ("HIP error", EXTRA),
    ("hipErrorOutOfMemory", EXTRA),
    ("PYTORCH_HIP_ALLOC_CONF", EXTRA),
    ("insufficient shared memory", NOT_MEMORY),
    ("out of shared memory", NOT_MEMORY),
    // platform wordings
    ("MPS backend out of memory", PLATFORM),
    ("XPU out of memory", PLATFORM),
    ("NPU out of memory", PLATFORM),
    ("ggml_vulkan", PLATFORM),
    ("Vulkan0", PLATFORM),
    ("ErrorOutOfDeviceMemory", PLATFORM),
    ("VK_ERROR_OUT_OF_DEVICE_MEMORY", PLATFORM),
    ("ggml_metal", PLATFORM),
    ("kIOGPUCommandBufferCallbackErrorOutOfMemory", PLATFORM),
    ("OUT_OF_DEVICE_MEMORY", PLATFORM),
    ("ggml_sycl", PLATFORM),
    ("cudaErrorMemoryAllocation", PLATFORM),
    ("CUBLAS_STATUS_ALLOC_FAILED", PLATFORM),
    ("CUDNN_STATUS_ALLOC_FAILED", PLATFORM),
    ("CUDA_ERROR_OUT_OF_MEMORY", PLATFORM),
    ("RESOURCE_EXHAUSTED", PLATFORM),
    ("out of memory", PLATFORM),
    ("OutOfMemoryError", PLATFORM),
    ("CUDA error", PLATFORM),
    ("Allocation of size", PLATFORM),
    // SGLang
    ("mem_fraction_static", SGLANG),
    ("--mem-fraction-static", SGLANG),
    ("avail mem=", SGLANG),
    ("Not enough memory. Please try to increase", SGLANG),
    ("Capture cuda graph", SGLANG | PHASE),
    ("KV Cache is allocated", SGLANG),
    ("max_total_num_tokens", SGLANG),
    ("Retract requests", SGLANG | ABSORB),
    // 2026 start-ups
    ("Error in memory profiling", STARTUP26),
    ("--kv-cache-memory=", STARTUP26),
    ("CUDA graph memory profiling is", STARTUP26),
    ("(process-scoped)", STARTUP26),
    ("(profiling fallback)", STARTUP26),
    ("[Stage-", STARTUP26),
    ("server config", OLLAMA),
    ("OLLAMA_NUM_PARALLEL", OLLAMA),
    ("OLLAMA_CONTEXT_LENGTH", OLLAMA),
    ("--parallel ", OLLAMA),
    ("--ctx-size ", OLLAMA),
    ("--batch-size ", OLLAMA),
    ("--n-gpu-layers ", OLLAMA),
    ("KvSize:", OLLAMA),
    ("GPULayers:", OLLAMA),
    // an out-of-memory the engine went on from
    ("Skipping tactic", ABSORB),
    ("pinned memory", ABSORB),
    ("retracted", ABSORB),
    ("falling back", ABSORB),
    ("retrying", ABSORB),
    ("evict", ABSORB),
    ("unloading", ABSORB),
    // serving, or past start-up
    ("Application startup complete", READY),
    ("Uvicorn running", READY),
    ("server is listening", READY),
    ("llama runner started", READY),
    ("The server is fired up", READY),
    ("Starting vLLM API server", READY),
    ("Avg prompt throughput", READY),
    ("init engine (profile", READY),
    ("Capture cuda graph end", READY),
    ("HTTP/1.1\" 200", READY),
    // error-looking lines kept for the "nothing recognised" report
    ("error", ERROR),
    ("failed", ERROR),
];

struct Gate {
    automaton: AhoCorasick,
    engines: usize,
    /// Fallback: every line wakes every group.
    everything: bool,
}

fn gate() -> &'static Gate {
    static GATE: OnceLock<Gate> = OnceLock::new();
    GATE.get_or_init(|| {
        let patterns: Vec<&str> = ENGINE_MARKERS
            .iter()
            .map(|(p, _)| *p)
            .chain(RULE_KEYWORDS.iter().map(|(p, _)| *p))
            .collect();
        // The patterns are fixed literals, so building cannot fail; fall back to an automaton
        // that matches everything (every line goes through the rules) rather than panic.
        let built = AhoCorasick::builder()
            .kind(Some(AhoCorasickKind::DFA))
            .match_kind(MatchKind::Standard)
            .ascii_case_insensitive(true)
            .build(&patterns);
        match built.or_else(|_| AhoCorasick::new(&patterns)) {
            Ok(automaton) => Gate {
                automaton,
                engines: ENGINE_MARKERS.len(),
                everything: false,
            },
            Err(_) => match_everything(),
        }
    })
}

/// Fallback that sends every line through the rules (slower, same results).
#[cold]
fn match_everything() -> Gate {
    match AhoCorasick::new([""]) {
        Ok(automaton) => Gate {
            automaton,
            engines: 0,
            everything: true,
        },
        Err(_) => std::process::abort(),
    }
}

/// What one line contains: engines whose markers appear, and whether any rule keyword does.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Hits {
    pub engines: [bool; 8],
    /// Bitmask of rule groups whose keywords appear.
    pub groups: u32,
}

fn engine_slot(e: Engine) -> usize {
    match e {
        Engine::Vllm => 0,
        Engine::Tgi => 1,
        Engine::Ollama => 2,
        Engine::LlamaCpp => 3,
        Engine::Ctranslate2 => 4,
        Engine::Whisper => 5,
        Engine::PyTorch => 6,
        Engine::Sglang => 7,
    }
}

pub const SLOT_ENGINES: [Engine; 8] = [
    Engine::Vllm,
    Engine::Tgi,
    Engine::Ollama,
    Engine::LlamaCpp,
    Engine::Ctranslate2,
    Engine::Whisper,
    Engine::PyTorch,
    Engine::Sglang,
];

/// Searches `line` once for every marker and keyword.
pub fn scan(line: &str) -> Hits {
    let g = gate();
    let mut hits = Hits::default();
    if g.everything {
        hits.groups = u32::MAX;
        return hits;
    }
    // A table row (`nvidia-smi`), whatever prefix the line carries.
    if line.trim_end().ends_with('|') {
        hits.groups |= GPU | EXTRA;
    }
    // Overlapping: a keyword must not hide an engine marker that starts where it starts
    // (`ggml_vulkan` is both a platform keyword and a ggml marker).
    for m in g.automaton.find_overlapping_iter(line) {
        let id = m.pattern().as_usize();
        if id < g.engines {
            hits.engines[engine_slot(ENGINE_MARKERS[id].1)] = true;
        } else {
            hits.groups |= RULE_KEYWORDS
                .get(id - g.engines)
                .map_or(u32::MAX, |(_, grp)| *grp);
        }
    }
    if hits.groups & CT2 != 0 {
        hits.engines[engine_slot(Engine::Ctranslate2)] = true;
    }
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routine_lines_skip_rules_and_markers_are_found() {
        let h = scan("INFO:     127.0.0.1:51234 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK");
        assert_eq!(
            h.groups, READY,
            "a served request only says the engine is up"
        );
        assert_eq!(
            scan("INFO:     Waiting for application startup."),
            Hits::default()
        );
        let h = scan(
            "ERROR 03-13 [core.py:330] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB.",
        );
        assert_eq!(h.groups, TORCH | ERROR | PLATFORM);
        assert!(h.engines[engine_slot(Engine::Vllm)]);
        assert!(h.engines[engine_slot(Engine::PyTorch)]);
        assert_eq!(
            scan("|   0  NVIDIA H100 80GB HBM3   On |").groups,
            GPU | EXTRA
        );
    }
}
