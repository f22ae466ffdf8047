//! `headroom plan` keeps what it was asked for: options that keep the minutes of audio, the
//! length and the sequences come first and the others say what they give up; a re-plan with an
//! option's flags works even when a flag is already on the line; nothing runnable for a plan that
//! does not fit; the defaults of the vLLM release asked for; help, man pages and the README say
//! what every flag does; colour when asked.

use std::path::Path;
use std::process::Output;

use crate::plan::{calibration_file, headroom, plan_json};

use serde_json::Value;

const GIB: u64 = 1 << 30;

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

const VIBEVOICE_12GIB_60MIN: [&str; 6] = [
    "--model",
    "microsoft/VibeVoice-ASR",
    "--gpu",
    "12GiB",
    "--audio-minutes",
    "60",
];

#[test]
fn options_that_keep_the_minutes_asked_come_before_those_that_cut_them() {
    let (p, code) = plan_json(&VIBEVOICE_12GIB_60MIN);
    assert_eq!(code, 3);
    let needed = p["audio"]["max_model_len_needed"].as_u64().unwrap();
    assert!(needed > 40_000, "{needed}");
    let options = p["options"].as_array().unwrap();
    assert!(!options.is_empty());
    // The first option keeps the 60 minutes.
    let first = &options[0];
    assert!(
        first["max_model_len"].as_u64().unwrap() >= needed,
        "the first option cuts the context: {first}"
    );
    // Every keeping option comes before every cutting one, and each cutting one says so.
    let keeps: Vec<bool> = options
        .iter()
        .map(|o| o["max_model_len"].as_u64().unwrap() >= needed)
        .collect();
    assert!(
        keeps.windows(2).all(|w| w[0] || !w[1]),
        "a cut-context option comes before a keeping one: {options:?}"
    );
    for o in options {
        let kept = o["max_model_len"].as_u64().unwrap() >= needed;
        assert_eq!(o["keeps_asked"].as_bool(), Some(kept), "{o}");
        let text = o["description"].as_str().unwrap();
        if !kept {
            assert!(
                text.contains("not 60"),
                "no word of the minutes given up: {o}"
            );
        }
    }
    // More GPUs are among the ways to keep 60 minutes.
    assert!(
        options
            .iter()
            .any(|o| o["gpus"].as_u64().unwrap() > 1
                && o["max_model_len"].as_u64().unwrap() >= needed),
        "{options:?}"
    );
}

#[test]
fn a_replan_at_a_shorter_length_does_not_say_fits_for_the_minutes_asked() {
    let mut args = vec!["plan"];
    args.extend(VIBEVOICE_12GIB_60MIN);
    args.extend(["--quantization", "bnb-4bit", "--max-model-len", "18400"]);
    let out = headroom(&args);
    let text = stdout(&out);
    assert!(
        !text.lines().any(|l| l.trim() == "verdict: fits"),
        "says it fits beside 60 minutes it does not hold:\n{text}"
    );
    let verdict = text.lines().find(|l| l.starts_with("verdict:")).unwrap();
    assert!(verdict.contains("not 60"), "{verdict}");
    let (p, _) = plan_json(&args[1..]);
    assert!(
        !p["gives_up"].as_array().unwrap().is_empty(),
        "{}",
        p["gives_up"]
    );
}

