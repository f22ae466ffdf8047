//! The model description every calculation starts from: shapes, attention layout, MoE, quantization
//! and (when known) exact weight bytes. `headroom-inspect` builds it from config.json, safetensors
//! headers, GGUF metadata or the built-in catalog; nothing here reads files.

use serde::{Deserialize, Serialize};

/// Element types that weights and KV caches are stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
    Fp8,
}

impl Dtype {
    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::Fp8 => 1,
        }
    }

    /// The spelling vLLM's `--dtype` flag takes.
    pub fn vllm_name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::Bf16 => "bfloat16",
            Dtype::F16 => "float16",
            Dtype::Fp8 => "fp8",
        }
    }

    /// Parses `bfloat16`, `bf16`, `float16`, `fp16`, `half`, `float32`, `fp32`, `float`.
    pub fn parse(s: &str) -> Option<Dtype> {
        match s.trim().to_ascii_lowercase().as_str() {
            "bfloat16" | "bf16" => Some(Dtype::Bf16),
            "float16" | "fp16" | "half" | "f16" => Some(Dtype::F16),
            "float32" | "fp32" | "float" | "f32" => Some(Dtype::F32),
            "fp8" | "float8" | "float8_e4m3fn" | "fp8_e4m3" => Some(Dtype::Fp8),
            _ => None,
        }
    }
}

/// How the linear layers of a checkpoint are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuantScheme {
    /// Unquantized: every weight in the model dtype.
    None,
    /// AWQ: 4-bit weights, fp16 scale and packed 4-bit zero per group.
    Awq,
    /// GPTQ: like AWQ, plus a per-input-channel permutation index.
    Gptq,
    /// bitsandbytes NF4/FP4 with one absmax per 64 weights.
    #[serde(rename = "bnb-4bit")]
    Bnb4,
    /// bitsandbytes LLM.int8 with one fp32 scale per output row.
    #[serde(rename = "bnb-8bit")]
    Bnb8,
    /// FP8 weights (e4m3) with per-channel or per-tensor scales.
    Fp8,
    /// OCP microscaling FP4: 4-bit values, one 8-bit exponent per 32.
    Mxfp4,
    /// NVIDIA FP4: 4-bit values, one fp8 scale per 16 plus a tensor scale.
    Nvfp4,
}

impl QuantScheme {
    /// Parses the names `--quantization` takes and those found in `quantization_config.quant_method`.
    pub fn parse(s: &str) -> Option<QuantScheme> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "" => Some(QuantScheme::None),
            "awq" | "awq_marlin" => Some(QuantScheme::Awq),
            "gptq" | "gptq_marlin" => Some(QuantScheme::Gptq),
            "bnb-4bit" | "bnb4" | "nf4" | "bitsandbytes" => Some(QuantScheme::Bnb4),
            "bnb-8bit" | "bnb8" | "int8" => Some(QuantScheme::Bnb8),
            "fp8" | "fbgemm_fp8" | "compressed-tensors-fp8" => Some(QuantScheme::Fp8),
            "mxfp4" => Some(QuantScheme::Mxfp4),
            "nvfp4" | "modelopt_fp4" => Some(QuantScheme::Nvfp4),
            _ => None,
        }
    }

    /// The flag value vLLM takes for `--quantization`, if it needs one.
    pub fn vllm_name(self) -> Option<&'static str> {
        match self {
            QuantScheme::None => None,
            QuantScheme::Awq => Some("awq_marlin"),
            QuantScheme::Gptq => Some("gptq_marlin"),
            QuantScheme::Bnb4 | QuantScheme::Bnb8 => Some("bitsandbytes"),
            QuantScheme::Fp8 => Some("fp8"),
            QuantScheme::Mxfp4 => Some("mxfp4"),
            QuantScheme::Nvfp4 => Some("modelopt_fp4"),
        }
    }

    /// Stable lower-case label used in output.
    pub fn label(self) -> &'static str {
        match self {
            QuantScheme::None => "none",
            QuantScheme::Awq => "awq",
            QuantScheme::Gptq => "gptq",
            QuantScheme::Bnb4 => "bnb-4bit",
            QuantScheme::Bnb8 => "bnb-8bit",
            QuantScheme::Fp8 => "fp8",
            QuantScheme::Mxfp4 => "mxfp4",
            QuantScheme::Nvfp4 => "nvfp4",
        }
    }
}

