//! `headroom plan` v2 through the built binary: right-sizing to the concurrency bound (the seed-2
//! case), `--fill`, and the one-line errors of the new flags.

use std::process::{Command, Output};

use serde_json::Value;

const GIB: u64 = 1 << 30;

fn headroom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .env("HF_HOME", "/nonexistent-headroom-test")
        // Never the network: a model outside the catalog is not looked up on the Hub.
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .output()
        .expect("run headroom")
}

fn plan_json(args: &[&str]) -> (Value, i32) {
    let mut all = vec!["plan", "--format", "json"];
    all.extend_from_slice(args);
    let out = headroom(&all);
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
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

const SEED2: &[&str] = &[
    "--model",
    "Qwen/Qwen2.5-7B-Instruct-AWQ",
    "--gpu",
    "24GiB",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "2",
    "--reserve",
    "whisper-large-v3",
    "--reserve",
    "tts=2GiB",
];

#[test]
fn seed2_right_sizes_the_kv_pool_and_reports_headroom() {
    let (p, code) = plan_json(SEED2);
    assert_eq!(code, 0);
    assert_eq!(p["sizing_mode"], "right_sized");
    // Qwen2.5-7B: 28 layers × 4 KV heads × 128 × 2 (K, V) × 2 B = 57,344 B/token; blocks of 16.
    let per_token = 28 * 4 * 128 * 2 * 2;
    assert_eq!(u(&p, "kv_bytes_per_token"), per_token);
    let blocks = 2 * 4096 / 16;
    let expected = (blocks + blocks / 4) * 16 * per_token;
    assert_eq!(u(&p, "kv_cache_memory_bytes"), expected);
    let two_seqs = 2 * 4096 * per_token;
    assert!(u(&p, "kv_cache_bytes") >= two_seqs);
    assert!(u(&p, "kv_cache_bytes") as f64 <= 1.5 * two_seqs as f64);
    let args: Vec<String> = p["vllm_args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_string())
        .collect();
    let at = args.iter().position(|a| a == "--kv-cache-memory").unwrap();
    assert_eq!(args[at + 1], expected.to_string());
    // What is left beside vLLM holds both reservations (6 GiB whisper + 2 GiB TTS) and more.
    let left = u(&p, "headroom_bytes");
    assert!(left > 8 * GIB + 4 * GIB, "{left}");
    assert_eq!(
        left + u(&p, "device_peak_bytes") - u(&p, "reserved_bytes") + u(&p, "safety_margin_bytes"),
        24 * GIB
    );

    let out = headroom(&[&["plan"], SEED2].concat());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&format!("--kv-cache-memory {expected}")),
        "{table}"
    );
    assert!(table.contains("headroom for audio: "), "{table}");
}

#[test]
fn fill_keeps_the_largest_safe_utilization() {
    let (f, code) = plan_json(&[SEED2, &["--fill"]].concat());
    assert_eq!(code, 0);
    assert_eq!(f["sizing_mode"], "fill");
    assert_eq!(f["utilization_source"], "largest_safe");
    // util = floor_2dp((total − co-tenants − margin − context) / total): since vLLM 0.21 the
    // CUDA-graph estimate is inside the budget, so it is not set aside on top.
    let total = 24 * GIB;
    let room = total
        - u(&f, "reserved_bytes")
        - u(&f, "safety_margin_bytes")
        - u(&f, "cuda_context_bytes");
    let util = (room as f64 / total as f64 * 100.0).floor() / 100.0;
    assert_eq!(f["gpu_memory_utilization"].as_f64().unwrap(), util);
    let requested = (total as f64 * util).floor() as u64;
    assert_eq!(
        u(&f, "kv_cache_bytes"),
        requested
            - u(&f, "weights_bytes")
            - u(&f, "activation_peak_bytes")
            - u(&f, "non_torch_bytes")
            - u(&f, "cuda_graph_bytes")
    );
    let (r, _) = plan_json(SEED2);
    assert!(u(&f, "kv_cache_bytes") > 10 * u(&r, "kv_cache_bytes"));
}

