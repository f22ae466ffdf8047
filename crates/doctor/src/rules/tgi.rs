//! text-generation-inference warm-up failures: "Not enough memory to handle N prefill tokens", "Not
//! enough memory to handle N total tokens with M prefill tokens" (the KV pool, set by
//! `--max-batch-total-tokens`, not the prefill) and the allocator's "Allocation on device N would
//! exceed allowed memory" report (currently allocated / requested / device limit / free according
//! to CUDA). Request-time OOMs are PyTorch messages and go through the PyTorch rule with TGI's knob
//! names.

use headroom_plan::advice::fragmentation_verdict;

use super::{gib, size};
use crate::facts::{Facts, TgiAllocExceed, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{int_after, leading_size};
use crate::text::{find, has};

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    if has(line, "Not enough memory to handle")
        && let Some(n) = int_after(line, "Not enough memory to handle ")
    {
        if has(line, "total tokens") {
            let prefill = int_after(line, "total tokens with ");
            record(&mut facts.tgi_total_tokens, (n, prefill), line_no);
        } else {
            record(&mut facts.tgi_prefill, n, line_no);
        }
        facts.saw_oom(line_no);
        mark(facts);
        return true;
    }
    if has(line, "would exceed allowed memory") {
        let v = TgiAllocExceed {
            allocated: labelled(line, "Currently allocated"),
            requested: labelled(line, "Requested"),
            limit: labelled(line, "Device limit"),
            free: labelled(line, "Free (according to CUDA)"),
        };
        record(&mut facts.tgi_alloc_exceed, v, line_no);
        facts.saw_oom(line_no);
        if has(line, "warmup") {
            mark(facts);
        }
        return true;
    }
    false
}

fn mark(facts: &mut Facts) {
    facts.saw_engine(Engine::Tgi);
}

/// `Label     : 16.08 GiB` (the report comes as one line with literal `\n` separators).
fn labelled(line: &str, label: &str) -> Option<f64> {
    let at = find(line, label)? + label.len();
    let rest = line[at..].trim_start_matches([' ', ':']);
    leading_size(rest).map(|v| v.0)
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    total_tokens_finding(facts, out);
    if let Some(seen) = &facts.tgi_prefill {
        let n = seen.value;
        out.push(
            Finding::new(Cause::ActivationPeak, 0.95)
                .count("prefill_tokens", Some(n))
                .fix(format!(
                    "TGI's warm-up runs one prefill of {n} tokens after loading the weights and it did not fit; the log has no memory sizes, so the exact \
                     count cannot be computed: `--max-batch-prefill-tokens {}` halves the warm-up peak (it grows with prefill tokens), or free memory on the GPU",
                    (n / 2).max(1)
                ))
                .lines(seen.lines.iter().copied()),
        );
    }
    if let Some(seen) = &facts.tgi_alloc_exceed {
        let t = &seen.value;
        let room = match (t.limit, t.allocated) {
            (Some(l), Some(a)) => Some((l - a).max(0.0)),
            _ => None,
        };
        let requested = t.requested.unwrap_or(0.0);
        let cached = match (room, t.free) {
            (Some(r), Some(f)) => Some((r - f).max(0.0)),
            _ => None,
        };
        out.push(
            Finding::new(Cause::ActivationPeak, 0.9)
                .num("allocated_gib", t.allocated)
                .num("tried_to_allocate_gib", t.requested)
                .num("device_limit_gib", t.limit)
                .num("free_gib", t.free)
                .fix(format!(
                    "the warm-up step asked for {} on top of {} allocated under a {} GiB limit; lower `--max-batch-prefill-tokens` in proportion \
                     (the step's peak grows with it), or raise `--cuda-memory-fraction` if below 1.0",
                    size(requested),
                    t.allocated.map(|a| format!("{} GiB", gib(a))).unwrap_or_else(|| "an unknown amount".into()),
                    t.limit.map(gib).unwrap_or_else(|| "?".into())
                ))
                .lines(seen.lines.iter().copied()),
        );
        if let (Some(room), Some(cached)) = (room, cached)
            && room >= requested
            && requested > 0.0
        {
            let verdict = fragmentation_verdict(requested, cached, t.free.unwrap_or(0.0));
            if verdict != headroom_plan::advice::FragmentationVerdict::NotFragmentation {
                out.push(
                        Finding::new(Cause::Fragmentation, 0.7)
                            .num("tried_to_allocate_gib", Some(requested))
                            .num("room_under_limit_gib", Some(room))
                            .num("reserved_unallocated_gib", Some(cached))
                            .fix(format!(
                                "the limit leaves {} GiB above what is allocated, more than the {} requested, yet CUDA had only {} free: about {} GiB sits \
                                 reserved but unallocated; set `PYTORCH_ALLOC_CONF=expandable_segments:True` (PyTorch ≥ 2.1)",
                                gib(room),
                                size(requested),
                                size(t.free.unwrap_or(0.0)),
                                gib(cached)
                            ))
                            .lines(seen.lines.iter().copied()),
                    );
            }
        }
    }
}

/// "Not enough memory to handle N total tokens with M prefill tokens": the warm-up could not fit
/// a KV pool of N tokens (`--max-batch-total-tokens`) next to one prefill of M tokens. The pool
/// must shrink below N; the prefill is not raised.
fn total_tokens_finding(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.tgi_total_tokens else {
        return;
    };
    let (total, prefill) = seen.value;
    let c = &facts.tgi_config;
    let half = (total / 2).max(1);
    let mut fix = format!(
        "TGI's warm-up could not fit a KV pool of {} total tokens (`--max-batch-total-tokens`) beside one prefill of {} tokens: \
         `--max-batch-total-tokens {half}` (half; the log has no sizes to compute the exact count), or leave it unset so the warm-up \
         sizes the pool from what is left (TGI ≥ 1.0)",
        crate::rules::count(total),
        prefill
            .map(crate::rules::count)
            .unwrap_or_else(|| "?".into()),
    );
    if let Some(t) = c.max_total_tokens.filter(|t| *t > half) {
        fix.push_str(&format!(
            "; one request may hold `--max-total-tokens` {} tokens, more than that pool: `--max-total-tokens {half}` as well",
            crate::rules::count(t)
        ));
    }
    fix.push_str("; leave the prefill limit as it is: the prefill was not what ran out");
    out.push(
        Finding::new(Cause::KvCacheTooSmall, 0.97)
            .count("max_batch_total_tokens", Some(total))
            .count("prefill_tokens", prefill)
            .count("max_batch_total_tokens_that_fits", Some(half))
            .fix(fix)
            .lines(seen.lines.iter().copied()),
    );
}
