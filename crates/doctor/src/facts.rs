//! Everything the rules read out of a log, kept as bounded state while the lines stream past:
//! first occurrence of each message with its numbers, a few evidence line numbers, repeat counts,
//! and context (engine, GPU name, parallelism, the phase a failure happened in).

use crate::finding::{Engine, Platform, StartupReport};

/// Evidence lines kept per fact.
pub const MAX_EVIDENCE: usize = 8;
/// Unrecognised error lines kept for the "nothing recognised" report.
pub const MAX_UNRECOGNISED: usize = 20;
/// A phase marker counts for a failure this many lines later at most.
pub const PHASE_WINDOW: u64 = 200;

/// The first occurrence of something, where else it appeared, and how often.
#[derive(Debug, Clone)]
pub struct Seen<T> {
    pub value: T,
    pub lines: Vec<u64>,
    pub count: u64,
}

impl<T> Seen<T> {
    pub fn new(value: T, line: u64) -> Self {
        Seen {
            value,
            lines: vec![line],
            count: 1,
        }
    }

    pub fn again(&mut self, line: u64) {
        self.count += 1;
        if self.lines.len() < MAX_EVIDENCE {
            self.lines.push(line);
        }
    }
}

/// Records `value` at `line`, or notes a repeat.
pub fn record<T>(slot: &mut Option<Seen<T>>, value: T, line: u64) {
    match slot {
        Some(seen) => seen.again(line),
        None => *slot = Some(Seen::new(value, line)),
    }
}

/// What the process was doing when memory ran out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    LoadWeights,
    Profiling,
    SamplerWarmup,
    GraphCapture,
    KvAllocation,
    Request,
}

impl Phase {
    pub fn describe(self) -> &'static str {
        match self {
            Phase::LoadWeights => "while loading weights",
            Phase::Profiling => "during the memory-profiling / warm-up forward pass",
            Phase::SamplerWarmup => "while warming up the sampler",
            Phase::GraphCapture => "while capturing CUDA graphs",
            Phase::KvAllocation => "while allocating the KV cache",
            Phase::Request => "while serving a request",
        }
    }
}

