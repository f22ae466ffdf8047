//! `headroom plan` inputs read the way they were meant or refused with a reason: decimal units,
//! marketing GPU sizes, sizes without units, repeated reserves, ambiguous GPU names and paths
//! that do not exist.

use std::process::{Command, Output};

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .arg("plan")
        .args(["--model", "meta-llama/Llama-3.1-8B-Instruct"])
        .args(args)
        .env("HF_HOME", "/nonexistent-headroom-test")
        .env_remove("HF_HUB_CACHE")
        .output()
        .expect("run headroom")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_gpu_in_decimal_gb_says_how_it_was_read_and_warns() {
    let out = plan(&[
        "--gpu",
        "24GB",
        "--max-model-len",
        "4096",
        "--format",
        "json",
    ]);
    let err = stderr(&out);
    assert!(err.contains("24,000,000,000 bytes (22.35 GiB)"), "{err}");
    assert!(err.contains("--gpu 24GiB"), "{err}");
    let p: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["gpu_total_bytes"], 24_000_000_000u64);
    // Binary units and card names are read silently.
    for gpu in ["24GiB", "RTX 4090"] {
        let out = plan(&["--gpu", gpu, "--max-model-len", "4096"]);
        assert!(!stderr(&out).contains("note"), "{gpu}: {}", stderr(&out));
    }
    // A decimal reserve is read as written, and said so.
    let out = plan(&["--gpu", "H100", "--reserve", "tts=3GB"]);
    assert!(
        stderr(&out).contains("3,000,000,000 bytes"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn sizes_without_a_unit_are_an_error_where_bytes_make_no_sense() {
    for args in [
        &["--gpu", "H100", "--reserve", "stt=3"][..],
        &["--gpu", "H100", "--other-used", "2"],
        &["--gpu", "H100", "--kv-cache-memory", "4"],
    ] {
        let out = plan(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = stderr(&out);
        assert!(err.contains("needs a unit"), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
    }
    // A byte count is still a byte count.
    let out = plan(&["--gpu", "H100", "--reserve", "stt=3221225472"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn one_reserve_name_given_twice_is_an_error() {
    let out = plan(&[
        "--gpu",
        "H100",
        "--reserve",
        "a=2GiB",
        "--reserve",
        "a=1GiB",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("'a' is given twice"),
        "{}",
        stderr(&out)
    );
    let out = plan(&[
        "--gpu",
        "H100",
        "--reserve",
        "a=2GiB",
        "--reserve",
        "b=1GiB",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn an_ambiguous_gpu_name_lists_the_cards_it_matches() {
    let out = plan(&["--gpu", "A100"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("ambiguous"), "{err}");
    for card in ["A100-SXM4-40GB", "A100-PCIE-40GB", "A100-SXM4-80GB"] {
        assert!(err.contains(card), "{err}");
    }
    assert!(!err.contains("RTX 4090"), "only the matches: {err}");
    let out = plan(&["--gpu", "A100-SXM4-80GB", "--max-model-len", "4096"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

#[test]
fn a_model_path_that_does_not_exist_says_so() {
    for path in ["./no/such/model", "/nonexistent/model.gguf", "~/models/x"] {
        let out = Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(["plan", "--gpu", "H100", "--model", path])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{path}");
        let err = stderr(&out);
        assert!(err.contains("no such file or directory"), "{path}: {err}");
        assert!(!err.contains("closest catalog names"), "{path}: {err}");
    }
}