/// Every option's flags, added to the command line it was printed for, plan again to a plan
/// that fits (and, for an option that keeps what was asked, with nothing given up).
fn every_option_replans(args: &[&str]) {
    let (p, code) = plan_json(args);
    assert_eq!(code, 3, "{args:?}");
    let options = p["options"].as_array().unwrap();
    assert!(!options.is_empty(), "{args:?}");
    for o in options {
        let extra: Vec<String> = o["headroom_args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect();
        let mut again: Vec<&str> = args.to_vec();
        again.extend(extra.iter().map(String::as_str));
        let (q, code) = plan_json(&again);
        assert_eq!(code, 0, "{again:?} does not fit again: {}", q["failure"]);
        assert_eq!(
            q["gives_up"].as_array().unwrap().is_empty(),
            o["keeps_asked"].as_bool().unwrap(),
            "{again:?}"
        );
    }
}

const LOW_UTILIZATION: [&str; 12] = [
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
    "--gpu-memory-utilization",
    "0.2",
];

#[test]
fn adding_an_options_flags_plans_again_even_when_the_flag_is_on_the_line() {
    every_option_replans(&LOW_UTILIZATION);
    every_option_replans(&VIBEVOICE_12GIB_60MIN);
}

#[test]
fn the_cheapest_option_for_a_too_low_utilization_is_the_least_memory() {
    let (p, _) = plan_json(&LOW_UTILIZATION);
    let options = p["options"].as_array().unwrap();
    let first = &options[0];
    // Without the flag the same plan is right-sized; that utilization is the cheapest fix.
    let (natural, code) = plan_json(&LOW_UTILIZATION[..10]);
    assert_eq!(code, 0);
    assert_eq!(natural["utilization_source"], "right_sized");
    let right = natural["gpu_memory_utilization"].as_f64().unwrap();
    let safe = p["largest_safe_gpu_memory_utilization"].as_f64().unwrap();
    let u = first["gpu_memory_utilization"].as_f64().unwrap();
    assert!(
        (u - right).abs() < 0.011 && u < safe - 0.1,
        "first option {u}, right-sized {right}, largest safe {safe}: {first}"
    );
    // It leaves the whisper reservation its memory.
    assert!(
        first["memory_needed_bytes"].as_u64().unwrap() < 20 * GIB,
        "{first}"
    );
}

#[test]
fn a_flag_given_twice_takes_the_later_value_with_a_note() {
    let out = headroom(&[
        "plan",
        "--format",
        "json",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "12GiB",
        "--max-model-len",
        "8192",
        "--gpu",
        "H100",
        "--tp",
        "1",
        "--tensor-parallel-size",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let p: Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(p["gpu_name"], "NVIDIA H100 80GB HBM3");
    assert_eq!(p["tensor_parallel_size"], 2);
    let err = stderr(&out);
    assert!(err.contains("--gpu") && err.contains("H100"), "{err}");
    assert!(err.contains("--tensor-parallel-size"), "{err}");
}

#[test]
fn no_launch_lines_for_a_plan_that_does_not_fit() {
    for extra in [
        &[
            "--model",
            "meta-llama/Llama-3.1-70B-Instruct",
            "--gpu",
            "24GiB",
            "--tp",
            "2",
        ][..],
        &[
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--gpu",
            "8GiB",
            "--dp",
            "2",
        ],
    ] {
        let mut args = vec!["plan"];
        args.extend(extra);
        let out = headroom(&args);
        assert_eq!(out.status.code(), Some(3), "{extra:?}");
        let text = stdout(&out);
        assert!(text.contains("nothing to run"), "{text}");
        assert!(
            !text.contains("launch:") && !text.contains("vllm serve"),
            "{extra:?} prints a launch line:\n{text}"
        );
        let (p, _) = plan_json(extra);
        assert!(
            p["launch_lines"].as_array().is_none_or(|l| l.is_empty()),
            "{}",
            p["launch_lines"]
        );
    }
}

#[test]
fn reserve_from_host_memory_figures_warns() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("box.calibration.json");
    calibration_file(&path, "host", &[("whisper", "audio", 2 * GIB)]);
    let args = [
        "plan",
        "--model",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "--gpu",
        "24GiB",
        "--max-model-len",
        "8192",
        "--reserve-from",
        path.to_str().unwrap(),
    ];
    let out = headroom(&args);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("probe: host") && err.contains("not GPU memory"),
        "no warning that host figures are reserved as GPU memory: {err}"
    );
    // The same file measured on a GPU says nothing.
    let mut gpu = headroom_gpu::Calibration::load(&path).unwrap();
    gpu.probe = "nvml".into();
    gpu.save(&path).unwrap();
    let out = headroom(&args);
    assert!(!stderr(&out).contains("probe"), "{}", stderr(&out));
}

#[test]
fn the_default_utilization_follows_the_vllm_release() {
    let base = [
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
    ];
    let (latest, _) = plan_json(&base);
    assert_eq!(latest["utilization_source"], "default");
    assert_eq!(latest["gpu_memory_utilization"], 0.92);
    // 0.21 and later count the CUDA-graph estimate inside the budget.
    let inside = latest["requested_bytes"].as_u64().unwrap()
        - latest["weights_bytes"].as_u64().unwrap()
        - latest["activation_peak_bytes"].as_u64().unwrap()
        - latest["non_torch_bytes"].as_u64().unwrap()
        - latest["cuda_graph_bytes"].as_u64().unwrap();
    assert_eq!(latest["kv_cache_bytes"].as_u64().unwrap(), inside);
    for (version, util) in [
        ("0.21.0", 0.92),
        ("0.20.1", 0.9),
        ("0.10.1", 0.9),
        ("0.6.3", 0.9),
    ] {
        let mut args = base.to_vec();
        args.extend(["--vllm-version", version]);
        let (p, _) = plan_json(&args);
        assert_eq!(p["gpu_memory_utilization"], util, "{version}");
    }
    let mut args = base.to_vec();
    args.extend(["--vllm-version", "0.20.1"]);
    let (before, _) = plan_json(&args);
    let outside = before["requested_bytes"].as_u64().unwrap()
        - before["weights_bytes"].as_u64().unwrap()
        - before["activation_peak_bytes"].as_u64().unwrap()
        - before["non_torch_bytes"].as_u64().unwrap();
    assert_eq!(before["kv_cache_bytes"].as_u64().unwrap(), outside);
}

/// `--flag` lines of a clap help text, each with the text clap printed under it.
fn help_entries(help: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = help.lines().collect();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        if let Some(rest) = t.strip_prefix("--").or_else(|| t.strip_prefix("-h, --")) {
            let flag = rest.split([' ', ',']).next().unwrap().to_string();
            let described = lines.get(i + 1).map_or("", |d| d.trim()).to_string();
            out.push((flag, described));
        }
    }
    out
}

