//! PyTorch's CUDA out-of-memory message in both wordings — current ("Tried to allocate X. GPU N
//! has a total capacity of T of which F is free. … this process has P … Process N has X … Of the
//! allocated memory A is allocated by PyTorch, … R is reserved by PyTorch but unallocated") and
//! pre-2.1 ("Tried to allocate X (GPU N; T total capacity; A already allocated; F free; R reserved
//! in total by PyTorch)") — and the attribution of the failed allocation to a cause.

use headroom_plan::advice::{FragmentationVerdict, fragmentation_verdict, utilization_drop_for};

use super::context::worker_rank;
use super::{gib, size};
use crate::facts::{Facts, Phase, TorchOom, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{leading_number, leading_size, size_after};
use crate::text::{ends, find, has, rfind, strip_prefix};

/// Memory a CUDA context and driver take in every process, not counted as "other processes".
const CONTEXT_ALLOWANCE_GIB: f64 = 0.5;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    if !has(line, "Tried to allocate") {
        return false;
    }
    // A crash loop repeats the same report: once enough evidence is kept, only count it.
    if let Some(seen) = facts.torch_oom.as_mut()
        && seen.lines.len() >= crate::facts::MAX_EVIDENCE
        && (has(line, "total capac") || has(line, "total capacty"))
    {
        seen.again(line_no);
        return true;
    }
    let Some(request) = size_after(line, "Tried to allocate") else {
        return false;
    };
    let mut oom = TorchOom {
        request,
        ..Default::default()
    };
    if has(line, "total capacity of") || has(line, "total capacty of") {
        current_wording(&mut oom, line);
    } else if has(line, "total capacity;") {
        old_wording(&mut oom, line);
    } else {
        return false;
    }
    oom.phase = facts.phase_at(line_no, phase_here);
    oom.worker_rank = worker_rank(line);
    facts.saw_engine(Engine::PyTorch);
    facts.saw_oom(line_no);
    record(&mut facts.torch_oom, oom, line_no);
    true
}

fn current_wording(oom: &mut TorchOom, line: &str) {
    if let Some(at) = find(line, " has a total capac") {
        let head = &line[..at];
        if let Some(g) = rfind(head, "GPU ") {
            oom.device = leading_number(&head[g + 4..]).map(|v| v.0 as u64);
        }
    }
    oom.total =
        size_after(line, "total capacity of").or_else(|| size_after(line, "total capacty of"));
    oom.free = size_after(line, "of which");
    oom.this_process = size_after(line, "this process has");
    let mut rest = line;
    while let Some(at) = find(rest, "Process ") {
        rest = &rest[at + 8..];
        let Some((pid, used)) = leading_number(rest) else {
            continue;
        };
        if let Some(after) = strip_prefix(&rest[used..], " has ")
            && let Some((gib, _)) = leading_size(after)
        {
            oom.processes.push((pid as u64, gib));
        }
        if oom.processes.len() >= 32 {
            break;
        }
    }
    oom.allocated = size_after(line, "Of the allocated memory");
    if has(line, "allocated in private pools") {
        oom.private_pools = find(line, "allocated by PyTorch, with")
            .and_then(|at| leading_size(line[at + 26..].trim_start()).map(|v| v.0));
    }
    if let Some(at) = find(line, " is reserved by PyTorch but unallocated") {
        let head = &line[..at];
        if let Some(and) = rfind(head, "and ") {
            oom.reserved_unallocated = leading_size(&head[and + 4..]).map(|v| v.0);
        }
    }
}

fn old_wording(oom: &mut TorchOom, line: &str) {
    let Some(open) = find(line, "(GPU ") else {
        return;
    };
    let inner = &line[open + 5..];
    let inner = &inner[..inner.find(')').unwrap_or(inner.len())];
    let mut parts = inner.split(';');
    oom.device = parts
        .next()
        .and_then(|d| leading_number(d.trim()))
        .map(|v| v.0 as u64);
    for part in parts {
        let part = part.trim();
        let Some((v, _)) = leading_size(part) else {
            continue;
        };
        if ends(part, "total capacity") {
            oom.total = Some(v);
        } else if ends(part, "already allocated") {
            oom.allocated = Some(v);
        } else if ends(part, " free") {
            oom.free = Some(v);
        } else if ends(part, "reserved in total by PyTorch") {
            oom.reserved_total = Some(v);
        }
    }
    if let (Some(r), Some(a)) = (oom.reserved_total, oom.allocated) {
        oom.reserved_unallocated = Some((r - a).max(0.0));
    }
}

