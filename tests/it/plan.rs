//! `headroom plan` end to end through the built binary: the acceptance figures, the co-tenancy
//! command line, sparse sharded checkpoints read header-only, and every kind of bad input.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const GIB: u64 = 1 << 30;

pub(crate) fn headroom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        // Keep a developer's own Hugging Face cache out of the results.
        .env("HF_HOME", "/nonexistent-headroom-test")
        // Never the network: a model outside the catalog is not looked up on the Hub.
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .output()
        .expect("run headroom")
}

pub(crate) fn plan_json(args: &[&str]) -> (Value, i32) {
    let mut all = vec!["plan", "--format", "json"];
    all.extend_from_slice(args);
    let out = headroom(&all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (json, out.status.code().unwrap())
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn llama_3_1_8b_kv_bytes_and_weights() {
    let (p, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(code, 0);
    assert_eq!(u(&p, "kv_bytes_per_token"), 131_072);
    let weights_gib = u(&p, "weights_bytes") as f64 / GIB as f64;
    assert!((weights_gib - 14.96).abs() <= 14.96 * 0.01, "{weights_gib}");
}

#[test]
fn qwen2_5_7b_kv_bytes_in_bf16_and_fp8() {
    let args = [
        "--model",
        "Qwen/Qwen2.5-7B-Instruct",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "8192",
    ];
    let (p, _) = plan_json(&args);
    assert_eq!(u(&p, "kv_bytes_per_token"), 57_344);
    let mut fp8 = args.to_vec();
    fp8.extend(["--kv-cache-dtype", "fp8"]);
    let (p, _) = plan_json(&fp8);
    assert_eq!(u(&p, "kv_bytes_per_token"), 28_672);
    assert!(
        p["vllm_args"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "fp8")
    );
}

#[test]
fn deepseek_v2_lite_mla_kv_bytes() {
    let (p, _) = plan_json(&[
        "--model",
        "deepseek-ai/DeepSeek-V2-Lite-Chat",
        "--gpu",
        "A100 80GB",
        "--max-model-len",
        "32768",
    ]);
    assert_eq!(u(&p, "kv_bytes_per_token"), 31_104);
}

#[test]
fn llama_70b_over_four_ranks() {
    let (p, _) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-70B-Instruct",
        "--gpu",
        "H100",
        "--tensor-parallel-size",
        "4",
        "--max-model-len",
        "32768",
    ]);
    assert_eq!(u(&p, "kv_bytes_per_token"), 81_920);
    // Weights are split four ways.
    assert!(u(&p, "weights_bytes") < 141_107_412_992 / 4 + GIB);
    assert!(
        p["vllm_args"]
            .as_array()
            .unwrap()
            .windows(2)
            .any(|w| w[0] == "--tensor-parallel-size" && w[1] == "4")
    );
}

#[test]
fn fixed_kv_cache_memory_blocks_tokens_and_concurrency() {
    let (p, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "24GiB",
        "--kv-cache-memory",
        "4GiB",
        "--max-model-len",
        "8192",
        "--gpu-memory-utilization",
        "0.9",
    ]);
    assert_eq!(code, 0, "{p}");
    let blocks = u(&p, "kv_cache_bytes") / (u(&p, "block_size") * 4096 * 32);
    assert_eq!(blocks, 2048);
    assert_eq!(u(&p, "kv_cache_tokens"), 32_768);
    assert_eq!(
        format!("{:.2}", p["max_concurrency"].as_f64().unwrap()),
        "4.00"
    );
    for field in [
        "gpu_total_bytes",
        "weights_bytes",
        "kv_bytes_per_token",
        "activation_peak_bytes",
        "non_torch_bytes",
        "cuda_graph_bytes",
        "reserved_bytes",
        "kv_cache_bytes",
        "kv_cache_tokens",
        "block_size",
        "max_concurrency",
        "gpu_memory_utilization",
        "fits",
        "vllm_args",
        "warnings",
    ] {
        assert!(p.get(field).is_some(), "stable field {field} missing");
    }
}