#[test]
fn help_describes_every_plan_flag() {
    let out = headroom(&["plan", "--help"]);
    let help = stdout(&out);
    let entries = help_entries(&help);
    assert!(entries.len() > 40, "{help}");
    for (flag, text) in entries.iter().filter(|(f, _)| f != "help") {
        let words = text
            .split_whitespace()
            .filter(|w| !w.starts_with('['))
            .count();
        assert!(words >= 3, "--{flag} has no description: '{text}'");
    }
    assert!(!help.contains("[default: \"\"]"), "{help}");
    let util = &entries
        .iter()
        .find(|(f, _)| f == "gpu-memory-utilization")
        .unwrap()
        .1;
    assert!(util.contains("0.92"), "{util}");
}

#[test]
fn man_pages_have_an_exit_status_section() {
    let dir = tempfile::tempdir().unwrap();
    let out = headroom(&["man", "--out-dir", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    for (page, codes) in [
        ("headroom.1", &["0", "2", "3"][..]),
        ("headroom-plan.1", &["0", "2", "3"]),
        ("headroom-doctor.1", &["0", "1", "2"]),
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        let section = text
            .split(".SH ")
            .find(|s| s.starts_with("\"EXIT STATUS\"") || s.starts_with("EXIT STATUS"))
            .unwrap_or_else(|| panic!("{page} has no EXIT STATUS section"));
        for c in codes {
            assert!(
                section.contains(&format!("\\fB{c}\\fR")),
                "{page}: exit {c} missing in {section}"
            );
        }
    }
    let printed = stdout(&headroom(&["man"]));
    assert!(
        printed.contains("EXIT STATUS"),
        "headroom man prints no EXIT STATUS"
    );
}

fn readme_plan_section() -> String {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let start = readme.find("## `headroom plan`").unwrap();
    let rest = &readme[start + 3..];
    let end = rest.find("\n## ").unwrap_or(rest.len());
    rest[..end].to_string()
}

#[test]
fn the_readme_lists_every_plan_flag_and_the_catalog_count() {
    let section = readme_plan_section();
    let help = stdout(&headroom(&["plan", "--help"]));
    for (flag, _) in help_entries(&help) {
        if flag == "help" || flag == "color" {
            continue;
        }
        assert!(
            section.contains(&format!("`--{flag}")),
            "the README's plan section does not describe --{flag}"
        );
    }
    let models = stdout(&headroom(&["plan", "--list", "models"]))
        .lines()
        .count();
    assert!(
        section.contains(&format!("{models} models")),
        "the README does not say {models} models"
    );
}

#[test]
fn a_bare_small_size_gets_one_consistent_message() {
    let out = headroom(&[
        "plan",
        "--gpu",
        "H100",
        "--model",
        "x",
        "--reserve",
        "stt=3",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        !(err.contains("needs a unit") && err.contains("a bare number is bytes")),
        "says both that a size needs a unit and that a bare number is bytes: {err}"
    );
    assert!(err.contains("3GiB"), "{err}");
}

#[test]
fn color_always_colours_the_plan_and_never_does_not() {
    let args = [
        "plan",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu",
        "H100",
        "--max-model-len",
        "8192",
    ];
    let mut always = args.to_vec();
    always.extend(["--color", "always"]);
    let text = stdout(&headroom(&always));
    assert!(
        text.contains("\x1b["),
        "--color always: no colour in\n{text}"
    );
    let mut never = args.to_vec();
    never.extend(["--color", "never"]);
    assert!(!stdout(&headroom(&never)).contains('\x1b'));
    // Not a terminal, no flag: plain.
    assert!(!stdout(&headroom(&args)).contains('\x1b'));
}

/// A tiny decoder: hidden 256, MLP 512 (gated), 2 layers, 4 heads, vocab 1,000. Its decoder
/// projections hold 2 × (4 × 256² + 3 × 256 × 512) = 1,310,720 weights, 20,480 blocks of 64.
const TINY: &str = r#""architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":256,
    "intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,
    "vocab_size":1000,"max_position_embeddings":4096,"torch_dtype":"bfloat16""#;

/// A safetensors file holding only a header: `(name, dtype, shape, bytes)`.
fn header_only(path: &Path, tensors: &[(&str, &str, &[u64], u64)]) -> u64 {
    let mut offset = 0;
    let mut entries = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let shape: Vec<String> = shape.iter().map(u64::to_string).collect();
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            shape.join(","),
            offset + bytes
        ));
        offset += bytes;
    }
    let json = format!("{{{}}}", entries.join(","));
    let mut data = (json.len() as u64).to_le_bytes().to_vec();
    data.extend_from_slice(json.as_bytes());
    std::fs::write(path, data).unwrap();
    offset
}