/// Memory of this process as PyTorch sees it, and memory held elsewhere on the device.
struct Accounting {
    this_process: Option<f64>,
    others_listed: f64,
    /// Device memory neither free nor explained by this process (other processes, other
    /// containers, display), after the CUDA-context allowance.
    held_elsewhere: Option<f64>,
    /// "Process N has X" entries that are this process seen through a PID namespace.
    self_pid: Option<u64>,
}

fn accounting(oom: &TorchOom) -> Accounting {
    let pytorch_pool = match (oom.allocated, oom.reserved_unallocated) {
        (Some(a), Some(u)) => Some(a + u),
        (Some(a), None) => Some(a),
        _ => oom.reserved_total,
    };
    let mut this_process = oom.this_process;
    let mut self_pid = None;
    let mut others: Vec<(u64, f64)> = oom.processes.clone();
    if this_process.is_none()
        && let Some(pool) = pytorch_pool
    {
        // Inside a container PyTorch cannot match its own PID; the entry at least as large as
        // its own pool and closest to it is this process.
        if let Some((i, _)) = others
            .iter()
            .enumerate()
            .filter(|(_, (_, g))| *g + 0.01 >= pool)
            .min_by(|a, b| a.1.1.total_cmp(&b.1.1))
        {
            let (pid, g) = others.remove(i);
            this_process = Some(g);
            self_pid = Some(pid);
        }
    }
    let others_listed: f64 = others.iter().map(|(_, g)| g).sum();
    let mine_known = this_process.or(pytorch_pool);
    let held_elsewhere = match (oom.total, oom.free, mine_known) {
        (Some(t), Some(f), Some(mine)) => {
            let allowance = if this_process.is_some() {
                0.0
            } else {
                CONTEXT_ALLOWANCE_GIB
            };
            Some((t - f - mine - allowance).max(others_listed).max(0.0))
        }
        _ => (others_listed > 0.0).then_some(others_listed),
    };
    Accounting {
        this_process,
        others_listed,
        held_elsewhere,
        self_pid,
    }
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    if let Some(seen) = &facts.torch_oom {
        torch_findings(facts, &seen.value, &seen.lines, seen.count, out);
    }
    if let Some(seen) = &facts.cuda_error_oom
        && seen.value != Some(Phase::GraphCapture)
    {
        sizeless_findings(
            facts,
            seen.value,
            &seen.lines,
            "CUDA error: out of memory",
            out,
        );
    }
}

/// A finding with the standard numbers of a PyTorch OOM.
fn base(cause: Cause, likelihood: f64, oom: &TorchOom, acc: &Accounting, lines: &[u64]) -> Finding {
    Finding::new(cause, likelihood)
        .num("tried_to_allocate_gib", Some(oom.request))
        .num("total_capacity_gib", oom.total)
        .num("free_gib", oom.free)
        .num("this_process_gib", acc.this_process)
        .num("allocated_by_pytorch_gib", oom.allocated)
        .num("reserved_unallocated_gib", oom.reserved_unallocated)
        .num("reserved_by_pytorch_gib", oom.reserved_total)
        .num("private_pools_gib", oom.private_pools)
        .num(
            "held_elsewhere_gib",
            acc.held_elsewhere.filter(|h| *h > 0.0),
        )
        .count("device_index", oom.device)
        .lines(lines.iter().copied())
}

