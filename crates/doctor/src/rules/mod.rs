//! Log rules: each engine module reads its own messages into [`Facts`] while lines stream past,
//! and turns them into findings at the end. This module dispatches lines, reads the context every
//! engine shares (engine, GPU name, parallelism, configured limits, the phase a failure happened
//! in) and ranks the findings.

mod absorbed;
mod context;
mod ct2;
mod gate;
mod llamacpp;
mod negative_kv;
mod not_memory;
mod nvidia_smi;
mod ollama;
mod platform;
mod rocm;
mod sglang;
mod tgi;
mod tgi_warmup;
mod torch;
mod vllm;
mod vllm_startup;

use crate::facts::{Facts, MAX_UNRECOGNISED};
use crate::finding::{Cause, Finding};
use crate::text::has;

/// Lines in which engine markers are looked for even when no rule keyword appears.
const ENGINE_SNIFF_LINES: u64 = 10_000;

/// Feeds one (normalised) line to the rules its keywords wake. Rules read the whole line, prefix
/// included (process tags name the worker, file tags the engine); rules anchored at the start of
/// a message (table rows) read its body, after the per-line prefixes.
pub fn scan_line(facts: &mut Facts, line_no: u64, line: &str) {
    facts.lines_read = line_no;
    let hits = gate::scan(line);
    let g = hits.groups;
    if g == 0 && line_no > ENGINE_SNIFF_LINES {
        return;
    }
    for (slot, seen) in hits.engines.iter().enumerate() {
        if *seen {
            facts.saw_engine(gate::SLOT_ENGINES[slot]);
        }
    }
    if g == 0 {
        return;
    }
    if g == gate::READY {
        // Routine serving lines: noted, nothing more to read.
        absorbed::ready(facts, line_no);
        return;
    }
    let prefix = crate::normalise::prefix(line);
    let body = &line[prefix.body..];
    facts.line_rank = prefix.rank;
    facts.line_stage = prefix.stage;
    if let Some(r) = prefix.rank {
        facts.max_worker_rank = facts.max_worker_rank.max(r);
    }
    platform::sniff(facts, line);
    let phase_here = context::scan(facts, line_no, line, g);
    if g & gate::READY != 0 {
        absorbed::ready(facts, line_no);
    }
    // A caught out-of-memory is read before any rule takes it for a failure.
    if g & (gate::ABSORB | gate::PLATFORM | gate::SGLANG) != 0
        && absorbed::scan(facts, line_no, line)
    {
        return;
    }
    let mut matched = false;
    if g & gate::VLLM != 0 {
        matched |= vllm::scan(facts, line_no, line, phase_here);
    }
    if g & gate::TORCH != 0 {
        matched |= torch::scan(facts, line_no, line, phase_here);
    }
    if g & gate::TGI != 0 {
        matched |= tgi::scan(facts, line_no, line);
    }
    if g & gate::LLAMA != 0 || llamacpp::expects_follow_up(facts, line_no) {
        matched |= llamacpp::scan(facts, line_no, line);
    }
    if g & gate::OLLAMA != 0 {
        matched |= ollama::scan(facts, line_no, line);
    }
    if g & gate::CT2 != 0 {
        matched |= ct2::scan(facts, line_no, line, phase_here);
    }
    if g & gate::NOT_MEMORY != 0 {
        matched |= not_memory::scan(facts, line_no, line);
    }
    if g & gate::EXTRA != 0 {
        matched |= extra_families(facts, line_no, line, body, phase_here);
    } else if g & gate::LLAMA != 0 {
        matched |= rocm::scan(facts, line_no, line, phase_here);
    }
    if g & gate::SGLANG != 0 {
        matched |= sglang::scan(facts, line_no, line);
    }
    if g & (gate::STARTUP26 | gate::VLLM) != 0 || facts.line_stage.is_some() {
        matched |= vllm_startup::scan(facts, line_no, line);
    }
    if g & gate::PLATFORM != 0 {
        matched |= platform::scan(facts, line_no, line, phase_here);
    }
    if !matched {
        matched = platform::unknown(facts, line_no, line, phase_here);
    }
    if !matched && g & gate::ERROR != 0 {
        tgi_warmup::note_exception(facts, line_no, line);
    }
    if !matched
        && g & gate::ERROR != 0
        && facts.unrecognised.len() < MAX_UNRECOGNISED
        && looks_like_error(line)
    {
        facts
            .unrecognised
            .push((line_no, line.chars().take(300).collect()));
    }
}

