//! `headroom plan` tells the truth: every option it prints fits when its flags are added to the
//! same command, a plan that does not fit prints nothing runnable, and settings vLLM refuses are
//! verdicts, not "fits". All through the built binary.

use std::collections::BTreeMap;
use std::process::{Command, Output};

use serde_json::Value;

fn headroom_env(args: &[String], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_headroom"));
    c.args(args)
        .env("HF_HOME", "/nonexistent-headroom-test")
        // Never the network: a model outside the catalog is not looked up on the Hub.
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .env_remove("VLLM_ALLOW_LONG_MAX_MODEL_LEN");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("run headroom")
}

fn headroom(args: &[String]) -> Output {
    headroom_env(args, &[])
}

/// `plan` flags as a map, so that an option's flags replace the ones they change.
fn plan_args(flags: &BTreeMap<String, String>, format: &str) -> Vec<String> {
    let mut v = vec!["plan".to_string(), "--format".into(), format.into()];
    for (k, val) in flags {
        v.push(k.clone());
        v.push(val.clone());
    }
    v
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn flags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A small deterministic generator (64-bit LCG), so the cases are the same on every run.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
}

fn random_plan(rng: &mut Lcg) -> BTreeMap<String, String> {
    let mut f = BTreeMap::new();
    let model = rng.pick(&[
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "meta-llama/Llama-3.3-70B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "google/gemma-3-27b-it",
    ]);
    f.insert("--model".into(), model.into());
    let gpu = rng.pick(&[
        "RTX 4090",
        "RTX 3060",
        "H100",
        "24GiB",
        "48GiB",
        "A100-SXM4-80GB",
    ]);
    f.insert("--gpu".into(), gpu.into());
    if rng.next().is_multiple_of(2) {
        let util = 50 + rng.next() % 49;
        f.insert("--gpu-memory-utilization".into(), format!("0.{util:02}"));
    }
    if !rng.next().is_multiple_of(3) {
        let len = rng.pick(&["4096", "8192", "32768", "131072", "200000"]);
        f.insert("--max-model-len".into(), len.into());
    }
    if rng.next().is_multiple_of(2) {
        let r = rng.pick(&["whisper-large-v3", "kokoro-82m", "tts=3GiB"]);
        f.insert("--reserve".into(), r.into());
    }
    if rng.next().is_multiple_of(4) {
        f.insert(
            "--tensor-parallel-size".into(),
            rng.pick(&["2", "3", "4"]).into(),
        );
    }
    if rng.next().is_multiple_of(4) {
        f.insert(
            "--target-concurrency".into(),
            (1 + rng.next() % 32).to_string(),
        );
    }
    if rng.next().is_multiple_of(5) {
        f.insert("--block-size".into(), rng.pick(&["7", "32"]).into());
    }
    if rng.next().is_multiple_of(5) {
        f.insert("--kv-cache-dtype".into(), "fp8".into());
    }
    f
}

