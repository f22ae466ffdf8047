//! Fix arithmetic for diagnosed failures: given the numbers an engine printed when it refused to
//! start or ran out of memory, compute the flag values that would have fitted (utilization that
//! the free memory allows, the `max_model_len` the KV pool holds at block granularity, the
//! utilization that would give the KV pool a full sequence, how many sequences a warm-up fits),
//! and compare a measured memory breakdown with a predicted one. Everything is pure: callers hand
//! in numbers, nothing here reads logs or devices.

use serde::Serialize;

/// Bytes in one GiB, the unit vLLM and PyTorch print.
pub const GIB: f64 = (1u64 << 30) as f64;

/// vLLM's default KV block size in tokens (CUDA attention backends).
pub const DEFAULT_BLOCK_SIZE: u64 = 16;

/// Rounding guard: values printed with two decimals are compared after this nudge so that a
/// quotient such as 0.83 computed as 0.82999999 still rounds to 0.83.
const EPS: f64 = 1e-9;

/// True for a finite number above zero (false for NaN).
fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Rounds `x` down to `decimals` places (0.8966 → 0.89).
pub fn floor_to(x: f64, decimals: u32) -> f64 {
    let scale = 10f64.powi(decimals as i32);
    ((x * scale) + EPS).floor() / scale
}

/// Rounds `x` up to `decimals` places (0.9278 → 0.93).
pub fn ceil_to(x: f64, decimals: u32) -> f64 {
    let scale = 10f64.powi(decimals as i32);
    ((x * scale) - EPS).ceil() / scale
}

/// The largest `--gpu-memory-utilization` (two decimals, rounded down) with
/// `util × total ≤ free`, which is the check vLLM V1 makes at start-up. `None` when the inputs
/// are not positive or the result would be zero.
pub fn utilization_within_free(free_gib: f64, total_gib: f64) -> Option<f64> {
    if !positive(free_gib) || !positive(total_gib) {
        return None;
    }
    let util = floor_to((free_gib / total_gib).min(1.0), 2);
    (util > 0.0).then_some(util)
}

/// KV bytes one token costs, recovered from an engine message of the form "N tokens need X GiB".
pub fn kv_bytes_per_token_from_need(need_gib: f64, tokens: u64) -> Option<f64> {
    (tokens > 0 && positive(need_gib)).then(|| need_gib * GIB / tokens as f64)
}

/// The longest `max_model_len` whose KV cache fits `available_gib`, counted the way vLLM counts:
/// whole blocks of `block_size` tokens, so the answer is a multiple of the block size.
pub fn max_model_len_for_kv(available_gib: f64, bytes_per_token: f64, block_size: u64) -> u64 {
    if !positive(available_gib) || !positive(bytes_per_token) || block_size == 0 {
        return 0;
    }
    let block_bytes = bytes_per_token * block_size as f64;
    let blocks = ((available_gib * GIB) / block_bytes + EPS).floor();
    if !blocks.is_finite() || blocks <= 0.0 {
        return 0;
    }
    (blocks as u64).saturating_mul(block_size)
}

/// Blocks a sequence of `tokens` occupies (`ceil(tokens / block_size)`).
pub fn blocks_for_tokens(tokens: u64, block_size: u64) -> u64 {
    if block_size == 0 {
        return 0;
    }
    tokens.div_ceil(block_size)
}

/// Tokens a pool of `pool_tokens` holds when each token costs `bytes_ratio` times its current
/// size (0.5 for fp8 KV in place of a 16-bit cache), kept at block granularity.
pub fn tokens_with_kv_ratio(pool_tokens: u64, bytes_ratio: f64, block_size: u64) -> u64 {
    if !positive(bytes_ratio) || block_size == 0 {
        return 0;
    }
    let blocks = (pool_tokens / block_size) as f64 / bytes_ratio;
    ((blocks + EPS).floor() as u64).saturating_mul(block_size)
}

/// The utilization (two decimals, rounded up) that grows the KV pool from `available_kv_gib` to
/// `needed_kv_gib`, everything else unchanged: `util + (needed − available) / total`.
pub fn utilization_for_kv(
    current_util: f64,
    total_gib: f64,
    needed_kv_gib: f64,
    available_kv_gib: f64,
) -> Option<f64> {
    if !positive(total_gib) || !positive(current_util) {
        return None;
    }
    let missing = (needed_kv_gib - available_kv_gib).max(0.0);
    Some(ceil_to(current_util + missing / total_gib, 2))
}

/// The utilization (two decimals, rounded down) that frees `shortfall_gib` on a device of
/// `total_gib`: `util − shortfall / total`. `None` when nothing positive is left.
pub fn utilization_after_shortfall(
    current_util: f64,
    shortfall_gib: f64,
    total_gib: f64,
) -> Option<f64> {
    if !positive(total_gib) {
        return None;
    }
    let util = floor_to(current_util - shortfall_gib.max(0.0) / total_gib, 2);
    (util > 0.0).then_some(util)
}

