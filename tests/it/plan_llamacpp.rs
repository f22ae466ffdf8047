//! `headroom plan --engine llamacpp` against the real llama.cpp: the xllamacpp wheel's embedded
//! server loads a GGUF at several `--ctx-size`/`--parallel`/`--ubatch-size`/cache-type settings
//! and logs its own buffer sizes; the plan must match its KV buffer within 1 % and its compute
//! buffer within 15 %. Two architectures: the bundled SmolLM2 (llama) and Gemma 3 270M (gemma3:
//! sliding-window layers, a second KQ mask, Q wider than n_embd), which scripts/backends.sh
//! install assembles into `.backends/models` (HEADROOM_GEMMA_GGUF overrides the path). Needs
//! `.backends/llm`; skipped locally without it, a failure when HEADROOM_REQUIRE_PY is set
//! (scripts/test.sh, CI).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const MIB: f64 = (1u64 << 20) as f64;

fn llm_python() -> Option<PathBuf> {
    let p = match std::env::var_os("HEADROOM_LLM_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join(".backends/llm/bin/python"),
    };
    p.is_file().then_some(p)
}

fn launcher() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/llama_memory.py")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs the launcher with `flags`; returns its log (stdout + stderr), killing it after 120 s.
fn run_llama(python: &Path, flags: &[&str]) -> String {
    run_llama_model(python, None, flags)
}

/// As `run_llama`, loading `model` instead of the bundled SmolLM2 when given.
fn run_llama_model(python: &Path, model: Option<&str>, flags: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("out.log");
    let out = std::fs::File::create(&out_path).unwrap();
    let err = out.try_clone().unwrap();
    let port = free_port().to_string();
    let mut child = Command::new(python)
        .arg(launcher())
        .args(["--port", &port])
        .args(model.map(|m| vec!["--model", m]).unwrap_or_default())
        .args(flags)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start the llama.cpp launcher");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let log = std::fs::read_to_string(&out_path).unwrap_or_default();
            assert!(
                status.success() || log.contains("LOADED"),
                "{flags:?}: {status}\n{log}"
            );
            return log;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&out_path).unwrap_or_default();
            if log.contains("LOADED") {
                return log;
            }
            panic!("llama.cpp did not load within 120 s ({flags:?}):\n{log}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `X` of `... <marker> X MiB` on each line containing `marker`.
fn mib_values(log: &str, marker: &str) -> Vec<f64> {
    log.lines()
        .filter_map(|l| l.split_once(marker))
        .filter_map(|(_, rest)| rest.split_whitespace().next()?.parse::<f64>().ok())
        .collect()
}

/// llama.cpp's logged KV buffer (all caches of the context) and CPU compute buffer, in MiB.
fn logged_buffers(log: &str) -> (f64, f64) {
    let ctx = log
        .rfind("constructing llama_context")
        .map_or(log, |i| &log[i..]);
    let kv = mib_values(ctx, "llama_kv_cache: size =");
    let compute = mib_values(ctx, "CPU compute buffer size =");
    assert!(
        !kv.is_empty() && !compute.is_empty(),
        "no buffer lines in:\n{ctx}"
    );
    (kv.iter().sum(), compute[0])
}

fn planned(model: &str, flags: &[&str]) -> Value {
    let mut args = vec![
        "plan",
        "--engine",
        "llamacpp",
        "--format",
        "json",
        "--model",
        model,
        "--gpu",
        "24GiB",
        "--n-gpu-layers",
        "0",
    ];
    args.extend_from_slice(flags);
    let out = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The settings both models are checked at: context, slots, micro-batch, KV types, one unified
/// KV, flash attention off, a larger batch.
const COMMON_SETTINGS: &[&[&str]] = &[
    &["--ctx-size", "4096"],
    &[
        "--ctx-size",
        "3000",
        "--parallel",
        "3",
        "--cache-type-k",
        "q4_0",
        "--cache-type-v",
        "q4_0",
    ],
    &[
        "--ctx-size",
        "8192",
        "--parallel",
        "4",
        "--ubatch-size",
        "256",
        "--cache-type-k",
        "q8_0",
        "--cache-type-v",
        "q8_0",
    ],
    &[
        "--ctx-size",
        "4096",
        "--parallel",
        "4",
        "--kv-unified",
        "--ubatch-size",
        "1024",
    ],
    &[
        "--ctx-size",
        "2048",
        "--ubatch-size",
        "128",
        "--cache-type-k",
        "q8_0",
        "--flash-attn",
        "off",
    ],
    &[
        "--ctx-size",
        "16384",
        "--batch-size",
        "1024",
        "--ubatch-size",
        "1024",
        "--cache-type-v",
        "q5_0",
    ],
];

/// The common settings and a model's own.
fn settings_with(extra: &[&'static [&'static str]]) -> Vec<&'static [&'static str]> {
    COMMON_SETTINGS
        .iter()
        .copied()
        .chain(extra.iter().copied())
        .collect()
}

