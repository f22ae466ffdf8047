//! Weight memory: parameter counts from a model's shape, bytes per parameter under each
//! quantization scheme, and the split across tensor-parallel ranks.

use crate::spec::{ModelSpec, QuantScheme, Quantization};

/// Parameter counts by where they live; quantization treats each group differently.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ParamCounts {
    /// Token embedding table (never quantized by AWQ/GPTQ/bnb).
    pub embedding: u64,
    /// Output projection; 0 when tied to the embedding.
    pub lm_head: u64,
    /// Attention projections of all decoder layers.
    pub attention: u64,
    /// Dense MLPs (and shared experts).
    pub dense_mlp: u64,
    /// Routed experts of every MoE layer.
    pub experts: u64,
    /// Norms, routers, biases: small tensors kept in the model dtype.
    pub small: u64,
    /// Encoder stacks, audio tokenizers and other towers, in `extra_dtype`.
    pub extra: u64,
}

impl ParamCounts {
    pub fn total(&self) -> u64 {
        self.embedding
            + self.lm_head
            + self.attention
            + self.dense_mlp
            + self.experts
            + self.small
            + self.extra
    }
}

/// Counts parameters from the shape in `spec`.
pub fn param_counts(spec: &ModelSpec) -> ParamCounts {
    let h = spec.hidden_size;
    let layers = spec.num_layers;
    let embedding = spec.vocab_size * h;
    let lm_head = if spec.tie_word_embeddings {
        0
    } else {
        spec.vocab_size * h
    };

    let attention_per_layer = match spec.mla {
        Some(m) => {
            let heads = spec.num_attention_heads;
            let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
            let q = match m.q_lora_rank {
                Some(r) => h * r + r * heads * qk,
                None => h * heads * qk,
            };
            let kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim);
            let kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim);
            let o = heads * m.v_head_dim * h;
            q + kv_a + kv_b + o
        }
        None => {
            let q = h * spec.num_attention_heads * spec.head_dim;
            let k = h * spec.num_kv_heads * spec.head_dim;
            let v = h * spec.num_kv_heads * spec.head_dim_v;
            let o = spec.num_attention_heads * spec.head_dim_v * h;
            q + k + v + o
        }
    };

    let (dense_mlp, experts, router) = match spec.moe {
        Some(moe) => {
            let mats = if moe.gated { 3 } else { 2 };
            let moe_layers = layers.saturating_sub(moe.first_dense_layers);
            let dense = moe.first_dense_layers * mats * h * spec.intermediate_size
                + moe_layers * moe.num_shared_experts * mats * h * moe.shared_intermediate_size;
            let experts = moe_layers * moe.num_experts * mats * h * moe.expert_intermediate_size;
            (dense, experts, moe_layers * h * moe.num_experts)
        }
        None => {
            let mats = if spec.gated_mlp { 3 } else { 2 };
            (layers * mats * h * spec.intermediate_size, 0, 0)
        }
    };

    // Two norms per layer and the final norm.
    let small = layers * 2 * h + h + router;
    ParamCounts {
        embedding,
        lm_head,
        attention: layers * attention_per_layer,
        dense_mlp,
        experts,
        small,
        extra: spec.extra_params,
    }
}

/// Weights bitsandbytes packs into one block that shares one absmax.
pub const BNB_BLOCK: u64 = 64;

/// Bits one quantized linear weight costs, scales and zeros included, as the engine holds it.
pub fn quantized_bits_per_weight(q: Quantization) -> f64 {
    let g = q.group_size.max(1) as f64;
    match q.scheme {
        QuantScheme::None => 16.0,
        // 4-bit value + fp16 scale per group + packed 4-bit zero per group.
        QuantScheme::Awq | QuantScheme::Gptq => 4.0 + 16.0 / g + 4.0 / g,
        // NF4 packed two to a byte with one fp32 absmax per 64 weights. Double quantization
        // (an 8-bit absmax with one fp32 constant per 256 of them) exists only on disk: vLLM's
        // bitsandbytes loader quantizes online with `compress_statistics=True` and then
        // dequantizes every nested absmax back to fp32 at load (`dequantize_dq`), and does the
        // same for a pre-quantized checkpoint. The 16-value fp32 code table each shard keeps
        // (64 B per q/k/v/o/gate/up/down matrix) is left out: a few KiB per model.
        QuantScheme::Bnb4 => 4.0 + 32.0 / BNB_BLOCK as f64,
        QuantScheme::Bnb8 => 8.0,
        QuantScheme::Fp8 => 8.0,
        // 4-bit E2M1 value + one E8M0 exponent per 32.
        QuantScheme::Mxfp4 => 4.0 + 8.0 / 32.0,
        // 4-bit E2M1 value + one FP8 scale per 16.
        QuantScheme::Nvfp4 => 4.0 + 8.0 / 16.0,
    }
}

