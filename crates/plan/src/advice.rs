//! Fix arithmetic for diagnosed failures: given the numbers an engine printed when it refused to
//! start or ran out of memory, compute the flag values that would have fitted (utilization that
//! the free memory allows, the `max_model_len` the KV pool holds at block granularity, the
//! utilization that would give the KV pool a full sequence, how many sequences a warm-up fits),
//! and compare a measured memory breakdown with a predicted one; and, for a plan that misses,
//! search the changes that make it fit, each planned again with the change applied
//! ([`verified_options`]). Everything is pure: callers hand in numbers, nothing here reads logs
//! or devices.

use serde::Serialize;

use crate::kv::KvCacheDtype;
use crate::spec::{Dtype, ModelSpec, QuantScheme};
use crate::units::thousands;
use crate::vllm::{FitOption, MAX_PROPOSED_UTILIZATION, Plan, PlanRequest, plan_unadvised};

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

/// One flag change an option is made of.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Change {
    Utilization(f64),
    MaxModelLen(u64),
    MaxNumSeqs(u64),
    TargetConcurrency(u64),
    KvFp8,
    Quantization(QuantScheme),
    TensorParallel(u64),
    BlockSize(u64),
}

impl Change {
    /// Applies the change to a request, the way the flag would.
    pub fn apply(self, req: &mut PlanRequest) {
        match self {
            Change::Utilization(u) => req.gpu_memory_utilization = Some(u),
            Change::MaxModelLen(l) => req.max_model_len = Some(l),
            Change::MaxNumSeqs(n) => req.max_num_seqs = Some(n),
            Change::TargetConcurrency(n) => req.target_concurrency = Some(n),
            Change::KvFp8 => req.kv_cache_dtype = KvCacheDtype::Fp8,
            Change::Quantization(q) => req.quantization = Some(q),
            Change::TensorParallel(t) => req.tensor_parallel_size = t,
            Change::BlockSize(b) => req.block_size = b,
        }
    }

    /// The `headroom plan` flag and value.
    fn headroom_flag(self) -> [String; 2] {
        let (flag, value) = match self {
            Change::Utilization(u) => ("--gpu-memory-utilization", format!("{u:.2}")),
            Change::MaxModelLen(l) => ("--max-model-len", l.to_string()),
            Change::MaxNumSeqs(n) => ("--max-num-seqs", n.to_string()),
            Change::TargetConcurrency(n) => ("--target-concurrency", n.to_string()),
            Change::KvFp8 => ("--kv-cache-dtype", "fp8".to_string()),
            Change::Quantization(q) => ("--quantization", q.label().to_string()),
            Change::TensorParallel(t) => ("--tensor-parallel-size", t.to_string()),
            Change::BlockSize(b) => ("--block-size", b.to_string()),
        };
        [flag.to_string(), value]
    }

    /// The `vllm serve` flag and value.
    fn vllm_flag(self) -> [String; 2] {
        match self {
            Change::TargetConcurrency(n) => ["--max-num-seqs".into(), n.to_string()],
            Change::Quantization(q) => [
                "--quantization".into(),
                q.vllm_name().unwrap_or("none").to_string(),
            ],
            other => other.headroom_flag(),
        }
    }

    /// Short name and cost rank: cheaper changes (no hardware, no quality cost) rank lower.
    fn name_and_rank(self) -> (String, u8) {
        match self {
            Change::BlockSize(_) => ("block_size".into(), 0),
            Change::Utilization(_) => ("utilization".into(), 1),
            Change::KvFp8 => ("fp8_kv_cache".into(), 2),
            Change::MaxNumSeqs(_) | Change::TargetConcurrency(_) => ("fewer_sequences".into(), 3),
            Change::MaxModelLen(_) => ("shorter_context".into(), 4),
            Change::Quantization(QuantScheme::Fp8) => ("fp8_weights".into(), 5),
            Change::Quantization(q) => (format!("{}_weights", q.label().replace('-', "_")), 6),
            Change::TensorParallel(t) => (format!("tensor_parallel_{t}"), 7),
        }
    }

