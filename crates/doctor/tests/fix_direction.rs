//! Property over every fixture log: the fixes speak the user's engine and never go against the
//! log. For each finding of each fixture:
//! - every numeric setting a fix names (`--flag N`, `--flag=N`, `-ub N`, `num_ctx N`, `ENV=N`)
//!   that the log itself states moves from the stated value in the direction that resolves the
//!   finding: a demand (context, batch, sequences, tokens, layers, parallel slots) goes down; an
//!   engine budget (`--gpu-memory-utilization`, `--mem-fraction-static`, `--cuda-memory-fraction`,
//!   `--kv-cache-memory`) goes down when the card itself ran out and up only when the engine's own
//!   budget was too small for what the card had (`kv_cache_too_small`, `weights_do_not_fit`);
//! - no setting belongs to another engine (no `-ngl`/`-ub` for an Ollama user, no vLLM flags for
//!   TGI or SGLang);
//! - a finding never claims to free more than is held (`frees_gib` ≤ what it says is held).
//!
//! The values the log states are read here with this test's own small parser, not the doctor's.

mod common;

use common::fixtures;
use headroom_doctor::{Cause, Diagnosis, Engine, diagnose_str};

/// The number right after `key` (spaces, `(`, `Some(` and `:` skipped).
fn number_after(text: &str, key: &str) -> Vec<f64> {
    let lower = text.to_ascii_lowercase();
    let key = key.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = lower[from..].find(&key) {
        let start = from + at + key.len();
        let rest = lower[start..].trim_start_matches([' ', '(', ':', '=']);
        let rest = rest.strip_prefix("some(").unwrap_or(rest);
        let num: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ',')
            .filter(|c| *c != ',')
            .collect();
        if let Ok(v) = num.trim_end_matches('.').parse::<f64>() {
            out.push(v);
        }
        from = start;
    }
    out
}

/// What the log states for a setting, by the setting's name in a fix.
fn stated(log: &str, flag: &str) -> Option<f64> {
    let keys: &[&str] = match flag {
        "--gpu-memory-utilization" => &[
            "gpu_memory_utilization=",
            "gpu_memory_utilization (",
            "--gpu-memory-utilization ",
            "--gpu-memory-utilization=",
            "desired gpu memory utilization is (",
            "desired gpu memory utilization (",
        ],
        "--max-model-len" => &[
            "max_seq_len=",
            "max_model_len=",
            "--max-model-len ",
            "max seq len (",
        ],
        "--max-num-seqs" => &[
            "max_num_seqs=",
            "--max-num-seqs ",
            "warming up sampler with ",
        ],
        "--max-num-batched-tokens" => &["max_num_batched_tokens=", "--max-num-batched-tokens "],
        "--max-batch-prefill-tokens" => &[
            "max_batch_prefill_tokens: ",
            "--max-batch-prefill-tokens ",
            "not enough memory to handle ",
        ],
        "--max-batch-total-tokens" => &["max_batch_total_tokens: ", "--max-batch-total-tokens "],
        "--max-input-tokens" => &[
            "max_input_tokens: ",
            "max_input_length: ",
            "--max-input-tokens ",
        ],
        "--max-total-tokens" => &["max_total_tokens: ", "--max-total-tokens "],
        "--mem-fraction-static" => &["mem_fraction_static=", "--mem-fraction-static "],
        "--cuda-graph-max-bs" => &["cuda_graph_max_bs=", "--cuda-graph-max-bs "],
        "--chunked-prefill-size" => &["chunked_prefill_size=", "--chunked-prefill-size "],
        "-ub" => &["n_ubatch ", "n_ubatch="],
        "-c" => &["n_ctx ", "n_ctx="],
        "-ngl" | "num_gpu" => &["--n-gpu-layers ", "gpulayers:", "layers.offload="],
        "num_batch" => &["--batch-size ", "batchsize:", "n_batch "],
        "OLLAMA_NUM_PARALLEL" => &["ollama_num_parallel:", "--parallel ", "parallel:"],
        _ => return None,
    };
    keys.iter()
        .flat_map(|k| number_after(log, k))
        .find(|v| *v > 0.0)
}

/// Settings that only lower memory when they go down.
const DEMANDS: [&str; 14] = [
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--max-batch-prefill-tokens",
    "--max-batch-total-tokens",
    "--max-input-tokens",
    "--cuda-graph-max-bs",
    "--chunked-prefill-size",
    "-ub",
    "-c",
    "-ngl",
    "num_gpu",
    "num_batch",
    "OLLAMA_NUM_PARALLEL",
];

/// Engine budgets: down when the card ran out, up when the engine's budget was too small.
const BUDGETS: [&str; 2] = ["--gpu-memory-utilization", "--mem-fraction-static"];

/// Causes where the engine's own budget was too small for what the card had.
fn budget_too_small(cause: Cause) -> bool {
    matches!(cause, Cause::KvCacheTooSmall | Cause::WeightsDoNotFit)
}