/// A PyTorch CUDA out-of-memory message, either wording.
#[derive(Debug, Clone, Default)]
pub struct TorchOom {
    pub request: f64,
    pub device: Option<u64>,
    pub total: Option<f64>,
    pub free: Option<f64>,
    /// "Including non-PyTorch memory, this process has X memory in use".
    pub this_process: Option<f64>,
    /// "Process N has X memory in use" entries.
    pub processes: Vec<(u64, f64)>,
    pub allocated: Option<f64>,
    pub private_pools: Option<f64>,
    pub reserved_unallocated: Option<f64>,
    /// Pre-2.1 wording: "X reserved in total by PyTorch".
    pub reserved_total: Option<f64>,
    pub phase: Option<Phase>,
    /// The OOM came from a worker / device other than the first.
    pub worker_rank: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct StartupFree {
    pub device: Option<String>,
    pub free: f64,
    pub total: f64,
    pub util: f64,
    pub requested: f64,
}

#[derive(Debug, Clone)]
pub struct KvNeed {
    pub max_model_len: u64,
    pub need: f64,
    pub available: f64,
    pub estimated_max_len: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct KvTokensShort {
    pub max_model_len: u64,
    pub kv_tokens: u64,
}

#[derive(Debug, Clone)]
pub struct GgmlAlloc {
    pub mib: f64,
    pub device: u64,
    /// Set from the lines that follow the allocation failure.
    pub kind: Option<GgmlBuffer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlBuffer {
    Model,
    Compute,
    Kv,
}

#[derive(Debug, Clone, Default)]
pub struct OllamaTooLittle {
    pub name: Option<String>,
    pub total: Option<f64>,
    pub available: Option<f64>,
    pub minimum: Option<f64>,
    pub layer_size: Option<f64>,
    pub partial_offload: Option<f64>,
    pub full_offload: Option<f64>,
}

#[derive(Debug, Clone, Default)]
pub struct OllamaOffload {
    pub layers_model: Option<u64>,
    pub layers_offload: Option<u64>,
    pub available: Vec<f64>,
    pub allocations: Vec<f64>,
    pub required_full: Option<f64>,
    pub required_partial: Option<f64>,
    pub required_kv: Option<f64>,
    pub graph_full: Option<f64>,
    pub lines: Vec<u64>,
}

#[derive(Debug, Clone)]
pub struct TgiAllocExceed {
    pub allocated: Option<f64>,
    pub requested: Option<f64>,
    pub limit: Option<f64>,
    pub free: Option<f64>,
}

/// PyTorch's MPS (Apple silicon) out-of-memory report: what its allocator holds, what other
/// Metal allocations of the process hold, the ceiling (`PYTORCH_MPS_HIGH_WATERMARK_RATIO` times
/// the recommended working set) and the request.
#[derive(Debug, Clone, Default)]
pub struct MpsOom {
    pub allocated: Option<f64>,
    pub other: Option<f64>,
    pub max_allowed: Option<f64>,
    pub request: f64,
    pub phase: Option<Phase>,
}

/// An out-of-memory error from a runtime or library that states no sizes (or one byte count):
/// its wording, the platform it names and the phase it came in.
#[derive(Debug, Clone)]
pub struct DeviceOom {
    pub wording: &'static str,
    pub phase: Option<Phase>,
    /// A size the message states (bytes asked for), in GiB.
    pub request: Option<f64>,
}

/// SGLang's start-up figures and limits (its own words: "avail mem", "mem usage",
/// `mem_fraction_static`).
#[derive(Debug, Clone, Default)]
pub struct SglangFacts {
    /// Free memory before the weights were loaded ("Load weight begin. avail mem=").
    pub avail_before_load: Option<f64>,
    /// Free memory after them ("Load weight end. … avail mem=").
    pub avail_after_load: Option<f64>,
    /// What the weights took ("mem usage=").
    pub weights: Option<f64>,
    pub mem_fraction_static: Option<f64>,
    pub chunked_prefill_size: Option<u64>,
    pub max_running_requests: Option<u64>,
    pub cuda_graph_max_bs: Option<u64>,
    pub kv_tokens: Option<u64>,
    /// "Not enough memory. Please try to increase --mem-fraction-static."
    pub not_enough: Option<Seen<()>>,
    /// Free memory when graph capture began.
    pub avail_at_capture: Option<f64>,
    pub lines: Vec<u64>,
}

/// vLLM's start-up race check: free memory at start and after profiling ("Error in memory
/// profiling. Initial free memory X GiB, current free memory Y GiB").
#[derive(Debug, Clone, Copy)]
pub struct ProfilingRace {
    pub initial_free: f64,
    pub current_free: f64,
}

/// vLLM ≥ 0.21: "CUDA graph memory profiling is enabled … --gpu-memory-utilization=U is
/// equivalent to --gpu-memory-utilization=E without CUDA graph memory profiling".
#[derive(Debug, Clone, Copy)]
pub struct GraphProfiling {
    pub utilization: f64,
    pub equivalent: f64,
    pub line: u64,
}

/// The `--kv-cache-memory=<bytes>` values a vLLM start-up prints: one that fits the requested
/// memory, one that fills the card.
#[derive(Debug, Clone, Copy, Default)]
pub struct KvCacheMemoryAdvice {
    pub fits_requested: Option<u64>,
    pub fills_card: Option<u64>,
    pub line: u64,
}

/// A stage of a multi-stage (omni / speech) vLLM stack: its KV budget and how it was measured.
#[derive(Debug, Clone, Default)]
pub struct Stage {
    pub id: u64,
    pub kv_gib: Option<f64>,
    pub process_scoped: bool,
    pub weights_gib: Option<f64>,
    pub utilization: Option<f64>,
}

/// Ollama's settings as its server prints them (`server config` env map, runner flags,
/// llama.cpp context lines).
#[derive(Debug, Clone, Default)]
pub struct OllamaConfig {
    /// Layers the runner put on the GPU (`--n-gpu-layers`, `GPULayers:`, `layers.offload=`).
    pub gpu_layers: Option<u64>,
    /// Batch size the runner got (`--batch-size`, `BatchSize:`).
    pub batch_size: Option<u64>,
    /// Context of the whole runner, all parallel slots together (`--ctx-size`, `KvSize:`).
    pub ctx_size: Option<u64>,
    pub num_parallel: Option<u64>,
    pub context_length: Option<u64>,
    pub kv_cache_type: Option<String>,
    pub flash_attention: Option<bool>,
    pub gpu_overhead: Option<u64>,
}

/// All state kept while scanning.
#[derive(Debug, Default)]
pub struct Facts {
    pub lines_read: u64,
    pub engine: Option<Engine>,
    pub engines_seen: Vec<Engine>,
    /// The accelerator family the wording names (a specific one wins over CUDA).
    pub platform: Option<Platform>,
    pub gpu_name: Option<String>,
    pub model: Option<String>,
    pub tp: Option<u64>,
    pub pp: Option<u64>,
    pub max_model_len_config: Option<u64>,
    pub kv_cache_dtype: Option<String>,
    pub utilization_config: Option<f64>,
    pub block_size: Option<u64>,
    pub max_worker_rank: u64,
    /// The worker rank the current line's prefix names (`[rank1]:`, `(VllmWorker rank=1 …)`).
    pub line_rank: Option<u64>,
    pub last_phase: Option<(Phase, u64)>,
    pub vllm_v0: bool,
    /// V1 engine-core markers seen (EngineCore, gpu_worker.py, gpu_model_runner).
    pub vllm_v1: bool,