    fn describe(self, spec: &ModelSpec) -> String {
        match self {
            Change::BlockSize(b) => format!("use vLLM's block size {b}"),
            Change::Utilization(u) => format!("set the utilization to {u:.2}"),
            Change::KvFp8 => "store the KV cache in fp8 (half the bytes per token)".into(),
            Change::MaxNumSeqs(n) => format!("run at most {n} sequences at once"),
            Change::TargetConcurrency(n) => format!("serve {n} full-length sequences at once"),
            Change::MaxModelLen(l) => format!("cap the context at {} tokens", thousands(l)),
            Change::Quantization(q) if q == spec.quantization.scheme => {
                format!("keep the checkpoint's {} quantization", q.label())
            }
            Change::Quantization(QuantScheme::Fp8) => {
                "quantize the weights to fp8 at load time".into()
            }
            Change::Quantization(q) => format!(
                "quantize the weights with {} at load time (weights estimated)",
                q.label()
            ),
            Change::TensorParallel(t) => {
                format!("split the model over {t} such GPUs (figures per GPU)")
            }
        }
    }
}

/// The re-plan of `req` with `changes` applied, when it fits.
fn fitting_replan(spec: &ModelSpec, req: &PlanRequest, changes: &[Change]) -> Option<Plan> {
    let mut v = req.clone();
    for c in changes {
        c.apply(&mut v);
    }
    plan_unadvised(spec, &v).ok().filter(|p| p.fits)
}

/// Changes every option must carry because vLLM refuses the request as given: an invalid block
/// size, a TP size that does not divide the heads (the largest smaller one that does), a
/// quantization the checkpoint does not have.
fn repairs(spec: &ModelSpec, req: &PlanRequest) -> Vec<Change> {
    let mut out = Vec::new();
    if !crate::vllm::VALID_BLOCK_SIZES.contains(&req.block_size) {
        out.push(Change::BlockSize(crate::vllm::DEFAULT_BLOCK_SIZE));
    }
    let heads = spec.num_attention_heads.max(1);
    let tp = req.tensor_parallel_size.max(1);
    if !heads.is_multiple_of(tp) {
        let smaller = (1..tp)
            .rev()
            .find(|t| heads.is_multiple_of(*t))
            .unwrap_or(1);
        out.push(Change::TensorParallel(smaller));
    }
    if let Some(q) = req.quantization
        && q != spec.quantization.scheme
        && q != QuantScheme::None
        && (spec.quantization.scheme != QuantScheme::None
            || !matches!(q, QuantScheme::Fp8 | QuantScheme::Bnb4 | QuantScheme::Bnb8))
    {
        out.push(Change::Quantization(spec.quantization.scheme));
    }
    out
}

/// The largest utilization (two decimals, at most [`MAX_PROPOSED_UTILIZATION`]) that fits.
fn best_utilization(spec: &ModelSpec, req: &PlanRequest, base: &[Change]) -> Option<Change> {
    let top = (MAX_PROPOSED_UTILIZATION * 100.0).round() as u64;
    (1..=top).rev().map(|c| c as f64 / 100.0).find_map(|u| {
        let mut changes = base.to_vec();
        changes.push(Change::Utilization(u));
        fitting_replan(spec, req, &changes).map(|_| Change::Utilization(u))
    })
}

/// The largest safe utilization beside the co-tenants (from the plan with `base` applied, at
/// most [`MAX_PROPOSED_UTILIZATION`]), when it differs from the one the plan uses.
fn safe_utilization(spec: &ModelSpec, req: &PlanRequest, base: &[Change]) -> Option<Change> {
    let mut v = req.clone();
    for c in base {
        c.apply(&mut v);
    }
    let p = plan_unadvised(spec, &v).ok()?;
    let safe = p
        .largest_safe_gpu_memory_utilization
        .min(MAX_PROPOSED_UTILIZATION);
    (safe > 0.0 && (safe - p.gpu_memory_utilization).abs() > 0.005)
        .then_some(Change::Utilization(safe))
}

