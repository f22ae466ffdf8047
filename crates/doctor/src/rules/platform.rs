//! The accelerator a log comes from and the out-of-memory wordings of each platform's runtime
//! that carry no PyTorch-style report: PyTorch's MPS allocator ("MPS backend out of memory (MPS
//! allocated: A, other allocations: O, max allowed: M). Tried to allocate R"), Intel's Level
//! Zero / Unified Runtime codes, Vulkan's and Metal's device errors, CUDA's driver, cuBLAS and
//! cuDNN codes, XLA's RESOURCE_EXHAUSTED, and — last — any line that says "out of memory" in
//! words no rule knows, so a new wording is still read as an out-of-memory at an unknown point.

use super::{gib, size, torch::sizeless_findings};
use crate::facts::{DeviceOom, Facts, MpsOom, Phase, record};
use crate::finding::{Cause, Finding, Platform};
use crate::parse::{leading_number, size_after};
use crate::text::{find, has};

/// Substrings that name a platform, most specific first.
const PLATFORM_MARKERS: [(&str, Platform); 24] = [
    ("MPS backend", Platform::Mps),
    ("PYTORCH_MPS_", Platform::Mps),
    ("torch.mps", Platform::Mps),
    ("XPU out of memory", Platform::Xpu),
    ("torch.xpu", Platform::Xpu),
    ("UR_RESULT_ERROR", Platform::Xpu),
    ("ZE_RESULT_ERROR", Platform::Xpu),
    ("ggml_sycl", Platform::Xpu),
    ("Level Zero", Platform::Xpu),
    ("ggml_vulkan", Platform::Vulkan),
    ("Vulkan0", Platform::Vulkan),
    ("vk::", Platform::Vulkan),
    ("VK_ERROR", Platform::Vulkan),
    ("ggml_metal", Platform::Metal),
    ("kIOGPUCommandBuffer", Platform::Metal),
    ("HIP out of memory", Platform::Rocm),
    ("hipErrorOutOfMemory", Platform::Rocm),
    ("hipMalloc", Platform::Rocm),
    ("ROCm0", Platform::Rocm),
    ("ROCm_Host", Platform::Rocm),
    ("CUDA out of memory", Platform::Cuda),
    ("cudaMalloc", Platform::Cuda),
    ("CUDA error", Platform::Cuda),
    ("CUDA0", Platform::Cuda),
];

/// Out-of-memory codes that state no sizes, with the platform they belong to.
const SIZELESS: [(&str, Option<Platform>); 13] = [
    ("UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", Some(Platform::Xpu)),
    ("ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", Some(Platform::Xpu)),
    ("XPU out of memory", Some(Platform::Xpu)),
    ("NPU out of memory", None),
    ("ErrorOutOfDeviceMemory", Some(Platform::Vulkan)),
    ("VK_ERROR_OUT_OF_DEVICE_MEMORY", Some(Platform::Vulkan)),
    (
        "kIOGPUCommandBufferCallbackErrorOutOfMemory",
        Some(Platform::Metal),
    ),
    ("cudaErrorMemoryAllocation", Some(Platform::Cuda)),
    ("CUBLAS_STATUS_ALLOC_FAILED", Some(Platform::Cuda)),
    ("CUDNN_STATUS_ALLOC_FAILED", Some(Platform::Cuda)),
    ("CUDA_ERROR_OUT_OF_MEMORY", Some(Platform::Cuda)),
    ("CUDA error: out of memory", Some(Platform::Cuda)),
    ("RESOURCE_EXHAUSTED: Out of memory", None),
];

/// Notes the platform a line names.
pub fn sniff(facts: &mut Facts, line: &str) {
    if let Some((_, p)) = PLATFORM_MARKERS.iter().find(|(m, _)| has(line, m)) {
        facts.saw_platform(*p);
    }
}

