//! ROCm / HIP wording: PyTorch's "HIP out of memory", HIP's driver-level "HIP error: out of
//! memory" / `hipErrorOutOfMemory`, and llama.cpp's ROCm buffers. Marks the log as ROCm so the
//! fixes name HIP's allocator variable and AMD's tools instead of CUDA's.

use crate::facts::Phase;
use crate::facts::{Facts, record};
use crate::finding::Finding;
use crate::text::has;

/// Substrings that say the log comes from a ROCm build.
const MARKERS: [&str; 8] = [
    "HIP out of memory",
    "HIP error",
    "hipErrorOutOfMemory",
    "hipMalloc",
    "ROCm0",
    "ROCm devices",
    "ROCm error",
    "PYTORCH_HIP_ALLOC_CONF",
];

pub fn scan(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    if !MARKERS.iter().any(|m| has(line, m)) {
        return false;
    }
    facts.rocm = true;
    if has(line, "HIP error: out of memory")
        || has(line, "hipErrorOutOfMemory")
        || has(line, "ROCm error: out of memory")
    {
        let phase = facts.phase_at(line_no, phase_here);
        facts.saw_oom(line_no);
        record(&mut facts.cuda_error_oom, phase, line_no);
    }
    true
}

/// Rewrites CUDA-only advice in the findings of a ROCm log.
pub fn adjust(facts: &Facts, findings: &mut [Finding]) {
    if !facts.rocm {
        return;
    }
    for f in findings {
        f.fix = f
            .fix
            .replace(
                "`PYTORCH_ALLOC_CONF=expandable_segments:True` (`PYTORCH_CUDA_ALLOC_CONF` before PyTorch 2.6)",
                "`PYTORCH_HIP_ALLOC_CONF=expandable_segments:True` (the variable ROCm builds of PyTorch read)",
            )
            .replace("`PYTORCH_ALLOC_CONF=", "`PYTORCH_HIP_ALLOC_CONF=")
            .replace(
                "`nvidia-smi --query-compute-apps=pid,used_memory --format=csv`",
                "`rocm-smi --showpids`",
            )
            .replace("`nvidia-smi`", "`rocm-smi --showpids`");
        if f.cause == crate::finding::Cause::OtherProcessHoldsMemory && !f.fix.contains("rocm-smi")
        {
            f.fix.push_str(
                "; on ROCm `rocm-smi --showpids` lists the holders, and on an APU (unified memory) the capacity is shared with host RAM, so host processes count too",
            );
        }
    }
}