/// The largest value in `1..=upper` for which `make(value)` fits, assuming smaller values fit
/// at least as well (binary search, then the answer is re-checked by the caller's re-plan).
fn largest_fitting(
    spec: &ModelSpec,
    req: &PlanRequest,
    base: &[Change],
    upper: u64,
    make: impl Fn(u64) -> Change,
) -> Option<Change> {
    let fits = |n: u64| {
        let mut changes = base.to_vec();
        changes.push(make(n));
        fitting_replan(spec, req, &changes).is_some()
    };
    if upper == 0 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1, upper);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) { lo = mid } else { hi = mid - 1 }
    }
    Some(make(lo))
}

/// The longest context (whole blocks, never above what vLLM accepts) that fits.
fn best_context(
    spec: &ModelSpec,
    req: &PlanRequest,
    base: &[Change],
    current: &Plan,
) -> Option<Change> {
    let mut v = req.clone();
    for c in base {
        c.apply(&mut v);
    }
    let block = v.block_size.max(1);
    let mut upper = current.max_model_len;
    if !v.allow_long_max_model_len && spec.positions_known && spec.max_position_embeddings > 0 {
        upper = upper.min(spec.max_position_embeddings);
    }
    let blocks = upper / block;
    let found = largest_fitting(spec, req, base, blocks, |b| Change::MaxModelLen(b * block))?;
    match found {
        Change::MaxModelLen(l) if l < current.max_model_len => Some(found),
        _ => None,
    }
}

/// The most sequences that fit, below the current count: `--target-concurrency` when the request
/// names one, else `--max-num-seqs`.
fn best_sequences(
    spec: &ModelSpec,
    req: &PlanRequest,
    base: &[Change],
    current: &Plan,
) -> Option<Change> {
    match req.target_concurrency {
        Some(n) if n > 1 => largest_fitting(spec, req, base, n - 1, Change::TargetConcurrency),
        Some(_) => None,
        None if current.max_num_seqs > 1 => largest_fitting(
            spec,
            req,
            base,
            current.max_num_seqs - 1,
            Change::MaxNumSeqs,
        ),
        None => None,
    }
}

/// Structural changes worth trying: fp8 KV, weights quantized at load time, more GPUs.
fn structural_changes(spec: &ModelSpec, req: &PlanRequest) -> Vec<Change> {
    let mut out = Vec::new();
    if req.kv_cache_dtype != KvCacheDtype::Fp8 {
        out.push(Change::KvFp8);
    }
    let scheme = req.quantization.unwrap_or(spec.quantization.scheme);
    let sixteen_bit = matches!(
        req.dtype.unwrap_or(spec.dtype),
        Dtype::Bf16 | Dtype::F16 | Dtype::F32
    );
    if scheme == QuantScheme::None && spec.quantization.scheme == QuantScheme::None && sixteen_bit {
        out.push(Change::Quantization(QuantScheme::Fp8));
        out.push(Change::Quantization(QuantScheme::Bnb4));
    }
    let heads = spec.num_attention_heads.max(1);
    let tp = req.tensor_parallel_size.max(1);
    if let Some(t) = [2u64, 4, 8]
        .into_iter()
        .find(|t| *t > tp && heads.is_multiple_of(*t))
    {
        out.push(Change::TensorParallel(t));
    }
    out
}

fn to_option(spec: &ModelSpec, changes: &[Change], p: &Plan) -> FitOption {
    let names: Vec<String> = changes.iter().map(|c| c.name_and_rank().0).collect();
    let descriptions: Vec<String> = changes.iter().map(|c| c.describe(spec)).collect();
    FitOption {
        option: names.join("+"),
        description: descriptions.join(", "),
        vllm_args: changes.iter().flat_map(|c| c.vllm_flag()).collect(),
        headroom_args: changes.iter().flat_map(|c| c.headroom_flag()).collect(),
        memory_needed_bytes: p.device_peak_bytes + p.safety_margin_bytes,
        fits: true,
        gpu_memory_utilization: p.gpu_memory_utilization,
        max_model_len: p.max_model_len,
        concurrency: p.max_concurrency.floor() as u64,
    }
}

/// (cost rank, change count, changes, re-plan, family: which structural change it builds on).
type Found = Vec<(u8, usize, Vec<Change>, Plan, usize)>;