/// Reads the platform out-of-memory wordings on `line`; true when one matched.
pub fn scan(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    if has(line, "MPS backend out of memory") {
        return mps(facts, line_no, line, phase_here);
    }
    // vLLM reads "CUDA error: out of memory" itself (graph capture); this rule takes the rest.
    if has(line, "CUDA error: out of memory") {
        return false;
    }
    for (wording, platform) in SIZELESS {
        if has(line, wording) {
            // An XPU/NPU report with sizes is PyTorch's own and read by the PyTorch rule.
            if has(line, "Tried to allocate")
                && (has(line, "total capacity") || has(line, "total capacty"))
            {
                return false;
            }
            if let Some(p) = platform {
                facts.saw_platform(p);
            }
            let phase = facts.phase_at(line_no, phase_here);
            let request = size_after(line, "Tried to allocate").or_else(|| bytes_after(line));
            record(
                &mut facts.device_oom,
                DeviceOom {
                    wording,
                    phase,
                    request,
                },
                line_no,
            );
            facts.saw_oom(line_no);
            return true;
        }
    }
    false
}

/// "… trying to allocate 123456 bytes" (XLA) → GiB.
fn bytes_after(line: &str) -> Option<f64> {
    let at = find(line, "allocate ")?;
    let rest = &line[at + 9..];
    let (v, used) = leading_number(rest)?;
    crate::text::starts(rest[used..].trim_start(), "bytes").then(|| v / crate::parse::GIB_BYTES)
}

/// The last resort: a line that says "out of memory" (or names an OutOfMemory exception) that no
/// other rule read. The wording is new; the fact — memory ran out — is not.
pub fn unknown(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    let says = has(line, "out of memory") || has(line, "OutOfMemory");
    if !says || has(line, "out of shared memory") || has(line, "host memory") {
        return false;
    }
    let phase = facts.phase_at(line_no, phase_here);
    record(&mut facts.unknown_oom, phase, line_no);
    facts.saw_oom(line_no);
    true
}

fn mps(facts: &mut Facts, line_no: u64, line: &str, phase_here: Option<Phase>) -> bool {
    let Some(request) = size_after(line, "Tried to allocate") else {
        return false;
    };
    facts.saw_platform(Platform::Mps);
    let oom = MpsOom {
        allocated: size_after(line, "MPS allocated:"),
        other: size_after(line, "other allocations:"),
        max_allowed: size_after(line, "max allowed:"),
        request,
        phase: facts.phase_at(line_no, phase_here),
    };
    record(&mut facts.mps_oom, oom, line_no);
    facts.saw_oom(line_no);
    true
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    mps_findings(facts, out);
    if let Some(seen) = &facts.device_oom {
        let d = &seen.value;
        let mut found = Vec::new();
        sizeless_findings(facts, d.phase, &seen.lines, d.wording, &mut found);
        for f in found {
            out.push(f.num("tried_to_allocate_gib", d.request));
        }
    }
    if let Some(seen) = &facts.unknown_oom {
        let already = out.iter().any(|f| f.cause != Cause::NotOutOfMemory);
        if !already && facts.torch_oom.is_none() && facts.cuda_error_oom.is_none() {
            let mut found = Vec::new();
            sizeless_findings(
                facts,
                seen.value,
                &seen.lines,
                "out of memory (a wording this doctor does not know in detail)",
                &mut found,
            );
            for mut f in found {
                f.likelihood *= 0.8;
                out.push(f);
            }
        }
    }
}

