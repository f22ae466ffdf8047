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

    /// Short name of the change.
    fn name(self) -> String {
        match self {
            Change::BlockSize(_) => "block_size".into(),
            Change::Utilization(_) => "utilization".into(),
            Change::KvFp8 => "fp8_kv_cache".into(),
            Change::MaxNumSeqs(_) | Change::TargetConcurrency(_) => "fewer_sequences".into(),
            Change::MaxModelLen(_) => "shorter_context".into(),
            Change::Quantization(q) => format!("{}_weights", q.label().replace('-', "_")),
            Change::TensorParallel(t) => format!("tensor_parallel_{t}"),
        }
    }

    /// What the change costs besides memory and GPUs: 0 nothing (a utilization, vLLM's block
    /// size, more GPUs, counted apart), 1 fewer sequences or a shorter context than the engine's
    /// defaults, 2 an fp8 KV cache, 3 fp8 weights, 4 4-bit weights.
    fn quality_cost(self) -> u8 {
        match self {
            Change::BlockSize(_) | Change::Utilization(_) | Change::TensorParallel(_) => 0,
            Change::MaxNumSeqs(_) | Change::TargetConcurrency(_) | Change::MaxModelLen(_) => 1,
            Change::KvFp8 => 2,
            Change::Quantization(QuantScheme::None) => 0,
            Change::Quantization(QuantScheme::Fp8 | QuantScheme::Bnb8) => 3,
            Change::Quantization(_) => 4,
        }
    }

    fn describe(self, spec: &ModelSpec) -> String {
        match self {
            Change::BlockSize(b) => format!("use vLLM's block size {b}"),
            Change::Utilization(u) => format!("set the utilization to {u:.2}"),
            Change::KvFp8 => "store the KV cache in fp8 (half the bytes per token)".into(),
            Change::MaxNumSeqs(n) => format!("run at most {n} sequences at once"),
            Change::TargetConcurrency(n) => format!(
                "serve {n} full-length sequence{} at once",
                if n == 1 { "" } else { "s" }
            ),
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

/// The re-plan of `req` with `changes` applied (fitting or not).
fn replan(spec: &ModelSpec, req: &PlanRequest, changes: &[Change]) -> Option<Plan> {
    let mut v = req.clone();
    for c in changes {
        c.apply(&mut v);
    }
    plan_unadvised(spec, &v).ok()
}

/// The re-plan of `req` with `changes` applied, when it fits.
fn fitting_replan(spec: &ModelSpec, req: &PlanRequest, changes: &[Change]) -> Option<Plan> {
    replan(spec, req, changes).filter(|p| p.fits)
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
    if tp > 1 && prequantized_bnb(spec) {
        out.push(Change::TensorParallel(1));
    } else if !heads.is_multiple_of(tp) {
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
            || !matches!(q, QuantScheme::Fp8 | QuantScheme::Bnb4))
    {
        out.push(Change::Quantization(spec.quantization.scheme));
    }
    out
}

/// A checkpoint saved in bitsandbytes, which vLLM does not split over tensor-parallel ranks.
fn prequantized_bnb(spec: &ModelSpec) -> bool {
    matches!(
        spec.quantization.scheme,
        QuantScheme::Bnb4 | QuantScheme::Bnb8
    )
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

/// The structural changes worth combining: an fp8 KV cache, weights quantized at load time
/// (a 16-bit checkpoint only), and more GPUs (tensor-parallel sizes that divide the heads).
fn structural_choices(spec: &ModelSpec, req: &PlanRequest) -> [Vec<Option<Change>>; 3] {
    let mut kv = vec![None];
    if req.kv_cache_dtype != KvCacheDtype::Fp8 {
        kv.push(Some(Change::KvFp8));
    }
    let mut weights = vec![None];
    let scheme = req.quantization.unwrap_or(spec.quantization.scheme);
    let sixteen_bit = matches!(
        req.dtype.unwrap_or(spec.dtype),
        Dtype::Bf16 | Dtype::F16 | Dtype::F32
    );
    if scheme == QuantScheme::None && spec.quantization.scheme == QuantScheme::None && sixteen_bit {
        weights.push(Some(Change::Quantization(QuantScheme::Fp8)));
        weights.push(Some(Change::Quantization(QuantScheme::Bnb4)));
    }
    let heads = spec.num_attention_heads.max(1);
    let tp = req.tensor_parallel_size.max(1);
    let mut gpus = vec![None];
    if prequantized_bnb(spec) {
        return [kv, weights, gpus];
    }
    gpus.extend(
        [2u64, 4, 8]
            .into_iter()
            .filter(|t| *t > tp && heads.is_multiple_of(*t))
            .map(|t| Some(Change::TensorParallel(t))),
    );
    [kv, weights, gpus]
}

/// What the request asks to keep: the length (the one `--audio-minutes` need, else a
/// `--max-model-len` given), the minutes, and the sequences (`--target-concurrency`, else a
/// `--max-num-seqs` given).
#[derive(Debug, Clone, Copy, Default)]
struct Asked {
    len: Option<u64>,
    minutes: Option<f64>,
    seqs: Option<u64>,
}

impl Asked {
    fn of(req: &PlanRequest, current: &Plan) -> Asked {
        let needed = current.audio.as_ref().and_then(|a| a.max_model_len_needed);
        Asked {
            len: needed.or(req.max_model_len),
            minutes: req.audio_minutes,
            seqs: req.concurrency_bound(),
        }
    }

    /// What `p` gives up, in words, and the smallest share of an ask it keeps (1 when all).
    fn given_up(&self, p: &Plan) -> (Vec<String>, f64) {
        let mut words = Vec::new();
        let mut kept: f64 = 1.0;
        if let Some(len) = self.len
            && p.max_model_len < len
        {
            kept = kept.min(p.max_model_len as f64 / len as f64);
            match (self.minutes, &p.audio) {
                (Some(m), Some(a)) => words.push(format!(
                    "holds {:.1} min of audio per sequence, not {}",
                    a.minutes_per_sequence,
                    crate::vllm::trim_float(m)
                )),
                _ => words.push(format!(
                    "a context of {} tokens, not the {} asked",
                    thousands(p.max_model_len),
                    thousands(len)
                )),
            }
        }
        if let Some(n) = self.seqs {
            let whole = (p.max_concurrency.floor() as u64).min(p.max_num_seqs);
            if whole < n {
                kept = kept.min(whole as f64 / n as f64);
                words.push(format!(
                    "{whole} sequence{} of {} tokens at once, not {n}",
                    if whole == 1 { "" } else { "s" },
                    thousands(p.max_model_len)
                ));
            }
        }
        (words, kept)
    }

    /// Sequences a plan must hold for the asks (at least one).
    fn sequences(&self) -> u64 {
        self.seqs.unwrap_or(1).max(1)
    }
}

/// One option found, with what orders it: whether it keeps the asks, the GPUs it needs, its
/// quality cost, and the memory it needs for what was asked (weights, workspaces, graphs,
/// context and the KV of the asked sequences, over all its GPUs).
struct Candidate {
    option: FitOption,
    cost: u8,
    essential_bytes: u64,
    kept: f64,
    changes: usize,
}

fn candidate(spec: &ModelSpec, asked: &Asked, changes: &[Change], p: &Plan) -> Candidate {
    let names: Vec<String> = changes.iter().map(|c| c.name()).collect();
    let descriptions: Vec<String> = changes.iter().map(|c| c.describe(spec)).collect();
    let (gives_up, kept) = asked.given_up(p);
    let mut description = descriptions.join(", ");
    if !gives_up.is_empty() {
        description = format!("{description} (gives up: {})", gives_up.join("; "));
    }
    let gpus = p.tensor_parallel_size.max(1) * p.pipeline_parallel_size.max(1);
    let kv = p.kv_bytes_per_token * p.max_model_len * asked.sequences();
    let per_gpu = p.weights_bytes
        + p.weights_upcast_bytes
        + p.activation_peak_bytes
        + p.non_torch_bytes
        + p.cuda_graph_bytes
        + p.cuda_context_bytes
        + kv;
    Candidate {
        option: FitOption {
            option: names.join("+"),
            description,
            vllm_args: changes.iter().flat_map(|c| c.vllm_flag()).collect(),
            headroom_args: changes.iter().flat_map(|c| c.headroom_flag()).collect(),
            memory_needed_bytes: p.device_peak_bytes + p.safety_margin_bytes,
            fits: true,
            keeps_asked: gives_up.is_empty(),
            gives_up,
            gpus,
            gpu_memory_utilization: p.gpu_memory_utilization,
            max_model_len: p.max_model_len,
            concurrency: p.max_concurrency.floor() as u64,
        },
        cost: changes.iter().map(|c| c.quality_cost()).sum(),
        essential_bytes: per_gpu * gpus,
        kept,
        changes: changes.len(),
    }
}

/// True when `e` (ordered before `o`) makes `o` pointless: it keeps at least as much of what was
/// asked on no more GPUs, at no higher quality cost and no more memory, and (on the same GPUs at
/// the same cost) holds at least as long a context and as many sequences.
fn dominates(e: &Candidate, o: &Candidate) -> bool {
    let (eo, oo) = (&e.option, &o.option);
    let same_kind = eo.gpus == oo.gpus && e.cost == o.cost;
    e.kept >= o.kept
        && eo.gpus <= oo.gpus
        && e.cost <= o.cost
        && e.essential_bytes <= o.essential_bytes
        && (!same_kind
            || (eo.max_model_len >= oo.max_model_len && eo.concurrency >= oo.concurrency))
}

/// Most options printed.
pub const MAX_OPTIONS: usize = 8;

/// Every change that makes `req` fit, planned again with the change applied and reported with
/// that plan's figures. The structural changes (fp8 KV, weights quantized at load time, more
/// GPUs) are tried alone and together; on each, the utilization (the one the plan would choose
/// without `--gpu-memory-utilization`, and the largest safe one), the sequence count and the
/// context are adjusted when it does not fit as is.
///
/// Order: options that keep everything asked (the minutes of audio, a `--max-model-len`, the
/// sequences) first, each giving-up option saying what it gives up; then fewer GPUs, a lower
/// quality cost, less memory for what was asked, less memory in all, fewer changes. An option
/// another one makes pointless (as much kept, no more GPUs, cost or memory) is left out.
pub fn verified_options(spec: &ModelSpec, req: &PlanRequest) -> Vec<FitOption> {
    let fixes = repairs(spec, req);
    let Ok(current) = plan_unadvised(spec, req) else {
        return Vec::new();
    };
    let asked = Asked::of(req, &current);
    let [kv, weights, gpus] = structural_choices(spec, req);
    let mut found: Vec<Candidate> = Vec::new();
    let record = |changes: Vec<Change>, p: Plan, found: &mut Vec<Candidate>| {
        let c = candidate(spec, &asked, &changes, &p);
        if !found
            .iter()
            .any(|f| f.option.headroom_args == c.option.headroom_args)
        {
            found.push(c);
        }
    };
    for k in &kv {
        for w in &weights {
            for g in &gpus {
                let mut base: Vec<Change> = fixes
                    .iter()
                    .copied()
                    .filter(|f| !(g.is_some() && matches!(f, Change::TensorParallel(_))))
                    .collect();
                base.extend([*k, *w, *g].into_iter().flatten());
                for changes in tunings(spec, req, &base, &current) {
                    if let Some(p) = fitting_replan(spec, req, &changes) {
                        record(changes, p, &mut found);
                    }
                }
            }
        }
    }
    found.sort_by(|a, b| {
        let key = |c: &Candidate| {
            (
                !c.option.keeps_asked,
                c.option.gpus,
                c.cost,
                c.essential_bytes,
                c.option.memory_needed_bytes,
                c.changes,
            )
        };
        key(a).cmp(&key(b))
    });
    let mut kept: Vec<Candidate> = Vec::new();
    for c in found {
        if !kept.iter().any(|e| dominates(e, &c)) {
            kept.push(c);
        }
    }
    kept.truncate(MAX_OPTIONS);
    kept.into_iter().map(|c| c.option).collect()
}

/// The change sets worth re-planning on one structural `base`: the base alone when it changes
/// anything; with a `--gpu-memory-utilization` given, the base with the utilization the plan
/// would choose without it and with the largest safe one; and on each of those that does not
/// fit, the most sequences and the longest context that do.
fn tunings(
    spec: &ModelSpec,
    req: &PlanRequest,
    base: &[Change],
    current: &Plan,
) -> Vec<Vec<Change>> {
    let mut starts: Vec<Vec<Change>> = vec![base.to_vec()];
    if req.gpu_memory_utilization.is_some() {
        for u in utilization_choices(spec, req, base) {
            let mut c = base.to_vec();
            c.push(u);
            starts.push(c);
        }
    }
    let mut out = Vec::new();
    for start in starts {
        if fitting_replan(spec, req, &start).is_some() {
            if !start.is_empty() {
                out.push(start);
            }
            continue;
        }
        for t in [
            best_sequences(spec, req, &start, current),
            best_context(spec, req, &start, current),
        ]
        .into_iter()
        .flatten()
        {
            let mut c = start.clone();
            c.push(t);
            out.push(c);
        }
    }
    out
}

/// Utilizations to put in place of a given one: the one the plan picks without it (right-sized
/// to the sequences asked, or vLLM's default, or the largest safe beside co-tenants) and the
/// largest safe one, when they differ from the one given.
fn utilization_choices(spec: &ModelSpec, req: &PlanRequest, base: &[Change]) -> Vec<Change> {
    let mut v = req.clone();
    for c in base {
        c.apply(&mut v);
    }
    v.gpu_memory_utilization = None;
    let Ok(natural) = plan_unadvised(spec, &v) else {
        return Vec::new();
    };
    let safe = natural
        .largest_safe_gpu_memory_utilization
        .min(MAX_PROPOSED_UTILIZATION);
    let mut out: Vec<f64> = Vec::new();
    for u in [natural.gpu_memory_utilization, safe] {
        let differs = req
            .gpu_memory_utilization
            .is_none_or(|g| (g - u).abs() > 0.005);
        if u > 0.0 && differs && !out.iter().any(|o| (o - u).abs() < 0.005) {
            out.push(u);
        }
    }
    out.into_iter().map(Change::Utilization).collect()
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

    use crate::facade::plan;
    use crate::units::GIB as GIB_BYTES;

    use crate::fixtures::vibevoice_asr;

    #[test]
    fn options_that_keep_the_minutes_come_first_and_the_others_say_what_they_give_up() {
        let mut req = PlanRequest::new(12 * GIB_BYTES);
        req.audio_minutes = Some(60.0);
        let p = plan(&vibevoice_asr(), &req).unwrap();
        assert!(!p.fits);
        let needed = p.audio.as_ref().unwrap().max_model_len_needed.unwrap();
        let o = &p.options;
        assert!(o.len() >= 3, "{o:#?}");
        let first_cut = o.iter().position(|x| !x.keeps_asked).unwrap_or(o.len());
        assert!(first_cut > 0, "{o:#?}");
        for x in &o[..first_cut] {
            assert!(x.max_model_len >= needed && x.gives_up.is_empty(), "{x:?}");
        }
        for x in &o[first_cut..] {
            assert!(x.max_model_len < needed, "{x:?}");
            assert!(
                x.gives_up[0].contains("min of audio per sequence, not 60"),
                "{x:?}"
            );
            assert!(x.description.contains("not 60"), "{x:?}");
        }
        // Fewest GPUs first among those that keep the minutes.
        let gpus: Vec<u64> = o[..first_cut].iter().map(|x| x.gpus).collect();
        assert!(gpus.windows(2).all(|w| w[0] <= w[1]), "{gpus:?}");
        // Each one, applied, fits and keeps the minutes.
        for x in &o[..first_cut] {
            let mut again = req.clone();
            let mut words = x.headroom_args.chunks(2);
            while let Some([flag, value]) = words.next() {
                match flag.as_str() {
                    "--quantization" => again.quantization = QuantScheme::parse(value),
                    "--tensor-parallel-size" => again.tensor_parallel_size = value.parse().unwrap(),
                    "--kv-cache-dtype" => again.kv_cache_dtype = KvCacheDtype::Fp8,
                    other => panic!("unexpected {other}"),
                }
            }
            let q = plan(&vibevoice_asr(), &again).unwrap();
            assert!(q.fits && q.gives_up.is_empty(), "{:?}", x.headroom_args);
        }
    }

    #[test]
    fn a_plan_shorter_than_the_minutes_asked_says_so() {
        let mut req = PlanRequest::new(80 * GIB_BYTES);
        req.audio_minutes = Some(60.0);
        req.max_model_len = Some(18_400);
        let p = plan(&vibevoice_asr(), &req).unwrap();
        assert!(p.fits);
        assert_eq!(p.gives_up.len(), 1);
        assert!(p.gives_up[0].starts_with("holds 26.1 min of audio per sequence, not 60"));
        req.max_model_len = Some(50_000);
        assert!(plan(&vibevoice_asr(), &req).unwrap().gives_up.is_empty());
    }

    #[test]
    fn a_given_utilization_too_low_is_fixed_with_the_least_memory_first() {
        let mut spec = ModelSpec::dense("qwen-awq", 3584, 18_944, 28, 28, 4, 152_064);
        spec.quantization = crate::spec::Quantization {
            scheme: QuantScheme::Awq,
            ..crate::spec::Quantization::NONE
        };
        let mut req = PlanRequest::new(24 * GIB_BYTES);
        req.max_model_len = Some(16_384);
        req.max_num_seqs = Some(4);
        req.reservations.push(crate::vllm::Reservation {
            name: "whisper".into(),
            bytes: 5 * GIB_BYTES,
            why: "test".into(),
        });
        let right_sized = plan(&spec, &req).unwrap();
        assert_eq!(right_sized.utilization_source, "right_sized");
        req.gpu_memory_utilization = Some(0.2);
        let p = plan(&spec, &req).unwrap();
        assert!(!p.fits);
        let first = &p.options[0];
        assert_eq!(first.option, "utilization");
        assert!(
            (first.gpu_memory_utilization - right_sized.gpu_memory_utilization).abs() < 0.011,
            "{first:?}"
        );
        // The largest safe utilization is offered too, after it.
        assert!(p.options.iter().skip(1).any(|o| o.option == "utilization"
            && (o.gpu_memory_utilization - p.largest_safe_gpu_memory_utilization).abs() < 0.011));
    }

    #[test]
    fn vllm_refuses_bnb_8bit_online_and_prequantized_bnb_over_tensor_parallel_ranks() {
        let spec = ModelSpec::dense("llama", 4096, 14_336, 32, 32, 8, 128_256);
        let mut req = PlanRequest::new(80 * GIB_BYTES);
        req.max_model_len = Some(8192);
        req.quantization = Some(QuantScheme::Bnb8);
        let p = plan(&spec, &req).unwrap();
        assert!(!p.fits);
        assert!(p.refused[0].contains("4-bit"), "{:?}", p.refused);
        let mut prequant = spec.clone();
        prequant.quantization = crate::spec::Quantization {
            scheme: QuantScheme::Bnb4,
            double_quant: true,
            ..crate::spec::Quantization::NONE
        };
        let mut req = PlanRequest::new(80 * GIB_BYTES);
        req.max_model_len = Some(8192);
        req.tensor_parallel_size = 2;
        let p = plan(&prequant, &req).unwrap();
        assert!(
            p.refused.iter().any(|r| r.contains("tensor-parallel")),
            "{:?}",
            p.refused
        );
        // Its options run it on one GPU.
        assert!(!p.options.is_empty());
        assert!(p.options.iter().all(|o| o.gpus == 1), "{:?}", p.options);
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