/// `(name, value)` for every numeric setting in the fix's code spans.
fn settings(fix: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for (i, span) in fix.split('`').enumerate() {
        // Even pieces are prose; a `headroom …` span is a command to run for figures, not a setting.
        if i % 2 == 0 || span.starts_with("headroom ") {
            continue;
        }
        for part in span.split_whitespace().collect::<Vec<_>>().windows(2) {
            let (name, value) = (part[0], part[1]);
            if (name.starts_with('-') || name.starts_with("num_"))
                && !name.contains('=')
                && let Ok(v) = value.parse::<f64>()
            {
                out.push((name.to_owned(), v));
            }
        }
        for word in span.split_whitespace() {
            if let Some((name, value)) = word.split_once('=')
                && let Ok(v) = value.parse::<f64>()
            {
                out.push((name.to_owned(), v));
            }
        }
    }
    out
}

/// Settings that belong to one engine only.
fn foreign(engine: Option<Engine>, name: &str) -> bool {
    let llama_cpp = [
        "-ngl",
        "-ub",
        "-c",
        "--tensor-split",
        "-ctk",
        "--ubatch-size",
    ];
    let vllm = [
        "--gpu-memory-utilization",
        "--enforce-eager",
        "--max-num-seqs",
        "--max-model-len",
        "--kv-cache-memory",
    ];
    match engine {
        Some(Engine::Ollama) => llama_cpp.contains(&name) || vllm.contains(&name),
        Some(Engine::Tgi) | Some(Engine::Sglang) => vllm.contains(&name),
        Some(Engine::Vllm) => name == "--mem-fraction-static" || llama_cpp.contains(&name),
        _ => false,
    }
}

fn check(name: &str, log: &str, d: &Diagnosis, problems: &mut Vec<String>, compared: &mut usize) {
    for f in &d.findings {
        for (flag, value) in settings(&f.fix) {
            let flag = flag.trim_end_matches(['=', ',']).to_owned();
            if foreign(d.engine, &flag) {
                problems.push(format!(
                    "{name}: {} fix names `{flag}`, which is not {:?}'s",
                    f.cause.as_str(),
                    d.engine
                ));
            }
            let Some(from) = stated(log, &flag) else {
                continue;
            };
            *compared += 1;
            let down = value < from;
            let ok = if DEMANDS.contains(&flag.as_str()) {
                down
            } else if BUDGETS.contains(&flag.as_str()) {
                if budget_too_small(f.cause) {
                    value > from
                } else {
                    down
                }
            } else {
                true
            };
            if !ok {
                problems.push(format!(
                    "{name}: {} fix moves `{flag}` from the log's {from} to {value}",
                    f.cause.as_str()
                ));
            }
        }
        if let Some(frees) = f.numbers.get("frees_gib") {
            let held = [
                "held_elsewhere_gib",
                "held_by_others_gib",
                "other_allocations_gib",
            ]
            .iter()
            .find_map(|k| f.numbers.get(*k));
            match held {
                Some(h) if frees > h => problems.push(format!(
                    "{name}: {} claims to free {frees} GiB of the {h} GiB held",
                    f.cause.as_str()
                )),
                None => problems.push(format!(
                    "{name}: {} says it frees {frees} GiB without saying what is held",
                    f.cause.as_str()
                )),
                _ => {}
            }
        }
    }
}

#[test]
fn every_fix_moves_settings_the_log_states_towards_fitting_in_the_users_engine() {
    let mut problems = Vec::new();
    let mut compared = 0;
    let all = fixtures();
    assert!(all.len() >= 50, "only {} fixtures", all.len());
    for (name, log) in &all {
        let d = diagnose_str(log);
        check(name, log, &d, &mut problems, &mut compared);
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert!(
        compared >= 15,
        "only {compared} settings could be compared with the logs: the property would hold vacuously"
    );
}

#[test]
fn the_parsers_of_this_test_read_what_they_should() {
    assert_eq!(
        settings(
            "use `--max-batch-prefill-tokens 512`, `OLLAMA_NUM_PARALLEL=1` and `num_ctx 2048`"
        ),
        vec![
            ("--max-batch-prefill-tokens".to_owned(), 512.0),
            ("OLLAMA_NUM_PARALLEL".to_owned(), 1.0),
            ("num_ctx".to_owned(), 2048.0)
        ]
    );
    assert_eq!(
        stated(
            "max_batch_prefill_tokens: Some(4096), x",
            "--max-batch-prefill-tokens"
        ),
        Some(4096.0)
    );
    assert_eq!(
        stated(
            "the current vLLM instance can use total_gpu_memory (44.53GiB) x gpu_memory_utilization (0.98) = 43.64GiB",
            "--gpu-memory-utilization"
        ),
        Some(0.98)
    );
    // A fix that raised a prefill the log states is caught.
    let d = Diagnosis {
        findings: vec![
            headroom_doctor::Finding::new(Cause::KvCacheTooSmall, 1.0)
                .fix("`--max-batch-prefill-tokens 8000`"),
        ],
        ..Diagnosis::empty()
    };
    let mut problems = Vec::new();
    let mut n = 0;
    check(
        "t",
        "max_batch_prefill_tokens: Some(4096)",
        &d,
        &mut problems,
        &mut n,
    );
    assert_eq!(n, 1);
    assert_eq!(problems.len(), 1, "{problems:?}");
}
