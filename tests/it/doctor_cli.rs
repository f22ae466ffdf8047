//! `headroom doctor` as a script uses it: documented exit codes, `--model` that adds a comparison
//! and never removes findings, fixes that name the value and the variable, and findings ranked
//! with the secondary ones saying why.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn log(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/logs")
        .join(name)
}

fn doctor(args: &[&str], file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .arg("doctor")
        .args(args)
        .arg(file)
        .env("HF_HOME", "/nonexistent-headroom-test")
        .env_remove("HF_HUB_CACHE")
        .output()
        .expect("run headroom")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn model_on_an_oom_log_keeps_every_finding() {
    let oom = log("vllm-v1-oom-8gb-gpu.log");
    let plain = doctor(&["--format", "json"], &oom);
    let with_model = doctor(
        &[
            "--format",
            "json",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
        ],
        &oom,
    );
    assert_eq!(
        with_model.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&with_model.stderr)
    );
    let a: Value = serde_json::from_slice(&plain.stdout).unwrap();
    let b: Value = serde_json::from_slice(&with_model.stdout).unwrap();
    assert!(!a["findings"].as_array().unwrap().is_empty());
    assert_eq!(
        a["findings"], b["findings"],
        "--model must not change the findings"
    );
    assert!(
        b["plan_comparison_note"]
            .as_str()
            .unwrap_or("")
            .contains("no vLLM memory figures"),
        "{b}"
    );
    // A log with figures gets the comparison added to its findings.
    let ok = doctor(
        &["--model", "meta-llama/Llama-3.1-8B-Instruct"],
        &log("vllm-v0-profile-20k-ok.log"),
    );
    assert!(
        stdout(&ok).contains("log vs `headroom plan`"),
        "{}",
        stdout(&ok)
    );
}

#[test]
fn exit_codes_are_the_documented_ones() {
    let ok = doctor(&[], &log("vllm-v1-ok-cudagraph-estimate.log"));
    assert_eq!(ok.status.code(), Some(0), "nothing found: {}", stdout(&ok));
    let oom = doctor(&[], &log("vllm-v1-startup-free-below-util.log"));
    assert_eq!(oom.status.code(), Some(1), "a memory problem found");
    let missing = doctor(&[], Path::new("/nonexistent/engine.log"));
    assert_eq!(missing.status.code(), Some(2));
    let bad_model = doctor(
        &["--model", "./no/such/model"],
        &log("vllm-v1-ok-cudagraph-estimate.log"),
    );
    assert_eq!(bad_model.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad_model.stderr).contains("no such file or directory"));
}

#[test]
fn fixes_name_the_value_and_the_variable() {
    let ollama = doctor(&[], &log("ollama-offload-partial.log"));
    assert!(
        stdout(&ollama).contains("OLLAMA_FLASH_ATTENTION=1"),
        "{}",
        stdout(&ollama)
    );
    assert!(stdout(&ollama).contains("OLLAMA_KV_CACHE_TYPE=q8_0"));
    // llama.cpp without n_ubatch in the log: half the default.
    let rocm = doctor(&[], &log("llamacpp-compute-buffer-rocm.log"));
    assert!(stdout(&rocm).contains("`-ub 256`"), "{}", stdout(&rocm));
    // With n_ubatch and n_ctx in the log: half of those.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("llama.log");
    std::fs::write(
        &file,
        "llama_context: n_ctx         = 16384\n\
         llama_context: n_ubatch      = 1024\n\
         ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: cudaMalloc failed: out of memory\n\
         ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 9437184000\n",
    )
    .unwrap();
    let out = doctor(&[], &file);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("`-ub 512`"), "{}", stdout(&out));
    std::fs::write(
        &file,
        "llama_context: n_ctx         = 16384\n\
         ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: cudaMalloc failed: out of memory\n\
         llama_kv_cache_init: failed to allocate buffer for kv cache\n",
    )
    .unwrap();
    let out = doctor(&[], &file);
    assert!(stdout(&out).contains("`-c 8192`"), "{}", stdout(&out));
}

#[test]
fn the_first_finding_is_the_cause_and_the_rest_say_why_they_are_secondary() {
    let file = log("vllm-v1-startup-free-below-util.log");
    let out = doctor(&["--format", "json"], &file);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let findings = v["findings"].as_array().unwrap();
    assert!(findings.len() >= 2, "{v}");
    assert_eq!(findings[0]["role"], "cause");
    assert!(findings[0].get("secondary_because").is_none());
    for f in &findings[1..] {
        assert_eq!(f["role"], "secondary");
        let why = f["secondary_because"].as_str().unwrap();
        assert!(
            why.contains(findings[0]["cause"].as_str().unwrap()),
            "{why}"
        );
    }
    let table = stdout(&doctor(&[], &file));
    assert_eq!(
        table.matches("   secondary: ").count(),
        findings.len() - 1,
        "{table}"
    );
}

#[test]
fn model_replans_the_flag_change_a_fix_names() {
    let file = log("vllm-v1-startup-free-below-util.log");
    let out = doctor(
        &["--format", "json", "--model", "Qwen/Qwen2.5-7B-Instruct"],
        &file,
    );
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let first = &v["findings"][0];
    let checked = first["fix_replanned"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"));
    assert!(
        checked.contains("`--gpu-memory-utilization 0.89`"),
        "{checked}"
    );
    // Whatever the verdict, the utilization it names must fit when `headroom plan` is run with the
    // log's figures (total, memory held by others) and that utilization.
    let util = if checked.contains("does not fit") {
        checked
            .split("what fits instead: `--gpu-memory-utilization ")
            .nth(1)
            .and_then(|r| r.split('`').next())
            .unwrap_or_else(|| panic!("{checked}"))
            .to_string()
    } else {
        "0.89".to_string()
    };
    let n = &first["numbers"];
    let plan = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args([
            "plan",
            "--model",
            "Qwen/Qwen2.5-7B-Instruct",
            "--format",
            "shell",
        ])
        .arg("--gpu")
        .arg(format!("{}GiB", n["total_gib"]))
        .arg("--other-used")
        .arg(format!("{}GiB", n["held_by_others_gib"]))
        .args(["--safety-margin", "0B", "--gpu-memory-utilization", &util])
        .output()
        .unwrap();
    assert_eq!(
        plan.status.code(),
        Some(0),
        "{util}: {}",
        String::from_utf8_lossy(&plan.stderr)
    );
}

#[test]
fn color_always_colours_the_report_and_never_or_a_pipe_does_not() {
    let file = log("vllm-v1-startup-free-below-util.log");
    let always = doctor(&["--color", "always"], &file);
    assert_eq!(always.status.code(), Some(1));
    let text = stdout(&always);
    assert!(
        text.contains("\x1b[1;31m1. startup_free_memory_below_utilization\x1b[0m"),
        "{text:?}"
    );
    assert!(text.contains("\x1b[1;32mfix:\x1b[0m"), "{text:?}");
    assert!(
        text.contains("\x1b[33m2. "),
        "secondary findings in yellow: {text:?}"
    );
    for args in [&["--color", "never"][..], &[][..]] {
        let plain = doctor(args, &file);
        assert!(
            !stdout(&plain).contains('\x1b'),
            "{args:?}: {}",
            stdout(&plain)
        );
    }
    // JSON is data: never styled.
    let json = doctor(&["--color", "always", "--format", "json"], &file);
    assert!(!stdout(&json).contains('\x1b'));
}
