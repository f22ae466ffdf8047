//! vLLM's memory budget, reproduced: `requested = total × util`, `non_kv = weights + activation
//! peak + non-torch`, `kv = requested − non_kv` (or exactly `--kv-cache-memory`), blocks, tokens and
//! concurrency; its three start-up failures with its own numbers; the CUDA-graph pool outside the
//! budget; co-tenants on the same card; the flags to pass; and the options when a plan misses.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::kv::{KvCacheDtype, KvLayout, KvSettings};
use crate::overhead::{
    CUDA_CONTEXT_BYTES, activation_peak_bytes, cuda_graph_bytes, non_torch_bytes,
};
use crate::spec::{Dtype, ModelKind, ModelSpec, QuantScheme, Quantization};
use crate::units::{GIB, floor_2dp, gib, thousands};
use crate::weights::{estimated_weight_bytes, weight_bytes_per_rank};

/// vLLM's default `--gpu-memory-utilization` since v0.21.0 (vLLM PR #38284 raised it from 0.90
/// when it began counting an estimate of the CUDA-graph pool inside that budget).
pub const DEFAULT_UTILIZATION: f64 = 0.92;
/// vLLM's default `--gpu-memory-utilization` before v0.21.0.
pub const DEFAULT_UTILIZATION_BEFORE_0_21: f64 = 0.9;
/// The highest utilization headroom proposes on a card that other tenants share.
pub const MAX_PROPOSED_UTILIZATION: f64 = 0.95;
/// vLLM's default block size on CUDA.
pub const DEFAULT_BLOCK_SIZE: u64 = 16;
/// Extra KV blocks a right-sized pool keeps beyond what the bounded sequences can hold at once,
/// as a fraction of those: room for prefix-cached blocks of finished requests to survive
/// (vLLM frees a finished request's blocks into a cache it evicts least-recently-used first).
pub const DEFAULT_KV_SLACK: f64 = 0.25;

/// Memory set aside for another tenant of the card (an audio server, say).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reservation {
    pub name: String,
    pub bytes: u64,
    pub why: String,
}

/// Everything a plan depends on besides the model.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    pub gpu_name: Option<String>,
    pub gpu_total_bytes: u64,
    pub gpu_memory_utilization: Option<f64>,
    pub kv_cache_memory: Option<u64>,
    pub max_model_len: Option<u64>,
    pub max_num_seqs: Option<u64>,
    pub max_num_batched_tokens: Option<u64>,
    pub kv_cache_dtype: KvCacheDtype,
    pub dtype: Option<Dtype>,
    pub quantization: Option<QuantScheme>,
    pub tensor_parallel_size: u64,
    pub block_size: u64,
    pub hybrid_kv_manager: bool,
    pub enforce_eager: bool,
    pub reservations: Vec<Reservation>,
    /// Memory other processes already hold on the card.
    pub other_used_bytes: u64,
    /// Slack kept free on top of everything else.
    pub safety_margin_bytes: u64,
    pub audio_minutes: Option<f64>,
    pub target_concurrency: Option<u64>,
    /// Keep the old behaviour when concurrency is bounded: the largest safe utilization instead
    /// of a KV pool sized to the bound (`--fill`).
    pub fill: bool,
    /// Right-sizing slack for prefix caching, as a fraction of the bounded need (`--kv-slack`).
    pub kv_slack: f64,
    /// `VLLM_ALLOW_LONG_MAX_MODEL_LEN=1` is set: vLLM accepts a length above the model's positions.
    pub allow_long_max_model_len: bool,
    /// `--pipeline-parallel-size`: decoder layers split over this many stages (one GPU each,
    /// times the tensor-parallel ranks).
    pub pipeline_parallel_size: u64,
    /// Which vLLM's memory accounting to reproduce (`--vllm-version`).
    pub vllm_version: VllmVersion,
}

/// vLLM releases whose memory accounting differs (the anchors' §1.1–1.2, and each release's
/// `determine_num_available_blocks` / `determine_available_memory`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum VllmVersion {
    /// 0.21.0 and later: as [`VllmVersion::V1Before0_21`], and the CUDA-graph pool is profiled at
    /// start-up and its estimate counted inside `util × total` (`VLLM_MEMORY_PROFILER_ESTIMATE_
    /// CUDAGRAPHS`, on by default since vLLM PR #38284), with the default utilization raised
    /// from 0.90 to 0.92 to make room for it.
    #[default]
    Current,
    /// 0.9.1 to 0.20.x: `requested = util × total` must be free at start; other processes are not
    /// charged; `--kv-cache-memory` exists; chunked prefill profiles `max_num_batched_tokens`;
    /// CUDA graphs are captured after the KV cache, outside the budget; default utilization 0.90.
    V1Before0_21,
    /// Early V1 (0.8 to 0.9.0): `non_torch = (total − free) − torch_allocated` after profiling,
    /// so all memory on the device outside this process's torch tensors (its own CUDA context and
    /// other processes' memory) is charged to the instance; no start-up free-memory check; no
    /// `--kv-cache-memory`.
    EarlyV1,
    /// V0 up to 0.6.3 and from 0.6.5 (`peak = init_free − free` after profiling, then the
    /// `memory_profiling` baseline): budget `util × total` minus the instance's own use, no
    /// start-up check, no `--kv-cache-memory`; without chunked prefill the profiling pass covers
    /// `max_model_len` tokens (`max_num_batched_tokens` defaults to `max(max_model_len, 2048)`).
    V0,
    /// V0 0.6.4.x: V0's profiling with early V1's non-torch rule (the CUDA context and other
    /// processes charged), which 0.6.5's `memory_profiling` baseline removed.
    V0AllNonTorch,
}

impl VllmVersion {
    /// `0.6.3`, `v0.8.5`, `0.10`, `0.21.0`, or `latest`.
    pub fn parse(s: &str) -> Option<VllmVersion> {
        let t = s.trim().trim_start_matches(['v', 'V']);
        if t.eq_ignore_ascii_case("latest") || t.eq_ignore_ascii_case("current") {
            return Some(VllmVersion::Current);
        }
        let mut parts = t.split('.').map(|p| p.parse::<u64>().ok());
        let major = parts.next()??;
        let minor = parts.next().flatten().unwrap_or(0);
        let patch = parts.next().flatten().unwrap_or(0);
        Some(match (major, minor, patch) {
            (0, 6, 4) => VllmVersion::V0AllNonTorch,
            (0, m, _) if m < 8 => VllmVersion::V0,
            (0, 8, _) | (0, 9, 0) => VllmVersion::EarlyV1,
            (0, m, _) if m < 21 => VllmVersion::V1Before0_21,
            _ => VllmVersion::Current,
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            VllmVersion::Current => "current",
            VllmVersion::V1Before0_21 => "v1_before_0_21",
            VllmVersion::EarlyV1 => "early_v1",
            VllmVersion::V0 => "v0",
            VllmVersion::V0AllNonTorch => "v0_6_4",
        }
    }

    /// The `--gpu-memory-utilization` this release uses when none is given.
    pub fn default_utilization(self) -> f64 {
        match self {
            VllmVersion::Current => DEFAULT_UTILIZATION,
            _ => DEFAULT_UTILIZATION_BEFORE_0_21,
        }
    }

    /// Whether the release counts its CUDA-graph estimate inside `util × total` (0.21 and later)
    /// rather than capturing the graphs on top of it.
    pub fn graphs_in_budget(self) -> bool {
        self == VllmVersion::Current
    }

    /// Whether the release has `--kv-cache-memory` (0.9.1 and later).
    pub fn has_kv_cache_memory(self) -> bool {
        matches!(self, VllmVersion::Current | VllmVersion::V1Before0_21)
    }

    /// Whether the release refuses to start unless `util × total` is free (0.9.1 and later).
    pub fn checks_free_memory_at_start(self) -> bool {
        self.has_kv_cache_memory()
    }

    /// V0 engines: no chunked prefill by default, so one profiling pass over a whole prompt.
    pub fn profiles_whole_prompt(self) -> bool {
        matches!(self, VllmVersion::V0 | VllmVersion::V0AllNonTorch)
    }

    /// Memory the version's profiler charges to the instance beyond its own weights,
    /// activations and workspaces: with `non_torch = (total − free) − torch_allocated`, the
    /// process's CUDA context and everything other processes hold on the device.
    pub fn charged_outside_instance(self, co_tenants: u64, cuda_context: u64) -> u64 {
        match self {
            VllmVersion::EarlyV1 | VllmVersion::V0AllNonTorch => co_tenants + cuda_context,
            VllmVersion::Current | VllmVersion::V1Before0_21 | VllmVersion::V0 => 0,
        }
    }
}

impl PlanRequest {
    /// A request with vLLM's defaults on a card of `total` bytes.
    pub fn new(gpu_total_bytes: u64) -> PlanRequest {
        PlanRequest {
            gpu_name: None,
            gpu_total_bytes,
            gpu_memory_utilization: None,
            kv_cache_memory: None,
            max_model_len: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            dtype: None,
            quantization: None,
            tensor_parallel_size: 1,
            block_size: DEFAULT_BLOCK_SIZE,
            hybrid_kv_manager: true,
            enforce_eager: false,
            reservations: Vec::new(),
            other_used_bytes: 0,
            safety_margin_bytes: 0,
            audio_minutes: None,
            target_concurrency: None,
            fill: false,
            kv_slack: DEFAULT_KV_SLACK,
            allow_long_max_model_len: false,
            pipeline_parallel_size: 1,
            vllm_version: VllmVersion::Current,
        }
    }