    // vLLM
    pub startup_free: Option<Seen<StartupFree>>,
    pub kv_need: Option<Seen<KvNeed>>,
    /// "max seq len (L)" of a KV check whose sizes may come on the next line, with its line.
    pub kv_need_len: Option<(u64, u64)>,
    /// The out-of-memory came with vLLM's hint that CUDA-graph memory profiling was on.
    pub graph_profiled: bool,
    pub kv_tokens_short: Option<Seen<KvTokensShort>>,
    pub no_cache_blocks: Option<Seen<()>>,
    pub sampler_warmup: Option<Seen<u64>>,
    pub startup: StartupReport,

    // PyTorch
    pub torch_oom: Option<Seen<TorchOom>>,
    /// An OOM that came as "CUDA error: out of memory" (driver-level, no sizes).
    pub cuda_error_oom: Option<Seen<Option<Phase>>>,

    // TGI
    pub tgi_prefill: Option<Seen<u64>>,
    pub tgi_alloc_exceed: Option<Seen<TgiAllocExceed>>,

    // llama.cpp
    pub ggml_alloc: Option<Seen<GgmlAlloc>>,
    pub ggml_pipeline_parallel: Option<u64>,
    pub ggml_devices: u64,
    /// `n_ubatch = N` and `n_ctx = N` from the context set-up lines, when the log has them.
    pub ggml_ubatch: Option<u64>,
    pub ggml_ctx: Option<u64>,

    // Ollama
    pub ollama_too_little: Option<Seen<OllamaTooLittle>>,
    pub ollama_system_memory: Option<Seen<(f64, f64)>>,
    pub ollama_offload: Option<OllamaOffload>,

    // CTranslate2 / faster-whisper
    pub ct2_oom: Option<Seen<Option<Phase>>>,

    // Families added with the v2 rules (negative KV budget, TGI warm-up, nvidia-smi tables)
    pub batch: BatchConfig,
    pub tgi_warmup: Option<Seen<()>>,
    pub tgi_config: TgiConfig,
    pub smi: SmiTable,
    /// ROCm/HIP wording seen (the fixes name HIP's allocator variable and tools).
    pub rocm: bool,

    // Platform families (MPS, XPU, Vulkan, Metal, driver-level wordings)
    pub mps_oom: Option<Seen<MpsOom>>,
    pub device_oom: Option<Seen<DeviceOom>>,
    /// A line that says "out of memory" in words no rule knows.
    pub unknown_oom: Option<Seen<Option<Phase>>>,

    // SGLang
    pub sglang: SglangFacts,

    // Families of 2026 engines
    pub profiling_race: Option<Seen<ProfilingRace>>,
    pub graph_profiling: Option<GraphProfiling>,
    pub kv_cache_memory: Option<KvCacheMemoryAdvice>,
    pub stages: Vec<Stage>,
    /// The stage the current line's prefix names (`[Stage-1]`).
    pub line_stage: Option<u64>,
    /// An out-of-memory the engine caught and went on from, with what it did next.
    pub absorbed: Option<Seen<&'static str>>,
    /// Lines that show the engine serving or past start-up.
    pub ready_lines: Vec<u64>,
    /// Last line of an out-of-memory report any rule recorded.
    pub last_oom_line: Option<u64>,
    /// TGI "Not enough memory to handle N total tokens with M prefill tokens".
    pub tgi_total_tokens: Option<Seen<(u64, Option<u64>)>>,
    /// An error inside TGI's warm-up that is not about memory (the wrapped exception).
    pub tgi_warmup_error: Option<Seen<String>>,
    pub ollama_config: OllamaConfig,

