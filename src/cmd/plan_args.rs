//! `headroom plan`'s flags and output formats, shared by the vLLM planner ([`super::plan`]) and
//! the llama.cpp one ([`super::plan_llamacpp`]): both import them from here, so neither imports
//! the other's types.

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Shell,
}

/// Which engine `plan` sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Engine {
    #[default]
    Vllm,
    Llamacpp,
}

/// `--list`: which part of the built-in catalog to print.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ListWhat {
    Models,
    Gpus,
    Reserves,
}

#[derive(Debug, clap::Args)]
// A flag given twice takes the later value (with a note on stderr), so an option's flags can be
// added to a command line that already has them.
#[command(args_override_self = true)]
pub struct PlanArgs {
    /// vllm, or llamacpp (llama.cpp / llama-server: GGUF, --n-gpu-layers partial offload).
    #[arg(long, value_enum, default_value_t = Engine::Vllm)]
    pub engine: Engine,
    /// Hugging Face id (meta-llama/Llama-3.1-8B-Instruct), local directory or file, or a catalog
    /// name. Looked up on disk, in the Hugging Face cache, in the catalog, then on the Hub
    /// (config.json and safetensors headers only; HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE=1).
    #[arg(long, required_unless_present = "list")]
    pub model: Option<String>,
    /// Print the built-in catalog's models, GPUs or reserve profiles (one per line) and exit.
    #[arg(long, value_enum)]
    pub list: Option<ListWhat>,
    /// GPU name (RTX 4090, H100, ...) or its memory (24GiB, 23.58GiB, 24GB, 24576MiB, bytes).
    /// Without it, GPU 0 of this machine is read through NVML, and memory other processes hold
    /// there counts as --other-used.
    #[arg(long)]
    pub gpu: Option<String>,
    /// vLLM's budget as a fraction of the card's memory. Default: vLLM's own (0.92 since vLLM
    /// 0.21, 0.90 before; see --vllm-version) on a card of its own; beside co-tenants the largest
    /// that leaves them free (at most 0.95); with --max-num-seqs or --target-concurrency, just
    /// what a KV pool sized for them needs.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// A fixed KV-cache size (vLLM --kv-cache-memory), e.g. 4GiB.
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// Longest sequence (prompt + output) in tokens; accepts 16k / 128K.
    #[arg(long)]
    pub max_model_len: Option<String>,
    /// vLLM --max-num-seqs: sequences run at once (vLLM's default: 256, or 1024 on cards of 70
    /// GiB and more other than A100s). Given without --gpu-memory-utilization, the KV pool is
    /// sized for that many sequences of --max-model-len plus --kv-slack (--fill: the largest
    /// safe utilization instead).
    #[arg(long)]
    pub max_num_seqs: Option<u64>,
    /// vLLM --max-num-batched-tokens: tokens one forward pass takes, which sets the activation
    /// peak (vLLM's default: 2048, or 8192 on cards of 70 GiB and more; V0 releases at least
    /// --max-model-len); accepts 8k.
    #[arg(long)]
    pub max_num_batched_tokens: Option<String>,
    /// auto (the model dtype) or fp8 (fp8_e4m3, fp8_e5m2).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// auto (the checkpoint's), bfloat16, float16 or float32.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// none, awq, gptq, bnb-4bit, bnb-8bit, fp8, mxfp4, nvfp4; default: what the checkpoint declares.
    #[arg(long)]
    pub quantization: Option<String>,
    /// GPUs one model is split over (vLLM --tensor-parallel-size): weights and KV heads are
    /// divided per rank, and every figure is per GPU. Must divide the attention heads.
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: u64,
    /// Decoder layers split over this many GPUs (vLLM --pipeline-parallel-size); figures per GPU.
    #[arg(long, visible_alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: u64,
    /// The vLLM release to reproduce (0.6.3, 0.8.5, 0.20.1, latest). 0.21 and later (latest):
    /// default utilization 0.92, CUDA-graph estimate counted inside it. 0.9.1 to 0.20: 0.90,
    /// graphs on top. 0.8 to 0.9.0 also charge other processes' memory to the instance; V0
    /// releases (before 0.8) profile a whole --max-model-len prompt. Before 0.9.1 there is no
    /// start-up free-memory check and no --kv-cache-memory.
    #[arg(long, default_value = "latest")]
    pub vllm_version: String,
    /// Memory for another tenant: NAME=SIZE, or a catalog profile (whisper-large-v3). Repeatable.
    #[arg(long)]
    pub reserve: Vec<String>,
    /// Reserve what `headroom up` measured instead of a guessed profile: the calibration file
    /// beside a box file (BOX.calibration.json); each audio backend's measured peak is reserved.
    /// A file measured with `probe: host` (a CPU-only box) holds host memory, not GPU memory:
    /// it is used as written, with a warning.
    #[arg(long, value_name = "FILE")]
    pub reserve_from: Option<std::path::PathBuf>,
    /// Memory other processes already hold on the card.
    #[arg(long)]
    pub other_used: Option<String>,
    /// Memory kept free on top of everything else (allocator slack, driver growth).
    #[arg(long, default_value = "256MiB")]
    pub safety_margin: String,
    /// Size --max-model-len for this many minutes of audio (VibeVoice-ASR).
    #[arg(long)]
    pub audio_minutes: Option<f64>,
    /// Sequences of --max-model-len that must run at once: prints the memory needed.
    #[arg(long)]
    pub target_concurrency: Option<u64>,
    /// KV-cache block size in tokens (vLLM --block-size: 1, 8, 16, 32, 64, 128 or 256); the
    /// pool and every sequence are counted in whole blocks.
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// Plan without CUDA graphs (vLLM --enforce-eager).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Charge sliding-window layers at full length (vLLM --disable-hybrid-kv-cache-manager).
    #[arg(long)]
    pub disable_hybrid_kv_cache_manager: bool,
    /// table (readable, coloured with --color always), json (every figure; field names are
    /// stable) or shell (the `vllm serve` line alone; nothing when the plan does not fit).
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// With --max-num-seqs/--target-concurrency: take the largest safe utilization instead of a
    /// KV pool sized to the bound (the pre-v2 behaviour).
    #[arg(long)]
    pub fill: bool,
    /// Extra KV a right-sized pool keeps for prefix caching: a fraction (0.25) or percent (25%).
    #[arg(long, default_value = "25%")]
    pub kv_slack: String,
    #[command(flatten)]
    pub llamacpp: LlamaCppArgs,
    #[command(flatten)]
    pub layout: super::plan_layout::LayoutArgs,
}

