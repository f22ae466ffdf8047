//! headroom-doctor: reads an inference-engine log (vLLM V0/V1, PyTorch, TGI, llama.cpp,
//! llama-cpp-python, Ollama, CTranslate2 / faster-whisper, Whisper, audio models served by vLLM),
//! names the GPU-memory limit that was crossed and computes the fix with `headroom-plan`'s
//! arithmetic. One streaming pass, bounded memory; the only I/O is reading the given input.
//! Before any rule reads a line, the way the log was captured is taken away ([`normalise`]:
//! colour codes, carriage returns, console wrapping, structured lines, per-line prefixes) and
//! every marker is matched without regard to letter case ([`text`]).

mod facts;
pub mod finding;
pub mod live;
pub mod normalise;
mod parse;
pub mod reader;
mod rules;
pub mod text;

use std::io::BufRead;

pub use finding::{Cause, Diagnosis, Engine, Finding, Platform, StartupReport};
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
    /// The input is not a text log (an executable, an archive, UTF-16 text).
    #[error("not a text log: {0}")]
    NotText(reader::NotText),
}

fn read_error(line: u64, source: std::io::Error) -> DoctorError {
    match reader::NotText::from_io(&source) {
        Some(nt) => DoctorError::NotText(nt),
        None => DoctorError::Read { line, source },
    }
}

/// Reads the whole log in one pass and diagnoses it. The first lines are held back (at most
/// [`normalise::HEAD_LINES`] lines or [`normalise::HEAD_BYTES`]) to learn whether a console
/// wrapped the log, then every line goes through [`normalise`] to the rules.
pub fn diagnose(input: impl BufRead) -> Result<Diagnosis, DoctorError> {
    let mut reader = reader::LineReader::new(input);
    let mut facts = facts::Facts::default();
    let mut head: Vec<(u64, String)> = Vec::new();
    let mut head_bytes = 0;
    let mut ended = false;
    while head.len() < normalise::HEAD_LINES && head_bytes < normalise::HEAD_BYTES {
        let line_no = reader.lines_read();
        match reader.next_line() {
            Ok(Some((n, line))) => {
                let mut lines = Vec::new();
                normalise::physical(&line, &mut lines);
                for clean in lines {
                    head_bytes += clean.len();
                    head.push((n, clean));
                }
            }
            Ok(None) => {
                ended = true;
                break;
            }
            Err(source) => return Err(read_error(line_no, source)),
        }
    }
    let width = normalise::learn_width(head.iter().map(|(_, l)| l.as_str()));
    let mut joiner = normalise::Joiner::new(width);
    let mut physical = Vec::new();
    {
        let mut emit = |n: u64, text: &str| {
            normalise::pieces(text, &mut |piece| rules::scan_line(&mut facts, n, piece));
        };
        for (n, line) in head.drain(..) {
            joiner.push(n, &line, &mut emit);
        }
        while !ended {
            let line_no = reader.lines_read();
            match reader.next_line() {
                Ok(Some((n, line))) => {
                    let clean = normalise::strip_ansi(&line);
                    if clean.trim_start().starts_with('{') {
                        physical.clear();
                        normalise::physical(&clean, &mut physical);
                        for piece in &physical {
                            joiner.push(n, piece, &mut emit);
                        }
                    } else {
                        // The common case: no structured line, no copy.
                        joiner.push(n, &clean, &mut emit);
                    }
                }
                Ok(None) => ended = true,
                Err(source) => return Err(read_error(line_no, source)),
            }
        }
        joiner.finish(&mut emit);
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
        platform: facts.platform,
        startup,
        unrecognised_lines: unrecognised,
    })
}

/// Diagnoses a log held in memory (reading a byte slice cannot fail).
pub fn diagnose_str(text: &str) -> Diagnosis {
    diagnose(text.as_bytes()).unwrap_or_else(|_| Diagnosis::empty())
}

#[cfg(test)]
mod tests {
    #[test]
    fn llama_cpp_start_up_kv_figures_are_read() {
        // The lines xllamacpp's llama.cpp logs at verbosity 10 for -c 16384 --parallel 4.
        let log = "0.00.482.694 I llama_kv_cache:        CPU KV buffer size =   360.00 MiB\n\
0.00.724.376 I llama_kv_cache: size =  360.00 MiB (  4096 cells,  30 layers,  4/4 seqs), K (f16):  180.00 MiB, V (f16):  180.00 MiB\n";
        let d = diagnose_str(log);
        let s = d.startup.expect("start-up figures");
        assert_eq!(s.breakdown.kv_cache_gib, Some(360.0 / 1024.0));
        assert_eq!(s.breakdown.kv_tokens, Some(16384));
        assert!(d.findings.is_empty(), "{:?}", d.findings);
    }

    use super::*;
    use proptest::prelude::*;

    const FIXTURES: [&str; 14] = [
        include_str!("../../../tests/data/logs/vllm-v1-startup-free-below-util.log"),
        include_str!("../../../tests/data/logs/vllm-v0-profile-29k-kv-too-small.log"),
        include_str!("../../../tests/data/logs/vllm-v0-oom-echo-cuda-graph-pool.log"),
        include_str!("../../../tests/data/logs/pytorch-pre21-oom-vlm-rl.log"),
        include_str!("../../../tests/data/logs/tgi-warmup-allocation-exceeds-limit.log"),
        include_str!("../../../tests/data/logs/ollama-offload-partial.log"),
        include_str!("../../../tests/data/logs/llamacpp-python-pipeline-parallel-device4.log"),
        include_str!("../../../tests/data/logs/vllm-v1-ok-cudagraph-estimate.log"),
        include_str!("../../../tests/data/logs/vllm-v0-negative-kv-qwen7b-8gb.log"),
        include_str!("../../../tests/data/logs/tgi-method-warmup-prefill-1024-llama70b.log"),
        include_str!("../../../tests/data/logs/torch-rocm-hip-oom-strix-halo.log"),
        include_str!("../../../tests/data/logs/not-memory-shm-bus-error-pipedream.log"),
        include_str!("../../../tests/data/logs/nvidia-smi-other-consumers-frigate.log"),
        include_str!("../../../tests/data/logs/vllm-v1-cudagraph-capture-oom.log"),
    ];

