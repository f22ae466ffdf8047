//! Context every rule shares: which engine wrote the log, the GPU's name, tensor/pipeline
//! parallel size, configured max_model_len / utilization / KV dtype / block size, the model, and
//! phase markers (loading, profiling, sampler warm-up, graph capture, request) that say what was
//! running when memory ran out.

use super::gate;
use crate::facts::{Facts, Phase};
use crate::finding::Engine;
use crate::parse::{int_after, leading_number, number_after};
use crate::text::{find, has, starts, strip_prefix};

/// Reads context from `line`; returns the phase marker on this line, if any.
pub fn scan(facts: &mut Facts, line_no: u64, line: &str, groups: u32) -> Option<Phase> {
    if groups & gate::GPU != 0 && facts.gpu_name.is_none() {
        facts.gpu_name = gpu_name(line);
    }
    if groups & gate::CONTEXT != 0 {
        parallelism(facts, line);
    }
    if groups & gate::RANK != 0 {
        worker_tags(facts, line);
    }
    if groups & gate::CONFIG != 0 {
        config(facts, line);
    }
    if has(line, "Capture cuda graph end") || has(line, "Graph capturing finished") {
        // Capture is over: a later failure belongs to whatever runs next.
        facts.last_phase = None;
    }
    if groups & gate::PHASE == 0 {
        return None;
    }
    let phase = phase_marker(line);
    if let Some(p) = phase {
        facts.last_phase = Some((p, line_no));
    }
    phase
}

/// The engine whose knobs the fixes name: the most specific one seen.
pub fn main_engine(seen: &[Engine]) -> Option<Engine> {
    // SGLang first: its older releases import vLLM's layers, so vLLM's paths show in its
    // tracebacks.
    const ORDER: [Engine; 8] = [
        Engine::Sglang,
        Engine::Vllm,
        Engine::Tgi,
        Engine::Ollama,
        Engine::LlamaCpp,
        Engine::Ctranslate2,
        Engine::Whisper,
        Engine::PyTorch,
    ];
    ORDER.into_iter().find(|e| seen.contains(e))
}

fn gpu_name(line: &str) -> Option<String> {
    // llama.cpp / ggml: "Device 0: NVIDIA GeForce RTX 3060 Laptop GPU, compute capability 8.6"
    if let Some(at) = find(line, "Device ") {
        let rest = &line[at + 7..];
        if let Some(colon) = find(rest, ": ")
            && rest[..colon].bytes().all(|b| b.is_ascii_digit())
            && colon > 0
        {
            let name = &rest[colon + 2..];
            let end = find(name, ", compute capability").or_else(|| name.find(','));
            if let Some(end) = end {
                return clean_name(&name[..end]);
            }
        }
    }
    // Ollama logfmt on GPU lines: name="NVIDIA A30"
    if has(line, "library=")
        && let Some(v) = crate::parse::logfmt_value(line, "name")
    {
        return clean_name(v);
    }
    // nvidia-smi table row: "|   0  NVIDIA H100 80GB HBM3          On  |"
    if line.starts_with('|')
        && let Some(at) = find(line, "NVIDIA ").or_else(|| find(line, "Tesla "))
    {
        let rest = &line[at..];
        let end = rest
            .find("  ")
            .or_else(|| rest.find('|'))
            .unwrap_or(rest.len());
        return clean_name(&rest[..end]);
    }
    // TGI / vLLM environment dumps: "GPU: NVIDIA ..." or "GPU 0: NVIDIA ..."
    for marker in ["GPU: ", "GPU 0: "] {
        if let Some(at) = find(line, marker) {
            let rest = &line[at + marker.len()..];
            if starts(rest, "NVIDIA") || starts(rest, "Tesla") || starts(rest, "AMD") {
                let end = rest.find(['(', ',', '|']).unwrap_or(rest.len());
                return clean_name(&rest[..end]);
            }
        }
    }
    None
}

fn clean_name(s: &str) -> Option<String> {
    let s = s.trim();
    (!s.is_empty() && s.len() <= 80).then(|| s.to_owned())
}

