//! headroom-doctor: reads an inference-engine log (vLLM V0/V1, PyTorch, TGI, llama.cpp,
//! llama-cpp-python, Ollama, CTranslate2 / faster-whisper, Whisper, audio models served by vLLM),
//! names the GPU-memory limit that was crossed and computes the fix with `headroom-plan`'s
//! arithmetic. One streaming pass, bounded memory; the only I/O is reading the given input.

mod facts;
pub mod finding;
mod parse;
pub mod reader;
mod rules;

use std::io::BufRead;

pub use finding::{Cause, Diagnosis, Engine, Finding, StartupReport};
pub use headroom_plan::advice::MemoryBreakdown;

/// Errors reading a log.
#[derive(Debug, thiserror::Error)]
pub enum DoctorError {
    #[error("reading the log failed after line {line}: {source}")]
    Read {
        line: u64,
        #[source]
        source: std::io::Error,
    },
}

/// Reads the whole log in one pass and diagnoses it.
pub fn diagnose(input: impl BufRead) -> Result<Diagnosis, DoctorError> {
    let mut reader = reader::LineReader::new(input);
    let mut facts = facts::Facts::default();
    loop {
        let line_no = reader.lines_read();
        match reader.next_line() {
            Ok(Some((n, line))) => rules::scan_line(&mut facts, n, &line),
            Ok(None) => break,
            Err(source) => {
                return Err(DoctorError::Read {
                    line: line_no,
                    source,
                });
            }
        }
    }
    let findings = rules::conclude(&mut facts);
    let startup = facts.startup.has_figures().then(|| facts.startup.clone());
    let unrecognised = if findings.is_empty() {
        std::mem::take(&mut facts.unrecognised)
    } else {
        Vec::new()
    };
    Ok(Diagnosis {
        findings,
        lines_read: reader.lines_read(),
        truncated_lines: reader.truncated_lines(),
        engine: facts.engine,
        gpu_name: facts.gpu_name.take(),
        startup,
        unrecognised_lines: unrecognised,
    })
}

/// Diagnoses a log held in memory.
pub fn diagnose_str(text: &str) -> Diagnosis {
    match diagnose(text.as_bytes()) {
        Ok(d) => d,
        Err(_) => unreachable_read(),
    }
}

#[cold]
fn unreachable_read() -> Diagnosis {
    // Reading from a byte slice cannot fail; keep a total function without panicking.
    Diagnosis {
        findings: Vec::new(),
        lines_read: 0,
        truncated_lines: 0,
        engine: None,
        gpu_name: None,
        startup: None,
        unrecognised_lines: Vec::new(),
    }
}