#[test]
fn a_double_quantized_bnb_checkpoint_is_planned_as_vllm_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        format!(
            r#"{{{TINY},"quantization_config":{{"quant_method":"bitsandbytes","load_in_4bit":true,
            "bnb_4bit_quant_type":"nf4","bnb_4bit_use_double_quant":true}}}}"#
        ),
    )
    .unwrap();
    // As saved: NF4 packed two to a byte, an 8-bit absmax per 64, an fp32 one per 256 of those.
    let on_disk = header_only(
        &dir.path().join("model.safetensors"),
        &[
            ("model.embed_tokens.weight", "BF16", &[1000, 256], 512_000),
            ("lm_head.weight", "BF16", &[1000, 256], 512_000),
            ("model.layers.all.weight", "U8", &[655_360, 1], 655_360),
            ("model.layers.all.weight.absmax", "U8", &[20_480], 20_480),
            ("model.layers.all.weight.nested_absmax", "F32", &[80], 320),
        ],
    );
    let (p, code) = plan_json(&[
        "--model",
        dir.path().to_str().unwrap(),
        "--gpu",
        "24GiB",
        "--max-model-len",
        "4096",
    ]);
    assert_eq!(code, 0, "{}", p["refused"]);
    // vLLM dequantizes each 8-bit absmax to fp32 at load: 3 more bytes for each of 20,480 blocks.
    assert_eq!(p["weights_bytes"].as_u64().unwrap(), on_disk + 61_440);
    // And refuses to split such a checkpoint over tensor-parallel ranks.
    let (tp, code) = plan_json(&[
        "--model",
        dir.path().to_str().unwrap(),
        "--gpu",
        "24GiB",
        "--max-model-len",
        "4096",
        "--tp",
        "2",
    ]);
    assert_eq!(code, 3);
    assert!(
        tp["refused"][0]
            .as_str()
            .unwrap()
            .contains("tensor-parallel"),
        "{}",
        tp["refused"]
    );
}

#[test]
fn bnb_4bit_at_load_time_quantizes_a_vision_towers_linear_layers() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("text");
    let vlm = dir.path().join("vlm");
    std::fs::create_dir_all(&text).unwrap();
    std::fs::create_dir_all(&vlm).unwrap();
    std::fs::write(text.join("config.json"), format!("{{{TINY}}}")).unwrap();
    // A tower of 2 layers, hidden 128, MLP 256: 2 × (4 × 128² + 2 × 128 × 256) = 262,144
    // weights, all in vLLM linear layers (both sizes are multiples of 64).
    std::fs::write(
        vlm.join("config.json"),
        format!(
            r#"{{{TINY},"vision_config":{{"hidden_size":128,"intermediate_size":256,"num_hidden_layers":2}}}}"#
        ),
    )
    .unwrap();
    let weights = |model: &Path, quantization: &str| {
        let (p, code) = plan_json(&[
            "--model",
            model.to_str().unwrap(),
            "--gpu",
            "24GiB",
            "--max-model-len",
            "4096",
            "--quantization",
            quantization,
        ]);
        assert_eq!(code, 0, "{p}");
        p["weights_bytes"].as_u64().unwrap() as i64
    };
    // 16-bit: the tower adds 262,144 × 2 B.
    assert_eq!(weights(&vlm, "none") - weights(&text, "none"), 524_288);
    // bnb-4bit at load time: 262,144 × (0.5 + 4/64) B = 147,456 B.
    let tower = weights(&vlm, "bnb-4bit") - weights(&text, "bnb-4bit");
    assert!((tower - 147_456).abs() <= 2, "{tower}");
}