fn torch_findings(
    facts: &Facts,
    oom: &TorchOom,
    lines: &[u64],
    repeats: u64,
    out: &mut Vec<Finding>,
) {
    let acc = accounting(oom);
    let knobs = facts.knobs();
    let total = oom.total.unwrap_or(0.0);
    let free = oom.free.unwrap_or(0.0);
    let shortfall = (oom.request - free).max(0.0);
    let drop = utilization_drop_for(shortfall.max(1.0 / 1024.0), total).filter(|_| total > 0.0);
    let budget_fix = budget_fix(facts, drop, shortfall);
    let need_line = format!(
        "the allocation of {} met {} free{}",
        size(oom.request),
        size(free),
        if total > 0.0 {
            format!(" on a {} GiB GPU", gib(total))
        } else {
            String::new()
        }
    );
    // Free memory at or above the request: the allocator could not use it (fragmentation at the
    // driver level, a per-process limit, or allocations racing), so a plain "lower the budget"
    // is not what the numbers say.
    let not_short = oom.free.is_some() && shortfall <= 0.0;
    let short_text = if not_short {
        "free memory was not below the request when the message was printed, so this is not a plain shortage".to_string()
    } else {
        format!("{} short", size(shortfall))
    };

    // Phase-driven causes.
    match oom.phase {
        Some(Phase::SamplerWarmup) => {
            // The vLLM rule names the sequence count; keep the numbers here too.
            out.push(
                base(Cause::TooManySequences, 0.9, oom, &acc, lines).fix(format!(
                    "{need_line} {}; lower `--max-num-seqs` (sampler warm-up memory grows with it)",
                    Phase::SamplerWarmup.describe()
                )),
            );
        }
        Some(Phase::GraphCapture) => {
            let multi_gpu = oom.device.is_some_and(|d| d > 0)
                || oom.worker_rank.is_some_and(|r| r > 0)
                || facts.max_worker_rank > 0
                || facts.tp.is_some_and(|t| t > 1);
            let (advice, new_util) = graph_capture_advice(facts, oom, shortfall, &budget_fix);
            out.push(
                base(Cause::CudaGraphCapture, 0.9, oom, &acc, lines)
                    .num("utilization_that_fits", new_util)
                    .fix(format!(
                        "{need_line} {}: {advice}{}{}",
                        Phase::GraphCapture.describe(),
                        super::vllm::kv_fits_note(facts),
                        if multi_gpu {
                            super::vllm::multi_gpu_capture_note(facts)
                        } else {
                            String::new()
                        }
                    )),
            );
        }
        Some(Phase::LoadWeights) => {
            let loaded = oom.allocated.or(acc.this_process);
            let lower_bound = loaded.map(|a| a + free.max(0.0));
            let options = match facts.engine {
                Some(Engine::Vllm) => {
                    "split it across GPUs (`--tensor-parallel-size`) or use a quantized checkpoint"
                        .to_owned()
                }
                Some(Engine::Tgi) => {
                    "shard it (`--num-shard`) or quantize (`--quantize`)".to_owned()
                }
                _ => "use a smaller or quantized model (fp16/int8), or another GPU".to_owned(),
            };
            let others = acc
                .held_elsewhere
                .filter(|h| *h >= 0.5)
                .map(|h| format!(", or free the {} held outside this process", size(h)))
                .unwrap_or_default();
            out.push(base(Cause::WeightsDoNotFit, 0.85, oom, &acc, lines).num("needs_more_than_gib", lower_bound).fix(format!(
                "{need_line} {}: {} the weights do not fit — the model needs more than {} of this GPU; {options}{others}",
                Phase::LoadWeights.describe(),
                loaded.map(|a| format!("{} GiB were already loaded and", gib(a))).unwrap_or_default(),
                lower_bound.map(|b| format!("{} GiB", gib(b))).unwrap_or_else(|| "what was free".into()),
            )));
        }
        Some(Phase::Profiling) | Some(Phase::Request) | Some(Phase::KvAllocation) => {
            let phase = oom.phase.map(Phase::describe).unwrap_or_default();
            out.push(base(Cause::ActivationPeak, 0.8, oom, &acc, lines).fix(format!(
                "{need_line} {phase}: the peak needs {} more; {budget_fix} to leave room for it, or lower {} (the peak grows with tokens per step){}",
                size(shortfall),
                knobs.batch,
                super::vllm::kv_fits_note(facts)
            )));
        }
        None => {}
    }

    if facts.platform == Some(crate::finding::Platform::Xpu)
        && oom.request >= XPU_SINGLE_ALLOCATION_GIB
        && oom.free.is_none_or(|f| f >= oom.request)
    {
        out.push(base(Cause::ActivationPeak, 0.92, oom, &acc, lines).fix(format!(
            "one allocation of {} GiB on an Intel GPU{}: Level Zero caps a single allocation (maxMemAllocSize, about {XPU_SINGLE_ALLOCATION_GIB} GiB on \
             many cards) below the card's memory; set `UR_L0_USE_RELAXED_ALLOCATION_LIMITS=1` in the environment, or make the step that asks \
             for it smaller ({})",
            gib(oom.request),
            oom.free
                .map(|f| format!(" with {} GiB free", gib(f)))
                .unwrap_or_default(),
            knobs.batch
        )));
    }

    if total > 0.0 && oom.request > total {
        out.push(base(Cause::ActivationPeak, 0.95, oom, &acc, lines).fix(format!(
            "one allocation of {} GiB is {:.1}× the whole {} GiB GPU: no memory setting fits it; shrink the step that makes it (input size, {}), \
             or use an attention kernel that does not materialise the full score matrix (flash-attention: `VLLM_ATTENTION_BACKEND=FLASH_ATTN` for vLLM, `attn_implementation=\"sdpa\"` in transformers' `from_pretrained`)",
            gib(oom.request),
            oom.request / total,
            gib(total),
            knobs.batch
        ) + if facts.platform == Some(crate::finding::Platform::Rocm) {
            "; on a ROCm APU (Strix Halo, gfx1151) the capacity PyTorch reports can be far below the VRAM/GTT the BIOS and kernel give the GPU: \
             compare it with `rocm-smi --showmeminfo vram` before shrinking the step"
        } else {
            ""
        }));
    }

    if let Some(held) = acc.held_elsewhere.filter(|h| *h >= 0.5) {
        let share = if total > 0.0 {
            (held / (0.25 * total)).min(1.0)
        } else {
            0.0
        };
        let relief = if not_short {
            format!(
                "{need_line} ({short_text}); freeing that memory gives the process room to work with"
            )
        } else if shortfall <= held {
            format!(
                "{need_line}: freeing {} of it (stopping that process) fits the request",
                size(shortfall)
            )
        } else {
            format!(
                "{need_line}: {} short, more than the {} held elsewhere: freeing all of it is not enough on its own",
                size(shortfall),
                size(held)
            )
        };
        let pids = if acc.others_listed > 0.0 {
            oom.processes
                .iter()
                .filter(|(pid, _)| Some(*pid) != acc.self_pid)
                .map(|(pid, g)| format!("PID {pid} {}", size(*g)))
                .collect::<Vec<_>>()
                .join(", ")
        } else {
            String::new()
        };
        let frees = if not_short { held } else { shortfall.min(held) };
        out.push(
            base(
                Cause::OtherProcessHoldsMemory,
                0.6 + 0.3 * share,
                oom,
                &acc,
                lines,
            )
            .num("frees_gib", Some(frees))
            .fix(format!(
                "{} of the {} GiB GPU is held outside this process's PyTorch memory{}; {relief}{}",
                size(held),
                gib(total),
                if pids.is_empty() {
                    String::new()
                } else {
                    format!(" ({pids})")
                },
                if facts.engine == Some(Engine::Vllm) {
                    format!(", or {budget_fix}")
                } else {
                    String::new()
                }
            )),
        );
    }

    let unalloc = oom.reserved_unallocated.unwrap_or(0.0);
    match fragmentation_verdict(oom.request, unalloc, free) {
        FragmentationVerdict::CachedExceedsRequest => {
            let ratio = unalloc / oom.request;
            // When other processes hold more than the cached-but-unallocated memory, they are the
            // larger explanation of a full card and rank first.
            let ceiling = match acc.held_elsewhere {
                Some(h) if h >= 0.5 && h > unalloc && !not_short => 0.6,
                _ => 1.0,
            };
            let likelihood = (0.7 + 0.2 * ((ratio - 1.0) / 4.0).clamp(0.0, 1.0)).min(ceiling);
            out.push(base(Cause::Fragmentation, likelihood, oom, &acc, lines).fix(format!(
                "the request needs {}; {} is reserved but unallocated: set `PYTORCH_ALLOC_CONF=expandable_segments:True` \
                 (`PYTORCH_CUDA_ALLOC_CONF` before PyTorch 2.6) so cached segments can grow instead of splitting{}",
                size(oom.request),
                size(unalloc),
                if free >= oom.request { format!("; {} was even free, so the failure is not a shortage of memory", size(free)) } else { String::new() }
            )));
        }
        FragmentationVerdict::CachedPlusFreeCoversRequest => {
            out.push(base(Cause::Fragmentation, 0.5, oom, &acc, lines).fix(format!(
                "the request needs {}; free {} plus {} reserved-but-unallocated would cover it in one piece: set `PYTORCH_ALLOC_CONF=expandable_segments:True`",
                size(oom.request),
                size(free),
                size(unalloc)
            )));
        }
        FragmentationVerdict::NotFragmentation => {}
    }

    let rank = oom.worker_rank.filter(|r| *r > 0);
    if (oom.device.is_some_and(|d| d > 0) || rank.is_some())
        && oom.phase != Some(Phase::GraphCapture)
        && !not_short
    {
        let who = match (rank, oom.device) {
            (Some(r), Some(d)) => format!("worker rank {r} on GPU {d}"),
            (Some(r), None) => format!("worker rank {r}"),
            (None, Some(d)) => format!("the worker on GPU {d}"),
            (None, None) => "one worker".into(),
        };
        out.push(base(Cause::MultiGpuWorkerLimit, 0.65, oom, &acc, lines).fix(format!(
            "{who} ran out: {need_line}, {short_text}; every rank must fit its share within its own GPU: {budget_fix} on all ranks, or raise {} so each holds less",
            knobs.parallel
        )));
    }

    // Nothing more specific: the step's own peak.
    if oom.phase.is_none() {
        let likelihood = if not_short { 0.3 } else { 0.4 };
        out.push(
            base(Cause::ActivationPeak, likelihood, oom, &acc, lines).fix(format!(
                "{need_line}, {short_text}{}; {}lower {} so the step's peak is smaller",
                if repeats > 1 {
                    format!(" (seen {repeats} times)")
                } else {
                    String::new()
                },
                if not_short {
                    String::new()
                } else {
                    format!("{budget_fix}, or ")
                },
                knobs.batch
            )),
        );
    }
}