/// Linear-layer weights a quantization scheme converts (decoder attention, dense MLPs and
/// experts, less the layers the checkpoint leaves unconverted); with online quantization also
/// the towers' linear layers.
pub fn quantized_linear_params(spec: &ModelSpec, quant: Quantization) -> u64 {
    if quant.scheme == QuantScheme::None {
        return 0;
    }
    let p = param_counts(spec);
    let layers = spec.num_layers.max(1);
    let kept = |n: u64, kept_layers: u64| n * kept_layers.min(layers) / layers;
    let (attention, dense) = if quant.experts_only {
        (0, 0)
    } else {
        (
            p.attention - kept(p.attention, quant.unconverted_attention_layers),
            p.dense_mlp - kept(p.dense_mlp, quant.unconverted_mlp_layers),
        )
    };
    let towers = if quant.online {
        spec.extra_linear_params.min(spec.extra_params)
    } else {
        0
    };
    attention + dense + p.experts + towers
}

/// Bytes a pre-quantized bitsandbytes 4-bit checkpoint with double quantization grows by when
/// vLLM loads it: each 8-bit absmax (one per 64 weights) becomes an fp32 one (`dequantize_dq`),
/// 3 bytes more per block. Its tensor headers count the 8-bit absmax; the engine holds the fp32.
pub fn bnb_nested_absmax_growth(spec: &ModelSpec) -> u64 {
    let q = spec.quantization;
    if q.scheme != QuantScheme::Bnb4 || !q.double_quant {
        return 0;
    }
    quantized_linear_params(spec, q).div_ceil(BNB_BLOCK) * 3
}

/// Estimated weight bytes of the whole model (all ranks together), as the engine holds them.
pub fn estimated_weight_bytes(spec: &ModelSpec, quant: Quantization) -> u64 {
    let p = param_counts(spec);
    let dense_bytes = spec.dtype.bytes() as f64;
    let q_bits = quantized_bits_per_weight(quant);
    let quantized = |n: u64| -> f64 {
        if quant.scheme == QuantScheme::None {
            n as f64 * dense_bytes
        } else {
            n as f64 * q_bits / 8.0
        }
    };
    // Layers the checkpoint leaves unconverted keep those matrices in the model dtype.
    let layers = spec.num_layers.max(1) as f64;
    let split = |n: u64, kept_layers: u64| -> f64 {
        let kept = n as f64 * (kept_layers.min(spec.num_layers) as f64 / layers);
        quantized((n as f64 - kept).round() as u64) + kept * dense_bytes
    };
    let (attention, dense_mlp) = if quant.experts_only {
        (
            p.attention as f64 * dense_bytes,
            p.dense_mlp as f64 * dense_bytes,
        )
    } else {
        (
            split(p.attention, quant.unconverted_attention_layers),
            split(p.dense_mlp, quant.unconverted_mlp_layers),
        )
    };
    // Quantized at load time, a tower's linear layers are converted with the decoder's; the rest
    // of it (and every tower of a pre-quantized checkpoint) stays in its own dtype.
    let tower_linear = if quant.online && quant.scheme != QuantScheme::None {
        spec.extra_linear_params.min(p.extra)
    } else {
        0
    };
    let extra =
        quantized(tower_linear) + (p.extra - tower_linear) as f64 * spec.extra_dtype.bytes() as f64;
    let total = (p.embedding + p.lm_head + p.small) as f64 * dense_bytes
        + attention
        + dense_mlp
        + quantized(p.experts)
        + extra;
    total.round() as u64
}

/// Bytes of the towers that every tensor-parallel rank holds whole: the part of `extra_params`
/// outside vLLM's parallel linear layers (convolutional audio tokenizers, patch embeddings), at
/// the dtype the total counts it in (`extra_dtype` for an estimate, the checkpoint's for an exact
/// total, whose widening is added separately).
pub fn replicated_extra_bytes(spec: &ModelSpec, weights_exact: bool) -> u64 {
    let replicated = spec.extra_params.saturating_sub(spec.extra_linear_params);
    let per_param = if weights_exact {
        spec.dtype.bytes()
    } else {
        spec.extra_dtype.bytes()
    };
    replicated * per_param
}