fn parallelism(facts: &mut Facts, line: &str) {
    for marker in [
        "tensor_parallel_size=",
        "--tensor-parallel-size ",
        "--tensor-parallel-size=",
        "--tensor_parallel ",
        " -tp ",
    ] {
        if let Some(v) = int_after(line, marker).filter(|v| (1..=4096).contains(v)) {
            facts.tp = Some(facts.tp.map_or(v, |t| t.max(v)));
        }
    }
    for marker in [
        "pipeline_parallel_size=",
        "--pipeline-parallel-size ",
        "--pipeline-parallel-size=",
        " -pp ",
    ] {
        if let Some(v) = int_after(line, marker).filter(|v| (1..=4096).contains(v)) {
            facts.pp = Some(facts.pp.map_or(v, |t| t.max(v)));
        }
    }
}

/// Worker tags on multi-GPU lines: the highest rank seen and the parallel sizes they imply.
fn worker_tags(facts: &mut Facts, line: &str) {
    if let Some(rank) = worker_rank(line) {
        facts.max_worker_rank = facts.max_worker_rank.max(rank);
    }
    // Worker_PP1_TP3 → at least 2 stages of at least 4 ranks.
    if let Some(at) = find(line, "Worker_PP") {
        let rest = &line[at + 9..];
        if let Some((pp, used)) = leading_number(rest) {
            facts.pp = Some(facts.pp.map_or(pp as u64 + 1, |p| p.max(pp as u64 + 1)));
            if let Some(tp) = strip_prefix(&rest[used..], "_TP").and_then(leading_number) {
                facts.tp = Some(facts.tp.map_or(tp.0 as u64 + 1, |t| t.max(tp.0 as u64 + 1)));
            }
        }
    } else if let Some(tp) = int_after(line, "Worker_TP") {
        facts.tp = Some(facts.tp.map_or(tp + 1, |t| t.max(tp + 1)));
    }
}

/// The worker rank a line comes from, for multi-GPU engines.
pub fn worker_rank(line: &str) -> Option<u64> {
    if let Some(v) = int_after(line, "VllmWorker rank=") {
        return Some(v);
    }
    if let Some(at) = find(line, "Worker_PP") {
        // Rank within the stage is what matters for a per-GPU limit; report a non-zero marker.
        let rest = &line[at + 9..];
        let (pp, used) = leading_number(rest)?;
        let tp = rest
            .get(used..)
            .and_then(|r| strip_prefix(r, "_TP"))
            .and_then(leading_number)
            .map_or(0.0, |t| t.0);
        return Some((pp + tp) as u64);
    }
    int_after(line, "Worker_TP")
}

fn config(facts: &mut Facts, line: &str) {
    if facts.max_model_len_config.is_none() {
        for marker in [
            "max_seq_len=",
            "--max-model-len ",
            "--max-model-len=",
            "max_model_len=",
            "--max_model_len ",
        ] {
            if let Some(v) = int_after(line, marker).filter(|v| *v > 0) {
                facts.max_model_len_config = Some(v);
                break;
            }
        }
    }
    if facts.utilization_config.is_none() {
        for marker in [
            "gpu_memory_utilization=",
            "--gpu-memory-utilization ",
            "--gpu-memory-utilization=",
        ] {
            if let Some(v) = number_after(line, marker).filter(|v| *v > 0.0 && *v <= 1.0) {
                facts.utilization_config = Some(v);
                break;
            }
        }
    }
    if facts.kv_cache_dtype.is_none() {
        for marker in ["kv_cache_dtype=", "--kv-cache-dtype "] {
            if let Some(at) = find(line, marker) {
                let rest = &line[at + marker.len()..];
                let end = rest.find([',', ' ', ')', '\'']).unwrap_or(rest.len());
                if end > 0 && end < 32 {
                    facts.kv_cache_dtype = Some(rest[..end].to_owned());
                }
                break;
            }
        }
    }
    if facts.block_size.is_none() {
        for marker in ["block_size=", "--block-size "] {
            if let Some(v) = int_after(line, marker).filter(|v| (1..=4096).contains(v)) {
                facts.block_size = Some(v);
                break;
            }
        }
    }
    if facts.model.is_none() {
        facts.model = model_name(line);
    }
}

fn model_name(line: &str) -> Option<String> {
    for (marker, end) in [
        ("model='", "'"),
        ("--model ", " "),
        ("--model=", " "),
        ("model_id: \"", "\""),
    ] {
        if let Some(at) = find(line, marker) {
            let rest = &line[at + marker.len()..];
            let stop = rest.find(end).unwrap_or(rest.len());
            let name = rest[..stop].trim();
            if !name.is_empty() && name.len() <= 200 && !name.contains('\\') {
                return Some(name.to_owned());
            }
        }
    }
    None
}

