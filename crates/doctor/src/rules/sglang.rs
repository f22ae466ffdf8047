//! SGLang: the static pool (weights + KV cache) is `--mem-fraction-static` of the memory that
//! was free when the server started, and the rest is left for activations and CUDA graphs. Its
//! start-up says "Load weight begin. avail mem=A GB", "Load weight end. … avail mem=B GB, mem
//! usage=W GB" and, when the weights leave the KV pool nothing, "Not enough memory. Please try to
//! increase --mem-fraction-static." The KV pool is `B − A × (1 − f)`, so the fraction that gives
//! it room is `1 − B/A` plus the pool wanted. Out-of-memory errors outside the pool (graph
//! capture, a prefill) go the other way: a lower fraction, `--cuda-graph-max-bs`,
//! `--chunked-prefill-size`.

use super::{count, gib};
use crate::facts::{Facts, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{int_after, number_after, size_after};
use crate::text::has;

/// Share of the memory free at start kept for a KV pool worth having when the log does not say
/// how large one token's KV is.
const KV_FLOOR_SHARE: f64 = 0.05;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let s = &mut facts.sglang;
    let mut hit = false;
    if has(line, "Load weight begin") {
        s.avail_before_load = size_after(line, "avail mem=").or(s.avail_before_load);
        hit = true;
    }
    if has(line, "Load weight end") {
        s.avail_after_load = size_after(line, "avail mem=").or(s.avail_after_load);
        s.weights = size_after(line, "mem usage=").or(s.weights);
        hit = true;
    }
    if has(line, "Capture cuda graph begin") {
        s.avail_at_capture = size_after(line, "avail mem=");
        hit = true;
    }
    if let Some(v) = number_after(line, "mem_fraction_static=")
        .or_else(|| number_after(line, "--mem-fraction-static "))
        .or_else(|| number_after(line, "--mem-fraction-static="))
        .filter(|v| *v > 0.0 && *v <= 1.0)
    {
        s.mem_fraction_static.get_or_insert(v);
        hit = true;
    }
    for (slot, keys) in [
        (
            &mut s.chunked_prefill_size,
            &["chunked_prefill_size=", "--chunked-prefill-size "][..],
        ),
        (
            &mut s.max_running_requests,
            &["max_running_requests=", "--max-running-requests "][..],
        ),
        (
            &mut s.cuda_graph_max_bs,
            &["cuda_graph_max_bs=", "--cuda-graph-max-bs "][..],
        ),
    ] {
        if slot.is_none() {
            *slot = keys
                .iter()
                .find_map(|k| int_after(line, k))
                .filter(|v| *v > 0);
            hit |= slot.is_some();
        }
    }
    if has(line, "KV Cache is allocated") {
        s.kv_tokens = int_after(line, "#tokens:");
        hit = true;
    }
    if has(line, "Not enough memory. Please try to increase") {
        record(&mut s.not_enough, (), line_no);
        facts.saw_oom(line_no);
        hit = true;
    }
    if hit {
        if facts.sglang.lines.len() < crate::facts::MAX_EVIDENCE {
            facts.sglang.lines.push(line_no);
        }
        facts.saw_engine(Engine::Sglang);
    }
    hit
}