/// How much a utilization must drop (two decimals, rounded up) to free `shortfall_gib`.
pub fn utilization_drop_for(shortfall_gib: f64, total_gib: f64) -> Option<f64> {
    positive(total_gib).then(|| ceil_to(shortfall_gib.max(0.0) / total_gib, 2).max(0.01))
}

/// Concurrency vLLM reports: pool blocks divided by the blocks one full-length request takes.
pub fn concurrency(num_blocks: u64, max_model_len: u64, block_size: u64) -> Option<f64> {
    let per_request = blocks_for_tokens(max_model_len, block_size);
    (per_request > 0).then(|| num_blocks as f64 / per_request as f64)
}

/// Sequences a warm-up whose memory grows linearly with the sequence count fits in `free_gib`,
/// given that `current_seqs` needed `request_gib` more than was free. Rounded down to a multiple
/// of 8 (at least 1).
pub fn sequences_that_fit(current_seqs: u64, request_gib: f64, free_gib: f64) -> Option<u64> {
    if current_seqs == 0 || !positive(request_gib) || free_gib < 0.0 {
        return None;
    }
    let fit = (current_seqs as f64 * free_gib / request_gib + EPS).floor() as u64;
    let fit = fit.min(current_seqs.saturating_sub(1));
    Some(if fit >= 8 { fit / 8 * 8 } else { fit.max(1) })
}

/// What the caching allocator's numbers say about a failed allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FragmentationVerdict {
    /// Reserved-but-unallocated alone is at least the request: the memory exists inside the
    /// allocator, just not in one piece.
    CachedExceedsRequest,
    /// Free plus reserved-but-unallocated covers the request and the cached part is a large
    /// share of it.
    CachedPlusFreeCoversRequest,
    /// The numbers do not point at fragmentation.
    NotFragmentation,
}

/// Compares reserved-but-unallocated (and free) memory with a failed request.
pub fn fragmentation_verdict(
    request_gib: f64,
    reserved_unallocated_gib: f64,
    free_gib: f64,
) -> FragmentationVerdict {
    if !positive(request_gib) || !positive(reserved_unallocated_gib) {
        return FragmentationVerdict::NotFragmentation;
    }
    if reserved_unallocated_gib >= request_gib {
        FragmentationVerdict::CachedExceedsRequest
    } else if reserved_unallocated_gib + free_gib.max(0.0) >= request_gib
        && reserved_unallocated_gib >= 0.25 * request_gib
    {
        FragmentationVerdict::CachedPlusFreeCoversRequest
    } else {
        FragmentationVerdict::NotFragmentation
    }
}

/// One engine instance's GPU memory split the way vLLM reports it, in GiB (per rank). Fields the
/// source did not give are `None`. Doctor fills it from a start-up log; plan fills it from a
/// prediction; [`compare_breakdowns`] lines the two up.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MemoryBreakdown {
    pub total_gib: Option<f64>,
    pub utilization: Option<f64>,
    pub budget_gib: Option<f64>,
    pub weights_gib: Option<f64>,
    pub activation_peak_gib: Option<f64>,
    pub non_torch_gib: Option<f64>,
    pub cuda_graph_gib: Option<f64>,
    pub kv_cache_gib: Option<f64>,
    pub kv_tokens: Option<u64>,
    pub gpu_blocks: Option<u64>,
    pub max_model_len: Option<u64>,
    pub max_concurrency: Option<f64>,
}

/// One line of a measured-vs-predicted comparison.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BreakdownDelta {
    /// Field name as in [`MemoryBreakdown`].
    pub item: &'static str,
    pub measured: f64,
    pub predicted: f64,
    /// `predicted − measured`.
    pub difference: f64,
    /// `difference / measured`, when measured is not zero.
    pub relative: Option<f64>,
}

