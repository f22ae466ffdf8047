//! `headroom drill` as a user meets it before any box starts: bad flags and files are one line
//! and exit 2, nothing is started, and `--compare` puts two reports side by side.

use std::process::{Command, Output};

fn drill(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .arg("drill")
        .args(args)
        .output()
        .expect("run headroom drill")
}

fn one_line_exit_2(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].contains(needle), "{needle}: {err}");
}

const BOX: &str = r#"
[memory]
probe = "host"
capacity = "1GiB"
[[backends]]
name = "whisper"
role = "audio"
engine = "whisper"
command = "/bin/true"
port = 19681
[serve]
listen = "127.0.0.1:19690"
"#;

#[test]
fn bad_input_is_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let box_file = dir.path().join("box.toml");
    std::fs::write(&box_file, BOX).unwrap();
    let night = dir.path().join("night.toml");
    let report = dir.path().join("out");
    let b = box_file.to_str().unwrap();
    let n = night.to_str().unwrap();
    let r = report.to_str().unwrap();

    // No such night file.
    one_line_exit_2(
        &drill(&["--box", b, "--scenario", n, "--report", r]),
        "cannot read",
    );
    // A night file with a mistake names the key.
    std::fs::write(
        &night,
        "name = \"n\"\n[[stream]]\nname = \"a\"\nkind = \"dance\"\nper_minute = 1\n",
    )
    .unwrap();
    one_line_exit_2(
        &drill(&["--box", b, "--scenario", n, "--report", r]),
        "stream[0].kind",
    );
    // A stream the box has no backend for.
    std::fs::write(
        &night,
        "name = \"n\"\n[[stream]]\nname = \"a\"\nkind = \"chat\"\nper_minute = 1\n",
    )
    .unwrap();
    one_line_exit_2(
        &drill(&["--box", b, "--scenario", n, "--report", r]),
        "no backend",
    );
    // A bad duration.
    one_line_exit_2(
        &drill(&[
            "--box",
            b,
            "--scenario",
            n,
            "--report",
            r,
            "--duration",
            "soon",
        ]),
        "--duration",
    );
    // Nothing was started and no report folder was made.
    assert!(!report.exists());
}

#[test]
fn compare_puts_two_reports_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let report = |mode: &str, lost: u64, ratio: f64| {
        serde_json::json!({
            "mode": mode, "variant": null, "night_s": 240.0, "page_shown": lost > 0,
            "verdicts": [{"name": "nothing_lost", "holds": lost == 0, "detail": ""}],
            "oom_kills": 0, "lost": lost, "refusals": 3, "refusals_without_retry_after": 0,
            "retries_after_retry_after_served": 2, "leak_verdict": "no_leak",
            "text_goodput_tokens_per_second": 12.5,
            "lanes": {"dictation": {"ok": 9, "requests": 10, "lost": lost, "p99_s": 0.9,
                                     "idle_p50_s": 0.3, "p99_ratio_to_idle": ratio}}
        })
    };
    let a = dir.path().join("a");
    std::fs::create_dir(&a).unwrap();
    std::fs::write(
        a.join("report.json"),
        report("hand-set", 4, 3.0).to_string(),
    )
    .unwrap();
    let b = dir.path().join("b.json");
    std::fs::write(&b, report("up", 0, 1.2).to_string()).unwrap();
    let out = drill(&["--compare", a.to_str().unwrap(), b.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with("| | hand-set | up |"), "{text}");
    assert!(text.contains("| lost | 4 | 0 |"), "{text}");
    assert!(
        text.contains("| verdicts | broken: nothing_lost | all hold |"),
        "{text}"
    );
    assert!(
        text.contains("| dictation | 9/10 ok, lost 4, p99 0.90 s, idle 0.30 s, 3.00× |"),
        "{text}"
    );
}
