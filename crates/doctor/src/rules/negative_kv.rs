//! A vLLM start-up whose own memory breakdown leaves nothing for the KV cache: weights +
//! activation peak + non-torch memory at or above `total × utilization` (V0 prints "the rest of
//! the memory reserved for KV Cache is -1.05GiB" and "# cuda blocks: 0", often with no error line
//! the other rules know). The fix comes from `headroom-plan`'s arithmetic on the log's numbers:
//! the utilization that leaves the KV minimum, or the `--max-num-batched-tokens` (encoder-decoder
//! models: `--max-num-seqs`) that shrinks the activation peak enough.

use headroom_plan::advice::{self, utilization_for_kv};

use super::{count, gib};
use crate::facts::Facts;
use crate::finding::{Cause, Finding};
use crate::parse::int_after;
use crate::text::has;

/// Share of the card kept as the KV minimum when the log gives no KV bytes per token.
const KV_FLOOR_SHARE: f64 = 0.01;
/// vLLM V0's default `max_num_batched_tokens` floor without chunked prefill
/// (`max(max_model_len, 2048)`).
const V0_BATCHED_TOKENS_FLOOR: u64 = 2048;
/// vLLM V0's default `max_num_seqs`.
const V0_DEFAULT_MAX_NUM_SEQS: u64 = 256;

/// Reads `max_num_batched_tokens` / `max_num_seqs` / chunked prefill and the encoder-decoder
/// profile marker. Returns true when the line held one of them.
pub fn scan(facts: &mut Facts, line: &str) -> bool {
    let c = &mut facts.batch;
    let mut hit = false;
    for marker in [
        "max_num_batched_tokens=",
        "--max-num-batched-tokens ",
        "--max-num-batched-tokens=",
    ] {
        if let Some(v) = int_after(line, marker).filter(|v| *v > 0) {
            c.max_num_batched_tokens.get_or_insert(v);
            hit = true;
        }
    }
    for marker in ["max_num_seqs=", "--max-num-seqs ", "--max-num-seqs="] {
        if let Some(v) = int_after(line, marker).filter(|v| *v > 0) {
            c.max_num_seqs.get_or_insert(v);
            hit = true;
        }
    }
    if has(line, "enable_chunked_prefill=True") || has(line, "chunked_prefill_enabled=True") {
        c.chunked_prefill = Some(true);
        hit = true;
    } else if has(line, "enable_chunked_prefill=False")
        || has(line, "chunked_prefill_enabled=False")
    {
        c.chunked_prefill = Some(false);
        hit = true;
    }
    if has(line, "enc_dec_model_runner") || has(line, "profile run for multi-modal") {
        c.encoder_profile = true;
        hit = true;
    }
    hit
}