/// The v2 families' line readers (each checks its own markers).
fn extra_families(
    facts: &mut Facts,
    line_no: u64,
    line: &str,
    body: &str,
    phase_here: Option<crate::facts::Phase>,
) -> bool {
    let mut matched = negative_kv::scan(facts, line);
    matched |= tgi_warmup::scan(facts, line_no, line);
    matched |= rocm::scan(facts, line_no, line, phase_here);
    if body.trim_start().starts_with('|') {
        matched |= nvidia_smi::scan(facts, line_no, body);
    }
    matched
}

fn looks_like_error(line: &str) -> bool {
    has(line, "error") || has(line, "failed")
}

/// Turns the facts into ranked findings.
pub fn conclude(facts: &mut Facts) -> Vec<Finding> {
    facts.engine = context::main_engine(&facts.engines_seen);
    vllm::finish_startup(facts);
    let mut findings = Vec::new();
    vllm::conclude(facts, &mut findings);
    torch::conclude(facts, &mut findings);
    tgi::conclude(facts, &mut findings);
    llamacpp::conclude(facts, &mut findings);
    ollama::conclude(facts, &mut findings);
    ct2::conclude(facts, &mut findings);
    negative_kv::conclude(facts, &mut findings);
    tgi_warmup::conclude(facts, &mut findings);
    nvidia_smi::conclude(facts, &mut findings);
    sglang::conclude(facts, &mut findings);
    vllm_startup::conclude(facts, &mut findings);
    platform::conclude(facts, &mut findings);
    absorbed::conclude(facts, &mut findings);
    rocm::adjust(facts, &mut findings);
    let memory_found = findings.iter().any(|f| f.cause != Cause::NotOutOfMemory);
    if !memory_found {
        not_memory::conclude(facts, &mut findings);
    }
    rank(findings)
}

/// Most likely first; one finding per cause (the most likely one, with the others' evidence).
fn rank(mut findings: Vec<Finding>) -> Vec<Finding> {
    findings.sort_by(|a, b| b.likelihood.total_cmp(&a.likelihood));
    let mut out: Vec<Finding> = Vec::new();
    for f in findings {
        if let Some(kept) = out.iter_mut().find(|k| k.cause == f.cause) {
            let lines = f.evidence_lines;
            kept.evidence_lines.extend(lines);
            kept.evidence_lines.sort_unstable();
            kept.evidence_lines.dedup();
        } else {
            out.push(f);
        }
    }
    out
}

/// `12.34` — sizes in GiB with two decimals.
pub(crate) fn gib(v: f64) -> String {
    format!("{v:.2}")
}

/// A size that may be small: MiB below 1 GiB.
pub(crate) fn size(v: f64) -> String {
    if v.abs() >= 1.0 {
        format!("{v:.2} GiB")
    } else if v.abs() * 1024.0 >= 1.0 || v == 0.0 {
        format!("{:.0} MiB", v * 1024.0)
    } else {
        format!("{:.0} KiB", v * 1024.0 * 1024.0)
    }
}

/// `32,768` — counts with thousands separators.
pub(crate) fn count(v: u64) -> String {
    let s = v.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// How to get numbers a fix needs when the log lacks them.
pub(crate) fn plan_hint(facts: &Facts) -> String {
    let model = facts.model.as_deref().unwrap_or("<model>");
    let mut cmd = format!("headroom plan --model {model}");
    if let Some(len) = facts
        .max_model_len_config
        .or(facts.startup.breakdown.max_model_len)
    {
        cmd.push_str(&format!(" --max-model-len {len}"));
    }
    format!("`{cmd}`")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(count(32_768), "32,768");
        assert_eq!(count(5), "5");
        assert_eq!(count(1_000_000), "1,000,000");
        assert_eq!(size(0.5), "512 MiB");
        assert_eq!(size(2.0), "2.00 GiB");
        assert_eq!(size(448.0 / 1024.0 / 1024.0), "448 KiB");
        assert_eq!(size(0.0), "0 MiB");
        assert_eq!(gib(19.771), "19.77");
    }

    #[test]
    fn ranking_keeps_one_finding_per_cause() {
        let a = Finding::new(Cause::Fragmentation, 0.5).lines([3]);
        let b = Finding::new(Cause::ActivationPeak, 0.9).lines([1]);
        let c = Finding::new(Cause::Fragmentation, 0.7).lines([2]);
        let ranked = rank(vec![a, b, c]);
        assert_eq!(ranked.len(), 2);
        assert_eq!(ranked[0].cause, Cause::ActivationPeak);
        assert_eq!(ranked[1].cause, Cause::Fragmentation);
        assert_eq!(ranked[1].evidence_lines, vec![2, 3]);
    }
}
