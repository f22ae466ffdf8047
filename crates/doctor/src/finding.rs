//! What a diagnosis says: the cause vocabulary, one finding (cause, numbers, computed fix,
//! evidence line numbers) and the whole diagnosis of one log.

use std::collections::BTreeMap;

use headroom_plan::advice::MemoryBreakdown;
use serde::Serialize;

/// Root causes, exactly the vocabulary `headroom doctor --format json` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    WeightsDoNotFit,
    KvCacheTooSmall,
    StartupFreeMemoryBelowUtilization,
    OtherProcessHoldsMemory,
    Fragmentation,
    ActivationPeak,
    TooManySequences,
    CudaGraphCapture,
    MultiGpuWorkerLimit,
    NotOutOfMemory,
}

impl Cause {
    /// The snake_case name used in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::WeightsDoNotFit => "weights_do_not_fit",
            Cause::KvCacheTooSmall => "kv_cache_too_small",
            Cause::StartupFreeMemoryBelowUtilization => "startup_free_memory_below_utilization",
            Cause::OtherProcessHoldsMemory => "other_process_holds_memory",
            Cause::Fragmentation => "fragmentation",
            Cause::ActivationPeak => "activation_peak",
            Cause::TooManySequences => "too_many_sequences",
            Cause::CudaGraphCapture => "cuda_graph_capture",
            Cause::MultiGpuWorkerLimit => "multi_gpu_worker_limit",
            Cause::NotOutOfMemory => "not_out_of_memory",
        }
    }
}

/// One named cause with the numbers behind it, the computed fix and the lines it came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub cause: Cause,
    /// Numbers read from the log or computed from them; sizes in GiB (`*_gib`).
    pub numbers: BTreeMap<String, f64>,
    /// The fix, with the values computed from `numbers`, or which number is missing and how to
    /// get it.
    pub fix: String,
    /// 1-based line numbers of the log lines this finding rests on.
    pub evidence_lines: Vec<u64>,
    /// Ranking weight (higher is more likely); not printed.
    #[serde(skip)]
    pub likelihood: f64,
}

impl Finding {
    pub fn new(cause: Cause, likelihood: f64) -> Self {
        Finding {
            cause,
            numbers: BTreeMap::new(),
            fix: String::new(),
            evidence_lines: Vec::new(),
            likelihood,
        }
    }

    pub fn num(mut self, name: &str, value: Option<f64>) -> Self {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            self.numbers.insert(name.to_owned(), v);
        }
        self
    }

    pub fn count(self, name: &str, value: Option<u64>) -> Self {
        self.num(name, value.map(|v| v as f64))
    }

    pub fn fix(mut self, text: impl Into<String>) -> Self {
        self.fix = text.into();
        self
    }

    pub fn lines(mut self, lines: impl IntoIterator<Item = u64>) -> Self {
        self.evidence_lines.extend(lines);
        self.evidence_lines.sort_unstable();
        self.evidence_lines.dedup();
        self
    }
}

/// The engine whose messages the log carries (the most specific one seen names the knobs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    Vllm,
    Tgi,
    LlamaCpp,
    Ollama,
    Ctranslate2,
    Whisper,
    #[serde(rename = "pytorch")]
    PyTorch,
    Sglang,
}

impl Engine {
    /// The name used in JSON (`vllm`, `tgi`, `llama_cpp`, `ollama`, `ctranslate2`, `whisper`,
    /// `pytorch`).
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Tgi => "tgi",
            Engine::LlamaCpp => "llama_cpp",
            Engine::Ollama => "ollama",
            Engine::Ctranslate2 => "ctranslate2",
            Engine::Whisper => "whisper",
            Engine::PyTorch => "pytorch",
            Engine::Sglang => "sglang",
        }
    }
}

/// The accelerator family a log comes from, told by its wording (each platform's allocator and
/// runtime word their errors differently, and the fixes name each platform's own variables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Platform {
    Cuda,
    Rocm,
    /// Apple silicon through PyTorch's MPS backend.
    Mps,
    /// Intel GPUs (PyTorch XPU, IPEX, Level Zero, SYCL).
    Xpu,
    Vulkan,
    /// Apple silicon through ggml's Metal backend.
    Metal,
}

impl Platform {
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Cuda => "cuda",
            Platform::Rocm => "rocm",
            Platform::Mps => "mps",
            Platform::Xpu => "xpu",
            Platform::Vulkan => "vulkan",
            Platform::Metal => "metal",
        }
    }
}

