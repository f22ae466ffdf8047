//! `headroom doctor` end to end through the built binary: every fixture under tests/data/logs/
//! against its checked-in expectation (causes in order, key numbers of the first finding, computed
//! flag values in the fix, vLLM start-up figures), plus stdin, bad input and table output.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
}

fn logs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/logs")
}

fn doctor_json(path: &Path) -> Value {
    let out = bin()
        .args(["doctor", "--format", "json"])
        .arg(path)
        .output()
        .expect("run headroom");
    // 0: nothing found, 1: a problem found; never 2 for a log that was read.
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "{}: exit {:?}, stderr {}",
        path.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()))
}

/// Every fixture log under `dir`, sorted.
fn fixture_logs(dir: &Path) -> Vec<PathBuf> {
    let mut logs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    logs.sort();
    logs
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 + 1e-9 * b.abs()
}

/// Checks one fixture; returns the problems found.
fn check_fixture(log: &Path, expected: &Value) -> Vec<String> {
    let name = log.file_name().unwrap().to_string_lossy().into_owned();
    let got = doctor_json(log);
    let mut problems = Vec::new();
    let findings = got["findings"].as_array().cloned().unwrap_or_default();
    let causes: Vec<&str> = findings
        .iter()
        .filter_map(|f| f["cause"].as_str())
        .collect();
    let want: Vec<&str> = expected["causes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    match expected.get("known_miss").and_then(Value::as_str) {
        // A documented miss: the doctor's reading is wrong today and counts as a miss in the
        // accuracy table; once it reads the log right, the note must go.
        Some(_) if causes == want => problems.push(format!(
            "{name}: reads right now ({causes:?}); remove its known_miss note"
        )),
        Some(_) => {}
        None if causes != want => {
            problems.push(format!("{name}: causes {causes:?}, expected {want:?}"))
        }
        None => {}
    }
    for f in &findings {
        for key in ["cause", "numbers", "fix", "evidence_lines"] {
            if f.get(key).is_none() {
                problems.push(format!("{name}: finding lacks `{key}`"));
            }
        }
        if f["evidence_lines"].as_array().is_none_or(|l| l.is_empty()) {
            problems.push(format!("{name}: a finding has no evidence lines"));
        }
    }
    if expected.get("known_miss").is_some() {
        return problems;
    }
    if want.is_empty() {
        if got["verdict"] != "no memory problem recognised" {
            problems.push(format!("{name}: verdict {}", got["verdict"]));
        }
    } else if let Some(first) = findings.first() {
        for (k, v) in expected["numbers"].as_object().unwrap() {
            let want = v.as_f64().unwrap();
            match first["numbers"][k].as_f64() {
                Some(g) if close(g, want) => {}
                other => problems.push(format!("{name}: numbers.{k} = {other:?}, expected {want}")),
            }
        }
        let fix = first["fix"].as_str().unwrap_or("");
        for needle in expected["fix_contains"].as_array().unwrap() {
            let needle = needle.as_str().unwrap();
            if !fix.contains(needle) {
                problems.push(format!("{name}: fix lacks {needle:?}: {fix}"));
            }
        }
    }
    if let Some(gpu) = expected.get("gpu_name")
        && &got["gpu_name"] != gpu
    {
        problems.push(format!(
            "{name}: gpu_name {}, expected {gpu}",
            got["gpu_name"]
        ));
    }
    if let Some(platform) = expected.get("platform")
        && &got["platform"] != platform
    {
        problems.push(format!(
            "{name}: platform {}, expected {platform}",
            got["platform"]
        ));
    }
    if let Some(startup) = expected.get("startup").and_then(Value::as_object) {
        for (k, v) in startup {
            let want = v.as_f64().unwrap();
            match got["startup"][k].as_f64() {
                Some(g) if close(g, want) => {}
                other => problems.push(format!("{name}: startup.{k} = {other:?}, expected {want}")),
            }
        }
    }
    problems
}