/// The budget change that frees `shortfall` on this engine: a lower vLLM utilization, TGI memory
/// fraction or SGLang static fraction, from the value the log states; elsewhere the memory to free.
fn budget_fix(facts: &Facts, drop: Option<f64>, shortfall: f64) -> String {
    let lowered = |flag: &str, from: Option<f64>, d: f64| match from {
        Some(u) if u - d > 0.0 => format!(
            "`{flag} {:.2}` (from {u:.2})",
            headroom_plan::advice::floor_to(u - d, 2)
        ),
        _ => format!("lower `{flag}` by at least {d:.2}"),
    };
    let util = facts
        .startup
        .breakdown
        .utilization
        .or(facts.utilization_config);
    match (facts.engine, drop) {
        (Some(Engine::Vllm) | None, Some(d)) => lowered("--gpu-memory-utilization", util, d),
        (Some(Engine::Tgi), Some(d)) => lowered("--cuda-memory-fraction", None, d),
        (Some(Engine::Sglang), Some(d)) => {
            lowered("--mem-fraction-static", facts.sglang.mem_fraction_static, d)
        }
        (Some(Engine::Sglang), None) => {
            "a lower `--mem-fraction-static` (the card's total is not in this log to size it)"
                .into()
        }
        (Some(Engine::Vllm), None) => {
            "a lower `--gpu-memory-utilization` (the card's total is not in this log to size it)"
                .into()
        }
        _ => format!("free {} on the device", size(shortfall.max(0.0))),
    }
}