    /// Properties every diagnosis must have, whatever the input.
    fn check_invariants(d: &Diagnosis, input: &[u8]) {
        let newlines = input.iter().filter(|b| **b == b'\n').count() as u64;
        let expected_lines =
            newlines + u64::from(!input.is_empty() && input.last() != Some(&b'\n'));
        assert_eq!(d.lines_read, expected_lines);
        let mut causes: Vec<Cause> = d.findings.iter().map(|f| f.cause).collect();
        causes.sort();
        causes.dedup();
        assert_eq!(causes.len(), d.findings.len(), "one finding per cause");
        for f in &d.findings {
            assert!(!f.evidence_lines.is_empty());
            assert!(
                f.evidence_lines
                    .iter()
                    .all(|l| *l >= 1 && *l <= d.lines_read)
            );
            assert!(f.numbers.values().all(|v| v.is_finite()));
            assert!(!f.fix.is_empty());
        }
        assert!(
            d.findings
                .windows(2)
                .all(|w| w[0].likelihood >= w[1].likelihood)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn random_bytes_never_panic(input in proptest::collection::vec(any::<u8>(), 0..4096)) {
            match diagnose(&input[..]) {
                Ok(d) => {
                    prop_assert!(!input.contains(&0), "NUL bytes must be refused");
                    check_invariants(&d, &input);
                }
                Err(DoctorError::NotText(nt)) => {
                    prop_assert_eq!(input.iter().position(|b| *b == 0), Some(nt.offset as usize));
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
        }

        #[test]
        fn random_log_like_text_never_panics(
            lines in proptest::collection::vec(
                prop_oneof![
                    "[ -~]{0,120}",
                    "(Tried to allocate|total capacity of|of which|is free|GiB|MiB|\\(|\\)|;|[0-9.,]{1,8}| ){0,40}",
                    "(Free memory on device|max seq len|KV cache|GiB|\\(|\\)|/|,|[0-9.]{1,6}| ){0,30}",
                    "(msg=|layers\\.offload=|memory\\.available=|\"|\\[|\\]|GiB|B|[0-9.]{1,5}| ){0,30}",
                    "(\\||MiB|/|N/A|C|G|python3|[0-9]{1,6}| ){0,30}",
                    "(model weights take|non_torch_memory takes|activation peak memory takes|KV Cache is|-|GiB|;|[0-9.]{1,6}| ){0,30}",
                    "(Method Warmup encountered an error|max_batch_prefill_tokens: |Some\\(|HIP out of memory|shared memory \\(shm\\)|[0-9]{1,6}| ){0,20}",
                ],
                0..40,
            )
        ) {
            let text = lines.join("\n");
            let d = diagnose_str(&text);
            check_invariants(&d, text.as_bytes());
        }

        #[test]
        fn truncated_and_spliced_fixtures_never_panic(
            which in 0..FIXTURES.len(),
            cut in 0usize..4000,
            start in 0usize..4000,
            junk in "[ -~]{0,40}",
        ) {
            let bytes = FIXTURES[which].as_bytes();
            let end = cut.min(bytes.len());
            let begin = start.min(end);
            let mut input = bytes[begin..end].to_vec();
            input.extend_from_slice(junk.as_bytes());
            let d = diagnose(&input[..]).unwrap();
            check_invariants(&d, &input);
        }
    }

    #[test]
    fn whole_fixtures_keep_their_invariants() {
        for text in FIXTURES {
            let d = diagnose_str(text);
            check_invariants(&d, text.as_bytes());
        }
    }

    #[test]
    fn one_huge_line_is_truncated_not_buffered() {
        let mut input = vec![b'a'; 3 * reader::MAX_LINE_BYTES];
        input.extend_from_slice(b"\nNo CUDA GPUs are available\n");
        let d = diagnose(&input[..]).unwrap();
        assert_eq!(d.lines_read, 2);
        assert_eq!(d.truncated_lines, 1);
        assert_eq!(d.findings[0].cause, Cause::NotOutOfMemory);
        assert_eq!(d.findings[0].evidence_lines, vec![2]);
    }

    #[test]
    fn a_read_error_is_reported_with_the_line() {
        struct Failing(u8);
        impl std::io::Read for Failing {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.0 == 0 {
                    return Err(std::io::Error::other("disk gone"));
                }
                self.0 -= 1;
                buf[..2].copy_from_slice(b"x\n");
                Ok(2)
            }
        }
        let err = diagnose(std::io::BufReader::new(Failing(3))).unwrap_err();
        assert!(err.to_string().contains("after line 3"), "{err}");
    }

    #[test]
    fn nothing_recognised_lists_error_lines_it_read() {
        let d = diagnose_str("starting\nERROR: upstream refused\nok\n");
        assert!(d.findings.is_empty());
        assert_eq!(d.verdict(), "no memory problem recognised");
        assert_eq!(
            d.unrecognised_lines,
            vec![(2, "ERROR: upstream refused".to_owned())]
        );
    }
}
