//! vLLM start-ups of 2026 and what goes wrong between co-tenants:
//! - the profiling race check ("Error in memory profiling. Initial free memory X GiB, current
//!   free memory Y GiB"): free memory grew while this instance profiled, because another process
//!   released memory — or did not move at all on a platform whose reading stays flat;
//! - the other direction of the race: a co-tenant's allocation during profiling charged to this
//!   instance as "non-torch" memory, leaving its KV pool small or empty;
//! - CUDA-graph memory profiling ("… --gpu-memory-utilization=U is equivalent to
//!   --gpu-memory-utilization=E without CUDA graph memory profiling"), whose estimate is counted
//!   inside the budget and can be short of what the real capture takes;
//! - the ready-made `--kv-cache-memory=<bytes>` values the start-up prints, read as the log's
//!   own figures;
//! - multi-stage (omni / speech) stacks: stages that each size KV against their own process's
//!   memory ("Available KV cache memory: X GiB (process-scoped)") and stages (codec, vocoder)
//!   with no budget at all.

use super::{gib, size};
use crate::facts::{Facts, GraphProfiling, KvCacheMemoryAdvice, ProfilingRace, Stage, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{leading_number, number_after, size_after};
use crate::text::{find, has};

/// Non-torch memory one process's CUDA context, NCCL and kernels take at most in practice;
/// far more during profiling is another process's allocation charged to this one.
const NON_TORCH_PLAUSIBLE_GIB: f64 = 4.0;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let mut hit = false;
    if has(line, "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS")
        && let Some(seen) = facts.torch_oom.as_mut()
        && seen
            .lines
            .last()
            .is_some_and(|l| line_no.saturating_sub(*l) <= 2)
    {
        // vLLM's capture-time hint: this out-of-memory came from CUDA-graph capture while graph
        // memory profiling was on.
        seen.value.phase = Some(crate::facts::Phase::GraphCapture);
        facts.graph_profiled = true;
        facts.saw_engine(Engine::Vllm);
        hit = true;
    }
    if has(line, "Error in memory profiling") {
        let initial = gib_figure(line, "Initial free memory");
        let current = gib_figure(line, "current free memory");
        if let (Some(initial_free), Some(current_free)) = (initial, current) {
            record(
                &mut facts.profiling_race,
                ProfilingRace {
                    initial_free,
                    current_free,
                },
                line_no,
            );
            facts.saw_engine(Engine::Vllm);
            hit = true;
        }
    }
    if has(line, "CUDA graph memory profiling is enabled")
        && let (Some(u), Some(e)) = (
            number_after(line, "current --gpu-memory-utilization="),
            number_after(line, "equivalent to --gpu-memory-utilization="),
        )
    {
        facts.graph_profiling = Some(GraphProfiling {
            utilization: u,
            equivalent: e,
            line: line_no,
        });
        facts.saw_engine(Engine::Vllm);
        hit = true;
    }
    if has(line, "--kv-cache-memory=") {
        let mut values = Vec::new();
        let mut rest = line;
        while let Some(at) = find(rest, "--kv-cache-memory=") {
            rest = &rest[at + "--kv-cache-memory=".len()..];
            if let Some((v, _)) = leading_number(rest)
                && v > 0.0
                && v.fract() == 0.0
            {
                values.push(v as u64);
            }
        }
        if !values.is_empty() {
            facts.kv_cache_memory = Some(KvCacheMemoryAdvice {
                fits_requested: values.first().copied(),
                fills_card: values.get(1).copied(),
                line: line_no,
            });
            hit = true;
        }
    }
    if has(line, "Available KV cache memory")
        && (has(line, "(process-scoped)") || has(line, "(profiling fallback)"))
    {
        let id = facts.line_stage.unwrap_or(facts.stages.len() as u64);
        let stage = stage_mut(facts, id);
        stage.kv_gib = size_after(line, "Available KV cache memory:");
        stage.process_scoped = has(line, "(process-scoped)");
        hit = true;
    }
    if let Some(id) = facts.line_stage {
        if has(line, "Model loading took") {
            let w = size_after(line, "loading took");
            stage_mut(facts, id).weights_gib = w;
            hit = true;
        }
        if let Some(u) = number_after(line, "Desired GPU memory utilization is (") {
            stage_mut(facts, id).utilization = Some(u);
            hit = true;
        }
        if facts.stages.iter().all(|s| s.id != id) {
            stage_mut(facts, id);
        }
    }
    hit
}