/// What a capture-time out-of-memory calls for. When the engine counted an estimate of the graphs
/// inside its budget (vLLM ≥ 0.21 profiles them), only the estimate's error is missing and the
/// budget drop that frees the shortfall fits. When graphs live outside the budget (older vLLM),
/// the failed allocation is only the one that tipped a full card: the pool is larger than what
/// the log shows, so `--enforce-eager` comes first and a utilization that leaves vLLM's own
/// stated 1–3 GiB for graphs second. Returns the text and the utilization it names.
fn graph_capture_advice(
    facts: &Facts,
    oom: &TorchOom,
    shortfall: f64,
    budget_fix: &str,
) -> (String, Option<f64>) {
    if facts.engine == Some(Engine::Sglang) {
        let bs = facts
            .sglang
            .cuda_graph_max_bs
            .map(|b| format!("`--cuda-graph-max-bs {}` (from {b})", (b / 2).max(1)))
            .unwrap_or_else(|| "a lower `--cuda-graph-max-bs` (fewer batch sizes captured)".into());
        return (
            format!(
                "SGLang captures graphs in the room `--mem-fraction-static` leaves outside its static pool; {budget_fix} gives them that room, or {bs}, or `--disable-cuda-graph`"
            ),
            None,
        );
    }
    let estimate = facts.startup.cuda_graph_estimate_gib.or_else(|| {
        let g = facts.graph_profiling?;
        let t = facts.startup.breakdown.total_gib.or(oom.total)?;
        Some((g.utilization - g.equivalent) * t)
    });
    let total = oom.total.or(facts.startup.breakdown.total_gib);
    let util = facts
        .startup
        .breakdown
        .utilization
        .or(facts.utilization_config)
        .or(facts.graph_profiling.map(|g| g.utilization));
    let profiled = facts.graph_profiled
        || facts.graph_profiling.is_some()
        || facts.startup.cuda_graph_estimate_gib.is_some();
    if profiled {
        let new_util = match (util, total) {
            (Some(u), Some(t)) if t > 0.0 => {
                headroom_plan::advice::utilization_drop_for(shortfall.max(1.0 / 1024.0), t)
                    .map(|d| headroom_plan::advice::floor_to(u - d, 2))
                    .filter(|n| *n > 0.0)
            }
            _ => None,
        };
        return (
            format!(
                "this vLLM counted an estimate{} for CUDA graphs inside its budget, and the real capture (after the KV pool was allocated) took {} more: {budget_fix} covers it, or capture fewer sizes (`--max-num-seqs`, `--cudagraph-capture-sizes`), or `--enforce-eager`",
                estimate
                    .map(|e| format!(" of {} GiB", gib(e)))
                    .unwrap_or_default(),
                size(shortfall)
            ),
            new_util,
        );
    }
    let full_card = oom.free.is_some_and(|f| f < 0.1) || shortfall < 0.25;
    if full_card
        && let (Some(u), Some(t)) = (util, total)
        && t > GRAPH_ROOM_GIB
    {
        let leave = headroom_plan::advice::floor_to((t - GRAPH_ROOM_GIB) / t, 2);
        let by_short = headroom_plan::advice::utilization_drop_for(shortfall.max(1.0 / 1024.0), t)
            .map(|d| headroom_plan::advice::floor_to(u - d, 2))
            .unwrap_or(u);
        let new_util = leave.min(by_short);
        if new_util < u {
            return (
                format!(
                    "the graph pool lives outside the utilization budget in this vLLM and the {} allocation that failed is only the one that tipped a full card: the pool is larger. `--enforce-eager` (no graphs) fixes it; to keep graphs, leave them room outside the budget — vLLM's own note puts graphs at 1–3 GiB per GPU: `--gpu-memory-utilization {new_util:.2}` (from {u:.2}, leaves {} GiB), or capture fewer sizes (`--max-num-seqs`)",
                    size(oom.request),
                    gib(t * (1.0 - new_util))
                ),
                Some(new_util),
            );
        }
    }
    (
        format!(
            "the graph pool lives outside the KV budget in this vLLM; `--enforce-eager` skips graphs, or {budget_fix}, or capture fewer sizes (`--max-num-seqs`)"
        ),
        None,
    )
}