    /// Sequences the user bounded concurrency to (`--target-concurrency`, else `--max-num-seqs`).
    pub fn concurrency_bound(&self) -> Option<u64> {
        self.target_concurrency.or(self.max_num_seqs)
    }

    /// Whether the KV pool is sized to the concurrency bound rather than to the card.
    pub fn right_sized(&self) -> bool {
        !self.fill
            && self.gpu_memory_utilization.is_none()
            && self.kv_cache_memory.is_none()
            && self.concurrency_bound().is_some()
    }

    fn co_tenant_bytes(&self) -> u64 {
        self.other_used_bytes + self.reservations.iter().map(|r| r.bytes).sum::<u64>()
    }
}

/// Settings that make a plan meaningless.
#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum PlanError {
    #[error("--gpu-memory-utilization must be in (0, 1], got {0}")]
    Utilization(f64),
    #[error("--tensor-parallel-size must be at least 1")]
    TensorParallel,
    #[error("--{0} must be at least 1")]
    Zero(&'static str),
    #[error("the GPU size must be more than 0 bytes")]
    NoGpuMemory,
    #[error("--audio-minutes needs a model with an audio tokenizer; {0} has none")]
    NotAnAudioModel(String),
    #[error("--audio-minutes must be a positive number of minutes, got {0}")]
    AudioMinutes(f64),
    #[error("--kv-slack must be between 0 and 4 (0 % to 400 %), got {0}")]
    KvSlack(f64),
}

/// How vLLM would fail to start (or run out of memory right after), with its numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Failure {
    /// The weights alone exceed what is free on the card.
    WeightsDoNotFit { weights_bytes: u64, free_bytes: u64 },
    /// Newer V1: `free < util × total` at start, because other processes hold memory.
    StartupFreeBelowUtilization {
        free_bytes: u64,
        total_bytes: u64,
        utilization: f64,
        requested_bytes: u64,
    },
    /// `requested − non_kv ≤ 0`: "No available memory for the cache blocks".
    NoKvCacheMemory {
        requested_bytes: u64,
        non_kv_bytes: u64,
    },
    /// One `max_model_len` sequence does not fit in the KV pool.
    MaxModelLenDoesNotFit {
        max_model_len: u64,
        needed_bytes: u64,
        available_bytes: u64,
        estimated_max_model_len: u64,
    },
    /// The budget plus the CUDA-graph pool, context and co-tenants exceed the card.
    DeviceOvercommitted { needed_bytes: u64, total_bytes: u64 },
}

impl Failure {
    /// The message vLLM (or the CUDA allocator) would print, with these numbers.
    pub fn message(&self) -> String {
        match self {
            Failure::WeightsDoNotFit {
                weights_bytes,
                free_bytes,
            } => format!(
                "CUDA out of memory while loading weights: {:.2} GiB of weights per GPU, {:.2} GiB free",
                gib(*weights_bytes),
                gib(*free_bytes)
            ),
            Failure::StartupFreeBelowUtilization {
                free_bytes,
                total_bytes,
                utilization,
                requested_bytes,
            } => format!(
                "Free memory on device ({:.2}/{:.2} GiB) on startup is less than desired GPU memory utilization ({:.2}, {:.2} GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
                gib(*free_bytes),
                gib(*total_bytes),
                utilization,
                gib(*requested_bytes)
            ),
            Failure::NoKvCacheMemory { .. } => "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine.".to_string(),
            Failure::MaxModelLenDoesNotFit {
                max_model_len,
                needed_bytes,
                available_bytes,
                estimated_max_model_len,
            } => format!(
                "To serve at least one request with the models's max seq len ({max_model_len}), ({:.2} GiB KV cache is needed, which is larger than the available KV cache memory ({:.2} GiB). Based on the available memory, the estimated maximum model length is {estimated_max_model_len}. Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine.",
                gib(*needed_bytes),
                gib(*available_bytes)
            ),
            Failure::DeviceOvercommitted {
                needed_bytes,
                total_bytes,
            } => format!(
                "CUDA out of memory after start-up: vLLM's budget, its CUDA-graph pool and context, and the other tenants need {:.2} GiB of a {:.2} GiB card",
                gib(*needed_bytes),
                gib(*total_bytes)
            ),
        }
    }

    /// Bytes missing for the plan to fit.
    pub fn shortfall_bytes(&self) -> u64 {
        match self {
            Failure::WeightsDoNotFit {
                weights_bytes,
                free_bytes,
            } => weights_bytes.saturating_sub(*free_bytes),
            Failure::StartupFreeBelowUtilization {
                free_bytes,
                requested_bytes,
                ..
            } => requested_bytes.saturating_sub(*free_bytes),
            Failure::NoKvCacheMemory {
                requested_bytes,
                non_kv_bytes,
            } => non_kv_bytes.saturating_sub(*requested_bytes),
            Failure::MaxModelLenDoesNotFit {
                needed_bytes,
                available_bytes,
                ..
            } => needed_bytes.saturating_sub(*available_bytes),
            Failure::DeviceOvercommitted {
                needed_bytes,
                total_bytes,
            } => needed_bytes.saturating_sub(*total_bytes),
        }
    }
}

/// One row of the memory table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Component {
    pub name: String,
    pub bytes: u64,
    pub why: String,
}

/// Audio-context arithmetic for models with an audio tokenizer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AudioContext {
    pub tokens_per_second: f64,
    pub tokens_per_minute: f64,
    /// Minutes of audio one `max_model_len` sequence holds: for speech-to-text with the
    /// transcript allowance and prompt the sizing adds; for speech output, audio tokens only.
    pub minutes_per_sequence: f64,
    /// For `--audio-minutes`: the audio tokens, the transcript allowance and the length needed.
    pub requested_minutes: Option<f64>,
    pub audio_tokens: Option<u64>,
    pub transcript_tokens_allowance: Option<u64>,
    pub max_model_len_needed: Option<u64>,
}

/// Transcript tokens budgeted per minute of audio when sizing `--max-model-len` for ASR:
/// about 150 spoken words a minute at ~1.3 tokens a word, plus speaker and timestamp markup.
pub const TRANSCRIPT_TOKENS_PER_MINUTE: u64 = 250;
/// Tokens of instruction prompt budgeted around the audio.
pub const ASR_PROMPT_TOKENS: u64 = 128;

/// A change that makes a missed plan fit: the request was planned again with it applied, and
/// these are that plan's figures (see [`crate::advice::verified_options`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitOption {
    /// Short name: `utilization`, `fp8_kv_cache`, `fewer_sequences`, `shorter_context`,
    /// `fp8_weights`, `bnb_4bit_weights`, `tensor_parallel_N`, or several joined with `+`.
    pub option: String,
    pub description: String,
    /// vLLM flags that change (the re-planned `vllm serve` line carries them).
    pub vllm_args: Vec<String>,
    /// Flags to add to the same `headroom plan` command to get that re-plan.
    #[serde(default)]
    pub headroom_args: Vec<String>,
    /// Whole-card memory the re-plan needs (device peak + safety margin).
    pub memory_needed_bytes: u64,
    /// Always true: options that do not fit are not offered.
    pub fits: bool,
    /// True when the re-plan keeps everything asked: the minutes of audio, the `--max-model-len`
    /// and the sequences (`--max-num-seqs`, `--target-concurrency`) given.
    #[serde(default)]
    pub keeps_asked: bool,
    /// What the option gives up of what was asked, in words ("holds 26.1 min of audio per
    /// sequence, not 60"); empty when it keeps everything.
    #[serde(default)]
    pub gives_up: Vec<String>,
    /// GPUs the option runs on (tensor-parallel ranks × pipeline stages).
    #[serde(default)]
    pub gpus: u64,
    pub gpu_memory_utilization: f64,
    pub max_model_len: u64,
    /// Full-length sequences the re-planned KV pool holds at once.
    pub concurrency: u64,
}

/// The inverse question: memory for N sequences of L tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetPlan {
    pub concurrency: u64,
    pub max_model_len: u64,
    pub kv_cache_bytes_needed: u64,
    /// Whole-card memory needed: this instance (with graphs and context), co-tenants and margin.
    pub memory_needed_bytes: u64,
    pub fits: bool,
}

/// Limits for `headroom serve` that follow from the plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LaneHints {
    /// Sequences the KV pool holds at full length, capped by `--max-num-seqs`.
    pub text_max_inflight: u64,
    /// A short queue at the gateway instead of an unbounded one inside the engine.
    pub text_max_queue: u64,
    /// One job at a time per audio tenant (speech servers serialize requests); for a planned
    /// speech model, the whole sequences of the planned length its KV pool holds.
    pub audio_max_inflight: u64,
    /// The lane the planned model serves: `text`, or `audio` for speech models (whose text
    /// limits are then 0).
    #[serde(default)]
    pub lane: String,
}

