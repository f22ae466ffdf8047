//! text-generation-inference warm-up failures wrapped in "Method Warmup encountered an error":
//! the launcher's limits (`max_batch_prefill_tokens`, `max_input_tokens`/`max_input_length`,
//! `max_total_tokens`, `max_batch_total_tokens`, from its `Args { … }` dump or command line) and
//! the fix in those three flags, scaled with `headroom-plan`'s linear-warm-up arithmetic when the
//! log carries the failed allocation's size.

use headroom_plan::advice::sequences_that_fit;

use super::{count, size};
use crate::facts::{Facts, record};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::{int_after, leading_number};
use crate::text::{find, has, strip_prefix};

/// Prefill tokens TGI uses when the launcher was given none (its documented default).
const TGI_DEFAULT_PREFILL_TOKENS: u64 = 4096;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let mut hit = false;
    if has(line, "Method Warmup encountered an error") || has(line, "Unable to warmup model") {
        record(&mut facts.tgi_warmup, (), line_no);
        facts.saw_engine(Engine::Tgi);
        hit = true;
    }
    let c = &mut facts.tgi_config;
    for (slot, keys) in [
        (
            &mut c.max_batch_prefill_tokens,
            &[
                "max_batch_prefill_tokens: ",
                "--max-batch-prefill-tokens ",
                "--max-batch-prefill-tokens=",
                "Default `max_batch_prefill_tokens` to ",
            ][..],
        ),
        (
            &mut c.max_input_tokens,
            &[
                "max_input_tokens: ",
                "max_input_length: ",
                "--max-input-tokens ",
                "--max-input-length ",
            ][..],
        ),
        (
            &mut c.max_total_tokens,
            &["max_total_tokens: ", "--max-total-tokens "][..],
        ),
        (
            &mut c.max_batch_total_tokens,
            &[
                "max_batch_total_tokens: ",
                "--max-batch-total-tokens ",
                "Setting max batch total tokens to ",
            ][..],
        ),
    ] {
        if slot.is_none() {
            *slot = keys.iter().find_map(|k| launcher_value(line, k));
            hit |= slot.is_some();
        }
    }
    hit
}

/// Keeps the first exception line that is not an out-of-memory (what a warm-up failure wrapped,
/// when it was not memory).
pub fn note_exception(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    if facts.tgi_warmup_error.is_some() {
        return false;
    }
    match exception_line(line) {
        Some(e) => {
            record(&mut facts.tgi_warmup_error, e, line_no);
            true
        }
        None => false,
    }
}

/// `RuntimeError: …`, `torch.AcceleratorError: …`: an exception's name and message (not an
/// out-of-memory), cut to 160 characters.
fn exception_line(line: &str) -> Option<String> {
    let body = &line[crate::normalise::prefix(line).body..];
    let (head, msg) = body.split_once(": ")?;
    let name = head.rsplit('.').next()?;
    let is_exception =
        !head.contains(' ') && ["Error", "Exception"].iter().any(|s| name.ends_with(s));
    let memory =
        has(body, "out of memory") || has(name, "OutOfMemory") || has(body, "Not enough memory");
    (is_exception && !memory && !msg.trim().is_empty()).then(|| body.chars().take(160).collect())
}

/// `key: 4096`, `key: Some(4096)` or `--flag 4096`.
fn launcher_value(line: &str, key: &str) -> Option<u64> {
    let at = find(line, key)? + key.len();
    let rest = line[at..].trim_start_matches(['`', ' ']);
    let rest = strip_prefix(rest, "Some(").unwrap_or(rest);
    leading_number(rest)
        .filter(|(v, _)| *v >= 1.0 && v.fract() == 0.0 && *v < 1e12)
        .map(|(v, _)| v as u64)
        .or_else(|| int_after(line, key))
}