#[test]
fn every_fixture_matches_its_expected_diagnosis() {
    let dir = logs_dir();
    let logs = fixture_logs(&dir);
    assert!(logs.len() >= 25, "only {} fixtures", logs.len());
    let sources = std::fs::read_to_string(dir.join("SOURCES.md")).unwrap();
    let mut problems = Vec::new();
    for log in &logs {
        let stem = log.file_stem().unwrap().to_string_lossy().into_owned();
        if !sources.contains(&format!("| {stem}.log |")) {
            problems.push(format!("{stem}.log has no row in SOURCES.md"));
        }
        let expected_path = dir.join("expected").join(format!("{stem}.json"));
        let Ok(text) = std::fs::read_to_string(&expected_path) else {
            problems.push(format!("{stem}.log has no expected/{stem}.json"));
            continue;
        };
        let expected: Value = serde_json::from_str(&text).unwrap();
        problems.extend(check_fixture(log, &expected));
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn reads_standard_input() {
    let log = std::fs::read(logs_dir().join("vllm-v1-startup-free-below-util.log")).unwrap();
    let mut child = bin()
        .args(["doctor", "-", "--format", "json"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&log).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "a problem found");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["findings"][0]["cause"],
        "startup_free_memory_below_utilization"
    );
    assert_eq!(v["findings"][0]["numbers"]["utilization_that_fits"], 0.89);
    assert_eq!(v["lines_read"], 1);
}

#[test]
fn missing_file_and_directory_are_bad_input() {
    for arg in [
        "/nonexistent/headroom-doctor.log",
        env!("CARGO_MANIFEST_DIR"),
    ] {
        let out = bin().args(["doctor", arg]).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{arg}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("headroom: "), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
    let out = bin()
        .args(["doctor", "x.log", "--format", "yaml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_file_that_is_not_text_is_refused_in_one_line() {
    // The headroom binary itself, the mistake seen in the field (`doctor target/release/headroom`).
    let exe = env!("CARGO_BIN_EXE_headroom");
    for args in [vec!["doctor", exe], vec!["doctor", "--format", "json", exe]] {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "nothing on stdout for bad input");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        assert!(err.starts_with("headroom: "), "{err}");
        assert!(err.contains("is not a text log: binary data"), "{err}");
    }
    // UTF-16 (a Windows redirect) is named as such, also on standard input.
    let utf16: Vec<u8> = "\u{feff}INFO starting\r\nERROR CUDA out of memory\r\n"
        .encode_utf16()
        .flat_map(u16::to_le_bytes)
        .collect();
    let mut child = bin()
        .args(["doctor", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&utf16).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("standard input is not a text log: it is UTF-16"),
        "{err}"
    );
}

#[test]
fn table_prints_breakdown_for_a_successful_start() {
    let out = bin()
        .arg("doctor")
        .arg(logs_dir().join("vllm-v0-profile-20k-ok.log"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("no memory problem recognised"), "{text}");
    assert!(text.contains("vLLM memory breakdown"), "{text}");
    let row = |label: &str, value: &str| {
        text.lines()
            .any(|l| l.trim_start().starts_with(label) && l.trim_end().ends_with(value))
    };
    assert!(row("weights", "14.99 GiB"), "{text}");
    assert!(row("KV tokens", "31232"), "{text}");
    assert!(row("max concurrency", "1.56x"), "{text}");
    assert!(text.contains("--model M"), "{text}");
}

#[test]
fn table_names_cause_fix_and_evidence() {
    let out = bin()
        .arg("doctor")
        .arg(logs_dir().join("vllm-v1-kv-too-small-tpu.log"))
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("1. kv_cache_too_small"), "{text}");
    assert!(text.contains("`--max-model-len 5632`"), "{text}");
    assert!(text.contains("evidence: line 5"), "{text}");
}

#[test]
fn unknown_log_is_not_guessed_at() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.log");
    std::fs::write(
        &path,
        "INFO starting\nERROR: connection refused to upstream\nINFO done\n",
    )
    .unwrap();
    let v = doctor_json(&path);
    assert_eq!(v["findings"].as_array().unwrap().len(), 0);
    assert_eq!(v["verdict"], "no memory problem recognised");
    assert_eq!(v["lines_read"], 3);
    assert_eq!(v["unrecognised_lines"][0]["line"], 2);
    let out = bin().arg("doctor").arg(&path).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("no memory problem recognised"));
    assert!(text.contains("connection refused"));
}

/// A plan in the stable `headroom plan --format json` shape (bytes), for the comparison path.
const PLAN_JSON: &str = r#"{"gpu_total_bytes": 25318195200, "gpu_memory_utilization": 0.9,
  "requested_bytes": 22786375680, "reserved_bytes": 0, "weights_bytes": 16060522496, "activation_peak_bytes": 2147483648,
  "non_torch_bytes": 402653184, "cuda_graph_bytes": 0, "kv_cache_bytes": 4175758336,
  "kv_cache_tokens": 31856, "kv_bytes_per_token": 131072, "block_size": 16, "max_concurrency": 1.59,
  "fits": true, "vllm_args": [], "warnings": []}"#;