#[test]
fn new_flags_reject_bad_values_in_one_line() {
    for (args, needle) in [
        (vec!["--kv-slack=-5%"], "--kv-slack"),
        (vec!["--kv-slack", "lots"], "--kv-slack"),
        (
            vec!["--engine", "llamacpp", "--cache-type-k", "q3"],
            "--cache-type-k",
        ),
        (
            vec!["--engine", "llamacpp", "--parallel", "0"],
            "--parallel",
        ),
        (
            vec!["--engine", "llamacpp", "--flash-attn", "maybe"],
            "--flash-attn",
        ),
        (vec!["--ctx-size", "4096"], "--engine llamacpp"),
    ] {
        let mut all = vec![
            "plan",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--gpu",
            "24GiB",
        ];
        all.extend(args.iter().copied());
        let out = headroom(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{all:?}: {err}");
        assert!(err.contains(needle), "{all:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{all:?}: {err}");
    }
}

#[test]
fn vibevoice_asr_is_planned_as_the_audio_lane_with_its_whole_checkpoint() {
    let base = [
        "--model",
        "microsoft/VibeVoice-ASR",
        "--gpu",
        "24GiB",
        "--audio-minutes",
        "60",
    ];
    let (p, code) = plan_json(&base);
    assert_eq!(code, 0);
    // The checkpoint: the hub index's metadata.total_parameters, 8,674,021,857 BF16 tensors
    // (decoder + lm_head + tokenizers + connectors).
    let checkpoint = 8_674_021_857.0 * 2.0;
    let w = u(&p, "weights_bytes") as f64;
    assert!((w - checkpoint).abs() <= checkpoint * 0.01, "{w}");
    assert!(u(&p, "weights_upcast_bytes") > 0);
    // The modules, their stored dtype (all bf16) and what the vLLM plugin holds them in.
    let parts = p["weights_by_component"].as_array().unwrap();
    let sum: u64 = parts.iter().map(|c| u(c, "bytes")).sum();
    assert_eq!(sum, u(&p, "weights_bytes"));
    assert!(parts.iter().all(|c| c["stored_dtype"] == "bf16"));
    let f32_params: u64 = parts
        .iter()
        .filter(|c| c["loaded_dtype"] == "f32")
        .map(|c| u(c, "params"))
        .sum();
    // Upcast bf16 → f32: 2 more bytes for each of those parameters.
    assert_eq!(u(&p, "weights_upcast_bytes"), 2 * f32_params);
    assert_eq!(p["lanes"]["lane"], "audio");
    // 60 min at 7.5 tokens/s + 250 transcript tokens a minute + a 128-token prompt.
    let len = 60 * 450 + 60 * 250 + 128;
    assert_eq!(u(&p, "max_model_len"), len);
    assert_eq!(p["audio"]["minutes_per_sequence"].as_f64().unwrap(), 60.0);
    let whole = u(&p, "num_blocks") / len.div_ceil(16);
    assert_eq!(u(&p["lanes"], "audio_max_inflight"), whole.max(1));
    assert!(u(&p, "max_num_seqs") <= whole.max(1));

    let (dp, code) = plan_json(&[&base[..], &["--data-parallel-size", "4"]].concat());
    assert_eq!(code, 0);
    let lines = dp["launch_lines"].as_array().unwrap();
    assert_eq!(lines.len(), 4);
    for (i, l) in lines.iter().enumerate() {
        let l = l.as_str().unwrap();
        assert!(
            l.starts_with(&format!("CUDA_VISIBLE_DEVICES={i} vllm serve")),
            "{l}"
        );
        assert!(l.ends_with(&format!("--port {}", 8000 + i)), "{l}");
    }
    assert_eq!(dp["upstreams"][3], "http://127.0.0.1:8003");
    // Per-GPU figures are the single-GPU plan's.
    assert_eq!(u(&dp, "kv_cache_bytes"), u(&p, "kv_cache_bytes"));
    assert_eq!(
        u(&dp, "kv_cache_tokens_all_replicas"),
        4 * u(&p, "kv_cache_tokens")
    );

    let (tp, code) = plan_json(&[&base[..], &["--tensor-parallel-size", "2"]].concat());
    assert_eq!(code, 0);
    // 4 KV heads over 2 GPUs: half of 28 layers × 4 heads × 128 × 2 × 2 B per GPU.
    assert_eq!(u(&tp, "kv_heads_per_rank"), 2);
    assert_eq!(u(&tp, "kv_bytes_per_token"), 57_344 / 2);
    assert_eq!(u(&tp, "kv_bytes_per_token_all_ranks"), 57_344);
    assert_eq!(
        tp["launch_lines"][0].as_str().unwrap().split(' ').next(),
        Some("CUDA_VISIBLE_DEVICES=0,1")
    );
    let out = headroom(&[&["plan"], &base[..], &["--tensor-parallel-size", "2"]].concat());
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("tensor parallel 2: 2 KV heads per GPU"),
        "{table}"
    );
}

#[test]
fn base_twins_are_in_the_catalog() {
    let (l, code) = plan_json(&[
        "--model",
        "meta-llama/Meta-Llama-3-8B",
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(code, 0);
    assert_eq!(l["model"], "meta-llama/Meta-Llama-3-8B");
    // 2 (K, V) × 32 layers × 8 KV heads × 128 × 2 B.
    assert_eq!(u(&l, "kv_bytes_per_token"), 2 * 32 * 8 * 128 * 2);
    let (d, code) = plan_json(&[
        "--model",
        "deepseek-ai/DeepSeek-V2-Lite",
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
    ]);
    assert_eq!(code, 0);
    // MLA: one latent of kv_lora_rank 512 + rope 64 per layer, 27 layers, bf16.
    assert_eq!(u(&d, "kv_bytes_per_token"), 27 * (512 + 64) * 2);
}

#[test]
fn pipeline_parallel_and_vllm_version_flags() {
    let (p, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "8192",
        "--pipeline-parallel-size",
        "2",
    ]);
    assert_eq!(code, 0);
    assert_eq!(u(&p, "layers_per_stage"), 16);
    assert_eq!(u(&p, "kv_bytes_per_token"), 16 * 2 * 8 * 128 * 2);
    assert_eq!(
        p["launch_lines"][0].as_str().unwrap().split(' ').next(),
        Some("CUDA_VISIBLE_DEVICES=0,1")
    );
    let (v, code) = plan_json(&[
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "8192",
        "--vllm-version",
        "0.6.3",
    ]);
    assert_eq!(code, 0);
    assert_eq!(v["vllm_version"], "v0");
    // Without chunked prefill the profiling pass is a whole 8,192-token prompt.
    assert_eq!(u(&v, "max_num_batched_tokens"), 8192);
}