    // Not memory at all
    pub non_memory: Option<Seen<&'static str>>,
    pub unrecognised: Vec<(u64, String)>,
}

impl Facts {
    /// Notes that the wording names `platform`; any specific platform wins over CUDA (ROCm builds
    /// of PyTorch still say "cuda" in paths and variable names).
    pub fn saw_platform(&mut self, platform: Platform) {
        match self.platform {
            None | Some(Platform::Cuda) => self.platform = Some(platform),
            Some(_) => {}
        }
    }

    /// Notes an out-of-memory report at `line` (for the absorbed-OOM reading).
    pub fn saw_oom(&mut self, line: u64) {
        self.last_oom_line = Some(line);
    }

    /// Notes that the log carries `engine`'s messages.
    pub fn saw_engine(&mut self, engine: Engine) {
        if !self.engines_seen.contains(&engine) {
            self.engines_seen.push(engine);
        }
    }

    /// The phase marker in force at `line` (same line first, else the last one within the window).
    pub fn phase_at(&self, line: u64, same_line: Option<Phase>) -> Option<Phase> {
        same_line.or_else(|| {
            self.last_phase
                .filter(|(_, at)| line.saturating_sub(*at) <= PHASE_WINDOW)
                .map(|(p, _)| p)
        })
    }

    /// The knob names of the engine in this log.
    pub fn knobs(&self) -> Knobs {
        match self.engine {
            Some(Engine::Tgi) => Knobs {
                budget: "--cuda-memory-fraction",
                batch: "--max-batch-prefill-tokens",
                parallel: "--num-shard",
            },
            Some(Engine::LlamaCpp) => Knobs {
                budget: "-ngl (layers on GPU)",
                batch: "-ub/--ubatch-size",
                parallel: "--tensor-split",
            },
            Some(Engine::Ollama) => Knobs {
                budget: "num_gpu (layers on GPU)",
                batch: "num_batch",
                parallel: "OLLAMA_SCHED_SPREAD=1 (spread layers over every GPU)",
            },
            Some(Engine::Ctranslate2) | Some(Engine::Whisper) => Knobs {
                budget: "a smaller model or compute_type",
                batch: "batch_size/beam_size",
                parallel: "device_index",
            },
            Some(Engine::PyTorch) => Knobs {
                budget: "the model size",
                batch: "the batch size",
                parallel: "more GPUs",
            },
            Some(Engine::Sglang) => Knobs {
                budget: "--mem-fraction-static",
                batch: "--chunked-prefill-size",
                parallel: "--tp-size",
            },
            Some(Engine::Vllm) | None => Knobs {
                budget: "--gpu-memory-utilization",
                batch: "--max-num-batched-tokens",
                parallel: "--tensor-parallel-size",
            },
        }
    }
}

/// Flag names for the three levers, per engine.
#[derive(Debug, Clone, Copy)]
pub struct Knobs {
    pub budget: &'static str,
    pub batch: &'static str,
    pub parallel: &'static str,
}

/// vLLM scheduler settings a start-up log shows (read by the negative-KV rule).
#[derive(Debug, Clone, Default)]
pub struct BatchConfig {
    pub max_num_batched_tokens: Option<u64>,
    pub max_num_seqs: Option<u64>,
    /// The profile run is an encoder-decoder / multimodal one (Whisper and friends).
    pub encoder_profile: bool,
    pub chunked_prefill: Option<bool>,
}

/// TGI launcher limits a log shows (`max_batch_prefill_tokens: Some(4096)`, `--max-total-tokens`).
#[derive(Debug, Clone, Default)]
pub struct TgiConfig {
    pub max_batch_prefill_tokens: Option<u64>,
    pub max_input_tokens: Option<u64>,
    pub max_total_tokens: Option<u64>,
    pub max_batch_total_tokens: Option<u64>,
}

/// A pasted `nvidia-smi` table: per-GPU memory rows and the process list.
#[derive(Debug, Clone, Default)]
pub struct SmiTable {
    /// (used GiB, total GiB) per GPU row, in order.
    pub gpus: Vec<(f64, f64)>,
    /// (gpu, pid, name, GiB) per process row.
    pub processes: Vec<(u64, u64, String, f64)>,
    pub lines: Vec<u64>,
}