#[test]
fn awq_beside_whisper_leaves_the_reservation_free() {
    let out = headroom(&[
        "plan",
        "--model",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "--gpu",
        "24GiB",
        "--reserve",
        "whisper-large-v3",
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "4",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("component"), "{table}");
    assert!(table.contains("reserved: whisper-large-v3"), "{table}");
    let cmd = table
        .lines()
        .find(|l| l.starts_with("vllm serve Qwen/Qwen2.5-7B-Instruct-AWQ"))
        .expect("a vllm command line");
    let util: f64 = cmd
        .split_whitespace()
        .skip_while(|w| *w != "--gpu-memory-utilization")
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    // The same plan as JSON: vLLM's budget plus what it holds outside it, plus whisper, fits 24 GiB.
    let (p, _) = plan_json(&[
        "--model",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "--gpu",
        "24GiB",
        "--reserve",
        "whisper-large-v3",
        "--max-model-len",
        "16384",
        "--max-num-seqs",
        "4",
    ]);
    let reserved = u(&p, "reserved_bytes");
    assert!(reserved >= 4 * GIB, "whisper-large-v3 reserves {reserved}");
    let vllm_peak =
        (util * 24.0 * GIB as f64) as u64 + u(&p, "cuda_graph_bytes") + u(&p, "cuda_context_bytes");
    assert!(
        vllm_peak + reserved <= 24 * GIB,
        "util {util}: vLLM {vllm_peak} + whisper {reserved} > 24 GiB"
    );
    assert!(p["max_concurrency"].as_f64().unwrap() >= 4.0);
}

#[test]
fn a_bare_model_number_is_a_gpu_name_not_bytes() {
    let (named, _) = plan_json(&[
        "--model",
        "Qwen/Qwen3-8B",
        "--gpu",
        "3090",
        "--max-model-len",
        "8192",
    ]);
    let (rtx, _) = plan_json(&[
        "--model",
        "Qwen/Qwen3-8B",
        "--gpu",
        "RTX 3090",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(named["gpu_total_bytes"], rtx["gpu_total_bytes"]);
    // vLLM sees 23.58 GiB of a 24,576 MiB RTX 3090.
    let gib = u(&named, "gpu_total_bytes") as f64 / GIB as f64;
    assert!((gib - 23.58).abs() < 0.02, "{gib}");
}

#[test]
fn shell_format_prints_one_command() {
    let out = headroom(&[
        "plan",
        "--model",
        "Qwen/Qwen3-8B",
        "--gpu",
        "RTX 4090",
        "--max-model-len",
        "16k",
        "--format",
        "shell",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1);
    assert!(text.starts_with("vllm serve Qwen/Qwen3-8B --gpu-memory-utilization "));
    assert!(text.contains("--max-model-len 16384"));
}

#[test]
fn a_plan_that_cannot_fit_exits_3_with_the_shortfall_and_options() {
    let out = headroom(&[
        "plan",
        "--model",
        "meta-llama/Llama-3.1-70B-Instruct",
        "--gpu",
        "RTX 4090",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("DOES NOT FIT"), "{table}");
    assert!(table.contains("GiB short"), "{table}");
    // Eight such GPUs hold it: offered with the flags to add.
    assert!(table.contains("options ("), "{table}");
    assert!(table.contains("--tensor-parallel-size 8"), "{table}");
    let (p, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "24GiB",
        "--gpu-memory-utilization",
        "0.9",
        "--max-model-len",
        "131072",
    ]);
    assert_eq!(code, 3);
    assert_eq!(p["fits"], false);
    assert_eq!(p["failure"]["kind"], "max_model_len_does_not_fit");
    let est = u(&p["failure"], "estimated_max_model_len");
    assert!(est > 8192 && est < 131_072, "{est}");
    let names: Vec<&str> = p["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["option"].as_str().unwrap())
        .collect();
    for expected in ["shorter_context", "tensor_parallel_2"] {
        assert!(names.contains(&expected), "{names:?}");
    }
    assert!(
        names.iter().any(|n| n.starts_with("fp8_kv_cache+")),
        "{names:?}"
    );
    // fp8 KV alone is 3+ GiB short here: not offered alone.
    assert!(!names.contains(&"fp8_kv_cache"), "{names:?}");
}

#[test]
fn other_processes_holding_memory_reproduce_vllms_startup_error() {
    let (p, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "24GiB",
        "--gpu-memory-utilization",
        "0.9",
        "--other-used",
        "4GiB",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(code, 3);
    assert_eq!(p["failure"]["kind"], "startup_free_below_utilization");
    assert_eq!(u(&p["failure"], "free_bytes"), 20 * GIB);
}

#[test]
fn vibevoice_asr_audio_minutes_set_the_context() {
    let (p, code) = plan_json(&[
        "--model",
        "microsoft/VibeVoice-ASR",
        "--gpu",
        "H100",
        "--audio-minutes",
        "60",
    ]);
    assert_eq!(code, 0, "{p}");
    assert_eq!(p["audio"]["tokens_per_minute"].as_f64(), Some(450.0));
    assert_eq!(u(&p["audio"], "audio_tokens"), 27_000);
    assert_eq!(
        u(&p, "max_model_len"),
        u(&p["audio"], "max_model_len_needed")
    );
}

fn one_line_exit_2(args: &[&str], needle: &str) {
    let out = headroom(args);
    assert_eq!(out.status.code(), Some(2), "{args:?}");
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "one line, got: {err}");
    assert!(err.contains(needle), "{args:?}: {err}");
    assert!(
        !err.contains("panicked") && !err.contains("backtrace"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let base = ["plan", "--model", "Qwen/Qwen2.5-7B-Instruct"];
    let with = |extra: &[&'static str]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        v
    };
    one_line_exit_2(&with(&["--gpu", "24XB"]), "unknown --gpu '24XB'");
    one_line_exit_2(&with(&["--gpu", "24"]), "smaller than 1 GiB");
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--kv-cache-memory", "lots"]),
        "invalid size 'lots'",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--max-model-len=-5"]),
        "invalid --max-model-len '-5'",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--max-model-len", "0"]),
        "invalid --max-model-len '0'",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--kv-cache-dtype", "int3"]),
        "invalid --kv-cache-dtype",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--quantization", "zip"]),
        "invalid --quantization",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--gpu-memory-utilization", "1.5"]),
        "must be in (0, 1]",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--gpu-memory-utilization", "lots"]),
        "invalid value 'lots'",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--reserve", "whisper-enormous"]),
        "unknown --reserve profile",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--reserve", "=3GiB"]),
        "invalid --reserve",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--audio-minutes", "10"]),
        "audio tokenizer",
    );
    one_line_exit_2(
        &with(&["--gpu", "24GiB", "--no-such-flag"]),
        "--no-such-flag",
    );
    one_line_exit_2(&["plan", "--gpu", "24GiB"], "--model");
    // No --gpu on a machine without a driver: the loader's reason, on one line.
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        one_line_exit_2(&["plan", "--model", "Qwen/Qwen3-8B"], "name one with --gpu");
    }
}

#[test]
fn unknown_model_names_five_catalog_entries() {
    let out = headroom(&[
        "plan",
        "--model",
        "Qwen/Qwen2.5-7B-Instrukt",
        "--gpu",
        "24GiB",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    let list = err.split("closest catalog names: ").nth(1).expect(&err);
    assert_eq!(list.trim().split(", ").count(), 5, "{err}");
    assert!(list.starts_with("Qwen/Qwen2.5-7B-Instruct"), "{err}");
}

#[test]
fn a_config_missing_a_field_names_field_and_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","hidden_size":64,"num_attention_heads":4,"vocab_size":100}"#,
    )
    .unwrap();
    let path = dir.path().to_str().unwrap();
    let out = headroom(&["plan", "--model", path, "--gpu", "24GiB"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("'num_hidden_layers'"), "{err}");
    assert!(err.contains(&format!("{path}/config.json")), "{err}");
}

/// Writes a safetensors shard whose header declares `tensors` of `[rows, cols]` bf16 and whose
/// data is a hole: the file is as long as the header says, but nothing is written there.
fn sparse_shard(path: &Path, tensors: &[(&str, u64, u64)]) -> u64 {
    let tensors: Vec<(String, u64, u64)> = tensors
        .iter()
        .map(|(n, r, c)| (n.to_string(), *r, *c))
        .collect();
    let (header, data) = headroom_hub::testing::shard_header(&tensors);
    let mut f = File::create(path).unwrap();
    f.write_all(&header).unwrap();
    f.set_len(header.len() as u64 + data).unwrap();
    data
}

#[test]
fn sharded_sparse_checkpoint_gives_exact_weights_from_headers() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":8192,
            "intermediate_size":28672,"num_hidden_layers":2,"num_attention_heads":64,"num_key_value_heads":8,
            "vocab_size":128256,"max_position_embeddings":8192,"torch_dtype":"bfloat16"}"#,
    )
    .unwrap();
    let a = sparse_shard(
        &d.join("model-00001-of-00002.safetensors"),
        &[
            ("model.embed_tokens.weight", 128_256, 8192),
            ("model.layers.0.mlp.up_proj.weight", 28_672, 8192),
        ],
    );
    let b = sparse_shard(
        &d.join("model-00002-of-00002.safetensors"),
        &[
            ("lm_head.weight", 128_256, 8192),
            ("model.layers.0.mlp.down_proj.weight", 8192, 28_672),
        ],
    );
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"metadata":{"total_size":1},"weight_map":{
            "model.embed_tokens.weight":"model-00001-of-00002.safetensors",
            "model.layers.0.mlp.up_proj.weight":"model-00001-of-00002.safetensors",
            "lm_head.weight":"model-00002-of-00002.safetensors",
            "model.layers.0.mlp.down_proj.weight":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    assert!(a + b > 4 * GIB, "several GiB declared");
    let on_disk: u64 = std::fs::read_dir(d)
        .unwrap()
        .map(|e| {
            use std::os::unix::fs::MetadataExt;
            e.unwrap().metadata().unwrap().blocks() * 512
        })
        .sum();
    assert!(
        on_disk < 1 << 20,
        "the checkpoint is sparse: {on_disk} bytes on disk"
    );
    let (p, _) = plan_json(&[
        "--model",
        d.to_str().unwrap(),
        "--gpu",
        "H200",
        "--max-model-len",
        "4096",
    ]);
    // Headers win over the index's (deliberately wrong) total_size.
    assert_eq!(u(&p, "weights_bytes"), a + b);
    assert_eq!(p["weights_origin"], "exact");
}

#[test]
fn reserve_from_a_calibration_file_reserves_the_measured_audio_peaks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box.up.calibration.json");
    calibration_file(
        &path,
        "nvml",
        &[
            ("whisper", "audio", 3 * GIB),
            ("tts", "audio", GIB / 2),
            ("llm", "text", 18 * GIB),
        ],
    );
    let args = [
        "--model",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "16384",
    ];
    let (plain, _) = plan_json(&args);
    let mut with: Vec<&str> = args.to_vec();
    with.extend(["--reserve-from", path.to_str().unwrap()]);
    let (p, _) = plan_json(&with);
    // Both audio peaks, not the text engine's figures: 3.5 GiB.
    assert_eq!(u(&p, "reserved_bytes"), 3 * GIB + GIB / 2);
    assert_eq!(p["reservations"].as_array().unwrap().len(), 2);
    assert!(
        p["gpu_memory_utilization"].as_f64().unwrap()
            < plain["gpu_memory_utilization"].as_f64().unwrap()
    );
    // A file with no audio figures is refused in one line with exit 2.
    let empty = dir.path().join("empty.calibration.json");
    std::fs::write(&empty, r#"{"format":1,"date":"2026-12-01T09:00:00Z"}"#).unwrap();
    let mut bad: Vec<&str> = vec!["plan"];
    bad.extend(args);
    bad.extend(["--reserve-from", empty.to_str().unwrap()]);
    let out = headroom(&bad);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no audio backend"), "{err}");
}

/// A calibration file as `headroom up` writes it: each backend's peak, half of it resident.
pub(crate) fn calibration_file(path: &Path, probe: &str, backends: &[(&str, &str, u64)]) {
    let mut c = headroom_gpu::Calibration::new(probe, 24 * GIB);
    for (name, role, peak) in backends {
        c.set_backend(
            name,
            headroom_gpu::BackendCalibration {
                role: role.to_string(),
                engine: "other".into(),
                idle_bytes: None,
                resident_bytes: peak / 2,
                peak_bytes: *peak,
                peak_per_audio_second_bytes: None,
                speech_seconds_per_char: None,
                warmup_runs: 3,
                date: String::new(),
            },
        );
    }
    c.save(path).unwrap();
}