fn stage_mut(facts: &mut Facts, id: u64) -> &mut Stage {
    if let Some(i) = facts.stages.iter().position(|s| s.id == id) {
        return &mut facts.stages[i];
    }
    facts.stages.push(Stage {
        id,
        ..Stage::default()
    });
    facts.stages.last_mut().expect("just pushed")
}

/// A free-memory figure in GiB; older releases printed raw bytes.
fn gib_figure(line: &str, marker: &str) -> Option<f64> {
    let at = find(line, marker)? + marker.len();
    let rest = line[at..].trim_start_matches([' ', ':']);
    if let Some((v, _)) = crate::parse::leading_size(rest) {
        return Some(v);
    }
    let (v, _) = leading_number(rest)?;
    Some(if v > 1e6 {
        v / crate::parse::GIB_BYTES
    } else {
        v
    })
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    race_finding(facts, out);
    charged_cotenant_finding(facts, out);
    stages_finding(facts, out);
}

fn race_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.profiling_race else {
        return;
    };
    let r = seen.value;
    let base = |cause, likelihood| {
        Finding::new(cause, likelihood)
            .num("initial_free_gib", Some(r.initial_free))
            .num("current_free_gib", Some(r.current_free))
            .lines(seen.lines.iter().copied())
    };
    let budget = budget_flag(facts);
    if r.current_free > r.initial_free {
        let released = r.current_free - r.initial_free;
        out.push(base(Cause::OtherProcessHoldsMemory, 0.97).num("released_gib", Some(released)).fix(format!(
            "a start-up race, not a shortage: free memory grew by {} GiB ({} → {} GiB) while this vLLM profiled, so another process on the \
             card released memory meanwhile; vLLM assumes co-tenants hold still and aborts. Start the instances one after the other \
             (`headroom up` does), or give this one a fixed budget with {budget} so its start-up does not depend on what the others do \
             at that moment (on a unified-memory device the OS page cache moves the same figure)",
            gib(released),
            gib(r.initial_free),
            gib(r.current_free),
        )));
    } else {
        out.push(base(Cause::NotOutOfMemory, 0.95).fix(format!(
            "not a shortage: free memory read the same before and after profiling ({} GiB); this vLLM's check wants it to drop and fails \
             when a platform's reading does not move (XPU, unified memory). Later vLLM accepts equal readings; upgrade, or pass {budget} \
             so the check is skipped",
            gib(r.initial_free)
        )));
    }
}

/// `--kv-cache-memory=<bytes>`: the log's own figure when it printed one.
fn budget_flag(facts: &Facts) -> String {
    match facts.kv_cache_memory.and_then(|k| k.fits_requested) {
        Some(b) => format!("`--kv-cache-memory={b}` (the figure this log printed)"),
        None => "`--kv-cache-memory=<bytes>` (a successful start prints the value to use)".into(),
    }
}

/// The race in the other direction: a co-tenant allocated during this instance's profiling and
/// the growth was charged to this one as non-torch memory.
fn charged_cotenant_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let b = &facts.startup.breakdown;
    let Some(non_torch) = b.non_torch_gib else {
        return;
    };
    let total = b.total_gib.unwrap_or(0.0);
    let limit = NON_TORCH_PLAUSIBLE_GIB.max(0.1 * total);
    let kv_failed = facts.no_cache_blocks.is_some()
        || facts.kv_need.is_some()
        || b.gpu_blocks == Some(0)
        || b.kv_cache_gib.is_some_and(|k| k <= 0.0);
    if non_torch <= limit {
        return;
    }
    out.push(
        Finding::new(
            Cause::OtherProcessHoldsMemory,
            if kv_failed { 0.95 } else { 0.7 },
        )
            .num("non_torch_gib", Some(non_torch))
            .num("total_gib", b.total_gib)
            .fix(format!(
                "{} GiB of \"non-torch\" memory during profiling is far above what one process's CUDA context, NCCL and kernels take \
                 (a few GiB): memory another process allocated while this vLLM profiled (a second instance starting or waking at the same \
                 time) was charged to this one, {}. Start instances one after the other (`headroom up` does), or give each a fixed budget with {}",
                gib(non_torch),
                if kv_failed {
                    "and left its KV cache nothing"
                } else {
                    "and its KV cache was sized that much smaller"
                },
                budget_flag(facts)
            ))
            .lines(facts.startup.evidence_lines.iter().copied()),
    );
}