fn mps_findings(facts: &Facts, out: &mut Vec<Finding>) {
    let Some(seen) = &facts.mps_oom else { return };
    let m = &seen.value;
    let allocated = m.allocated.unwrap_or(0.0);
    let other = m.other.unwrap_or(0.0);
    let lines = seen.lines.iter().copied();
    let base = |cause, likelihood| {
        Finding::new(cause, likelihood)
            .num("tried_to_allocate_gib", Some(m.request))
            .num("mps_allocated_gib", m.allocated)
            .num("other_allocations_gib", m.other)
            .num("max_allowed_gib", m.max_allowed)
            .lines(lines.clone())
    };
    let ceiling = "the MPS ceiling is `PYTORCH_MPS_HIGH_WATERMARK_RATIO` × the GPU's recommended working set \
                   (unified memory: shared with every app on the Mac); raising the ratio (0.0 removes the limit) lets macOS swap and can freeze the system";
    let Some(limit) = m.max_allowed else {
        out.push(base(Cause::ActivationPeak, 0.6).fix(format!(
            "MPS ran out asking for {} with {} held by PyTorch: lower the batch, resolution or sequence length, or use a smaller model; {ceiling}",
            size(m.request),
            size(allocated)
        )));
        return;
    };
    let short = (allocated + other + m.request - limit).max(0.0);
    if m.request > limit {
        out.push(base(Cause::ActivationPeak, 0.95).num("short_gib", Some(short)).fix(format!(
            "one allocation of {} GiB is larger than the whole {} GiB MPS ceiling: no setting makes it fit; shrink the step that asks for it \
             (batch, resolution, sequence length, or an attention that does not build the full score matrix)",
            gib(m.request),
            gib(limit)
        )));
        return;
    }
    if other >= 0.5 && other >= allocated {
        let frees = other.min(short.max(0.0));
        out.push(
            base(Cause::OtherProcessHoldsMemory, 0.85)
                .num("short_gib", Some(short))
                .num("frees_gib", Some(frees))
                .fix(format!(
                    "{} GiB of the {} GiB MPS ceiling is Metal memory of this process outside PyTorch's allocator (\"other allocations\": \
                     another model or library in the same process, or buffers not yet released), more than PyTorch's own {} GiB; \
                     the request of {} was {} short: release what holds it (unload the other model, `torch.mps.empty_cache()`), \
                     or run it in its own process; {ceiling}",
                    gib(other),
                    gib(limit),
                    gib(allocated),
                    size(m.request),
                    size(short)
                )),
        );
    }
    let (cause, what) = match m.phase {
        Some(Phase::LoadWeights) => (
            Cause::WeightsDoNotFit,
            "while loading weights: the model does not fit under the ceiling; a smaller or quantized model".to_owned(),
        ),
        _ => (
            Cause::ActivationPeak,
            format!(
                "{}: lower the batch, resolution or sequence length so the step's peak shrinks by {}, or a smaller model",
                m.phase.map(Phase::describe).unwrap_or("during a step"),
                size(short)
            ),
        ),
    };
    out.push(base(cause, 0.8).num("short_gib", Some(short)).fix(format!(
        "PyTorch on MPS holds {} GiB plus {} GiB of other Metal allocations under a {} GiB ceiling; {} more did not fit ({} short) {what}; {ceiling}",
        gib(allocated),
        gib(other),
        gib(limit),
        size(m.request),
        size(short)
    )));
}

#[cfg(test)]
mod tests {
    use crate::{Cause, Platform, diagnose_str};

    #[test]
    fn mps_report_is_read_and_the_shortfall_computed() {
        // ComfyUI#7440 (2025): other Metal allocations dominate.
        let d = diagnose_str(
            "MPS backend out of memory (MPS allocated: 9.57 GiB, other allocations: 17.35 GiB, max allowed: 27.20 GiB). Tried to allocate 292.50 MiB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause system failure).\n",
        );
        assert_eq!(d.platform, Some(Platform::Mps));
        let f = &d.findings[0];
        assert_eq!(f.cause, Cause::OtherProcessHoldsMemory);
        // 9.57 + 17.35 + 0.2856 − 27.20 = 0.0056
        assert!((f.numbers["short_gib"] - 0.005_644_53).abs() < 1e-6);
        assert!(f.numbers["frees_gib"] <= f.numbers["other_allocations_gib"]);
    }

    #[test]
    fn sizeless_codes_of_other_platforms_are_out_of_memory() {
        for (line, platform) in [
            (
                "RuntimeError: UR_RESULT_ERROR_OUT_OF_DEVICE_MEMORY",
                Platform::Xpu,
            ),
            (
                "ggml_vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
                Platform::Vulkan,
            ),
            (
                "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
                Platform::Cuda,
            ),
        ] {
            let d = diagnose_str(line);
            assert_eq!(d.platform, Some(platform), "{line}");
            assert_ne!(d.findings.first().map(|f| f.cause), None, "{line}");
            assert_ne!(d.findings[0].cause, Cause::NotOutOfMemory, "{line}");
        }
    }

    #[test]
    fn an_unknown_out_of_memory_wording_is_still_an_out_of_memory() {
        let d =
            diagnose_str("SomeEngineError: device ran out of memory while building the graph\n");
        assert_eq!(d.findings.len(), 1);
        assert_ne!(d.findings[0].cause, Cause::NotOutOfMemory);
        assert!(
            d.findings[0].fix.contains("wording"),
            "{}",
            d.findings[0].fix
        );
    }
}