fn phase_marker(line: &str) -> Option<Phase> {
    const MARKERS: [(&str, Phase); 31] = [
        ("_dummy_sampler_run", Phase::SamplerWarmup),
        ("dummy_sampler", Phase::SamplerWarmup),
        ("dummy_metadata", Phase::SamplerWarmup),
        ("Capture cuda graph", Phase::GraphCapture),
        ("init_cuda_graphs", Phase::GraphCapture),
        ("cuda_graph_runner", Phase::GraphCapture),
        ("warming up sampler", Phase::SamplerWarmup),
        ("capture_model", Phase::GraphCapture),
        ("capture_end", Phase::GraphCapture),
        ("torch.cuda.graph(", Phase::GraphCapture),
        ("Capturing cudagraphs", Phase::GraphCapture),
        ("Capturing CUDA graph", Phase::GraphCapture),
        ("profile_run", Phase::Profiling),
        ("determine_available_memory", Phase::Profiling),
        ("determine_num_available_blocks", Phase::Profiling),
        ("Unable to warmup model", Phase::Profiling),
        ("in warmup", Phase::Profiling),
        ("initialize_kv_cache", Phase::KvAllocation),
        ("_allocate_kv_cache", Phase::KvAllocation),
        ("load_model", Phase::LoadWeights),
        ("load_weights", Phase::LoadWeights),
        ("load_state_dict", Phase::LoadWeights),
        ("from_pretrained", Phase::LoadWeights),
        ("model.to(device)", Phase::LoadWeights),
        ("Error in model execution", Phase::Request),
        ("EngineDeadError", Phase::Request),
        ("serving_chat", Phase::Request),
        ("execute_model", Phase::Request),
        ("Request failed during generation", Phase::Request),
        ("generate_with_fallback", Phase::Request),
        ("in generate_token", Phase::Request),
    ];
    for (marker, phase) in MARKERS {
        if has(line, marker) {
            return Some(phase);
        }
    }
    // faster-whisper builds its CTranslate2 model in WhisperModel.__init__.
    if has(line, "faster_whisper") && crate::text::ends(line.trim_end(), "in __init__") {
        return Some(Phase::LoadWeights);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_names_from_several_formats() {
        assert_eq!(
            gpu_name("  Device 0: NVIDIA GeForce RTX 3060 Laptop GPU, compute capability 8.6")
                .as_deref(),
            Some("NVIDIA GeForce RTX 3060 Laptop GPU")
        );
        assert_eq!(
            gpu_name(r#"msg="x" id=GPU-1 library=cuda name="NVIDIA A30" total="23.5 GiB""#)
                .as_deref(),
            Some("NVIDIA A30")
        );
        assert_eq!(
            gpu_name("|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |")
                .as_deref(),
            Some("NVIDIA H100 80GB HBM3")
        );
        assert_eq!(gpu_name("nothing here"), None);
    }

    #[test]
    fn worker_ranks_and_parallel_sizes() {
        let mut f = Facts::default();
        worker_tags(&mut f, "(Worker_PP1_TP3 pid=4365) WARNING x");
        assert_eq!((f.pp, f.tp), (Some(2), Some(4)));
        assert_eq!(worker_rank("(VllmWorker rank=7 pid=1) ERROR"), Some(7));
        assert_eq!(worker_rank("(Worker_TP1 pid=26348) INFO"), Some(1));
        let mut g = Facts::default();
        parallelism(&mut g, "tensor_parallel_size=4, pipeline_parallel_size=2,");
        assert_eq!((g.tp, g.pp), (Some(4), Some(2)));
    }

    #[test]
    fn config_values() {
        let mut f = Facts::default();
        config(
            &mut f,
            "Initializing an LLM engine with config: model='Qwen/Qwen2-7B', max_seq_len=4096, kv_cache_dtype=auto, gpu_memory_utilization=0.9",
        );
        assert_eq!(f.model.as_deref(), Some("Qwen/Qwen2-7B"));
        assert_eq!(f.max_model_len_config, Some(4096));
        assert_eq!(f.kv_cache_dtype.as_deref(), Some("auto"));
        assert_eq!(f.utilization_config, Some(0.9));
    }
}
