//! `headroom doctor --model`: every vLLM flag change a finding's fix names is planned again with
//! `headroom plan`'s arithmetic, on the settings the log shows (GPU total, memory other processes
//! held, utilization, max_model_len, TP), and the finding says whether that plan fits; when it
//! does not, it names the cheapest verified option instead.

use headroom_doctor::{Diagnosis, Finding};
use headroom_plan::advice::GIB;
use headroom_plan::{KvCacheDtype, ModelSpec, PlanRequest};

/// One check line per finding (`None` where the fix names no vLLM flag or the log lacks the
/// GPU's total memory).
pub fn checks(d: &Diagnosis, spec: &ModelSpec, model: &str) -> Vec<Option<String>> {
    d.findings
        .iter()
        .map(|f| check(d, f, spec, model))
        .collect()
}

fn check(d: &Diagnosis, f: &Finding, spec: &ModelSpec, model: &str) -> Option<String> {
    let flags = fix_flags(&f.fix);
    if flags.is_empty() {
        return None;
    }
    let base = log_request(d, f)?;
    let mut req = base.clone();
    for (flag, value) in &flags {
        apply(&mut req, flag, value)?;
    }
    let written: Vec<String> = flags.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let p = headroom_plan::plan(spec, &req).ok()?;
    Some(if p.fits {
        format!(
            "re-planned for {model} with the log's settings: `{}` fits ({:.2} GiB KV, {:.2}x at {} tokens)",
            written.join(" "),
            p.kv_cache_bytes as f64 / GIB,
            p.max_concurrency,
            p.max_model_len
        )
    } else {
        let why = p
            .refused
            .first()
            .cloned()
            .or_else(|| p.failure.as_ref().map(|f| f.message()))
            .unwrap_or_else(|| "the target does not fit".into());
        let instead = p
            .options
            .first()
            .map(|o| format!("; what fits instead: `{}`", o.vllm_args.join(" ")))
            .unwrap_or_default();
        format!(
            "re-planned for {model} with the log's settings: `{}` alone does not fit ({}){instead}",
            written.join(" "),
            first_sentence(&why)
        )
    })
}

fn first_sentence(s: &str) -> &str {
    s.split(". ").next().unwrap_or(s)
}

/// `--flag value` pairs written in backticks in a fix, for the flags `headroom plan` takes.
fn fix_flags(fix: &str) -> Vec<(String, String)> {
    const KNOWN: [&str; 6] = [
        "--gpu-memory-utilization",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--kv-cache-dtype",
        "--tensor-parallel-size",
    ];
    fix.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|quoted| {
            let mut words = quoted.split_whitespace();
            let (flag, value) = (words.next()?, words.next()?);
            (KNOWN.contains(&flag) && words.next().is_none())
                .then(|| (flag.to_string(), value.to_string()))
        })
        .collect()
}

fn apply(req: &mut PlanRequest, flag: &str, value: &str) -> Option<()> {
    match flag {
        "--gpu-memory-utilization" => req.gpu_memory_utilization = Some(value.parse().ok()?),
        "--max-model-len" => req.max_model_len = Some(value.parse().ok()?),
        "--max-num-seqs" => req.max_num_seqs = Some(value.parse().ok()?),
        "--max-num-batched-tokens" => req.max_num_batched_tokens = Some(value.parse().ok()?),
        "--kv-cache-dtype" => req.kv_cache_dtype = KvCacheDtype::parse(value)?,
        "--tensor-parallel-size" => req.tensor_parallel_size = value.parse().ok()?,
        _ => return None,
    }
    Some(())
}

/// The request the log describes: the GPU total (required), what other processes held, the
/// utilization and length in force, and the parallelism.
fn log_request(d: &Diagnosis, f: &Finding) -> Option<PlanRequest> {
    let n = |k: &str| f.numbers.get(k).copied();
    let b = d.startup.as_ref().map(|s| &s.breakdown);
    let total = b
        .and_then(|b| b.total_gib)
        .or_else(|| n("total_gib"))
        .or_else(|| n("total_capacity_gib"))?;
    let mut req = PlanRequest::new((total * GIB).round() as u64);
    req.other_used_bytes = n("held_by_others_gib")
        .or_else(|| n("held_elsewhere_gib"))
        .map_or(0, |g| (g * GIB).round() as u64);
    req.gpu_memory_utilization = b
        .and_then(|b| b.utilization)
        .or_else(|| n("requested_utilization"));
    req.max_model_len = b
        .and_then(|b| b.max_model_len)
        .or_else(|| n("max_model_len").map(|l| l as u64));
    if let Some(tp) = d.startup.as_ref().and_then(|s| s.tensor_parallel_size) {
        req.tensor_parallel_size = tp;
    }
    Some(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fix_flags_are_read_from_backticks_only() {
        let fix = "lower it: `--gpu-memory-utilization 0.89`, or `-ub 256`, or `--max-model-len 5632` and --max-num-seqs 8";
        assert_eq!(
            fix_flags(fix),
            vec![
                ("--gpu-memory-utilization".to_string(), "0.89".to_string()),
                ("--max-model-len".to_string(), "5632".to_string())
            ]
        );
    }
}
