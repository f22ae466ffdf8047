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

/// Bits one quantized linear weight costs, scales and zeros included.
pub fn quantized_bits_per_weight(q: Quantization) -> f64 {
    let g = q.group_size.max(1) as f64;
    match q.scheme {
        QuantScheme::None => 16.0,
        // 4-bit value + fp16 scale per group + packed 4-bit zero per group.
        QuantScheme::Awq | QuantScheme::Gptq => 4.0 + 16.0 / g + 4.0 / g,
        // NF4 with one fp32 absmax per 64 weights; with double quantization the absmax is 8-bit
        // and each 256 of them share one fp32 constant.
        QuantScheme::Bnb4 if q.double_quant => 4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0),
        QuantScheme::Bnb4 => 4.0 + 32.0 / 64.0,
        QuantScheme::Bnb8 => 8.0,
        QuantScheme::Fp8 => 8.0,
        // 4-bit E2M1 value + one E8M0 exponent per 32.
        QuantScheme::Mxfp4 => 4.0 + 8.0 / 32.0,
        // 4-bit E2M1 value + one FP8 scale per 16.
        QuantScheme::Nvfp4 => 4.0 + 8.0 / 16.0,
    }
}

/// Estimated weight bytes of the whole model (all ranks together).
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
    let total = (p.embedding + p.lm_head + p.small) as f64 * dense_bytes
        + attention
        + dense_mlp
        + quantized(p.experts)
        + p.extra as f64 * spec.extra_dtype.bytes() as f64;
    total.round() as u64
}

/// Weight bytes one tensor-parallel rank holds. Everything is sharded `1/tp` except norms, and
/// K/V projections, which are replicated once `tp` exceeds the KV-head count (each rank keeps one
/// KV head).
pub fn weight_bytes_per_rank(spec: &ModelSpec, total_bytes: u64, tp: u64) -> u64 {
    let tp = tp.max(1);
    if tp == 1 {
        return total_bytes;
    }
    let mut per_rank = total_bytes as f64 / tp as f64;
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
    fn bnb_double_quant_and_unconverted_modules() {
        let spec = ModelSpec::dense("llama", 4096, 14_336, 32, 32, 8, 128_256);
        let p = param_counts(&spec);
        let mut q = Quantization {
            scheme: QuantScheme::Bnb4,
            ..Quantization::NONE
        };
        let plain = estimated_weight_bytes(&spec, q);
        q.double_quant = true;
        let double = estimated_weight_bytes(&spec, q);
        // Per quantized weight: 32/64 bits of fp32 absmax become 8/64 + 32/16384 bits.
        let quantized = (p.attention + p.dense_mlp) as f64;
        let saved = quantized * (32.0 / 64.0 - 8.0 / 64.0 - 32.0 / 16_384.0) / 8.0;
        assert!(
            (plain as f64 - double as f64 - saved).abs() < 2.0,
            "{plain} {double} {saved}"
        );
        // All 32 layers' attention kept in bf16: those weights cost 2 B instead of 4.127 bits.
        q.unconverted_attention_layers = 32;
        let kept = estimated_weight_bytes(&spec, q);
        let extra = p.attention as f64 * (2.0 - (4.0 + 8.0 / 64.0 + 32.0 / 16_384.0) / 8.0);
        assert!((kept as f64 - double as f64 - extra).abs() < 2.0);
    }

    #[test]
    fn tensor_parallel_splits_weights() {
        let spec = llama_8b();
        let total = 16_000_000_000;
        assert_eq!(weight_bytes_per_rank(&spec, total, 2), 8_000_000_000);
        // tp 16 > 8 KV heads: K/V projections are replicated, so a rank holds more than 1/16.
        assert!(weight_bytes_per_rank(&spec, total, 16) > total / 16);
    }
}