/// Quantization as declared by a checkpoint (or forced by `--quantization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quantization {
    pub scheme: QuantScheme,
    /// Weights per scale group (AWQ/GPTQ `group_size`; 128 when unstated).
    pub group_size: u64,
    /// When true only the MoE expert weights are quantized (gpt-oss's mxfp4 layout).
    pub experts_only: bool,
    /// bitsandbytes `bnb_4bit_use_double_quant`: the fp32 absmax of every 64 weights is itself
    /// quantized to 8 bits, with one fp32 constant per 256 of them.
    #[serde(default)]
    pub double_quant: bool,
    /// Decoder layers whose attention / MLP the checkpoint keeps in the model dtype
    /// (`modules_to_not_convert`, `llm_int8_skip_modules`, compressed-tensors `ignore`).
    #[serde(default)]
    pub unconverted_attention_layers: u64,
    #[serde(default)]
    pub unconverted_mlp_layers: u64,
    /// True when vLLM quantizes an unquantized checkpoint while it loads it (`--quantization
    /// fp8` or `bitsandbytes` on 16-bit weights): every layer built from vLLM's linear layers is
    /// then quantized, towers included.
    #[serde(default)]
    pub online: bool,
}

impl Quantization {
    pub const NONE: Quantization = Quantization {
        scheme: QuantScheme::None,
        group_size: 128,
        experts_only: false,
        double_quant: false,
        unconverted_attention_layers: 0,
        unconverted_mlp_layers: 0,
        online: false,
    };
}

/// Multi-head latent attention (DeepSeek-V2/V3, Kimi): one compressed latent per token and layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mla {
    pub kv_lora_rank: u64,
    pub qk_rope_head_dim: u64,
    pub qk_nope_head_dim: u64,
    pub v_head_dim: u64,
    /// `None` when queries are projected directly (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<u64>,
}

/// Mixture-of-experts feed-forward layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Moe {
    pub num_experts: u64,
    pub experts_per_token: u64,
    /// Intermediate size of one routed expert.
    pub expert_intermediate_size: u64,
    /// Shared (always active) experts, each of `shared_intermediate_size`.
    pub num_shared_experts: u64,
    pub shared_intermediate_size: u64,
    /// Leading layers that use a dense MLP of `intermediate_size` instead of experts.
    pub first_dense_layers: u64,
    /// Gated (gate+up+down = 3 matrices) or plain (up+down = 2).
    pub gated: bool,
}

/// Encoder–decoder models (Whisper): the encoder output is attended by every decoder layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EncoderDecoder {
    pub encoder_layers: u64,
    /// Encoder positions each request's cross-attention cache holds (Whisper: 1500).
    pub encoder_positions: u64,
    /// Mel bins fed to the encoder (for the activation estimate).
    pub num_mel_bins: u64,
}

/// Audio front ends that turn samples into decoder tokens (VibeVoice's 3,200× tokenizer).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AudioTokenizer {
    pub sample_rate_hz: u64,
    pub samples_per_token: u64,
}

impl AudioTokenizer {
    pub fn tokens_per_second(&self) -> f64 {
        self.sample_rate_hz as f64 / self.samples_per_token as f64
    }

    /// Decoder tokens for `seconds` of audio: whole samples, then whole tokens (both rounded up).
    pub fn tokens_for_seconds(&self, seconds: f64) -> u64 {
        let samples = (seconds.max(0.0) * self.sample_rate_hz as f64).ceil() as u64;
        crate::units::cdiv(samples, self.samples_per_token.max(1))
    }
}

/// What a model does, as far as planning cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    Text,
    SpeechToText,
    TextToSpeech,
}

/// Weight bytes read from headers rather than estimated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExactWeights {
    /// Sum of every tensor's bytes as stored.
    pub bytes: u64,
    /// Where the figure came from (`safetensors headers`, `index total_size`, `gguf tensors`).
    pub origin: WeightsOrigin,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightsOrigin {
    SafetensorsHeaders,
    IndexTotalSize,
    GgufTensors,
    Catalog,
}