/// Lines up every field both breakdowns have.
pub fn compare_breakdowns(
    measured: &MemoryBreakdown,
    predicted: &MemoryBreakdown,
) -> Vec<BreakdownDelta> {
    let pairs: [(&'static str, Option<f64>, Option<f64>); 12] = [
        ("total_gib", measured.total_gib, predicted.total_gib),
        ("utilization", measured.utilization, predicted.utilization),
        ("budget_gib", measured.budget_gib, predicted.budget_gib),
        ("weights_gib", measured.weights_gib, predicted.weights_gib),
        (
            "activation_peak_gib",
            measured.activation_peak_gib,
            predicted.activation_peak_gib,
        ),
        (
            "non_torch_gib",
            measured.non_torch_gib,
            predicted.non_torch_gib,
        ),
        (
            "cuda_graph_gib",
            measured.cuda_graph_gib,
            predicted.cuda_graph_gib,
        ),
        (
            "kv_cache_gib",
            measured.kv_cache_gib,
            predicted.kv_cache_gib,
        ),
        (
            "kv_tokens",
            measured.kv_tokens.map(|v| v as f64),
            predicted.kv_tokens.map(|v| v as f64),
        ),
        (
            "gpu_blocks",
            measured.gpu_blocks.map(|v| v as f64),
            predicted.gpu_blocks.map(|v| v as f64),
        ),
        (
            "max_model_len",
            measured.max_model_len.map(|v| v as f64),
            predicted.max_model_len.map(|v| v as f64),
        ),
        (
            "max_concurrency",
            measured.max_concurrency,
            predicted.max_concurrency,
        ),
    ];
    pairs
        .into_iter()
        .filter_map(|(item, m, p)| {
            let (measured, predicted) = (m?, p?);
            let difference = predicted - measured;
            let relative = (measured != 0.0).then(|| difference / measured);
            Some(BreakdownDelta {
                item,
                measured,
                predicted,
                difference,
                relative,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utilization_within_free_rounds_down() {
        // vLLM: "Free memory on device cuda:1 (19.77/22.05 GiB) ... (0.9, 19.84 GiB)".
        let util = utilization_within_free(19.77, 22.05).unwrap();
        assert_eq!(util, 0.89);
        assert!(util * 22.05 <= 19.77);
        assert!((util + 0.01) * 22.05 > 19.77);
        assert_eq!(utilization_within_free(0.0, 22.0), None);
        assert_eq!(utilization_within_free(30.0, 20.0), Some(1.0));
    }

    #[test]
    fn max_model_len_is_block_granular() {
        // 32,768 tokens need 4.0 GiB (131,072 B/token); 1.1 GiB available.
        let bpt = kv_bytes_per_token_from_need(4.0, 32_768).unwrap();
        assert_eq!(bpt, 131_072.0);
        assert_eq!(max_model_len_for_kv(1.1, bpt, 16), 9008);
        // fp8 halves bytes per token.
        assert_eq!(max_model_len_for_kv(1.1, bpt / 2.0, 16), 18_016);
        assert_eq!(max_model_len_for_kv(0.0, bpt, 16), 0);
        assert_eq!(max_model_len_for_kv(1.0, bpt, 0), 0);
    }

    #[test]
    fn utilization_for_kv_rounds_up() {
        // 4.0 GiB needed, 1.1 available, util 0.9 on 80 GiB: 0.9 + 2.9/80 = 0.93625 → 0.94.
        assert_eq!(utilization_for_kv(0.9, 80.0, 4.0, 1.1), Some(0.94));
        assert_eq!(utilization_for_kv(0.9, 0.0, 4.0, 1.1), None);
    }

    #[test]
    fn shortfall_and_drop() {
        assert_eq!(utilization_after_shortfall(0.9, 1.0, 20.0), Some(0.85));
        assert_eq!(utilization_after_shortfall(0.1, 5.0, 20.0), None);
        assert_eq!(utilization_drop_for(0.11, 21.98), Some(0.01));
        assert_eq!(utilization_drop_for(2.5, 20.0), Some(0.13));
    }

    #[test]
    fn blocks_tokens_and_concurrency() {
        assert_eq!(blocks_for_tokens(29_000, 16), 1813);
        assert_eq!(tokens_with_kv_ratio(23_648, 0.5, 16), 47_296);
        // vLLM#10517: 1478 blocks for 29000 tokens → 0.82x.
        let c = concurrency(1478, 29_000, 16).unwrap();
        assert!((c - 0.815).abs() < 0.001, "{c}");
    }

    #[test]
    fn sequences_scale_linearly_and_round_to_eight() {
        assert_eq!(sequences_that_fit(256, 2.0, 1.0), Some(128));
        assert_eq!(sequences_that_fit(256, 2.0, 0.0), Some(1));
        assert_eq!(sequences_that_fit(1024, 1.0, 5.0), Some(1016));
        assert_eq!(sequences_that_fit(0, 1.0, 1.0), None);
    }

    #[test]
    fn fragmentation_needs_cached_memory() {
        assert_eq!(
            fragmentation_verdict(0.53, 0.72, 0.5),
            FragmentationVerdict::CachedExceedsRequest
        );
        assert_eq!(
            fragmentation_verdict(4.0, 1.5, 3.0),
            FragmentationVerdict::CachedPlusFreeCoversRequest
        );
        assert_eq!(
            fragmentation_verdict(4.0, 0.1, 3.0),
            FragmentationVerdict::NotFragmentation
        );
        assert_eq!(
            fragmentation_verdict(4.0, 0.0, 9.0),
            FragmentationVerdict::NotFragmentation
        );
    }

    #[test]
    fn compare_lines_up_shared_fields() {
        let measured = MemoryBreakdown {
            weights_gib: Some(14.96),
            kv_cache_gib: Some(53.29),
            ..Default::default()
        };
        let predicted = MemoryBreakdown {
            weights_gib: Some(15.0),
            kv_tokens: Some(10),
            ..Default::default()
        };
        let d = compare_breakdowns(&measured, &predicted);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].item, "weights_gib");
        assert!((d[0].difference - 0.04).abs() < 1e-9);
    }
}