#[test]
fn plan_matches_real_llama_cpp_buffers() {
    let Some(python) = llm_python() else {
        assert!(
            std::env::var_os("HEADROOM_REQUIRE_PY").is_none(),
            "HEADROOM_REQUIRE_PY is set but .backends/llm (xllamacpp) is missing"
        );
        eprintln!("SKIPPED: .backends/llm is not installed (scripts/backends.sh install)");
        return;
    };
    let first = run_llama(&python, &["--ctx-size", "256", "--print-model"]);
    let model = first
        .lines()
        .find_map(|l| l.strip_prefix("MODEL "))
        .expect("model path")
        .trim()
        .to_string();
    let settings = settings_with(&[
        &["--ctx-size", "4096", "--parallel", "2"],
        &[
            "--ctx-size",
            "6144",
            "--parallel",
            "2",
            "--flash-attn",
            "off",
        ],
    ]);
    check_against_llama(&python, &model, None, &settings);
}

fn gemma_gguf() -> PathBuf {
    match std::env::var_os("HEADROOM_GEMMA_GGUF") {
        Some(p) => PathBuf::from(p),
        None => {
            Path::new(env!("CARGO_MANIFEST_DIR")).join(".backends/models/gemma-3-270m-q4_k_m.gguf")
        }
    }
}

#[test]
fn plan_matches_real_llama_cpp_buffers_on_gemma3() {
    let (Some(python), gguf) = (llm_python(), gemma_gguf()) else {
        assert!(
            std::env::var_os("HEADROOM_REQUIRE_PY").is_none(),
            "HEADROOM_REQUIRE_PY is set but .backends/llm (xllamacpp) is missing"
        );
        eprintln!("SKIPPED: .backends/llm is not installed (scripts/backends.sh install)");
        return;
    };
    if !gguf.is_file() {
        assert!(
            std::env::var_os("HEADROOM_REQUIRE_PY").is_none(),
            "HEADROOM_REQUIRE_PY is set but {} is missing (scripts/backends.sh install)",
            gguf.display()
        );
        eprintln!("SKIPPED: {} is missing", gguf.display());
        return;
    }
    let model = gguf.to_string_lossy().into_owned();
    let settings = settings_with(&[&[
        "--ctx-size",
        "4096",
        "--parallel",
        "2",
        "--flash-attn",
        "off",
    ]]);
    check_against_llama(&python, &model, Some(&model), &settings);
}

/// Loads `model` (the bundled one when `load` is None) at each setting and compares llama.cpp's
/// logged KV and compute buffers with the plan's.
fn check_against_llama(python: &Path, model: &str, load: Option<&str>, settings: &[&[&str]]) {
    let mut rows = Vec::new();
    for flags in settings {
        let log = run_llama_model(python, load, flags);
        let (kv_real, compute_real) = logged_buffers(&log);
        let p = planned(model, flags);
        let kv = p["kv_cache_bytes"].as_u64().unwrap() as f64 / MIB;
        let compute = p["compute_buffer_bytes"].as_u64().unwrap() as f64 / MIB;
        let row = format!(
            "{:<100} KV {kv:8.2} vs {kv_real:8.2} MiB ({:+.2} %), compute {compute:7.2} vs {compute_real:7.2} MiB ({:+.1} %)",
            flags.join(" "),
            (kv / kv_real - 1.0) * 100.0,
            (compute / compute_real - 1.0) * 100.0
        );
        eprintln!("{row}");
        rows.push((row, kv, kv_real, compute, compute_real));
    }
    for (row, kv, kv_real, compute, compute_real) in rows {
        assert!(
            (kv - kv_real).abs() <= kv_real * 0.01,
            "KV off by more than 1 %: {row}"
        );
        assert!(
            (compute - compute_real).abs() <= compute_real * 0.15,
            "compute buffer off by more than 15 %: {row}"
        );
    }
}