/// What vLLM reported about a start-up (successful or not), per GPU.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StartupReport {
    #[serde(flatten)]
    pub breakdown: MemoryBreakdown,
    /// Engine-side estimate of CUDA-graph memory, when the version prints one.
    pub cuda_graph_estimate_gib: Option<f64>,
    pub tensor_parallel_size: Option<u64>,
    pub pipeline_parallel_size: Option<u64>,
    pub block_size: Option<u64>,
    pub model: Option<String>,
    /// Memory left outside the utilization budget (`total − budget`), where graphs and other
    /// tenants must fit in versions that do not count graphs.
    pub outside_budget_gib: Option<f64>,
    /// KV bytes per token implied by the pool size and token count (compare with the model's
    /// `2 × layers × kv_heads × head_dim × dtype` to check which layers vLLM charged).
    pub kv_bytes_per_token: Option<f64>,
    /// Concurrency recomputed from the pool and max_model_len, to cross-check vLLM's figure.
    pub concurrency_check: Option<f64>,
    /// Weights and non-torch memory together, where the engine prints them as one figure
    /// ("X GiB for consumed memory (weights + non-torch)").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumed_gib: Option<f64>,
    /// The engine's own `--kv-cache-memory=<bytes>` that fits the requested memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_memory_fits_bytes: Option<u64>,
    /// The engine's own `--kv-cache-memory=<bytes>` that fills the card's free memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_memory_fills_bytes: Option<u64>,
    pub evidence_lines: Vec<u64>,
}

impl StartupReport {
    /// True when at least one memory figure was found.
    pub fn has_figures(&self) -> bool {
        let b = &self.breakdown;
        b.weights_gib.is_some()
            || b.kv_cache_gib.is_some()
            || b.kv_tokens.is_some()
            || b.gpu_blocks.is_some()
            || b.activation_peak_gib.is_some()
            || b.budget_gib.is_some()
            || b.cuda_graph_gib.is_some()
            || self.cuda_graph_estimate_gib.is_some()
            || self.consumed_gib.is_some()
            || self.kv_cache_memory_fits_bytes.is_some()
    }
}

/// The result of reading one log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diagnosis {
    /// Most likely first; empty when no memory problem was recognised.
    pub findings: Vec<Finding>,
    pub lines_read: u64,
    pub truncated_lines: u64,
    pub engine: Option<Engine>,
    pub gpu_name: Option<String>,
    /// The accelerator family the log's wording names (`cuda`, `rocm`, `mps`, `xpu`, `vulkan`,
    /// `metal`; the fixes then name that platform's variables and tools), absent when none does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
    /// vLLM's memory figures, when the log has them.
    pub startup: Option<StartupReport>,
    /// Error-looking lines no rule understood (bounded), shown when nothing was recognised.
    pub unrecognised_lines: Vec<(u64, String)>,
}

impl Diagnosis {
    /// A diagnosis of nothing: no lines, no findings.
    pub fn empty() -> Self {
        Diagnosis {
            findings: Vec::new(),
            lines_read: 0,
            truncated_lines: 0,
            engine: None,
            gpu_name: None,
            platform: None,
            startup: None,
            unrecognised_lines: Vec::new(),
        }
    }

    /// "no memory problem recognised" when there are no findings.
    pub fn verdict(&self) -> &'static str {
        if self.findings.is_empty() {
            "no memory problem recognised"
        } else {
            "memory problem recognised"
        }
    }
}

impl Diagnosis {
    /// Why finding `i` (0-based, not the first) is secondary to the first, which is the cause.
    pub fn secondary_reason(&self, i: usize) -> Option<String> {
        let first = self.findings.first()?;
        let f = self.findings.get(i).filter(|_| i > 0)?;
        let shared = f
            .evidence_lines
            .iter()
            .any(|l| first.evidence_lines.contains(l));
        Some(if shared {
            format!(
                "secondary: a less likely reading of the same lines as 1 ({}); fix 1 first",
                first.cause.as_str()
            )
        } else {
            format!(
                "secondary: seen on other lines; it did not stop the engine, 1 ({}) did — check it once 1 is fixed",
                first.cause.as_str()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_json() {
        for e in [
            Engine::Vllm,
            Engine::Tgi,
            Engine::LlamaCpp,
            Engine::Ollama,
            Engine::Ctranslate2,
            Engine::Whisper,
            Engine::PyTorch,
            Engine::Sglang,
        ] {
            assert_eq!(serde_json::to_value(e).unwrap(), e.as_str());
        }
        for p in [
            Platform::Cuda,
            Platform::Rocm,
            Platform::Mps,
            Platform::Xpu,
            Platform::Vulkan,
            Platform::Metal,
        ] {
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        for c in [
            Cause::WeightsDoNotFit,
            Cause::KvCacheTooSmall,
            Cause::StartupFreeMemoryBelowUtilization,
            Cause::OtherProcessHoldsMemory,
            Cause::Fragmentation,
            Cause::ActivationPeak,
            Cause::TooManySequences,
            Cause::CudaGraphCapture,
            Cause::MultiGpuWorkerLimit,
            Cause::NotOutOfMemory,
        ] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
    }
}