/// A full prediction.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub model: String,
    pub model_source: String,
    pub gpu_name: Option<String>,
    pub gpu_total_bytes: u64,
    pub tensor_parallel_size: u64,
    pub pipeline_parallel_size: u64,
    /// Decoder layers on the largest pipeline stage; per-GPU weights and KV are for that stage.
    pub layers_per_stage: u64,
    /// The vLLM accounting reproduced: `current`, `early_v1` or `v0`.
    pub vllm_version: String,
    pub weights_bytes: u64,
    /// `exact` (from headers) or `estimated` (from the shape).
    pub weights_origin: String,
    pub quantization: String,
    pub dtype: String,
    pub kv_bytes_per_token: u64,
    /// KV heads each tensor-parallel rank holds (`max(1, kv_heads / tp)`; 0 for MLA, whose one
    /// latent is not split), and the KV bytes one token costs over all ranks together.
    pub kv_heads_per_rank: u64,
    pub kv_bytes_per_token_all_ranks: u64,
    /// Extra bytes of components loaded wider than stored (VibeVoice tokenizers in float32),
    /// on top of `weights_bytes` (the checkpoint's own total).
    pub weights_upcast_bytes: u64,
    /// The checkpoint's modules with stored and loaded dtypes, when the model source lists them
    /// (the catalog's VibeVoice entries); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weights_by_component: Vec<crate::spec::WeightComponent>,
    pub activation_peak_bytes: u64,
    pub non_torch_bytes: u64,
    pub cuda_graph_bytes: u64,
    pub cuda_context_bytes: u64,
    /// Co-tenants: reservations plus memory other processes hold.
    pub reserved_bytes: u64,
    pub safety_margin_bytes: u64,
    pub gpu_memory_utilization: f64,
    /// Where the utilization came from: `given`, `default`, `largest_safe`, or `right_sized`
    /// (just above what the right-sized instance uses, so vLLM's start-up check passes).
    pub utilization_source: String,
    /// How the KV pool was sized: `right_sized` (to the concurrency bound, passed as
    /// `--kv-cache-memory`), `fill` (largest safe utilization), `given` (the user's
    /// `--gpu-memory-utilization` or `--kv-cache-memory`), or `default` (no bound given).
    pub sizing_mode: String,
    /// Slack fraction a right-sized pool carries (0 in the other modes).
    pub kv_slack: f64,
    /// Memory vLLM leaves on the card for the co-tenants: total − vLLM's whole footprint (budget
    /// or right-sized parts, CUDA graphs, context) − other processes − the safety margin.
    pub headroom_bytes: u64,
    pub largest_safe_gpu_memory_utilization: f64,
    pub requested_bytes: u64,
    pub kv_cache_bytes: u64,
    /// The `--kv-cache-memory` value equivalent to the utilization.
    pub kv_cache_memory_bytes: u64,
    pub kv_cache_tokens: u64,
    pub num_blocks: u64,
    pub block_size: u64,
    pub kv_cache_dtype: String,
    pub max_model_len: u64,
    pub max_num_seqs: u64,
    pub max_num_batched_tokens: u64,
    pub max_concurrency: f64,
    /// Whole-card use once vLLM runs: `util × total` (or its parts) + graphs + context + co-tenants.
    pub device_peak_bytes: u64,
    pub fits: bool,
    pub failure: Option<Failure>,
    /// Settings vLLM rejects before it allocates anything (a TP size that does not divide the
    /// heads, an invalid block size, ...); any entry makes `fits` false.
    #[serde(default)]
    pub refused: Vec<String>,
    pub shortfall_bytes: u64,
    pub estimated_max_model_len: Option<u64>,
    pub components: Vec<Component>,
    pub reservations: Vec<Reservation>,
    pub vllm_args: Vec<String>,
    pub lanes: LaneHints,
    pub audio: Option<AudioContext>,
    pub target: Option<TargetPlan>,
    pub options: Vec<FitOption>,
    /// What this plan holds short of what was asked, in words ("holds 26.1 min of audio per
    /// sequence, not 60"): a length given beside `--audio-minutes` that is too short for them.
    /// Empty when the plan is for everything asked.
    #[serde(default)]
    pub gives_up: Vec<String>,
    pub warnings: Vec<String>,
}

/// vLLM's default `(max_num_batched_tokens, max_num_seqs)` for `vllm serve`: larger on cards of
/// 70 GiB or more (except A100s).
pub fn default_batching(total_bytes: u64, gpu_name: Option<&str>) -> (u64, u64) {
    let is_a100 = gpu_name.is_some_and(|n| n.to_ascii_lowercase().contains("a100"));
    if total_bytes >= 70 * GIB && !is_a100 {
        (8192, 1024)
    } else {
        (2048, 256)
    }
}

struct Resolved {
    spec: ModelSpec,
    weights_total: u64,
    weights_exact: bool,
    tp: u64,
    pp: u64,
    /// Decoder layers on the largest pipeline stage (all of them without PP).
    stage_layers: u64,
    max_model_len: u64,
    max_num_seqs: u64,
    mbt: u64,
    layout: KvLayout,
}

fn resolve(spec: &ModelSpec, req: &PlanRequest, warnings: &mut Vec<String>) -> Resolved {
    let mut spec = spec.clone();
    if let Some(d) = req.dtype {
        spec.dtype = d;
    }
    let mut weights_exact = spec.exact_weights.is_some();
    if let Some(q) = req.quantization
        && q != spec.quantization.scheme
    {
        if spec.quantization.scheme != QuantScheme::None && q == QuantScheme::None {
            warnings.push(format!(
                "the checkpoint is {}-quantized; planning it as unquantized weights",
                spec.quantization.scheme.label()
            ));
        }
        spec.quantization = Quantization {
            scheme: q,
            group_size: spec.quantization.group_size,
            experts_only: spec.quantization.experts_only && q == QuantScheme::Mxfp4,
            // vLLM quantizes 16-bit weights itself only to fp8 and bitsandbytes.
            online: spec.quantization.scheme == QuantScheme::None
                && matches!(q, QuantScheme::Fp8 | QuantScheme::Bnb4 | QuantScheme::Bnb8),
            ..Quantization::NONE
        };
        weights_exact = false;
    }
    let weights_total = match (weights_exact, spec.exact_weights) {
        // A pre-quantized bitsandbytes checkpoint's headers count its 8-bit nested absmax; vLLM
        // holds them as fp32 once loaded.
        (true, Some(w)) => w.bytes + crate::weights::bnb_nested_absmax_growth(&spec),
        _ => estimated_weight_bytes(&spec, spec.quantization),
    };
    let tp = req.tensor_parallel_size.max(1);
    let default_len = spec.max_position_embeddings.max(1);
    let max_model_len = match req.max_model_len {
        Some(l) => {
            if l > default_len && !spec.positions_known {
                warnings.push(format!(
                    "the config names no position limit; {default_len} is assumed, and vLLM may refuse --max-model-len {l}"
                ));
            } else if l > default_len && req.allow_long_max_model_len {
                warnings.push(format!(
                    "--max-model-len {l} is above the model's {default_len} positions (allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); quality past the trained length is not guaranteed"
                ));
            }
            l
        }
        None => default_len,
    };
    let (default_mbt, default_seqs) =
        default_batching(req.gpu_total_bytes, req.gpu_name.as_deref());
    // A target concurrency is the sequence count to serve: the printed line carries it.
    let max_num_seqs = req
        .max_num_seqs
        .or(req.target_concurrency)
        .unwrap_or(default_seqs);
    let default_mbt = if req.vllm_version.profiles_whole_prompt() {
        // No chunked prefill: one profiling pass over a whole max-length prompt.
        default_mbt.max(max_model_len)
    } else {
        default_mbt
    };
    let mbt = req
        .max_num_batched_tokens
        .unwrap_or(default_mbt)
        .max(max_num_seqs.min(default_mbt));
    let pp = req.pipeline_parallel_size.max(1);
    let stage_layers = spec.num_layers.div_ceil(pp);
    // The KV cache of one stage: its share of the layers (sliding ones in proportion).
    let mut stage = spec.clone();
    stage.num_layers = stage_layers;
    stage.num_sliding_layers = (spec.num_sliding_layers * stage_layers)
        .div_ceil(spec.num_layers.max(1))
        .min(stage_layers);
    let layout = KvLayout::new(
        &stage,
        KvSettings {
            dtype: req.kv_cache_dtype,
            tensor_parallel_size: tp,
            block_size: req.block_size,
            hybrid_manager: req.hybrid_kv_manager,
        },
    );
    Resolved {
        spec,
        weights_total,
        weights_exact,
        tp,
        pp,
        stage_layers,
        max_model_len,
        max_num_seqs,
        mbt,
        layout,
    }
}

/// vLLM's `--block-size` choices (`CacheConfig.block_size`).
pub const VALID_BLOCK_SIZES: [u64; 7] = [1, 8, 16, 32, 64, 128, 256];

/// What vLLM rejects at argument or config validation, in its terms.
fn refusals(spec: &ModelSpec, req: &PlanRequest, r: &Resolved) -> Vec<String> {
    let mut out = Vec::new();
    let heads = spec.num_attention_heads;
    if r.tp > 1 && heads > 0 && !heads.is_multiple_of(r.tp) {
        out.push(format!(
            "total number of attention heads ({heads}) must be divisible by tensor parallel size ({})",
            r.tp
        ));
    }
    if !VALID_BLOCK_SIZES.contains(&req.block_size) {
        out.push(format!(
            "--block-size {} is not one of {}",
            req.block_size,
            VALID_BLOCK_SIZES.map(|b| b.to_string()).join(", ")
        ));
    }
    let positions = spec.max_position_embeddings;
    if spec.positions_known
        && positions > 0
        && r.max_model_len > positions
        && !req.allow_long_max_model_len
    {
        out.push(format!(
            "--max-model-len {} is greater than the model's {positions} positions (set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it, or shorten it)",
            r.max_model_len
        ));
    }
    if let Some(reason) = req.quantization.and_then(|q| quantization_refusal(spec, q)) {
        out.push(reason);
    }
    if r.tp > 1
        && matches!(
            spec.quantization.scheme,
            QuantScheme::Bnb4 | QuantScheme::Bnb8
        )
    {
        out.push(format!(
            "the checkpoint is pre-quantized with bitsandbytes, which vLLM cannot split over {} tensor-parallel ranks (\"Prequant BitsAndBytes models with tensor parallelism is not supported\"; use --pipeline-parallel-size, or the unquantized checkpoint with --quantization bnb-4bit)",
            r.tp
        ));
    }
    if let Some(k) = req.kv_cache_memory
        && !req.vllm_version.has_kv_cache_memory()
    {
        out.push(format!(
            "--kv-cache-memory {k} does not exist before vLLM 0.9.1 (--vllm-version {})",
            req.vllm_version.label()
        ));
    }
    out
}