#[test]
fn compares_a_successful_start_with_a_plan() {
    let dir = tempfile::tempdir().unwrap();
    let plan = dir.path().join("plan.json");
    std::fs::write(&plan, PLAN_JSON).unwrap();
    let log = logs_dir().join("vllm-v0-profile-20k-ok.log");
    let out = bin()
        .args(["doctor", "--format", "json", "--compare-plan"])
        .arg(&plan)
        .arg(&log)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["plan_comparison"].as_array().unwrap();
    let row = |item: &str| {
        rows.iter()
            .find(|r| r["item"] == item)
            .unwrap_or_else(|| panic!("no {item} row"))
    };
    // The log says "Loading model weights took 14.9888 GB"; the plan says 16060522496 B = 14.9574 GiB.
    let w = row("weights_gib");
    assert!(close(w["measured"].as_f64().unwrap(), 14.9888));
    assert!(
        (w["difference"].as_f64().unwrap() - (16_060_522_496.0 / 1073741824.0 - 14.9888)).abs()
            < 1e-9
    );
    assert_eq!(row("kv_tokens")["measured"], 31232.0);
    assert_eq!(row("kv_tokens")["predicted"], 31856.0);
    assert_eq!(row("gpu_blocks")["predicted"], 1991.0);
    assert!(close(
        row("kv_bytes_per_token")["predicted"].as_f64().unwrap(),
        131_072.0
    ));
    let table = bin()
        .args(["doctor", "--compare-plan"])
        .arg(&plan)
        .arg(&log)
        .output()
        .unwrap();
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.contains("log vs `headroom plan`"), "{text}");
}

#[test]
fn a_bad_plan_or_a_log_without_figures_is_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "not json").unwrap();
    let log = logs_dir().join("vllm-v0-profile-20k-ok.log");
    let out = bin()
        .args(["doctor", "--compare-plan"])
        .arg(&bad)
        .arg(&log)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let good = dir.path().join("plan.json");
    std::fs::write(&good, PLAN_JSON).unwrap();
    let no_figures = logs_dir().join("vllm-no-cuda-gpus.log");
    let out = bin()
        .args(["doctor", "--compare-plan"])
        .arg(&good)
        .arg(&no_figures)
        .output()
        .unwrap();
    // A log without figures keeps its findings; the comparison is left out with a note.
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("no vLLM memory figures"), "{text}");
    assert!(text.contains("1. not_out_of_memory"), "{text}");
}