/// True when the log shows that memory ran out somewhere (any rule's out-of-memory report).
fn memory_ran_out(facts: &Facts) -> bool {
    facts.torch_oom.is_some()
        || facts.tgi_prefill.is_some()
        || facts.tgi_alloc_exceed.is_some()
        || facts.cuda_error_oom.is_some()
        || facts.device_oom.is_some()
        || facts.unknown_oom.is_some()
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.tgi_warmup else {
        return;
    };
    if facts.tgi_total_tokens.is_some() {
        // The total-token pool is what ran out; its own finding says so.
        return;
    }
    if !memory_ran_out(facts) {
        // The warm-up wraps every exception; without an out-of-memory in the log it is another
        // failure (a kernel, a shape, a missing feature), which no prefill setting fixes.
        let what = facts
            .tgi_warmup_error
            .as_ref()
            .map(|e| format!(": \"{}\"", e.value))
            .unwrap_or_default();
        let at = facts
            .tgi_config
            .max_batch_prefill_tokens
            .map(|p| format!(" at {} prefill tokens", count(p)))
            .unwrap_or_default();
        let mut lines = seen.lines.clone();
        if let Some(e) = &facts.tgi_warmup_error {
            lines.extend(e.lines.iter().copied());
        }
        out.push(
            Finding::new(Cause::NotOutOfMemory, 0.9)
                .count("max_batch_prefill_tokens", facts.tgi_config.max_batch_prefill_tokens)
                .fix(format!(
                    "TGI's warm-up failed{at} with an error that is not an out-of-memory{what}: the log has no out-of-memory report, \
                     so lowering `--max-batch-prefill-tokens` will not help; it is an engine or model problem (upgrade TGI, check the \
                     model's support and the kernels for this GPU)"
                ))
                .lines(lines),
        );
        return;
    }
    let c = &facts.tgi_config;
    let reported = facts.tgi_prefill.as_ref().map(|s| s.value);
    let prefill = reported.or(c.max_batch_prefill_tokens);
    let base = prefill.unwrap_or(TGI_DEFAULT_PREFILL_TOKENS);
    let torch = facts.torch_oom.as_ref().map(|t| &t.value);
    let alloc = facts.tgi_alloc_exceed.as_ref().map(|a| &a.value);
    // The failed allocation and the room it met: PyTorch's report, or TGI's allocator report
    // (room under the device limit).
    let (request, room) = match (torch, alloc) {
        (Some(t), _) => (Some(t.request), t.free),
        (None, Some(a)) => (
            a.requested,
            match (a.limit, a.allocated) {
                (Some(l), Some(used)) => Some((l - used).max(0.0)),
                _ => a.free,
            },
        ),
        (None, None) => (None, None),
    };
    if torch.is_none()
        && let (Some(r), Some(f)) = (request, room)
        && f >= r
    {
        // Room under the limit covered the request: not a prefill shortage; the allocator
        // rule's fragmentation reading stands.
        return;
    }
    let scaled = match (request, room) {
        (Some(r), Some(f)) => sequences_that_fit(base, r, f.max(0.0)),
        _ => None,
    };
    let new_prefill = scaled.unwrap_or((base / 2).max(1));
    let mut lines: Vec<u64> = seen.lines.clone();
    if let Some(s) = &facts.tgi_prefill {
        lines.extend(s.lines.iter().copied());
    }
    if let Some(t) = &facts.torch_oom {
        lines.extend(t.lines.iter().copied());
    }
    if let Some(a) = &facts.tgi_alloc_exceed {
        lines.extend(a.lines.iter().copied());
    }
    let why = match (scaled, request, room) {
        (Some(_), Some(r), Some(f)) => format!(
            "the warm-up prefill of {} tokens asked for {} with {} of room; its peak grows with the prefill tokens, so {} fit",
            count(base),
            size(r),
            size(f),
            count(new_prefill)
        ),
        _ => format!(
            "the warm-up runs one prefill of {} tokens{} and it did not fit; the log has no allocation sizes, so the count is halved",
            count(base),
            if prefill.is_none() {
                " (TGI's default)"
            } else {
                ""
            }
        ),
    };
    let input_cap = new_prefill;
    let mut fix = format!(
        "TGI's warm-up failed (\"Method Warmup encountered an error\"): {why}: `--max-batch-prefill-tokens {new_prefill}`"
    );
    match c.max_input_tokens {
        Some(i) if i > input_cap => fix.push_str(&format!(
            ", `--max-input-tokens {input_cap}` (it was {}; TGI requires max_input_tokens ≤ max_batch_prefill_tokens)",
            count(i)
        )),
        _ => fix.push_str(&format!(
            ", with `--max-input-tokens` at most {input_cap} (TGI requires max_input_tokens ≤ max_batch_prefill_tokens)"
        )),
    }
    match c.max_total_tokens {
        Some(t) if t <= input_cap.min(c.max_input_tokens.unwrap_or(u64::MAX)) => {}
        Some(t) => fix.push_str(&format!(
            " and `--max-total-tokens` above the input cap (now {}), which bounds one request's KV",
            count(t)
        )),
        None => fix.push_str(" and `--max-total-tokens` above it, which bounds one request's KV"),
    }
    fix.push_str(
        "; leave `--max-batch-total-tokens` unset so the warm-up sizes the KV pool from what is left, or lower it if set",
    );
    out.push(
        Finding::new(Cause::ActivationPeak, 0.97)
            .count("prefill_tokens", Some(base))
            .count("max_batch_prefill_tokens_that_fits", Some(new_prefill))
            .count("max_input_tokens", c.max_input_tokens)
            .count("max_total_tokens", c.max_total_tokens)
            .count("max_batch_total_tokens", c.max_batch_total_tokens)
            .num("tried_to_allocate_gib", request)
            .num("room_gib", room)
            .num(
                "free_gib",
                torch.and_then(|t| t.free).or(alloc.and_then(|a| a.free)),
            )
            .num("allocated_gib", alloc.and_then(|a| a.allocated))
            .num("device_limit_gib", alloc.and_then(|a| a.limit))
            .fix(fix)
            .lines(lines),
    );
}