/// llama.cpp's own flags, used only with `--engine llamacpp`.
#[derive(Debug, Default, clap::Args)]
pub struct LlamaCppArgs {
    /// llama.cpp --ctx-size: total context over all sequences (default: the model's).
    #[arg(long)]
    pub ctx_size: Option<u64>,
    /// llama.cpp --parallel: sequences (server slots).
    #[arg(long)]
    pub parallel: Option<u64>,
    /// llama.cpp --batch-size (logical batch).
    #[arg(long)]
    pub batch_size: Option<u64>,
    /// llama.cpp --ubatch-size (physical batch; sizes the compute buffer).
    #[arg(long)]
    pub ubatch_size: Option<u64>,
    /// llama.cpp --cache-type-k: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1.
    #[arg(long)]
    pub cache_type_k: Option<String>,
    /// llama.cpp --cache-type-v (quantized types need flash attention).
    #[arg(long)]
    pub cache_type_v: Option<String>,
    /// llama.cpp --n-gpu-layers; default: the most that fit (as llama.cpp's --fit does).
    #[arg(long)]
    pub n_gpu_layers: Option<u64>,
    /// llama.cpp --kv-unified: one KV stream shared by all sequences.
    #[arg(long)]
    pub kv_unified: bool,
    /// llama.cpp --flash-attn: on, off or auto.
    #[arg(long)]
    pub flash_attn: Option<String>,
    /// llama.cpp --no-kv-offload: keep the KV cache in host memory.
    #[arg(long)]
    pub no_kv_offload: bool,
    /// llama.cpp --swa-full: full-size cache for sliding-window layers.
    #[arg(long)]
    pub swa_full: bool,
    /// Weight type assumed when the model is not a local GGUF: f16, q8_0, q6_k, q5_k, q4_k, q4_0.
    #[arg(long, default_value = "q4_k")]
    pub gguf_type: String,
}

impl LlamaCppArgs {
    /// True when any llama.cpp flag was given (they mean nothing to vLLM).
    pub fn any_given(&self) -> bool {
        self.ctx_size.is_some()
            || self.parallel.is_some()
            || self.batch_size.is_some()
            || self.ubatch_size.is_some()
            || self.cache_type_k.is_some()
            || self.cache_type_v.is_some()
            || self.n_gpu_layers.is_some()
            || self.kv_unified
            || self.flash_attn.is_some()
            || self.no_kv_offload
            || self.swa_full
    }
}