/// Records `changes` with its re-plan when that re-plan fits.
fn found_alone(spec: &ModelSpec, req: &PlanRequest, changes: &[Change], found: &mut Found) {
    if let Some(p) = fitting_replan(spec, req, changes) {
        let rank = changes
            .iter()
            .map(|c| c.name_and_rank().1)
            .max()
            .unwrap_or(0);
        found.push((rank, changes.len(), changes.to_vec(), p, 0));
    }
}

/// True when `o` makes every change `e` makes, and more, without a longer context or more
/// sequences to show for it.
fn adds_nothing(o: &FitOption, e: &FitOption) -> bool {
    let mine: Vec<&str> = o.option.split('+').collect();
    e.option.split('+').all(|k| mine.contains(&k))
        && o.max_model_len <= e.max_model_len
        && o.concurrency <= e.concurrency
}

/// Most options printed.
pub const MAX_OPTIONS: usize = 8;

/// Every change (alone, or a structural change with the utilization, the sequence count or the
/// context adjusted on top) that makes `req` fit, planned again with the change applied and
/// reported with that plan's figures; cheapest first. Options that do not fit are left out.
pub fn verified_options(spec: &ModelSpec, req: &PlanRequest) -> Vec<FitOption> {
    let fixes = repairs(spec, req);
    let Ok(current) = plan_unadvised(spec, req) else {
        return Vec::new();
    };
    let mut bases: Vec<Vec<Change>> = vec![fixes.clone()];
    for s in structural_changes(spec, req) {
        let mut b: Vec<Change> = fixes
            .iter()
            .copied()
            .filter(|f| {
                !matches!(
                    (f, s),
                    (Change::TensorParallel(_), Change::TensorParallel(_))
                )
            })
            .collect();
        b.push(s);
        bases.push(b);
    }
    let mut found: Found = Vec::new();
    for (family, base) in bases.iter().enumerate() {
        let before = found.len();
        let mut candidates: Vec<Vec<Change>> = Vec::new();
        if !base.is_empty() {
            candidates.push(base.clone());
            // A change that fits alone needs nothing tuned on top.
            if fitting_replan(spec, req, base).is_some() {
                found_alone(spec, req, base, &mut found);
                continue;
            }
        }
        let tuned = [
            best_utilization(spec, req, base),
            best_sequences(spec, req, base, &current),
            best_context(spec, req, base, &current),
        ];
        for t in tuned.into_iter().flatten() {
            if !matches!(t, Change::Utilization(u) if req.gpu_memory_utilization == Some(u)) {
                let mut c = base.clone();
                c.push(t);
                candidates.push(c);
            }
        }
        // A given utilization that is too high for the co-tenants: lower it to the largest safe
        // one, then fit the context or the sequence count into what that leaves.
        if let Some(safe) = safe_utilization(spec, req, base) {
            let mut with_util = base.clone();
            with_util.push(safe);
            for t in [
                best_sequences(spec, req, &with_util, &current),
                best_context(spec, req, &with_util, &current),
            ]
            .into_iter()
            .flatten()
            {
                let mut c = with_util.clone();
                c.push(t);
                candidates.push(c);
            }
        }
        for changes in candidates {
            found_alone(spec, req, &changes, &mut found);
        }
        for f in &mut found[before..] {
            f.4 = family;
        }
    }
    // The cheapest (by the dearest change an option makes), then the fewest changes; the first
    // of equal ones wins.
    found.sort_by_key(|(rank, n, ..)| (*rank, *n));
    // Every tuning of the request as it is, then the best one of each structural change, so
    // that fp8 KV, quantized weights and more GPUs each get a line.
    let mut out: Vec<FitOption> = Vec::new();
    let mut families_seen = Vec::new();
    for (_, _, changes, p, family) in found {
        if family > 0 && families_seen.contains(&family) {
            continue;
        }
        let o = to_option(spec, &changes, &p);
        if out.iter().any(|e| adds_nothing(&o, e)) {
            continue;
        }
        families_seen.push(family);
        out.push(o);
    }
    out.truncate(MAX_OPTIONS);
    out
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