/// A `--quantization` the checkpoint cannot be loaded with: one that disagrees with the method the
/// checkpoint declares, or one that needs pre-quantized weights on an unquantized checkpoint
/// (vLLM quantizes online only to fp8 and bitsandbytes).
fn quantization_refusal(spec: &ModelSpec, q: QuantScheme) -> Option<String> {
    let declared = spec.quantization.scheme;
    if q == declared || q == QuantScheme::None {
        return None;
    }
    let name = q.vllm_name().unwrap_or(q.label());
    if declared != QuantScheme::None {
        return Some(format!(
            "the checkpoint declares {} quantization, which does not match --quantization {name}",
            declared.label()
        ));
    }
    match q {
        QuantScheme::Fp8 | QuantScheme::Bnb4 => None,
        QuantScheme::Bnb8 => Some(
            "--quantization bnb-8bit needs a checkpoint saved in bitsandbytes 8-bit; on 16-bit weights vLLM's bitsandbytes loader quantizes to 4-bit NF4 only (use --quantization bnb-4bit)".to_string(),
        ),
        _ => Some(format!(
            "--quantization {name} needs a checkpoint quantized with {}; this one is unquantized (use a {} checkpoint of the model, or fp8 / bitsandbytes, which vLLM applies at load time)",
            q.label(),
            q.label()
        )),
    }
}

/// Weights one GPU holds: the tensor-parallel share, then the largest pipeline stage's layers plus
/// the larger of the embedding (first stage) and the output projection (last stage).
fn rank_weights(r: &Resolved) -> u64 {
    let replicated = crate::weights::replicated_extra_bytes(&r.spec, r.weights_exact);
    let per_rank = weight_bytes_per_rank(&r.spec, r.weights_total, r.tp, replicated);
    if r.pp <= 1 {
        return per_rank;
    }
    let table = r.spec.vocab_size * r.spec.hidden_size * r.spec.dtype.bytes() / r.tp;
    let tables = if r.spec.tie_word_embeddings {
        table
    } else {
        2 * table
    };
    let layers = per_rank.saturating_sub(tables);
    layers * r.stage_layers / r.spec.num_layers.max(1) + table
}

/// The prediction alone, without searching for options (each option is one of these).
pub fn plan_unadvised(spec: &ModelSpec, req: &PlanRequest) -> Result<Plan, PlanError> {
    validate(spec, req)?;
    let mut warnings = Vec::new();
    let mut req = req.clone();
    let audio = audio_context(spec, &mut req)?;
    if req.right_sized() && req.max_num_seqs.is_none() {
        // A pool sized for N sequences should not admit more than N at once.
        req.max_num_seqs = req.target_concurrency;
    }
    let r = resolve(spec, &req, &mut warnings);
    let total = req.gpu_total_bytes;
    let weights = rank_weights(&r);
    let upcast = upcast_bytes(&r.spec, r.weights_exact);
    let activation = activation_peak_bytes(&r.spec, r.mbt, r.max_num_seqs, r.tp);
    let non_torch = non_torch_bytes(r.tp * r.pp);
    let graphs = cuda_graph_bytes(&r.spec, r.max_num_seqs, req.enforce_eager);
    let context = CUDA_CONTEXT_BYTES;
    let co_tenants = req.co_tenant_bytes();
    let margin = req.safety_margin_bytes;
    let non_kv = weights + upcast + activation + non_torch;
    // Since 0.21 vLLM counts its CUDA-graph estimate inside util × total; before, the graphs were
    // captured on top of it.
    let graphs_inside = if req.vllm_version.graphs_in_budget() {
        graphs
    } else {
        0
    };
    let graphs_outside = graphs - graphs_inside;

    // Largest utilization whose whole footprint leaves every co-tenant and the margin free.
    let room = total.saturating_sub(co_tenants + margin + graphs_outside + context);
    let largest_safe = floor_2dp(room as f64 / total as f64).clamp(0.0, 1.0);
    let shared = co_tenants > 0;
    let right_sized = req.right_sized();
    let sizing_mode = if right_sized {
        "right_sized"
    } else if req.gpu_memory_utilization.is_some() || req.kv_cache_memory.is_some() {
        "given"
    } else if req.fill {
        "fill"
    } else {
        "default"
    };
    let kv_slack = if right_sized { req.kv_slack } else { 0.0 };
    if right_sized {
        let n = req.concurrency_bound().unwrap_or(1);
        let k = right_sized_kv_bytes(&r.layout, n, r.max_model_len, r.mbt, req.kv_slack);
        if req.vllm_version.has_kv_cache_memory() {
            req.kv_cache_memory = Some(k);
            // vLLM still refuses to start unless util × total is free: ask for just what it uses.
            req.gpu_memory_utilization =
                Some(ceil_2dp((non_kv + graphs_inside + k) as f64 / total as f64).min(1.0));
        } else {
            // No --kv-cache-memory before 0.9.1: the utilization whose budget leaves that pool
            // (early V1 and 0.6.4 also charge the context and the co-tenants to this instance).
            let charged = req
                .vllm_version
                .charged_outside_instance(co_tenants, context);
            req.gpu_memory_utilization =
                Some(ceil_2dp((non_kv + k + charged) as f64 / total as f64).min(1.0));
        }
    }
    let (utilization, utilization_source) = match req.gpu_memory_utilization {
        Some(u) if right_sized => (u, "right_sized"),
        Some(u) => (u, "given"),
        None if shared => (largest_safe.min(MAX_PROPOSED_UTILIZATION), "largest_safe"),
        None if largest_safe >= req.vllm_version.default_utilization() => {
            (req.vllm_version.default_utilization(), "default")
        }
        None => (largest_safe, "largest_safe"),
    };
    let requested = (total as f64 * utilization).floor() as u64;
    let free_at_start = total.saturating_sub(co_tenants);

    let charged_others = req
        .vllm_version
        .charged_outside_instance(co_tenants, context);
    let kv_cache = match req.kv_cache_memory {
        Some(k) => k,
        None => requested.saturating_sub(non_kv + graphs_inside + charged_others),
    };
    let num_blocks = r.layout.num_blocks(kv_cache);
    let kv_tokens = r.layout.tokens(num_blocks);
    let max_concurrency = r.layout.max_concurrency(num_blocks, r.max_model_len, r.mbt);
    let needed_one = r.layout.bytes_per_request(r.max_model_len, r.mbt);
    let pool_bytes = num_blocks * r.layout.bytes_per_block();

    let instance = match req.kv_cache_memory {
        Some(k) => non_kv + k + graphs,
        None => requested.max(non_kv + graphs_inside) + graphs_outside,
    } + context;
    let device_peak = instance + co_tenants;
    let headroom = total.saturating_sub(instance + req.other_used_bytes + margin);

    let mut estimated_max_model_len = None;
    let failure = if weights + upcast > free_at_start {
        Some(Failure::WeightsDoNotFit {
            weights_bytes: weights + upcast,
            free_bytes: free_at_start,
        })
    } else if req.vllm_version.checks_free_memory_at_start() && free_at_start < requested {
        Some(Failure::StartupFreeBelowUtilization {
            free_bytes: free_at_start,
            total_bytes: total,
            utilization,
            requested_bytes: requested,
        })
    } else if req.kv_cache_memory.is_none() && requested <= non_kv + graphs_inside + charged_others
    {
        Some(Failure::NoKvCacheMemory {
            requested_bytes: requested,
            non_kv_bytes: non_kv + graphs_inside,
        })
    } else if needed_one > pool_bytes {
        let est = r.layout.max_seq_len_for(pool_bytes, r.max_model_len, r.mbt);
        estimated_max_model_len = Some(est);
        Some(Failure::MaxModelLenDoesNotFit {
            max_model_len: r.max_model_len,
            needed_bytes: needed_one,
            available_bytes: kv_cache,
            estimated_max_model_len: est,
        })
    } else if device_peak + margin > total {
        Some(Failure::DeviceOvercommitted {
            needed_bytes: device_peak + margin,
            total_bytes: total,
        })
    } else {
        None
    };

    if graphs > 0 {
        warnings.push(if graphs_inside > 0 {
            format!(
                "CUDA graphs take about {:.2} GiB, which vLLM 0.21 and later estimate at start-up and count inside --gpu-memory-utilization; its estimate can fall short, so keep the utilization below 0.95 (--enforce-eager removes them at a speed cost)",
                gib(graphs)
            )
        } else {
            format!(
                "CUDA graphs take about {:.2} GiB outside --gpu-memory-utilization in vLLM before 0.21 (estimated; --enforce-eager removes them at a speed cost)",
                gib(graphs)
            )
        });
    }
    if shared {
        warnings.push("start every co-tenant and let it reach its steady-state memory before vLLM starts: vLLM checks free memory once at start-up and assumes it never shrinks".to_string());
    }
    if req.kv_cache_memory.is_some() {
        warnings.push("--kv-cache-memory fixes the KV pool and ignores --gpu-memory-utilization for it; vLLM still refuses to start unless util × total is free".to_string());
    }
    if r.spec.sliding_window.is_some() && r.spec.num_sliding_layers > 0 {
        warnings.push(if req.hybrid_kv_manager {
            "sliding-window layers keep only their window (hybrid KV-cache manager); vLLM versions differ here, and 'GPU KV cache size' is reported per layer group".to_string()
        } else {
            "hybrid KV-cache manager off: sliding-window layers are charged at full length".to_string()
        });
    }
    if r.spec.kind == ModelKind::SpeechToText && r.spec.encoder_decoder.is_some() {
        warnings.push(
            "each request also holds cross-attention KV for the encoder's 1,500 positions"
                .to_string(),
        );
    }

    let concurrency_floor = max_concurrency.floor() as u64;
    let whole = concurrency_floor.min(r.max_num_seqs).max(1);
    let lanes = if r.spec.kind == ModelKind::Text {
        LaneHints {
            text_max_inflight: whole,
            text_max_queue: (whole * 2).min(64),
            audio_max_inflight: 1,
            lane: "text".into(),
        }
    } else {
        LaneHints {
            text_max_inflight: 0,
            text_max_queue: 0,
            audio_max_inflight: whole,
            lane: "audio".into(),
        }
    };

    let mut vllm_args = vec![
        "--gpu-memory-utilization".to_string(),
        format!("{utilization:.2}"),
    ];
    if let Some(k) = req.kv_cache_memory {
        vllm_args.push("--kv-cache-memory".to_string());
        vllm_args.push(k.to_string());
    }
    vllm_args.extend([
        "--max-model-len".to_string(),
        r.max_model_len.to_string(),
        "--max-num-seqs".to_string(),
        r.max_num_seqs.to_string(),
        "--max-num-batched-tokens".to_string(),
        r.mbt.to_string(),
        "--kv-cache-dtype".to_string(),
        req.kv_cache_dtype.label().to_string(),
    ]);
    if r.tp > 1 {
        vllm_args.push("--tensor-parallel-size".to_string());
        vllm_args.push(r.tp.to_string());
    }
    if r.pp > 1 {
        vllm_args.push("--pipeline-parallel-size".to_string());
        vllm_args.push(r.pp.to_string());
    }
    if req.dtype.is_some() {
        vllm_args.push("--dtype".to_string());
        vllm_args.push(r.spec.dtype.vllm_name().to_string());
    }
    if req.quantization.is_some()
        && let Some(q) = r.spec.quantization.scheme.vllm_name()
    {
        vllm_args.push("--quantization".to_string());
        vllm_args.push(q.to_string());
    }
    if req.block_size != DEFAULT_BLOCK_SIZE {
        vllm_args.push("--block-size".to_string());
        vllm_args.push(req.block_size.to_string());
    }
    if req.enforce_eager {
        vllm_args.push("--enforce-eager".to_string());
    }
    if !req.hybrid_kv_manager {
        vllm_args.push("--disable-hybrid-kv-cache-manager".to_string());
    }

    let per_token = r.layout.bytes_per_token();
    let mut components = components(
        &r, &req, weights, activation, non_torch, graphs, kv_cache, per_token,
    );
    if upcast > 0 {
        components.insert(
            1,
            Component {
                name: "audio tokenizers fp32".into(),
                bytes: upcast,
                why: format!(
                    "{} M tokenizer/connector parameters stored {} and loaded as {}",
                    r.spec.extra_params / 1_000_000,
                    r.spec.dtype.vllm_name(),
                    r.spec.extra_dtype.vllm_name()
                ),
            },
        );
    }

    let target = req
        .target_concurrency
        .map(|n| target_plan(n, &r, &req, non_kv, graphs + context));
    let target_missed = target.as_ref().is_some_and(|t| !t.fits);
    let refused = refusals(spec, &req, &r);
    let shortfall = match (&failure, &target) {
        (Some(f), _) => f.shortfall_bytes(),
        (None, Some(t)) if !t.fits => t.memory_needed_bytes.saturating_sub(total),
        _ => 0,
    };

    let gives_up = short_of_asked_minutes(audio.as_ref(), r.max_model_len);
    Ok(Plan {
        model: spec.name.clone(),
        model_source: spec.source.clone(),
        gpu_name: req.gpu_name.clone(),
        gpu_total_bytes: total,
        tensor_parallel_size: r.tp,
        pipeline_parallel_size: r.pp,
        layers_per_stage: r.stage_layers,
        vllm_version: req.vllm_version.label().to_string(),
        weights_bytes: weights,
        weights_origin: if r.weights_exact {
            "exact"
        } else {
            "estimated"
        }
        .to_string(),
        quantization: r.spec.quantization.scheme.label().to_string(),
        dtype: r.spec.dtype.vllm_name().to_string(),
        kv_bytes_per_token: per_token,
        kv_heads_per_rank: if r.spec.mla.is_some() {
            0
        } else {
            (r.spec.num_kv_heads / r.tp).max(1)
        },
        kv_bytes_per_token_all_ranks: per_token * r.tp,
        weights_upcast_bytes: upcast,
        weights_by_component: spec.weight_components.clone(),
        activation_peak_bytes: activation,
        non_torch_bytes: non_torch,
        cuda_graph_bytes: graphs,
        cuda_context_bytes: context,
        reserved_bytes: co_tenants,
        safety_margin_bytes: margin,
        gpu_memory_utilization: utilization,
        utilization_source: utilization_source.to_string(),
        sizing_mode: sizing_mode.to_string(),
        kv_slack,
        headroom_bytes: headroom,
        largest_safe_gpu_memory_utilization: largest_safe,
        requested_bytes: requested,
        kv_cache_bytes: kv_cache,
        kv_cache_memory_bytes: kv_cache,
        kv_cache_tokens: kv_tokens,
        num_blocks,
        block_size: r.layout.block_size,
        kv_cache_dtype: req.kv_cache_dtype.label().to_string(),
        max_model_len: r.max_model_len,
        max_num_seqs: r.max_num_seqs,
        max_num_batched_tokens: r.mbt,
        max_concurrency,
        device_peak_bytes: device_peak,
        fits: failure.is_none() && !target_missed && refused.is_empty(),
        failure,
        refused,
        shortfall_bytes: shortfall,
        estimated_max_model_len,
        components,
        reservations: req.reservations.clone(),
        vllm_args,
        lanes,
        audio,
        target,
        options: Vec::new(),
        gives_up,
        warnings,
    })
}