/// Weight bytes one tensor-parallel rank holds. Everything is sharded `1/tp` except norms, the
/// towers outside vLLM's parallel layers (`replicated`, from [`replicated_extra_bytes`]), and
/// K/V projections, which are replicated once `tp` exceeds the KV-head count (each rank keeps one
/// KV head).
pub fn weight_bytes_per_rank(spec: &ModelSpec, total_bytes: u64, tp: u64, replicated: u64) -> u64 {
    let tp = tp.max(1);
    if tp == 1 {
        return total_bytes;
    }
    let replicated = replicated.min(total_bytes);
    let mut per_rank = (total_bytes - replicated) as f64 / tp as f64 + replicated as f64;
    if spec.mla.is_none() && tp > spec.num_kv_heads && spec.num_kv_heads > 0 {
        // Each rank holds one KV head instead of kv_heads / tp of one.
        let kv_bytes_all = (spec.num_layers
            * spec.hidden_size
            * spec.num_kv_heads
            * (spec.head_dim + spec.head_dim_v)) as f64
            * spec.dtype.bytes() as f64;
        let per_head = kv_bytes_all / spec.num_kv_heads as f64;
        per_rank += per_head - kv_bytes_all / tp as f64;
    }
    per_rank.round() as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    fn llama_8b() -> ModelSpec {
        ModelSpec::dense("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128_256)
    }

    #[test]
    fn llama_3_1_8b_has_eight_billion_parameters() {
        let p = param_counts(&llama_8b());
        assert_eq!(p.total(), 8_030_261_248);
    }

    #[test]
    fn tied_embeddings_drop_the_output_projection() {
        let mut spec = llama_8b();
        let untied = param_counts(&spec).total();
        spec.tie_word_embeddings = true;
        assert_eq!(untied - param_counts(&spec).total(), 128_256 * 4096);
    }

    #[test]
    fn awq_keeps_embeddings_in_sixteen_bits() {
        let spec = llama_8b();
        let awq = Quantization {
            scheme: QuantScheme::Awq,
            group_size: 128,
            ..Quantization::NONE
        };
        let bytes = estimated_weight_bytes(&spec, awq);
        let p = param_counts(&spec);
        let floor = (p.embedding + p.lm_head) * 2;
        assert!(bytes > floor);
        // 4.156 bits per linear weight.
        let linear = (p.attention + p.dense_mlp) as f64 * (4.0 + 20.0 / 128.0) / 8.0;
        let expected = floor as f64 + linear + p.small as f64 * 2.0;
        assert!((bytes as f64 - expected).abs() < 2.0);
        assert!(gib(bytes) > 5.0 && gib(bytes) < 6.0, "{}", gib(bytes));
    }

    fn gib(b: u64) -> f64 {
        b as f64 / GIB as f64
    }

    #[test]
    fn bnb_4bit_is_held_with_an_fp32_absmax_per_64_weights_nested_or_not() {
        let spec = ModelSpec::dense("llama", 4096, 14_336, 32, 32, 8, 128_256);
        let p = param_counts(&spec);
        let mut q = Quantization {
            scheme: QuantScheme::Bnb4,
            ..Quantization::NONE
        };
        let plain = estimated_weight_bytes(&spec, q);
        // Embedding, lm_head and norms in bf16; every decoder projection packed two to a byte
        // with one fp32 absmax per 64 weights: 0.5 + 4/64 B.
        let linear = p.attention + p.dense_mlp;
        let expected = (p.embedding + p.lm_head + p.small) * 2 + linear / 2 + linear / 64 * 4;
        assert!(
            (plain as f64 - expected as f64).abs() < 2.0,
            "{plain} vs {expected}"
        );
        // vLLM dequantizes a nested absmax at load: the same bytes with double quantization.
        q.double_quant = true;
        assert_eq!(estimated_weight_bytes(&spec, q), plain);
        // A double-quantized checkpoint's headers count 1 B of absmax per 64 weights; loaded,
        // each is 4 B.
        let mut prequant = spec.clone();
        prequant.quantization = q;
        assert_eq!(bnb_nested_absmax_growth(&prequant), linear.div_ceil(64) * 3);
        prequant.quantization.double_quant = false;
        assert_eq!(bnb_nested_absmax_growth(&prequant), 0);
        // All 32 layers' attention kept in bf16: those weights cost 2 B instead of 4.5 bits.
        q.unconverted_attention_layers = 32;
        let kept = estimated_weight_bytes(&spec, q);
        let extra = p.attention as f64 * (2.0 - 4.5 / 8.0);
        assert!((kept as f64 - plain as f64 - extra).abs() < 2.0);
    }

    #[test]
    fn online_quantization_converts_a_towers_linear_layers_only() {
        let mut spec = ModelSpec::dense("vlm", 4096, 14_336, 32, 32, 8, 128_256);
        spec.extra_params = 400_000_000;
        spec.extra_linear_params = 300_000_000;
        let mut q = Quantization {
            scheme: QuantScheme::Bnb4,
            ..Quantization::NONE
        };
        let prequantized = estimated_weight_bytes(&spec, q);
        q.online = true;
        let online = estimated_weight_bytes(&spec, q);
        // 300 M tower weights at 4.5 bits instead of 2 B.
        let saved = 300_000_000.0 * (2.0 - 4.5 / 8.0);
        assert!(((prequantized - online) as f64 - saved).abs() < 2.0);
        // The 100 M outside linear layers are what every rank holds whole.
        assert_eq!(replicated_extra_bytes(&spec, false), 200_000_000);
    }

    #[test]
    fn tensor_parallel_splits_weights() {
        let spec = llama_8b();
        let total = 16_000_000_000;
        assert_eq!(weight_bytes_per_rank(&spec, total, 2, 0), 8_000_000_000);
        // tp 16 > 8 KV heads: K/V projections are replicated, so a rank holds more than 1/16.
        assert!(weight_bytes_per_rank(&spec, total, 16, 0) > total / 16);
        // A replicated tower is held whole by every rank.
        assert_eq!(
            weight_bytes_per_rank(&spec, total, 2, 1_000_000_000),
            7_500_000_000 + 1_000_000_000
        );
    }
}
