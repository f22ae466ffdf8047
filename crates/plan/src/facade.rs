//! The entry point callers use: vLLM's prediction ([`crate::vllm`]) and, when it misses, the
//! verified options ([`crate::advice`]). It sits above both so that `advice` (which re-plans
//! through `vllm`) and `vllm` never import each other both ways.

use crate::advice::verified_options;
use crate::spec::{ModelKind, ModelSpec};
use crate::units::thousands;
use crate::vllm::{Plan, PlanError, PlanRequest, plan_unadvised};

/// Predicts vLLM's memory for `spec` under `req`. For a speech model whose `--max-num-seqs` was
/// not given, the plan is made again with `--max-num-seqs` lowered to the whole sequences of the
/// planned length the KV pool holds (vLLM's 256 default would admit jobs it can only preempt).
pub fn plan(spec: &ModelSpec, req: &PlanRequest) -> Result<Plan, PlanError> {
    let first = plan_advised(spec, req)?;
    let speech = spec.kind != ModelKind::Text;
    if !speech || req.max_num_seqs.is_some() || req.target_concurrency.is_some() {
        return Ok(first);
    }
    let whole = (first.max_concurrency.floor() as u64).max(1);
    if whole >= first.max_num_seqs {
        return Ok(first);
    }
    let mut bounded = req.clone();
    bounded.max_num_seqs = Some(whole);
    // Keep the sizing the user chose (not a right-sized pool for the derived bound).
    bounded.fill = true;
    let mut p = plan_advised(spec, &bounded)?;
    p.sizing_mode = first.sizing_mode.clone();
    p.warnings.push(format!(
        "--max-num-seqs {whole}: the whole {}-token sequences this KV pool holds (vLLM's default {} would admit jobs it can only preempt)",
        thousands(p.max_model_len),
        first.max_num_seqs
    ));
    Ok(p)
}

/// The prediction, and when it misses, the verified options.
fn plan_advised(spec: &ModelSpec, req: &PlanRequest) -> Result<Plan, PlanError> {
    let mut p = plan_unadvised(spec, req)?;
    if !p.fits {
        p.options = verified_options(spec, req);
    }
    Ok(p)
}
