//! Memory vLLM spends besides weights and KV: the activation peak of its profiling run, non-torch
//! allocations (cuBLAS/attention workspaces, NCCL), the CUDA-graph pool, and the CUDA context.
//! These are estimates from the model's shape; each function says what it models.

use crate::spec::ModelSpec;
use crate::units::{GIB, MIB};

/// Activation peak of vLLM's `profile_run`: one forward pass over `max_num_batched_tokens` tokens
/// plus the sampler warm-up over `max_num_seqs` rows of logits.
///
/// Forward pass: per token, the MLP's gate+up output (`2·I`) beside two residual-stream copies
/// (`2·H`) in the model dtype; MoE layers route each token to `top_k` experts and keep their
/// fused-MoE caches (`3·I_e + H` per routed copy). Sampler: `max_num_seqs × vocab` logits, about
/// 22 bytes per logit (the fp32 logits and the probability, log-probability and sorted copies).
/// Fitted to vLLM's own profiles of Llama-3-8B (1.26 GiB at 8,192 tokens, PR #10511; 2.07 GiB at
/// 20,000, issue #10517).
pub fn activation_peak_bytes(
    spec: &ModelSpec,
    max_num_batched_tokens: u64,
    max_num_seqs: u64,
    tp: u64,
) -> u64 {
    let tp = tp.max(1);
    let b = spec.dtype.bytes();
    let t = max_num_batched_tokens;
    let h = spec.hidden_size;
    let widest = if spec.gated_mlp { 2 } else { 1 };
    let dense_per_token = (widest * spec.intermediate_size / tp + 2 * h) * b;
    let per_token = match spec.moe {
        Some(moe) => {
            let routed =
                moe.experts_per_token * (3 * moe.expert_intermediate_size / tp + h) * b + 2 * h * b;
            routed.max(dense_per_token)
        }
        None => dense_per_token,
    };
    let forward = t * per_token;
    let sampler = max_num_seqs.min(t) * spec.vocab_size * 22 / tp.min(2);
    let encoder = match spec.encoder_decoder {
        // Whisper's encoder runs on 30 s of mel frames (2 × positions) per request in the batch.
        Some(ed) => ed.encoder_positions * 2 * (3 * spec.intermediate_size + 2 * h) * b,
        None => 0,
    };
    forward + sampler + encoder
}

/// Non-torch memory vLLM's profiler attributes to itself: cuBLAS and attention-backend
/// workspaces (about 0.25 GiB), plus NCCL and custom all-reduce buffers once ranks talk to each
/// other (about 0.75 GiB for two ranks, 0.25 GiB more per further rank).
pub fn non_torch_bytes(tp: u64) -> u64 {
    let base = GIB / 4;
    match tp {
        0 | 1 => base,
        n => base + 3 * GIB / 4 + (n - 2) * GIB / 4,
    }
}

/// The CUDA-graph pool captured after the KV cache is allocated (outside the
/// `--gpu-memory-utilization` budget in most vLLM versions). Piecewise graphs are captured for up
/// to `min(2·max_num_seqs, 512)` batch sizes; the pool grows with depth: about 0.1 GiB plus 4 MiB
/// per layer at the full 512-size capture, scaled down for fewer capture sizes (recent V1 logs:
/// 0.11–0.26 GiB for 7–8 B models).
pub fn cuda_graph_bytes(spec: &ModelSpec, max_num_seqs: u64, enforce_eager: bool) -> u64 {
    if enforce_eager {
        return 0;
    }
    let largest = (2 * max_num_seqs).clamp(1, 512);
    let scale = largest as f64 / 512.0;
    let per_layers = spec.num_layers as f64 * 4.0 * MIB as f64 * scale.sqrt();
    (GIB as f64 / 10.0 + per_layers).round() as u64
}

/// The CUDA context and allocator slack of the vLLM process, which sit outside
/// `util × total` because vLLM measures its budget after creating its context.
pub const CUDA_CONTEXT_BYTES: u64 = 512 * MIB;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::gib;

    fn llama_8b() -> ModelSpec {
        ModelSpec::dense("llama", 4096, 14336, 32, 32, 8, 128_256)
    }

    #[test]
    fn activation_peak_is_close_to_a_logged_profile() {
        // vLLM PR #10511: Meta-Llama-3-8B, 8192 batched tokens, 256 seqs: 1.26 GiB.
        let a = gib(activation_peak_bytes(&llama_8b(), 8192, 256, 1));
        assert!((a - 1.26).abs() < 0.05, "{a}");
        // vLLM #10517 (V0, no chunked prefill, so 20,000 batched tokens): 2.07 GiB.
        let a = gib(activation_peak_bytes(&llama_8b(), 20_000, 256, 1));
        assert!((a - 2.07).abs() < 0.1, "{a}");
    }

    #[test]
    fn activation_peak_grows_with_batched_tokens() {
        let s = llama_8b();
        assert!(activation_peak_bytes(&s, 16384, 256, 1) > activation_peak_bytes(&s, 8192, 256, 1));
    }

    #[test]
    fn non_torch_grows_with_tensor_parallelism() {
        assert!(non_torch_bytes(2) > non_torch_bytes(1));
        assert!(non_torch_bytes(8) > non_torch_bytes(4));
    }

    #[test]
    fn eager_mode_has_no_graph_pool() {
        assert_eq!(cuda_graph_bytes(&llama_8b(), 256, true), 0);
        assert!(cuda_graph_bytes(&llama_8b(), 256, false) > 0);
    }
}