/// The tool that shows a device's memory on each platform.
fn memory_report(platform: Option<crate::finding::Platform>) -> &'static str {
    use crate::finding::Platform;
    match platform {
        Some(Platform::Rocm) => "`rocm-smi --showmeminfo vram`",
        Some(Platform::Xpu) => "`xpu-smi stats`",
        Some(Platform::Mps) | Some(Platform::Metal) => {
            "Activity Monitor's memory pressure (the GPU shares the Mac's memory)"
        }
        Some(Platform::Vulkan) => "the driver's memory report (`vulkaninfo --summary`, `nvtop`)",
        _ => "`nvidia-smi`",
    }
}

/// Intel GPUs' usual cap on one allocation (Level Zero `maxMemAllocSize`), in GiB.
const XPU_SINGLE_ALLOCATION_GIB: f64 = 4.0;

/// Room vLLM's own log message says CUDA graphs take per GPU at most ("1~3 GiB").
const GRAPH_ROOM_GIB: f64 = 3.0;

/// An OOM with no sizes (driver-level "CUDA error: out of memory"): name the phase and say which
/// numbers are missing.
pub fn sizeless_findings(
    facts: &Facts,
    phase: Option<Phase>,
    lines: &[u64],
    what: &str,
    out: &mut Vec<Finding>,
) {
    let knobs = facts.knobs();
    let missing = format!(
        "the message carries no sizes: the request, the free memory and the card total are missing ({} at the time, or the PyTorch OOM line if the log has one)",
        memory_report(facts.platform)
    );
    let (cause, likelihood, advice) = match phase {
        Some(Phase::LoadWeights) => (
            Cause::WeightsDoNotFit,
            0.8,
            format!(
                "a smaller or quantized model, or more GPUs ({})",
                knobs.parallel
            ),
        ),
        Some(Phase::SamplerWarmup) => (
            Cause::TooManySequences,
            0.8,
            "lower `--max-num-seqs`".to_owned(),
        ),
        Some(Phase::GraphCapture) => (
            Cause::CudaGraphCapture,
            0.8,
            "`--enforce-eager` or a lower utilization".to_owned(),
        ),
        Some(Phase::Profiling) | Some(Phase::Request) | Some(Phase::KvAllocation) => {
            (Cause::ActivationPeak, 0.7, format!("lower {}", knobs.batch))
        }
        None => (
            Cause::ActivationPeak,
            0.4,
            format!("lower {} or {}", knobs.batch, knobs.budget),
        ),
    };
    let phase_text = phase.map(Phase::describe).unwrap_or("at an unknown point");
    out.push(
        Finding::new(cause, likelihood)
            .fix(format!("\"{what}\" {phase_text}; {missing}; {advice}"))
            .lines(lines.iter().copied()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> TorchOom {
        let mut f = Facts::default();
        assert!(scan(&mut f, 1, line, None));
        f.torch_oom.unwrap().value
    }

    #[test]
    fn current_wording_with_pools_and_processes() {
        let o = parse(
            "CUDA out of memory. Tried to allocate 3.82 GiB. GPU 0 has a total capacity of 79.14 GiB of which 3.02 GiB is free. Process 3620138 has 76.10 GiB memory in use. Of the allocated memory 75.34 GiB is allocated by PyTorch, with 58.00 MiB allocated in private pools (e.g., CUDA Graphs), and 75.30 MiB is reserved by PyTorch but unallocated.",
        );
        assert_eq!(o.request, 3.82);
        assert_eq!(o.device, Some(0));
        assert_eq!(o.total, Some(79.14));
        assert_eq!(o.free, Some(3.02));
        assert_eq!(o.processes, vec![(3_620_138, 76.10)]);
        assert_eq!(o.allocated, Some(75.34));
        assert_eq!(o.private_pools, Some(58.0 / 1024.0));
        assert_eq!(o.reserved_unallocated, Some(75.30 / 1024.0));
        let acc = accounting(&o);
        assert_eq!(acc.self_pid, Some(3_620_138));
        assert_eq!(acc.this_process, Some(76.10));
    }

    #[test]
    fn old_wording() {
        let o = parse(
            "torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 258.00 MiB (GPU 0; 23.54 GiB total capacity; 11.75 GiB already allocated; 572.50 MiB free; 12.40 GiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb",
        );
        assert_eq!(o.total, Some(23.54));
        assert_eq!(o.allocated, Some(11.75));
        assert_eq!(o.free, Some(572.5 / 1024.0));
        assert_eq!(o.reserved_total, Some(12.40));
        assert!((o.reserved_unallocated.unwrap() - 0.65).abs() < 1e-9);
    }

    #[test]
    fn zero_bytes_free_and_typo() {
        let o = parse(
            "CUDA out of memory. Tried to allocate 42.00 MiB. GPU 0 has a total capacty of 39.39 GiB of which 0 bytes is free.",
        );
        assert_eq!(o.total, Some(39.39));
        assert_eq!(o.free, Some(0.0));
    }

    #[test]
    fn not_an_oom_line() {
        let mut f = Facts::default();
        assert!(!scan(&mut f, 1, "Tried to allocate nothing", None));
        assert!(f.torch_oom.is_none());
    }
}