/// The fraction of start-up free memory that leaves `kv` GiB of pool after the weights.
fn fraction_for_pool(before: f64, after: f64, kv: f64) -> Option<f64> {
    (before > 0.0).then(|| headroom_plan::advice::ceil_to(1.0 - (after - kv) / before, 2))
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let s = &facts.sglang;
    let Some(seen) = &s.not_enough else { return };
    let mut lines: Vec<u64> = seen.lines.clone();
    lines.extend(s.lines.iter().copied());
    let frac = s.mem_fraction_static;
    let base = |cause, likelihood| {
        Finding::new(cause, likelihood)
            .num("avail_before_load_gib", s.avail_before_load)
            .num("avail_after_load_gib", s.avail_after_load)
            .num("weights_gib", s.weights)
            .num("mem_fraction_static", frac)
            .lines(lines.iter().copied())
    };
    let (Some(before), Some(after)) = (s.avail_before_load, s.avail_after_load) else {
        out.push(base(Cause::KvCacheTooSmall, 0.9).fix(format!(
            "SGLang's KV pool got no room: the weights took what `--mem-fraction-static`{} leaves of the memory free at start. \
             The log lacks the \"Load weight begin/end … avail mem\" figures to compute the fraction; raise it in steps of 0.02 \
             (the rest of the card is for activations and CUDA graphs, so a higher fraction may need `--cuda-graph-max-bs` or \
             `--chunked-prefill-size` lower), or use a smaller or quantized model",
            frac.map(|f| format!(" ({f:.2})")).unwrap_or_default()
        )));
        return;
    };
    let kv_floor = KV_FLOOR_SHARE * before;
    let need = fraction_for_pool(before, after, kv_floor);
    let current_pool = frac.map(|f| after - before * (1.0 - f));
    let weights_beyond = frac.is_some_and(|f| s.weights.is_some_and(|w| w >= before * f));
    let mut fix = format!(
        "SGLang sizes its static pool (weights + KV) as `--mem-fraction-static` × the {} GiB free at start; after the weights {} GiB was free, \
         so the KV pool is {} GiB − {} GiB × (1 − fraction){}: ",
        gib(before),
        gib(after),
        gib(after),
        gib(before),
        current_pool
            .map(|p| format!(" = {} GiB", gib(p)))
            .unwrap_or_default()
    );
    match need {
        Some(n) if n < 0.99 => fix.push_str(&format!(
            "`--mem-fraction-static {n:.2}` leaves about {} GiB ({:.0}% of the start-up free memory) for the KV cache; \
             it takes room from activations and CUDA graphs, so lower `--cuda-graph-max-bs`{} or `--chunked-prefill-size`{} \
             if graph capture or a prefill then runs out",
            gib(kv_floor),
            KV_FLOOR_SHARE * 100.0,
            s.cuda_graph_max_bs
                .map(|b| format!(" (now {b})"))
                .unwrap_or_default(),
            s.chunked_prefill_size
                .map(|c| format!(" (now {})", count(c)))
                .unwrap_or_default(),
        )),
        _ => fix.push_str(
            "no fraction leaves a KV pool on this card: the weights take nearly all of it; more GPUs (`--tp-size`) or a quantized model",
        ),
    }
    let cause = if weights_beyond || need.is_none_or(|n| n >= 0.99) {
        Cause::WeightsDoNotFit
    } else {
        Cause::KvCacheTooSmall
    };
    out.push(
        base(cause, 0.95)
            .num("kv_pool_gib", current_pool)
            .num("mem_fraction_static_that_fits", need.filter(|n| *n < 0.99))
            .fix(fix),
    );
}

#[cfg(test)]
mod tests {
    use crate::{Cause, Engine, diagnose_str};

    #[test]
    fn the_fraction_that_leaves_a_pool_is_computed_from_free_memory() {
        // Figures in SGLang's own wording; 1 − (4.0 − 0.05 × 23.5) / 23.5 = 0.88
        let d = diagnose_str(
            "[2025-03-29 18:10:00 TP0] Load weight begin. avail mem=23.50 GB\n\
             [2025-03-29 18:18:30 TP0] Load weight end. type=Gemma3ForConditionalGeneration, dtype=torch.bfloat16, avail mem=4.00 GB, mem usage=19.50 GB.\n\
             [2025-03-29 18:18:34 TP0] Scheduler hit an exception: RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.\n",
        );
        assert_eq!(d.engine, Some(Engine::Sglang));
        let f = &d.findings[0];
        assert_eq!(f.cause, Cause::KvCacheTooSmall);
        assert_eq!(f.numbers["mem_fraction_static_that_fits"], 0.88);
        assert!(f.fix.contains("`--mem-fraction-static 0.88`"), "{}", f.fix);
    }
}