#[test]
fn plans_the_logged_settings_and_compares_them() {
    // Llama-3.1-8B on an RTX 3090 at 20,000 tokens (vLLM #10517, V0: no chunked prefill, so the
    // profiling batch is the whole 20,000-token sequence).
    let log = logs_dir().join("vllm-v0-profile-20k-ok.log");
    let out = bin()
        .args([
            "doctor",
            "--format",
            "json",
            "--model",
            "meta-llama/Llama-3.1-8B-Instruct",
            "--max-num-batched-tokens",
            "20000",
        ])
        .arg(&log)
        .env("HF_HOME", "/nonexistent")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["plan_comparison"].as_array().unwrap();
    let rel = |item: &str| {
        rows.iter()
            .find(|r| r["item"] == item)
            .unwrap_or_else(|| panic!("no {item} row"))["relative"]
            .as_f64()
            .unwrap()
    };
    // The planner reproduces vLLM's own figures for the settings the log shows.
    assert!(rel("budget_gib").abs() < 1e-9);
    assert!(rel("weights_gib").abs() < 0.01);
    assert!(rel("activation_peak_gib").abs() < 0.05);
    assert!(rel("kv_cache_gib").abs() < 0.08, "{}", rel("kv_cache_gib"));
    assert!(rel("kv_tokens").abs() < 0.08);
    assert!(rel("max_concurrency").abs() < 0.08);
}

/// First-cause accuracy over every fixture, per engine and per platform (the labels in each
/// `expected` JSON, written by hand), for the older set and the 2025–2026 set. The table is
/// printed and must match the one in docs/doctor.md, so the documented figures are the measured
/// ones.
#[test]
fn first_cause_accuracy_per_engine_and_platform() {
    use std::collections::BTreeMap;
    let dir = logs_dir();
    let logs = fixture_logs(&dir);
    // (group, set) → (right, total)
    let mut tally: BTreeMap<(String, String), (u32, u32)> = BTreeMap::new();
    let mut misses = Vec::new();
    for log in &logs {
        let stem = log.file_stem().unwrap().to_string_lossy().into_owned();
        let expected: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("expected").join(format!("{stem}.json"))).unwrap(),
        )
        .unwrap();
        let want = expected["causes"][0].as_str().unwrap_or("none").to_owned();
        let got_json = doctor_json(log);
        let got = got_json["findings"][0]["cause"]
            .as_str()
            .unwrap_or("none")
            .to_owned();
        let set = expected["set"].as_str().unwrap_or("older").to_owned();
        let engine = expected["engine"].as_str().unwrap_or("unknown");
        let platform = expected["platform"].as_str().unwrap_or("not stated");
        let right = u32::from(want == got);
        if right == 0 {
            misses.push(format!("{stem}: {got} (truth {want})"));
        }
        for group in [
            format!("engine {engine}"),
            format!("platform {platform}"),
            "all".to_owned(),
        ] {
            let e = tally.entry((group, set.clone())).or_default();
            e.0 += right;
            e.1 += 1;
        }
    }
    let cell = |t: Option<&(u32, u32)>| match t {
        Some((r, n)) => format!("{r}/{n} ({:.0}%)", 100.0 * f64::from(*r) / f64::from(*n)),
        None => "–".to_owned(),
    };
    let mut groups: Vec<&String> = tally.keys().map(|(g, _)| g).collect();
    groups.dedup();
    let mut table = String::from("| group | older set | 2025–2026 set |\n|---|---|---|\n");
    for g in groups {
        table.push_str(&format!(
            "| {g} | {} | {} |\n",
            cell(tally.get(&(g.clone(), "older".into()))),
            cell(tally.get(&(g.clone(), "2025-2026".into())))
        ));
    }
    println!("{table}\nmisses:\n{}", misses.join("\n"));
    let (right, total) = tally[&("all".to_owned(), "2025-2026".to_owned())];
    assert!(
        f64::from(right) >= 0.9 * f64::from(total),
        "2025–2026 set: {right}/{total} first causes right\n{}",
        misses.join("\n")
    );
    let (right, total) = tally[&("all".to_owned(), "older".to_owned())];
    assert_eq!(right, total, "older set regressed:\n{}", misses.join("\n"));
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/doctor.md"))
        .unwrap();
    let begin = doc
        .find("<!-- accuracy:begin -->\n")
        .expect("accuracy markers in docs/doctor.md");
    let end = doc.find("<!-- accuracy:end -->").unwrap();
    let documented = &doc[begin + "<!-- accuracy:begin -->\n".len()..end];
    assert_eq!(
        documented, table,
        "docs/doctor.md's accuracy table is stale; the measured one is above"
    );
}