#[test]
fn every_printed_option_fits_when_its_flags_are_applied() {
    let mut rng = Lcg(14);
    let (mut missed, mut options_checked) = (0, 0);
    for case in 0..60 {
        let base = random_plan(&mut rng);
        let out = headroom(&plan_args(&base, "json"));
        let code = out.status.code();
        if code == Some(2) {
            // A model the catalog cannot resolve here would be a test bug, not a skip.
            panic!(
                "case {case} {base:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let p = json_of(&out);
        if p["fits"] == true {
            assert_eq!(code, Some(0), "case {case}");
            continue;
        }
        missed += 1;
        assert_eq!(code, Some(3), "case {case}");
        let shell = headroom(&plan_args(&base, "shell"));
        assert_eq!(shell.status.code(), Some(3), "case {case}");
        assert!(
            shell.stdout.is_empty(),
            "case {case} {base:?}: printed a line for a plan that does not fit"
        );
        for o in p["options"].as_array().unwrap() {
            let mut applied = base.clone();
            let extra: Vec<&str> = o["headroom_args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            for pair in extra.chunks(2) {
                applied.insert(pair[0].into(), pair[1].into());
            }
            let again = headroom(&plan_args(&applied, "json"));
            let q = json_of(&again);
            assert_eq!(
                again.status.code(),
                Some(0),
                "case {case}: option {} {extra:?} on {base:?} does not fit: {} {}",
                o["option"],
                q["failure"],
                q["refused"]
            );
            let peak = q["device_peak_bytes"].as_u64().unwrap()
                + q["safety_margin_bytes"].as_u64().unwrap();
            assert_eq!(
                Some(peak),
                o["memory_needed_bytes"].as_u64(),
                "case {case}: figures of the re-plan"
            );
            let line = headroom(&plan_args(&applied, "shell"));
            let line = String::from_utf8_lossy(&line.stdout).into_owned();
            // Multi-GPU lines name their devices first (`CUDA_VISIBLE_DEVICES=0,1 vllm serve …`).
            let line = line
                .split_whitespace()
                .skip_while(|w| w.contains('=') && !w.starts_with('-'))
                .collect::<Vec<_>>()
                .join(" ");
            assert!(line.starts_with("vllm serve "), "case {case}: {line}");
            let changed: Vec<&str> = o["vllm_args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap())
                .collect();
            for pair in changed.chunks(2) {
                // vLLM's default block size is not spelled out on the line.
                if pair == ["--block-size", "16"] {
                    assert!(!line.contains("--block-size"), "case {case}: {line}");
                    continue;
                }
                let flag = format!("{} {} ", pair[0], pair[1]);
                assert!(
                    format!("{} ", line.trim_end()).contains(&flag),
                    "case {case}: {line} lacks {flag}"
                );
            }
            options_checked += 1;
        }
    }
    eprintln!("{missed} plans of 60 missed; {options_checked} options re-planned, all fit");
    assert!(
        missed >= 10 && options_checked >= 30,
        "{missed} missed plans, {options_checked} options"
    );
}

#[test]
fn the_24gib_card_beside_whisper_gets_fixes_that_fit() {
    let base = flags(&[
        ("--model", "Qwen/Qwen2.5-7B-Instruct"),
        ("--gpu", "RTX 4090"),
        ("--reserve", "whisper-large-v3"),
        ("--gpu-memory-utilization", "0.9"),
        ("--max-model-len", "8192"),
    ]);
    let p = json_of(&headroom(&plan_args(&base, "json")));
    assert_eq!(p["fits"], false);
    let names: Vec<&str> = p["options"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["option"].as_str().unwrap())
        .collect();
    // fp8 KV or a second GPU do not lower the start-up check: alone they are not fixes.
    assert!(!names.contains(&"fp8_kv_cache"), "{names:?}");
    assert!(!names.contains(&"tensor_parallel_2"), "{names:?}");
    let util = p["options"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["option"] == "utilization")
        .unwrap_or_else(|| panic!("no utilization option: {names:?}"));
    let largest_safe = p["largest_safe_gpu_memory_utilization"].as_f64().unwrap();
    assert!(util["gpu_memory_utilization"].as_f64().unwrap() <= largest_safe);
    assert_eq!(names[0], "utilization", "the cheapest first: {names:?}");
}

#[test]
fn a_plan_that_does_not_fit_prints_no_runnable_line() {
    let base = flags(&[
        ("--model", "meta-llama/Llama-3.1-8B-Instruct"),
        ("--gpu", "RTX 4090"),
        ("--max-model-len", "131072"),
        ("--gpu-memory-utilization", "0.9"),
    ]);
    let shell = headroom(&plan_args(&base, "shell"));
    assert_eq!(shell.status.code(), Some(3));
    assert!(
        shell.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&shell.stdout)
    );
    assert!(String::from_utf8_lossy(&shell.stderr).contains("does not fit"));
    let table = headroom(&plan_args(&base, "table"));
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(!table.contains("vllm serve "), "{table}");
    assert!(table.contains("nothing to run"), "{table}");
}

fn refused(extra: &[(&str, &str)], env: &[(&str, &str)]) -> (Option<i32>, Value) {
    let mut f = flags(&[
        ("--model", "Qwen/Qwen2.5-7B-Instruct"),
        ("--gpu", "H100"),
        ("--max-model-len", "8192"),
    ]);
    for (k, v) in extra {
        f.insert(k.to_string(), v.to_string());
    }
    let out = headroom_env(&plan_args(&f, "json"), env);
    (out.status.code(), json_of(&out))
}

#[test]
fn settings_vllm_refuses_are_the_verdict() {
    let (code, p) = refused(&[], &[]);
    assert_eq!((code, &p["refused"]), (Some(0), &Value::Array(vec![])));
    for (extra, needle) in [
        (
            &[("--tensor-parallel-size", "3")][..],
            "divisible by tensor parallel size (3)",
        ),
        (&[("--block-size", "7")], "--block-size 7"),
        (
            &[("--max-model-len", "65536")],
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
        ),
        (&[("--quantization", "awq")], "unquantized"),
    ] {
        let (code, p) = refused(extra, &[]);
        assert_eq!(code, Some(3), "{extra:?}: {p}");
        assert_eq!(p["fits"], false, "{extra:?}");
        let reasons = p["refused"].to_string();
        assert!(reasons.contains(needle), "{extra:?}: {reasons}");
        // Every option repairs the refusal too.
        assert!(!p["options"].as_array().unwrap().is_empty(), "{extra:?}");
    }
    let (code, p) = refused(
        &[("--max-model-len", "65536")],
        &[("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")],
    );
    assert_eq!(
        (code, &p["refused"]),
        (Some(0), &Value::Array(vec![])),
        "{p}"
    );
    let table = headroom(&plan_args(
        &flags(&[
            ("--model", "Qwen/Qwen2.5-7B-Instruct"),
            ("--gpu", "H100"),
            ("--tensor-parallel-size", "3"),
        ]),
        "table",
    ));
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("verdict: vLLM REFUSES"), "{table}");
    assert!(!table.contains("verdict: fits"), "{table}");
}

#[test]
fn target_concurrency_reaches_the_printed_line() {
    let f = flags(&[
        ("--model", "meta-llama/Llama-3.1-8B-Instruct"),
        ("--gpu", "H100"),
        ("--max-model-len", "8192"),
        ("--target-concurrency", "4"),
    ]);
    let out = headroom(&plan_args(&f, "shell"));
    assert_eq!(out.status.code(), Some(0));
    let line = String::from_utf8_lossy(&out.stdout);
    assert!(line.contains("--max-num-seqs 4 "), "{line}");
}