/// One module of a checkpoint, when its source lists them (the catalog's VibeVoice entries):
/// element count, the dtype the checkpoint stores it in and the one the engine holds it in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightComponent {
    pub name: String,
    pub params: u64,
    pub stored_dtype: Dtype,
    pub loaded_dtype: Dtype,
    /// `params ×` the stored dtype's bytes.
    pub bytes: u64,
}

/// Everything the planner needs to know about one model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Hugging Face id or path.
    pub name: String,
    /// Where the description came from (file path, cache path, or catalog source URL).
    pub source: String,
    pub architecture: String,
    pub kind: ModelKind,
    /// Dtype the engine computes in (`torch_dtype`); also the default KV dtype.
    pub dtype: Dtype,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    /// Gated MLP (gate, up and down: three matrices) or plain (up and down: two).
    pub gated_mlp: bool,
    pub num_layers: u64,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    /// Key head size (`head_dim`, else hidden / heads).
    pub head_dim: u64,
    /// Value head size when it differs from the key's.
    pub head_dim_v: u64,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: u64,
    /// False when the config names no position limit and `max_position_embeddings` is a
    /// default: vLLM's refusal of longer lengths is then not predicted.
    #[serde(default = "known")]
    pub positions_known: bool,
    /// Layers that use sliding-window attention, and the window in tokens.
    pub sliding_window: Option<u64>,
    pub num_sliding_layers: u64,
    pub mla: Option<Mla>,
    pub moe: Option<Moe>,
    pub quantization: Quantization,
    pub encoder_decoder: Option<EncoderDecoder>,
    pub audio_tokenizer: Option<AudioTokenizer>,
    /// Parameters outside the decoder described above (audio tokenizers, diffusion heads, vision
    /// towers), with the dtype they are held in.
    pub extra_params: u64,
    pub extra_dtype: Dtype,
    /// The part of `extra_params` held in vLLM's own parallel linear layers (a vision tower's
    /// attention and MLP projections, Whisper's encoder): split across tensor-parallel ranks and
    /// quantized along with the decoder. The rest (convolutional audio tokenizers, patch
    /// embeddings) is replicated on every rank and kept in `extra_dtype`.
    #[serde(default)]
    pub extra_linear_params: u64,
    pub exact_weights: Option<ExactWeights>,
    /// The checkpoint's modules with their dtypes, when known (empty otherwise).
    #[serde(default)]
    pub weight_components: Vec<WeightComponent>,
}

fn known() -> bool {
    true
}

impl ModelSpec {
    /// Layers with full-length attention.
    pub fn num_full_layers(&self) -> u64 {
        self.num_layers - self.num_sliding_layers.min(self.num_layers)
    }

    /// A plain dense decoder with the given shape; the rest take neutral defaults.
    /// Mostly for tests and for building specs field by field.
    pub fn dense(
        name: &str,
        hidden: u64,
        intermediate: u64,
        layers: u64,
        heads: u64,
        kv_heads: u64,
        vocab: u64,
    ) -> ModelSpec {
        ModelSpec {
            name: name.to_string(),
            source: "built by hand".to_string(),
            architecture: "LlamaForCausalLM".to_string(),
            kind: ModelKind::Text,
            dtype: Dtype::Bf16,
            hidden_size: hidden,
            intermediate_size: intermediate,
            gated_mlp: true,
            num_layers: layers,
            num_attention_heads: heads,
            num_kv_heads: kv_heads,
            head_dim: hidden / heads,
            head_dim_v: hidden / heads,
            vocab_size: vocab,
            tie_word_embeddings: false,
            max_position_embeddings: 131_072,
            positions_known: true,
            sliding_window: None,
            num_sliding_layers: 0,
            mla: None,
            moe: None,
            quantization: Quantization::NONE,
            encoder_decoder: None,
            audio_tokenizer: None,
            extra_params: 0,
            extra_dtype: Dtype::Bf16,
            extra_linear_params: 0,
            exact_weights: None,
            weight_components: Vec::new(),
        }
    }
}