/// A length too short for the `--audio-minutes` asked, in words.
pub fn short_of_asked_minutes(audio: Option<&AudioContext>, max_model_len: u64) -> Vec<String> {
    let Some(a) = audio else {
        return Vec::new();
    };
    match (a.requested_minutes, a.max_model_len_needed) {
        (Some(m), Some(needed)) if max_model_len < needed => vec![format!(
            "holds {:.1} min of audio per sequence, not {} (--max-model-len {}; {} min need {})",
            a.minutes_per_sequence,
            trim_float(m),
            thousands(max_model_len),
            trim_float(m),
            thousands(needed)
        )],
        _ => Vec::new(),
    }
}

/// `60` for 60.0, `12.5` for 12.5.
pub fn trim_float(x: f64) -> String {
    let t = format!("{x:.2}");
    t.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn validate(spec: &ModelSpec, req: &PlanRequest) -> Result<(), PlanError> {
    if req.gpu_total_bytes == 0 {
        return Err(PlanError::NoGpuMemory);
    }
    if let Some(u) = req.gpu_memory_utilization
        && !(u > 0.0 && u <= 1.0)
    {
        return Err(PlanError::Utilization(u));
    }
    if req.tensor_parallel_size == 0 {
        return Err(PlanError::TensorParallel);
    }
    if req.pipeline_parallel_size == 0 {
        return Err(PlanError::Zero("pipeline-parallel-size"));
    }
    for (name, v) in [
        ("max-model-len", req.max_model_len),
        ("max-num-seqs", req.max_num_seqs),
        ("max-num-batched-tokens", req.max_num_batched_tokens),
        ("target-concurrency", req.target_concurrency),
        ("block-size", Some(req.block_size)),
    ] {
        if v == Some(0) {
            return Err(PlanError::Zero(name));
        }
    }
    if !(req.kv_slack.is_finite() && (0.0..=4.0).contains(&req.kv_slack)) {
        return Err(PlanError::KvSlack(req.kv_slack));
    }
    if let Some(m) = req.audio_minutes {
        if !(m.is_finite() && m > 0.0) {
            return Err(PlanError::AudioMinutes(m));
        }
        if spec.audio_tokenizer.is_none() {
            return Err(PlanError::NotAnAudioModel(spec.name.clone()));
        }
    }
    Ok(())
}

/// Bytes the engine adds when it loads the extra components (audio tokenizers) in a wider dtype
/// than the checkpoint stores them in: VibeVoice's vLLM plugin converts its bf16 acoustic and
/// semantic tokenizers to float32 at load. Only for exact checkpoint totals (estimates already
/// price `extra_params` at `extra_dtype`).
pub fn upcast_bytes(spec: &ModelSpec, weights_exact: bool) -> u64 {
    let stored = spec.dtype.bytes();
    if weights_exact && spec.extra_dtype.bytes() > stored {
        spec.extra_params * (spec.extra_dtype.bytes() - stored)
    } else {
        0
    }
}

/// Rounds `x` up to two decimals (0.431 → 0.44), the precision vLLM's flag is written with.
fn ceil_2dp(x: f64) -> f64 {
    ((x * 100.0) - 1e-9).ceil() / 100.0
}

/// A KV pool for `n` sequences of `len` tokens: their blocks at full length plus `slack` of
/// them (rounded up to whole blocks), in bytes of vLLM's blocks.
pub fn right_sized_kv_bytes(layout: &KvLayout, n: u64, len: u64, mbt: u64, slack: f64) -> u64 {
    let blocks = n * layout.blocks_per_request(len, mbt);
    let extra = (blocks as f64 * slack).ceil() as u64;
    (blocks + extra) * layout.bytes_per_block()
}

/// Audio tokens for `seconds` of audio at `tokens_per_second` (a model whose rate is known but
/// whose tokenizer is not described, e.g. a stand-in or a plugin headroom does not read).
pub fn audio_tokens_at_rate(seconds: f64, tokens_per_second: f64) -> u64 {
    (seconds.max(0.0) * tokens_per_second.max(0.0) - 1e-9)
        .ceil()
        .max(0.0) as u64
}

/// The `max_model_len` a speech-to-text sequence of `audio_tokens` (for `seconds` of audio)
/// needs: the audio tokens, the transcript allowance ([`TRANSCRIPT_TOKENS_PER_MINUTE`]) and the
/// prompt ([`ASR_PROMPT_TOKENS`]). Returns `(transcript allowance, total)`.
pub fn asr_sequence_tokens(audio_tokens: u64, seconds: f64) -> (u64, u64) {
    let allowance = (seconds.max(0.0) / 60.0 * TRANSCRIPT_TOKENS_PER_MINUTE as f64).ceil() as u64;
    (allowance, audio_tokens + allowance + ASR_PROMPT_TOKENS)
}

/// Fills in `max_model_len` from `--audio-minutes` when it was not given.
fn audio_context(
    spec: &ModelSpec,
    req: &mut PlanRequest,
) -> Result<Option<AudioContext>, PlanError> {
    let Some(tok) = spec.audio_tokenizer else {
        return Ok(None);
    };
    let per_s = tok.tokens_per_second();
    let per_min = per_s * 60.0;
    let mut ctx = AudioContext {
        tokens_per_second: per_s,
        tokens_per_minute: per_min,
        minutes_per_sequence: 0.0,
        requested_minutes: None,
        audio_tokens: None,
        transcript_tokens_allowance: None,
        max_model_len_needed: None,
    };
    if let Some(minutes) = req.audio_minutes {
        let audio_tokens = tok.tokens_for_seconds(minutes * 60.0);
        let (allowance, needed) = asr_sequence_tokens(audio_tokens, minutes * 60.0);
        ctx.requested_minutes = Some(minutes);
        ctx.audio_tokens = Some(audio_tokens);
        ctx.transcript_tokens_allowance = Some(allowance);
        ctx.max_model_len_needed = Some(needed);
        if req.max_model_len.is_none() {
            req.max_model_len = Some(needed);
        }
    }
    let len = req.max_model_len.unwrap_or(spec.max_position_embeddings);
    // The inverse of the sizing above: speech-to-text sequences also carry the transcript and the
    // prompt, so a length sized for M minutes holds exactly M minutes.
    ctx.minutes_per_sequence = if spec.kind == ModelKind::SpeechToText {
        len.saturating_sub(ASR_PROMPT_TOKENS) as f64
            / (per_min + TRANSCRIPT_TOKENS_PER_MINUTE as f64)
    } else {
        len as f64 / per_min
    };
    Ok(Some(ctx))
}

#[allow(clippy::too_many_arguments)]
fn components(
    r: &Resolved,
    req: &PlanRequest,
    weights: u64,
    activation: u64,
    non_torch: u64,
    graphs: u64,
    kv_cache: u64,
    per_token: u64,
) -> Vec<Component> {
    let tp_note = if r.tp > 1 {
        format!(" on each of {} ranks", r.tp)
    } else {
        String::new()
    };
    let mut rows = vec![
        Component {
            name: "weights".into(),
            bytes: weights,
            why: if r.weights_exact {
                match r.spec.exact_weights.map(|w| w.origin) {
                    Some(crate::spec::WeightsOrigin::Catalog) => {
                        format!("exact checkpoint total (catalog, with its source){tp_note}")
                    }
                    _ => format!("exact, from tensor headers{tp_note}"),
                }
            } else {
                format!(
                    "estimated from the shape, {} {}{tp_note}",
                    r.spec.quantization.scheme.label(),
                    r.spec.dtype.vllm_name()
                )
            },
        },
        Component {
            name: "activation peak".into(),
            bytes: activation,
            why: format!(
                "profiling pass over {} batched tokens + sampler over {} sequences",
                thousands(r.mbt),
                r.max_num_seqs
            ),
        },
        Component {
            name: "non-torch".into(),
            bytes: non_torch,
            why: if r.tp > 1 {
                "cuBLAS/attention workspaces + NCCL and all-reduce buffers".into()
            } else {
                "cuBLAS and attention-backend workspaces".into()
            },
        },
        Component {
            name: "KV cache".into(),
            bytes: kv_cache,
            why: format!(
                "{} B/token, {} tokens in blocks of {}",
                thousands(per_token),
                thousands(r.layout.tokens(r.layout.num_blocks(kv_cache))),
                r.layout.block_size
            ),
        },
        Component {
            name: "CUDA graphs".into(),
            bytes: graphs,
            why: if graphs == 0 {
                "--enforce-eager".into()
            } else if req.vllm_version.graphs_in_budget() {
                "estimated at start-up and counted inside the utilization budget (vLLM 0.21+)"
                    .into()
            } else {
                "captured after the KV cache, outside the utilization budget (estimate)".into()
            },
        },
        Component {
            name: "CUDA context".into(),
            bytes: CUDA_CONTEXT_BYTES,
            why: "the vLLM process's context, outside util × total".into(),
        },
    ];
    for res in &req.reservations {
        rows.push(Component {
            name: format!("reserved: {}", res.name),
            bytes: res.bytes,
            why: res.why.clone(),
        });
    }
    if req.other_used_bytes > 0 {
        rows.push(Component {
            name: "other processes".into(),
            bytes: req.other_used_bytes,
            why: "already held on the card (--other-used)".into(),
        });
    }
    if req.safety_margin_bytes > 0 {
        rows.push(Component {
            name: "safety margin".into(),
            bytes: req.safety_margin_bytes,
            why: "kept free on purpose".into(),
        });
    }
    rows
}

fn target_plan(
    n: u64,
    r: &Resolved,
    req: &PlanRequest,
    non_kv: u64,
    outside_budget: u64,
) -> TargetPlan {
    let kv_needed = n * r.layout.bytes_per_request(r.max_model_len, r.mbt);
    let needed =
        non_kv + kv_needed + outside_budget + req.co_tenant_bytes() + req.safety_margin_bytes;
    TargetPlan {
        concurrency: n,
        max_model_len: r.max_model_len,
        kv_cache_bytes_needed: kv_needed,
        memory_needed_bytes: needed,
        fits: needed <= req.gpu_total_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::facade::plan;
    use crate::spec::{AudioTokenizer, ExactWeights, WeightsOrigin};
    use crate::units::MIB;

    fn llama_8b() -> ModelSpec {
        ModelSpec::dense(
            "meta-llama/Llama-3.1-8B-Instruct",
            4096,
            14336,
            32,
            32,
            8,
            128_256,
        )
    }

    #[test]
    fn fixed_kv_cache_memory_gives_vllms_blocks_and_concurrency() {
        let mut req = PlanRequest::new(24 * GIB);
        req.kv_cache_memory = Some(4 * GIB);
        req.max_model_len = Some(8192);
        let p = plan(&llama_8b(), &req).unwrap();
        assert_eq!(p.num_blocks, 2048);
        assert_eq!(p.kv_cache_tokens, 32_768);
        assert_eq!(format!("{:.2}", p.max_concurrency), "4.00");
        assert!(p.vllm_args.contains(&"--kv-cache-memory".to_string()));
    }

    #[test]
    fn budget_is_utilization_minus_everything_else() {
        let mut req = PlanRequest::new(80 * GIB);
        req.gpu_memory_utilization = Some(0.9);
        req.max_model_len = Some(8192);
        let p = plan(&llama_8b(), &req).unwrap();
        // Since 0.21 the CUDA-graph estimate is inside the budget too.
        let expected = p.requested_bytes
            - p.weights_bytes
            - p.activation_peak_bytes
            - p.non_torch_bytes
            - p.cuda_graph_bytes;
        assert_eq!(p.kv_cache_bytes, expected);
        assert!(p.fits);
        assert_eq!(p.failure, None);
        // Before, the graphs were captured on top of it.
        req.vllm_version = VllmVersion::V1Before0_21;
        let before = plan(&llama_8b(), &req).unwrap();
        assert_eq!(before.kv_cache_bytes, p.kv_cache_bytes + p.cuda_graph_bytes);
        assert_eq!(
            before.device_peak_bytes,
            p.device_peak_bytes + p.cuda_graph_bytes
        );
    }

    #[test]
    fn other_processes_trip_the_startup_check() {
        let mut req = PlanRequest::new(24 * GIB);
        req.gpu_memory_utilization = Some(0.9);
        req.other_used_bytes = 4 * GIB;
        req.max_model_len = Some(8192);
        let p = plan(&llama_8b(), &req).unwrap();
        match p.failure {
            Some(Failure::StartupFreeBelowUtilization { free_bytes, .. }) => {
                assert_eq!(free_bytes, 20 * GIB)
            }
            ref f => panic!("{f:?}"),
        }
        assert!(!p.fits);
        assert!(p.shortfall_bytes > 0);
        assert!(
            p.failure
                .unwrap()
                .message()
                .starts_with("Free memory on device (20.00/24.00 GiB)")
        );
    }

    #[test]
    fn a_small_card_has_no_room_for_cache_blocks() {
        let mut req = PlanRequest::new(16 * GIB);
        req.gpu_memory_utilization = Some(0.9);
        let p = plan(&llama_8b(), &req).unwrap();
        assert!(
            matches!(p.failure, Some(Failure::NoKvCacheMemory { .. })),
            "{:?}",
            p.failure
        );
        assert!(!p.options.is_empty());
    }

    #[test]
    fn long_context_that_does_not_fit_reports_the_estimated_length() {
        let mut req = PlanRequest::new(24 * GIB);
        req.gpu_memory_utilization = Some(0.9);
        req.max_model_len = Some(131_072);
        let p = plan(&llama_8b(), &req).unwrap();
        match &p.failure {
            Some(Failure::MaxModelLenDoesNotFit {
                estimated_max_model_len,
                needed_bytes,
                ..
            }) => {
                assert_eq!(*needed_bytes, 16 * GIB);
                assert!(*estimated_max_model_len > 0 && *estimated_max_model_len < 131_072);
                assert_eq!(p.estimated_max_model_len, Some(*estimated_max_model_len));
            }
            f => panic!("{f:?}"),
        }
        // fp8 KV alone leaves 131,072 tokens short of room here: it must not be offered alone.
        assert!(
            !p.options.iter().any(|o| o.option == "fp8_kv_cache"),
            "{:?}",
            p.options
        );
        let shorter = p
            .options
            .iter()
            .find(|o| o.option == "shorter_context")
            .unwrap();
        assert!(shorter.fits);
        assert!(shorter.max_model_len < 131_072);
        assert_eq!(shorter.max_model_len % 16, 0);
        let mut longer = req.clone();
        longer.max_model_len = Some(shorter.max_model_len + 16);
        assert!(
            !plan(&llama_8b(), &longer).unwrap().fits,
            "the largest that fits, to the block"
        );
    }

    #[test]
    fn reservations_lower_the_proposed_utilization() {
        let mut req = PlanRequest::new(24 * GIB);
        req.max_model_len = Some(16384);
        req.max_num_seqs = Some(4);
        req.fill = true;
        let alone = plan(&llama_8b(), &req).unwrap();
        req.reservations.push(Reservation {
            name: "whisper".into(),
            bytes: 5 * GIB,
            why: "test".into(),
        });
        let shared = plan(&llama_8b(), &req).unwrap();
        assert!(shared.gpu_memory_utilization < alone.gpu_memory_utilization);
        assert_eq!(shared.utilization_source, "largest_safe");
        // Everything vLLM holds plus the reservation fits the card.
        assert!(shared.device_peak_bytes <= req.gpu_total_bytes);
        assert!(shared.requested_bytes + CUDA_CONTEXT_BYTES + 5 * GIB <= 24 * GIB);
    }

    #[test]
    fn exact_weights_win_over_the_estimate() {
        let mut spec = llama_8b();
        spec.exact_weights = Some(ExactWeights {
            bytes: 16_060_522_496,
            origin: WeightsOrigin::SafetensorsHeaders,
        });
        let p = plan(&spec, &PlanRequest::new(80 * GIB)).unwrap();
        assert_eq!(p.weights_bytes, 16_060_522_496);
        assert_eq!(p.weights_origin, "exact");
        let mut req = PlanRequest::new(80 * GIB);
        req.quantization = Some(QuantScheme::Awq);
        let q = plan(&spec, &req).unwrap();
        assert_eq!(q.weights_origin, "estimated");
        assert!(q.weights_bytes < p.weights_bytes / 2);
    }

    #[test]
    fn target_concurrency_reports_memory_and_options() {
        let mut req = PlanRequest::new(24 * GIB);
        req.max_model_len = Some(32_768);
        req.target_concurrency = Some(8);
        let p = plan(&llama_8b(), &req).unwrap();
        let t = p.target.as_ref().unwrap();
        assert_eq!(t.kv_cache_bytes_needed, 8 * 32_768 * 131_072);
        assert!(!t.fits);
        assert!(!p.fits);
        let fewer = p
            .options
            .iter()
            .find(|o| o.option == "fewer_sequences")
            .unwrap();
        assert!(fewer.concurrency < 8);
        assert!(fewer.vllm_args.contains(&"--max-num-seqs".to_string()));
        assert!(
            p.options
                .iter()
                .any(|o| o.option.contains("tensor_parallel")
                    && o.keeps_asked
                    && o.concurrency >= 8)
        );
        // Fewer sequences than the 8 asked is said in words, after what keeps them.
        assert!(!fewer.keeps_asked);
        assert!(fewer.description.contains("not 8"), "{}", fewer.description);
        let first_cut = p.options.iter().position(|o| !o.keeps_asked).unwrap();
        assert!(p.options[..first_cut].iter().all(|o| o.keeps_asked));
        assert!(p.options[first_cut..].iter().all(|o| !o.keeps_asked));
        // The target reaches the printed line.
        assert!(p.vllm_args.windows(2).any(|w| w == ["--max-num-seqs", "8"]));
    }

    #[test]
    fn audio_minutes_size_the_context() {
        let mut spec = ModelSpec::dense("microsoft/VibeVoice-ASR", 3584, 18944, 28, 28, 4, 152_064);
        spec.audio_tokenizer = Some(AudioTokenizer {
            sample_rate_hz: 24_000,
            samples_per_token: 3200,
        });
        let mut req = PlanRequest::new(80 * GIB);
        req.audio_minutes = Some(60.0);
        let p = plan(&spec, &req).unwrap();
        let a = p.audio.unwrap();
        assert_eq!(a.tokens_per_minute, 450.0);
        assert_eq!(a.audio_tokens, Some(27_000));
        assert_eq!(p.max_model_len, a.max_model_len_needed.unwrap());
        assert!(p.max_model_len > 27_000);
        req.audio_minutes = None;
        req.max_model_len = Some(45_000);
        let p = plan(&spec, &req).unwrap();
        assert_eq!(p.audio.unwrap().minutes_per_sequence, 100.0);
    }

    fn qwen_7b_awq() -> ModelSpec {
        let mut spec = ModelSpec::dense(
            "Qwen/Qwen2.5-7B-Instruct-AWQ",
            3584,
            18_944,
            28,
            28,
            4,
            152_064,
        );
        spec.dtype = Dtype::F16;
        spec.quantization = Quantization {
            scheme: QuantScheme::Awq,
            group_size: 128,
            ..Quantization::NONE
        };
        spec
    }

    #[test]
    fn bounded_concurrency_sizes_the_pool_to_the_bound_plus_slack() {
        let mut req = PlanRequest::new(24 * GIB);
        req.max_model_len = Some(4096);
        req.max_num_seqs = Some(2);
        req.reservations.push(Reservation {
            name: "whisper".into(),
            bytes: 6 * GIB,
            why: "test".into(),
        });
        let p = plan(&qwen_7b_awq(), &req).unwrap();
        // vLLM's page: 16 tokens × 2 (K, V) × 4 KV heads × 128 × 2 B, over 28 layers.
        let block = 16 * 2 * 4 * 128 * 2 * 28;
        // Two sequences of 4,096 tokens = 2 × 256 blocks, plus 25 % = 128 blocks.
        let blocks = 2 * 4096 / 16;
        let expected = (blocks + blocks / 4) * block;
        assert_eq!(p.sizing_mode, "right_sized");
        assert_eq!(p.kv_cache_memory_bytes, expected);
        assert_eq!(p.num_blocks, (blocks + blocks / 4) * 28 / 28);
        assert!(
            p.vllm_args
                .windows(2)
                .any(|w| w[0] == "--kv-cache-memory" && w[1] == expected.to_string())
        );
        // At most 50 % over what the two sequences can hold.
        assert!(p.kv_cache_bytes as f64 <= 1.5 * (2 * 4096 * 57_344) as f64);
        // The card splits into vLLM's footprint, the headroom left and the margin.
        let instance = p.weights_bytes
            + p.activation_peak_bytes
            + p.non_torch_bytes
            + p.kv_cache_bytes
            + p.cuda_graph_bytes
            + p.cuda_context_bytes;
        assert_eq!(
            p.headroom_bytes + instance + p.safety_margin_bytes,
            24 * GIB
        );
        assert!(p.headroom_bytes > 6 * GIB);
        // The start-up check passes: util × total covers what vLLM holds and is free at start.
        let requested = (p.gpu_memory_utilization * (24 * GIB) as f64) as u64;
        assert!(requested >= instance - p.cuda_graph_bytes - p.cuda_context_bytes);
        assert!(requested <= 18 * GIB);
        assert!(p.fits, "{:?}", p.failure);

        // --kv-slack 0: exactly the two sequences' blocks.
        req.kv_slack = 0.0;
        let tight = plan(&qwen_7b_awq(), &req).unwrap();
        assert_eq!(tight.kv_cache_bytes, blocks * block);

        // --fill: the largest safe utilization, budget minus the rest.
        req.fill = true;
        let f = plan(&qwen_7b_awq(), &req).unwrap();
        assert_eq!(f.sizing_mode, "fill");
        assert_eq!(f.utilization_source, "largest_safe");
        assert_eq!(
            f.kv_cache_bytes,
            f.requested_bytes
                - f.weights_bytes
                - f.activation_peak_bytes
                - f.non_torch_bytes
                - f.cuda_graph_bytes
        );
        assert!(f.kv_cache_bytes > 10 * p.kv_cache_bytes);
        assert!(f.headroom_bytes < p.headroom_bytes);
    }

    #[test]
    fn target_concurrency_alone_bounds_max_num_seqs_too() {
        let mut req = PlanRequest::new(80 * GIB);
        req.max_model_len = Some(8192);
        req.target_concurrency = Some(3);
        let p = plan(&llama_8b(), &req).unwrap();
        assert_eq!(p.sizing_mode, "right_sized");
        assert_eq!(p.max_num_seqs, 3);
        // 3 × 512 blocks + 25 % (384) of 16 × 131,072 B.
        assert_eq!(p.kv_cache_bytes, (3 * 512 + 384) * 16 * 131_072);
        // A user's utilization or pool keeps its meaning.
        req.gpu_memory_utilization = Some(0.5);
        assert_eq!(plan(&llama_8b(), &req).unwrap().sizing_mode, "given");
    }

    use crate::fixtures::vibevoice_asr;

    #[test]
    fn a_speech_model_gets_audio_lane_limits_and_a_consistent_minutes_line() {
        let mut req = PlanRequest::new(24 * GIB);
        req.audio_minutes = Some(60.0);
        let p = plan(&vibevoice_asr(), &req).unwrap();
        // bf16 tokenizers loaded as float32: 2 more bytes a parameter.
        assert_eq!(p.weights_upcast_bytes, 1_058_405_345 * 2);
        assert_eq!(p.weights_bytes, 17_348_043_714);
        // 60 min: 27,000 audio + 15,000 transcript + 128 prompt tokens.
        assert_eq!(p.max_model_len, 42_128);
        let a = p.audio.as_ref().unwrap();
        assert!(
            (a.minutes_per_sequence - 60.0).abs() < 1e-9,
            "{}",
            a.minutes_per_sequence
        );
        assert_eq!(p.lanes.lane, "audio");
        assert_eq!((p.lanes.text_max_inflight, p.lanes.text_max_queue), (0, 0));
        // Whole sequences of 42,128 tokens the pool holds: blocks / ceil(42,128 / 16).
        let whole = p.num_blocks / 42_128u64.div_ceil(16);
        assert_eq!(p.lanes.audio_max_inflight, whole.max(1));
        assert!(p.max_num_seqs <= whole.max(1));
        assert!(p.fits);
    }

    #[test]
    fn tensor_parallel_splits_kv_heads_across_ranks() {
        let mut req = PlanRequest::new(24 * GIB);
        req.tensor_parallel_size = 2;
        req.max_model_len = Some(32_768);
        let p = plan(&vibevoice_asr(), &req).unwrap();
        // 4 KV heads over 2 ranks: 2 heads × 128 × 2 (K, V) × 2 B × 28 layers per rank.
        assert_eq!(p.kv_heads_per_rank, 2);
        assert_eq!(p.kv_bytes_per_token, 2 * 128 * 2 * 2 * 28);
        assert_eq!(p.kv_bytes_per_token_all_ranks, 4 * 128 * 2 * 2 * 28);
    }

    #[test]
    fn pipeline_parallel_splits_layers_weights_and_kv_per_stage() {
        let mut spec = llama_8b();
        spec.exact_weights = Some(ExactWeights {
            bytes: 16_060_522_496,
            origin: WeightsOrigin::SafetensorsHeaders,
        });
        let mut req = PlanRequest::new(24 * GIB);
        req.pipeline_parallel_size = 2;
        req.max_model_len = Some(8192);
        let p = plan(&spec, &req).unwrap();
        assert_eq!(p.layers_per_stage, 16);
        // 16 layers × 2 (K, V) × 8 heads × 128 × 2 B on each GPU.
        assert_eq!(p.kv_bytes_per_token, 16 * 2 * 8 * 128 * 2);
        // Half the decoder layers plus one 128,256 × 4,096 bf16 table (embedding or lm_head).
        let table = 128_256 * 4096 * 2;
        assert_eq!(p.weights_bytes, (16_060_522_496 - 2 * table) / 2 + table);
        assert!(
            p.vllm_args
                .windows(2)
                .any(|w| w[0] == "--pipeline-parallel-size" && w[1] == "2")
        );
    }

    #[test]
    fn older_vllm_versions_account_memory_their_way() {
        assert_eq!(VllmVersion::parse("0.6.3"), Some(VllmVersion::V0));
        assert_eq!(VllmVersion::parse("v0.8.5"), Some(VllmVersion::EarlyV1));
        assert_eq!(VllmVersion::parse("0.9.0"), Some(VllmVersion::EarlyV1));
        assert_eq!(VllmVersion::parse("0.9.1"), Some(VllmVersion::V1Before0_21));
        assert_eq!(
            VllmVersion::parse("0.11.0"),
            Some(VllmVersion::V1Before0_21)
        );
        assert_eq!(
            VllmVersion::parse("0.20.2"),
            Some(VllmVersion::V1Before0_21)
        );
        assert_eq!(VllmVersion::parse("0.21.0"), Some(VllmVersion::Current));
        assert_eq!(VllmVersion::parse("0.27.1"), Some(VllmVersion::Current));
        assert_eq!(VllmVersion::parse("x"), None);

        let mut req = PlanRequest::new(24 * GIB);
        req.gpu_memory_utilization = Some(0.9);
        req.max_model_len = Some(8192);
        req.other_used_bytes = 4 * GIB;
        // 0.9.1 and later: 20 GiB free < 0.9 × 24 GiB, the start-up check refuses.
        for v in [VllmVersion::Current, VllmVersion::V1Before0_21] {
            req.vllm_version = v;
            assert!(matches!(
                plan(&llama_8b(), &req).unwrap().failure,
                Some(Failure::StartupFreeBelowUtilization { .. })
            ));
        }
        // `now` is 0.9.1–0.20: graphs on top of the budget, as in early V1.
        let now = plan(&llama_8b(), &req).unwrap();
        // Early V1: no such check, but its non-torch term is (total − free) − torch_allocated
        // after profiling, so the 4 GiB other processes hold and its own 512 MiB CUDA context
        // come out of the pool.
        req.vllm_version = VllmVersion::EarlyV1;
        let early = plan(&llama_8b(), &req).unwrap();
        assert!(!matches!(
            early.failure,
            Some(Failure::StartupFreeBelowUtilization { .. })
        ));
        assert_eq!(
            early.kv_cache_bytes,
            now.kv_cache_bytes - 4 * GIB - 512 * MIB
        );
        // V0: the profiling pass covers the whole 8,192-token prompt (no chunked prefill).
        req.vllm_version = VllmVersion::V0;
        req.other_used_bytes = 0;
        let v0 = plan(&llama_8b(), &req).unwrap();
        assert_eq!(v0.max_num_batched_tokens, 8192);
        req.vllm_version = VllmVersion::Current;
        let cur = plan(&llama_8b(), &req).unwrap();
        assert_eq!(cur.max_num_batched_tokens, 2048);
        assert!(v0.activation_peak_bytes > cur.activation_peak_bytes);
        // Right-sizing without --kv-cache-memory: a utilization that leaves the bounded pool.
        req.gpu_memory_utilization = None;
        req.max_num_seqs = Some(2);
        req.vllm_version = VllmVersion::V0;
        let rs = plan(&llama_8b(), &req).unwrap();
        assert!(!rs.vllm_args.contains(&"--kv-cache-memory".to_string()));
        assert!(rs.kv_cache_bytes >= 2 * 8192 * 131_072 * 5 / 4);
    }

    #[test]
    fn vllm_0_6_4_charges_all_device_memory_outside_its_torch_tensors() {
        assert_eq!(
            VllmVersion::parse("0.6.4.post1"),
            Some(VllmVersion::V0AllNonTorch)
        );
        assert_eq!(VllmVersion::parse("0.6.5"), Some(VllmVersion::V0));
        assert_eq!(VllmVersion::parse("0.5.5"), Some(VllmVersion::V0));
        let mut req = PlanRequest::new(48 * GIB);
        req.gpu_memory_utilization = Some(0.6);
        req.max_model_len = Some(8192);
        req.other_used_bytes = 3 * GIB;
        req.vllm_version = VllmVersion::V0;
        let v0 = plan(&llama_8b(), &req).unwrap();
        req.vllm_version = VllmVersion::V0AllNonTorch;
        let v064 = plan(&llama_8b(), &req).unwrap();
        // Same profiling pass (a whole 8,192-token prompt), same weights and workspaces.
        assert_eq!(v064.max_num_batched_tokens, 8192);
        assert_eq!(v064.activation_peak_bytes, v0.activation_peak_bytes);
        assert_eq!(v064.non_torch_bytes, v0.non_torch_bytes);
        // 0.6.4: kv = util × total − torch peak − ((total − free) − torch_allocated); with 3 GiB
        // of other processes and a 512 MiB context on the device, the pool is that much smaller.
        let requested = (48.0 * GIB as f64 * 0.6).floor() as u64;
        let expected = requested
            - v0.weights_bytes
            - v0.activation_peak_bytes
            - v0.non_torch_bytes
            - (3 * GIB + 512 * MIB);
        assert_eq!(v064.kv_cache_bytes, expected);
        assert_eq!(v0.kv_cache_bytes, expected + 3 * GIB + 512 * MIB);
        assert_eq!(v064.vllm_version, "v0_6_4");
    }

    #[test]
    fn bad_settings_are_errors_not_plans() {
        let spec = llama_8b();
        let mut req = PlanRequest::new(24 * GIB);
        req.gpu_memory_utilization = Some(1.5);
        assert_eq!(plan(&spec, &req), Err(PlanError::Utilization(1.5)));
        let mut req = PlanRequest::new(24 * GIB);
        req.audio_minutes = Some(5.0);
        assert!(matches!(
            plan(&spec, &req),
            Err(PlanError::NotAnAudioModel(_))
        ));
        let mut req = PlanRequest::new(24 * GIB);
        req.max_num_seqs = Some(0);
        assert_eq!(plan(&spec, &req), Err(PlanError::Zero("max-num-seqs")));
        let mut req = PlanRequest::new(24 * GIB);
        req.kv_slack = -0.1;
        assert_eq!(plan(&spec, &req), Err(PlanError::KvSlack(-0.1)));
    }
}
