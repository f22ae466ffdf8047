//! CTranslate2 (faster-whisper, whisper-ctranslate2): "CUDA failed with error out of memory". The
//! message has no sizes; the traceback says whether the model was being built (weights) or
//! generating (activation / beam state).

use super::torch::sizeless_findings;
use crate::facts::{Facts, Phase, record};
use crate::finding::{Cause, Engine, Finding};
use crate::text::has;

pub fn scan(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    if has(line, "CUDA failed with error out of memory") {
        let phase = facts.phase_at(line_no, phase_here);
        record(&mut facts.ct2_oom, phase, line_no);
        facts.saw_oom(line_no);
        facts.saw_engine(Engine::Ctranslate2);
        return true;
    }
    false
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.ct2_oom else { return };
    let lines: Vec<u64> = seen.lines.clone();
    match seen.value {
        Some(Phase::LoadWeights) => out.push(
            Finding::new(Cause::WeightsDoNotFit, 0.85)
                .fix("CTranslate2 ran out while building the model; the message has no sizes (free memory and model size are missing: `nvidia-smi`, and the model's \
                     size on disk ≈ its float16 weights): `compute_type=\"int8_float16\"` halves float16 weights, a smaller model shrinks them; if the GPU was \
                     empty, CTranslate2 ≥ 2.11's default allocator is a known cause: `CT2_CUDA_ALLOCATOR=cub_caching`".to_string())
                .lines(lines.clone()),
        ),
        Some(Phase::Request) => out.push(
            Finding::new(Cause::ActivationPeak, 0.85)
                .fix(
                    "CTranslate2 ran out while generating; the message has no sizes (free memory is missing: `nvidia-smi` during the run): decoder state grows with \
                     `beam_size` × `batch_size` — beam 5 → 1 cuts it about 5×, or a smaller batch",
                )
                .lines(lines.clone()),
        ),
        phase => {
            sizeless_findings(facts, phase, &lines, "CUDA failed with error out of memory", out);
            out.push(
                Finding::new(Cause::WeightsDoNotFit, 0.45)
                    .fix(
                        "if this happened while loading: the model does not fit what is free (sizes missing: `nvidia-smi`); `compute_type=\"int8_float16\"` or a smaller \
                         model; on an empty GPU with CTranslate2 ≥ 2.11 try `CT2_CUDA_ALLOCATOR=cub_caching`",
                    )
                    .lines(lines.clone()),
            );
        }
    }
}
