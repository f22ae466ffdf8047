//! `nvidia-smi` tables pasted into a report: the per-GPU "used / total" memory rows and the
//! process list. Memory held by processes other than the engine is memory the engine never gets;
//! the finding lists them and computes the reservation that keeps the engine's estimate honest.

use super::{gib, size};
use crate::facts::{Facts, MAX_EVIDENCE};
use crate::finding::{Cause, Engine, Finding};
use crate::parse::leading_number;
use crate::text::find;

/// Process rows kept.
const MAX_PROCESSES: usize = 64;
/// Below this, other processes are noise (display servers, small helpers).
const MIN_HELD_GIB: f64 = 0.25;
/// Names that are the inference engine itself, not another consumer.
const ENGINE_NAMES: [&str; 6] = [
    "ollama",
    "llama-server",
    "llama_server",
    "vllm",
    "text-generation",
    "whisper",
];

/// Reads one table row; true when it was a GPU memory row or a process row.
pub fn scan(facts: &mut Facts, line_no: u64, line: &str) -> bool {
    let t = line.trim();
    if !t.starts_with('|') || !t.ends_with('|') {
        return false;
    }
    if let Some(row) = memory_row(t) {
        if facts.smi.gpus.len() < MAX_PROCESSES {
            facts.smi.gpus.push(row);
        }
        keep(facts, line_no);
        return true;
    }
    if let Some(p) = process_row(t) {
        if facts.smi.processes.len() < MAX_PROCESSES {
            facts.smi.processes.push(p);
        }
        keep(facts, line_no);
        return true;
    }
    false
}

fn keep(facts: &mut Facts, line_no: u64) {
    if facts.smi.lines.len() < MAX_EVIDENCE * 4 {
        facts.smi.lines.push(line_no);
    }
}

/// `|  14214MiB / 24564MiB |` inside a GPU row → (used, total) in GiB.
fn memory_row(t: &str) -> Option<(f64, f64)> {
    let at = find(t, "MiB / ")?;
    let head = &t[..at];
    let start = head.rfind(|c: char| !c.is_ascii_digit())? + 1;
    let used = head[start..].parse::<f64>().ok()?;
    let (total, used_len) = leading_number(&t[at + 6..])?;
    t[at + 6 + used_len..]
        .get(..3)
        .is_some_and(|u| u.eq_ignore_ascii_case("MiB"))
        .then_some((used / 1024.0, total / 1024.0))
}

/// `|    0   N/A  N/A     48824      C   /opt/venv/bin/python3     238MiB |` (or the older
/// form without GI/CI) → (gpu, pid, name, GiB).
fn process_row(t: &str) -> Option<(u64, u64, String, f64)> {
    let inner = t.trim_matches('|');
    let words: Vec<&str> = inner.split_whitespace().collect();
    if words.len() < 5 {
        return None;
    }
    let gpu = words[0].parse::<u64>().ok()?;
    let mem = crate::text::strip_suffix(words.last()?, "MiB")?
        .parse::<f64>()
        .ok()?;
    let kind = words.iter().position(|w| {
        ["C", "G", "C+G", "M", "M+C"]
            .iter()
            .any(|k| k.eq_ignore_ascii_case(w))
    })?;
    if kind < 2 || kind + 1 >= words.len() - 1 {
        return None;
    }
    let pid = words[kind - 1].parse::<u64>().ok()?;
    let name = words[kind + 1..words.len() - 1].join(" ");
    (!name.is_empty() && name.len() <= 200).then(|| (gpu, pid, name, mem / 1024.0))
}

fn is_engine(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    ENGINE_NAMES.iter().any(|e| lower.contains(e))
}

pub fn conclude(facts: &Facts, out: &mut Vec<Finding>) {
    let smi = &facts.smi;
    let mut others: Vec<&(u64, u64, String, f64)> =
        smi.processes.iter().filter(|p| !is_engine(&p.2)).collect();
    // Largest holders first.
    others.sort_by(|a, b| b.3.total_cmp(&a.3));
    let held: f64 = others.iter().map(|p| p.3).sum();
    if others.is_empty() || held < MIN_HELD_GIB {
        return;
    }
    let gpu = others[0].0;
    let total = smi.gpus.get(gpu as usize).map(|g| g.1);
    let listed = others
        .iter()
        .take(8)
        .map(|(g, pid, name, m)| format!("GPU {g} PID {pid} {name} {}", size(*m)))
        .collect::<Vec<_>>()
        .join(", ");
    let reserve = match facts.engine {
        Some(Engine::Ollama) | None => format!(
            "tell Ollama about it with `OLLAMA_GPU_OVERHEAD={}` (bytes it keeps free per GPU)",
            (held * headroom_plan::advice::GIB).round() as u64
        ),
        Some(Engine::Vllm) => match total {
            Some(t) if t > 0.0 => format!(
                "keep vLLM's `--gpu-memory-utilization` at or below {:.2} ((total − held) / total)",
                headroom_plan::advice::floor_to((t - held) / t, 2)
            ),
            _ => "lower vLLM's `--gpu-memory-utilization` by held / total".to_owned(),
        },
        Some(Engine::LlamaCpp) => {
            "offload fewer layers (`-ngl`) so the model fits next to them".to_owned()
        }
        Some(_) => "size the engine for the memory that is left".to_owned(),
    };
    out.push(
        Finding::new(Cause::OtherProcessHoldsMemory, 0.5)
            .num("held_by_others_gib", Some(held))
            .count("other_processes", Some(others.len() as u64))
            .num("total_gib", total)
            .fix(format!(
                "the pasted nvidia-smi table lists {} other process(es) holding {} GiB{}: {listed}; an engine that sizes itself from total memory \
                 does not see them: stop them, or {reserve}",
                others.len(),
                gib(held),
                total.map(|t| format!(" of the {} GiB card", gib(t))).unwrap_or_default(),
            ))
            .lines(smi.lines.iter().copied()),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_both_table_formats() {
        assert_eq!(
            process_row(
                "|    0   N/A  N/A           56674      C   frigate.embeddings_manager              958MiB |"
            ),
            Some((
                0,
                56674,
                "frigate.embeddings_manager".into(),
                958.0 / 1024.0
            ))
        );
        assert_eq!(
            process_row(
                "|    0      1267      G   /usr/lib/Xorg                                   4MiB |"
            ),
            Some((0, 1267, "/usr/lib/Xorg".into(), 4.0 / 1024.0))
        );
        assert_eq!(
            memory_row(
                "| 30%   26C    P8              16W / 450W |  14214MiB / 24564MiB |      0%      Default |"
            ),
            Some((14214.0 / 1024.0, 24564.0 / 1024.0))
        );
        assert_eq!(
            process_row("|  GPU   GI   CI        PID   Type   Process name    GPU Memory |"),
            None
        );
    }
}