/// A multi-stage stack that ran out: each stage sized against its own process (or against the
/// card), and stages without a KV pool are outside every budget.
fn stages_finding(facts: &Facts, out: &mut Vec<Finding>) {
    if facts.stages.len() < 2 {
        return;
    }
    let oom_line = facts.last_oom_line;
    let Some(oom_line) = oom_line else { return };
    let with_kv: Vec<&Stage> = facts.stages.iter().filter(|s| s.kv_gib.is_some()).collect();
    let unbudgeted: Vec<&Stage> = facts.stages.iter().filter(|s| s.kv_gib.is_none()).collect();
    let util_sum: f64 = facts.stages.iter().filter_map(|s| s.utilization).sum();
    let unbudgeted_weights: f64 = unbudgeted.iter().filter_map(|s| s.weights_gib).sum();
    let scoped = facts.stages.iter().any(|s| s.process_scoped);
    let total = facts.startup.breakdown.total_gib;
    let mut fix = format!(
        "this stack runs {} stages as separate processes on the card",
        facts.stages.len()
    );
    if scoped {
        fix.push_str(&format!(
            "; {} of them sized their KV cache against their own process's memory (\"process-scoped\"), each taking its \
             gpu_memory_utilization of the whole card as if the others were not there",
            with_kv.iter().filter(|s| s.process_scoped).count()
        ));
    }
    if util_sum > 0.0 {
        fix.push_str(&format!(
            "; their gpu_memory_utilization values add up to {util_sum:.2}"
        ));
    }
    if !unbudgeted.is_empty() {
        fix.push_str(&format!(
            "; stage(s) {} have no KV budget (codec / vocoder / encoder){}: their memory is counted by no gpu_memory_utilization",
            unbudgeted
                .iter()
                .map(|s| s.id.to_string())
                .collect::<Vec<_>>()
                .join(", "),
            if unbudgeted_weights > 0.0 {
                format!(", their weights alone {}", size(unbudgeted_weights))
            } else {
                String::new()
            }
        ));
    }
    let room = match total {
        Some(t) if t > 0.0 => {
            let left = headroom_plan::advice::floor_to(1.0 - unbudgeted_weights / t - 0.05, 2);
            format!(
                "; set the stages' gpu_memory_utilization so they add up to at most {left:.2} (1 − unbudgeted stages' weights / total − 0.05 \
                 for their activations)"
            )
        }
        _ => {
            "; set the stages' gpu_memory_utilization so they add up to less than 1 minus what the unbudgeted stages take".to_owned()
        }
    };
    fix.push_str(&room);
    fix.push_str(", or put stages on different GPUs");
    out.push(
        Finding::new(Cause::OtherProcessHoldsMemory, 0.9)
            .count("stages", Some(facts.stages.len() as u64))
            .num("utilization_sum", (util_sum > 0.0).then_some(util_sum))
            .num(
                "unbudgeted_weights_gib",
                (unbudgeted_weights > 0.0).then_some(unbudgeted_weights),
            )
            .fix(fix)
            .lines([oom_line]),
    );
}

#[cfg(test)]
mod tests {
    use crate::{Cause, diagnose_str};

    #[test]
    fn free_memory_that_grew_during_profiling_is_a_race() {
        let d = diagnose_str(
            "(EngineCore_DP0 pid=418) ERROR 09-14 10:00:00 [core.py:946] AssertionError: Error in memory profiling. Initial free memory 82.94 GiB, current free memory 90.17 GiB. This happens when other processes sharing the same container release GPU memory while vLLM is profiling during initialization.\n",
        );
        let f = &d.findings[0];
        assert_eq!(f.cause, Cause::OtherProcessHoldsMemory);
        assert!((f.numbers["released_gib"] - 7.23).abs() < 1e-9);
        assert!(f.fix.contains("one after the other"), "{}", f.fix);
    }

    #[test]
    fn free_memory_that_did_not_move_is_not_a_race() {
        let d = diagnose_str(
            "AssertionError: Error in memory profiling. Initial free memory 30.3 GiB, current free memory 30.3 GiB. This happens when other processes sharing the same container release GPU memory while vLLM is profiling during initialization.\n",
        );
        assert_eq!(d.findings[0].cause, Cause::NotOutOfMemory);
    }
}
