//! Property tests of the planner's invariants over random model shapes and budgets.

use proptest::prelude::*;

use crate::kv::{KvCacheDtype, KvLayout, KvSettings};
use crate::spec::ModelSpec;
use crate::units::{GIB, MIB};
use crate::vllm::{PlanRequest, plan};

fn dense_model() -> impl Strategy<Value = ModelSpec> {
    (1u64..=48, 0u32..=4, 6u32..=8, 1u64..=4).prop_map(
        |(layers, kv_shift, head_shift, ffn_mult)| {
            let head_dim = 1u64 << head_shift;
            let kv_heads = 1u64 << kv_shift;
            let heads = kv_heads * 4;
            let hidden = heads * head_dim;
            let mut spec = ModelSpec::dense(
                "prop",
                hidden,
                hidden * ffn_mult * 2,
                layers,
                heads,
                kv_heads,
                32_000,
            );
            spec.head_dim = head_dim;
            spec.head_dim_v = head_dim;
            spec
        },
    )
}

fn layout(spec: &ModelSpec, dtype: KvCacheDtype, tp: u64) -> KvLayout {
    KvLayout::new(
        spec,
        KvSettings {
            dtype,
            tensor_parallel_size: tp,
            block_size: 16,
            hybrid_manager: true,
        },
    )
}

proptest! {
    #[test]
    fn more_memory_never_gives_fewer_tokens(
        spec in dense_model(),
        small in 8u64..200,
        extra in 0u64..200,
        util in 0.5f64..0.95,
    ) {
        let mut a = PlanRequest::new(small * GIB);
        a.gpu_memory_utilization = Some(util);
        a.max_model_len = Some(4096);
        let mut b = a.clone();
        b.gpu_total_bytes = (small + extra) * GIB;
        let pa = plan(&spec, &a).unwrap();
        let pb = plan(&spec, &b).unwrap();
        prop_assert!(pb.kv_cache_tokens >= pa.kv_cache_tokens,
            "{} GiB gave {} tokens, {} GiB gave {}", small, pa.kv_cache_tokens, small + extra, pb.kv_cache_tokens);
    }

    #[test]
    fn a_larger_kv_cache_memory_never_gives_fewer_tokens(
        spec in dense_model(),
        kv_a in 1u64..100_000,
        kv_extra in 0u64..100_000,
    ) {
        let l = layout(&spec, KvCacheDtype::Auto, 1);
        let a = l.tokens(l.num_blocks(kv_a * MIB));
        let b = l.tokens(l.num_blocks((kv_a + kv_extra) * MIB));
        prop_assert!(b >= a);
    }

    #[test]
    fn fp8_kv_gives_twice_the_tokens_within_one_block(
        spec in dense_model(),
        kv_mib in 64u64..200_000,
        total in 16u64..200,
    ) {
        let mut req = PlanRequest::new(total * GIB);
        req.kv_cache_memory = Some(kv_mib * MIB);
        req.max_model_len = Some(2048);
        let bf16 = plan(&spec, &req).unwrap();
        req.kv_cache_dtype = KvCacheDtype::Fp8;
        let fp8 = plan(&spec, &req).unwrap();
        let diff = fp8.kv_cache_tokens as i128 - 2 * bf16.kv_cache_tokens as i128;
        prop_assert!(diff.unsigned_abs() <= bf16.block_size as u128,
            "bf16 {} fp8 {}", bf16.kv_cache_tokens, fp8.kv_cache_tokens);
        prop_assert_eq!(fp8.kv_bytes_per_token * 2, bf16.kv_bytes_per_token);
    }

    #[test]
    fn doubling_tp_halves_per_rank_kv_until_tp_exceeds_the_kv_heads(spec in dense_model(), tp_shift in 0u32..5) {
        let tp = 1u64 << tp_shift;
        let per = layout(&spec, KvCacheDtype::Auto, tp).bytes_per_token();
        let doubled = layout(&spec, KvCacheDtype::Auto, tp * 2).bytes_per_token();
        if tp * 2 <= spec.num_kv_heads {
            prop_assert_eq!(doubled * 2, per);
        } else {
            // Heads are replicated: each rank keeps one, so the per-rank cost stops falling.
            prop_assert_eq!(doubled, per);
            prop_assert_eq!(per, 2 * spec.num_layers * spec.head_dim * 2 * (spec.num_kv_heads / tp).max(1));
        }
    }
}