/// Non-KV memory and the KV budget it leaves, when every figure is in the log.
fn deficit(facts: &Facts) -> Option<(f64, f64, f64, f64)> {
    let b = &facts.startup.breakdown;
    let (w, a, n) = (b.weights_gib?, b.activation_peak_gib?, b.non_torch_gib?);
    let total = b.total_gib?;
    let budget = b.budget_gib?;
    let non_kv = w + a + n;
    Some((non_kv, budget - non_kv, budget, total))
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let Some((non_kv, kv, budget, total)) = deficit(facts) else {
        return;
    };
    let b = &facts.startup.breakdown;
    let blocks_zero = b.gpu_blocks == Some(0) || b.kv_tokens == Some(0);
    // The budget covers the non-KV memory with room to spare: not this rule's case.
    if kv > 0.005 && !blocks_zero {
        return;
    }
    let Some(util) = b.utilization else { return };
    if total.is_nan() || total <= 0.0 {
        return;
    }
    let a = b.activation_peak_gib.unwrap_or(0.0);
    let max_len = b.max_model_len.or(facts.max_model_len_config);
    let kv_min = match (facts.startup.kv_bytes_per_token, max_len) {
        (Some(bpt), Some(len)) if bpt > 0.0 => bpt * len as f64 / advice::GIB,
        _ => KV_FLOOR_SHARE * total,
    };
    let kv_min_from = if facts.startup.kv_bytes_per_token.is_some() && max_len.is_some() {
        "one max_model_len request"
    } else {
        "1% of the card, as the log gives no KV bytes per token"
    };
    let util_fit = utilization_for_kv(util, total, kv_min, kv);
    let shrink_by = (kv_min - kv).max(0.0);
    let c = &facts.batch;
    let (lever, current) = if c.encoder_profile {
        (
            "--max-num-seqs",
            c.max_num_seqs.unwrap_or(V0_DEFAULT_MAX_NUM_SEQS),
        )
    } else {
        (
            "--max-num-batched-tokens",
            c.max_num_batched_tokens.unwrap_or_else(|| {
                max_len.map_or(V0_BATCHED_TOKENS_FLOOR, |l| l.max(V0_BATCHED_TOKENS_FLOOR))
            }),
        )
    };
    // The activation peak grows linearly with the tokens (or encoder inputs) of the profile run.
    let lever_fit = (a > shrink_by && a > 0.0)
        .then(|| advice::sequences_that_fit(current, a, a - shrink_by))
        .flatten()
        .filter(|v| *v < current);
    let mut fix = format!(
        "weights {} + activation peak {} + non-torch {} = {} GiB of a {} GiB budget ({util:.2} × {} GiB) leaves {} GiB for the KV cache; \
         the KV minimum here is {} GiB ({kv_min_from}): ",
        gib(b.weights_gib.unwrap_or(0.0)),
        gib(a),
        gib(b.non_torch_gib.unwrap_or(0.0)),
        gib(non_kv),
        gib(budget),
        gib(total),
        gib(kv),
        gib(kv_min),
    );
    let mut options = Vec::new();
    match util_fit {
        Some(u) if u <= 1.0 => options.push(format!("`--gpu-memory-utilization {u:.2}`")),
        Some(_) => options.push("no utilization ≤ 1.0 leaves it on this card".to_owned()),
        None => {}
    }
    if let Some(v) = lever_fit {
        let what = if c.encoder_profile {
            "the profile run encodes one dummy input per sequence"
        } else {
            "the profile run's peak grows with the tokens of one step"
        };
        let mut text = format!(
            "or `{lever} {v}` (from {}; {what}, so {} GiB less peak needs {:.0}% of it)",
            count(current),
            gib(shrink_by),
            100.0 * v as f64 / current as f64
        );
        if !c.encoder_profile && c.chunked_prefill != Some(true) && max_len.is_some_and(|l| l > v) {
            text.push_str(&format!(
                " with `--enable-chunked-prefill`, since without it vLLM needs {lever} ≥ max_model_len {}",
                count(max_len.unwrap_or(0))
            ));
        }
        options.push(text);
    }
    if options.is_empty() {
        options.push(
            "lower the activation peak (`--max-num-batched-tokens`) or use a smaller model".into(),
        );
    }
    fix.push_str(&options.join(", "));
    out.push(
        Finding::new(Cause::KvCacheTooSmall, 0.93)
            .num("weights_gib", b.weights_gib)
            .num("activation_peak_gib", b.activation_peak_gib)
            .num("non_torch_gib", b.non_torch_gib)
            .num("non_kv_gib", Some(non_kv))
            .num("budget_gib", Some(budget))
            .num("kv_budget_gib", Some(kv))
            .num("kv_minimum_gib", Some(kv_min))
            .num("total_gib", Some(total))
            .num("requested_utilization", Some(util))
            .num("utilization_that_fits", util_fit)
            .count(
                if c.encoder_profile {
                    "max_num_seqs"
                } else {
                    "max_num_batched_tokens"
                },
                Some(current),
            )
            .count(
                if c.encoder_profile {
                    "max_num_seqs_that_fits"
                } else {
                    "max_num_batched_tokens_that_fits"
                },
                lever_fit,
            )
            .fix(fix)
            .lines(facts.startup.evidence_lines.iter().copied()),
    );
}
