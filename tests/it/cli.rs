//! The command line as a shell user meets it: closed pipes, clap's suggestions, completions, the
//! manual page, the catalog lists, colour switches and the version stamp.

use std::io::Read;
use std::process::{Command, Output, Stdio};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_headroom"));
    c.env("HF_HOME", "/nonexistent-headroom-test")
        .env_remove("HF_HUB_CACHE")
        .env_remove("NO_COLOR")
        .env_remove("CLICOLOR_FORCE");
    c
}

fn headroom(args: &[&str]) -> Output {
    bin().args(args).output().expect("run headroom")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs `args` with stdout's read end closed before headroom writes, as `| head -c0` would.
fn with_closed_stdout(args: &[&str]) -> (Option<i32>, String) {
    let mut child = bin()
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn headroom");
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    (status.code(), err)
}

const PLAN_8B_4090: [&str; 6] = [
    "plan",
    "--model",
    "meta-llama/Llama-3.1-8B-Instruct",
    "--gpu",
    "RTX 4090",
    "--max-model-len",
];

#[test]
fn a_closed_pipe_ends_quietly_with_the_documented_code() {
    for format in ["table", "json", "shell"] {
        for (len, code) in [("8192", 0), ("131072", 3)] {
            let mut args = PLAN_8B_4090.to_vec();
            args.extend([len, "--format", format]);
            let (status, err) = with_closed_stdout(&args);
            assert!(
                !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
                "{format} {len}: {err}"
            );
            assert_eq!(status, Some(code), "{format} {len}: {err}");
            assert!(err.lines().count() <= 1, "{format} {len}: {err}");
        }
    }
    for args in [
        &["plan", "--list", "models"][..],
        &["completions", "bash"],
        &["man"],
        &[
            "doctor",
            "tests/data/logs/vllm-v1-ok-cudagraph-estimate.log",
        ],
    ] {
        let (status, err) = with_closed_stdout(args);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            matches!(status, Some(0 | 1 | 141)),
            "{args:?}: {status:?} {err}"
        );
    }
}

#[test]
fn clap_keeps_its_did_you_mean_tip() {
    let out = headroom(&[
        "plan",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--gpu-memory-utilizaton",
        "0.5",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("'--gpu-memory-utilization'"), "{err}");
    let out = headroom(&["plann"]);
    assert!(
        text(&out.stderr).contains("'plan'"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn bash_can_source_the_completion_script() {
    let out = headroom(&["completions", "bash"]);
    assert_eq!(out.status.code(), Some(0));
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("headroom.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let check = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source '{}' && complete -p headroom; COMP_WORDS=(headroom pl); COMP_CWORD=1; _headroom headroom pl headroom; echo \"${{COMPREPLY[@]}}\"",
            script.display()
        ))
        .output()
        .expect("bash");
    let said = text(&check.stdout);
    assert!(check.status.success(), "{said} {}", text(&check.stderr));
    assert!(said.contains("complete"), "{said}");
    assert!(said.lines().last().unwrap_or("").contains("plan"), "{said}");
    for shell in ["zsh", "fish"] {
        let out = headroom(&["completions", shell]);
        assert_eq!(out.status.code(), Some(0), "{shell}");
        assert!(text(&out.stdout).contains("headroom"), "{shell}");
    }
}

#[test]
fn man_renders_the_generated_page() {
    let dir = tempfile::tempdir().unwrap();
    let out = headroom(&["man", "--out-dir", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let page = dir.path().join("headroom.1");
    assert!(dir.path().join("headroom-plan.1").exists());
    // `man -l` where man-db is installed, else groff, which man itself runs.
    let rendered = Command::new("man")
        .arg("-l")
        .arg(&page)
        .env("MANPAGER", "cat")
        .env("PAGER", "cat")
        .output()
        .or_else(|_| {
            Command::new("groff")
                .args(["-man", "-Tutf8"])
                .arg(&page)
                .output()
        })
        .expect("man or groff must be installed to check the manual page");
    let shown = text(&rendered.stdout);
    assert!(rendered.status.success(), "{}", text(&rendered.stderr));
    assert!(
        shown.contains("NAME") && shown.contains("headroom"),
        "{shown}"
    );
    assert!(
        shown.contains("completions") && shown.contains("doctor"),
        "{shown}"
    );
}

#[test]
fn plan_lists_the_catalog() {
    let out = headroom(&["plan", "--list", "models"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(text(&out.stdout).contains("meta-llama/Llama-3.1-8B-Instruct"));
    let out = headroom(&["plan", "--list", "gpus"]);
    let gpus = text(&out.stdout);
    assert!(gpus.contains("H100") && gpus.contains("RTX 4090"), "{gpus}");
    let out = headroom(&["plan", "--list", "reserves"]);
    let reserves = text(&out.stdout);
    assert!(
        reserves.lines().any(|l| l.starts_with("whisper-large-v3 ")),
        "{reserves}"
    );
    let out = headroom(&["plan", "--list", "engines"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn color_never_and_no_color_are_respected() {
    let forced = bin()
        .args(["plan", "--help"])
        .env("CLICOLOR_FORCE", "1")
        .output()
        .unwrap();
    assert!(
        forced.stdout.contains(&0x1b),
        "colour forced on should colour help"
    );
    let never = bin()
        .args(["--color", "never", "plan", "--help"])
        .env("CLICOLOR_FORCE", "1")
        .output()
        .unwrap();
    assert!(!never.stdout.contains(&0x1b), "{}", text(&never.stdout));
    let no_color = bin()
        .args(["plan", "--help"])
        .env("CLICOLOR_FORCE", "1")
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(
        !no_color.stdout.contains(&0x1b),
        "{}",
        text(&no_color.stdout)
    );
    let always = headroom(&["--color=always", "plan", "--help"]);
    assert!(always.stdout.contains(&0x1b));
}

#[test]
fn version_names_the_commit_and_the_catalog_date() {
    let out = headroom(&["--version"]);
    let v = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    let commit = v.split("commit ").nth(1).and_then(|r| r.split(',').next());
    let commit = commit.unwrap_or_else(|| panic!("{v}"));
    assert!(
        commit == "unknown" || commit.chars().all(|c| c.is_ascii_hexdigit()),
        "{v}"
    );
    let date = v
        .split("catalog ")
        .nth(1)
        .unwrap_or("")
        .trim_end_matches([')', '\n']);
    assert!(
        date == "unknown" || (date.len() == 10 && date.chars().filter(|c| *c == '-').count() == 2),
        "{v}"
    );
    // In a git checkout the stamp is real, not the fallback.
    if std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(".git")
        .exists()
    {
        assert_ne!(commit, "unknown", "{v}");
        assert_ne!(date, "unknown", "{v}");
    }
}

/// A box file moved to another folder: `up --check` checks every path it names before anything
/// starts, and a missing relative one is reported with the folder it was taken from; `--listen`
/// and `--port-base` move the gateway and the backends without editing the file.
#[test]
fn up_check_finds_a_bad_path_and_the_command_line_moves_the_ports() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("boxes");
    std::fs::create_dir_all(folder.join("bin")).unwrap();
    let tool = folder.join("bin/speech-server");
    std::fs::write(&tool, "#!/bin/sh\nexit 0\n").unwrap();
    std::fs::write(folder.join("model.gguf"), b"GGUF").unwrap();
    std::fs::write(
        folder.join("clip.wav"),
        headroom_server::audio::fixtures::wav(1.0, 8000, 1),
    )
    .unwrap();
    let box_file = folder.join("voice.up.toml");
    std::fs::write(
        &box_file,
        r#"
[memory]
probe = "host"
capacity = "1GiB"

[[backends]]
name = "stt"
role = "audio"
engine = "whisper"
command = "./bin/speech-server"
args = ["--port", "{port}"]
port = 18281
[backends.warmup]
file = "clip.wav"

[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "sh"
port = 18280
model = "model.gguf"

[serve]
listen = "127.0.0.1:8280"
"#,
    )
    .unwrap();
    let config = box_file.to_str().unwrap();
    let out = headroom(&[
        "up",
        "--check",
        "--config",
        config,
        "--listen",
        "127.0.0.1:19299",
        "--port-base",
        "19250",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(
        said.contains("stt 19250, llm 19251") && said.contains("gateway on 127.0.0.1:19299"),
        "{said}"
    );
    // A program that is not there is found by --check, with the folder its path started from.
    std::fs::remove_file(&tool).unwrap();
    let out = headroom(&["up", "--check", "--config", config]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    let folder = std::fs::canonicalize(&folder).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("speech-server")
            && err.contains(&format!(
                "relative paths start at the box file's folder, {}",
                folder.display()
            )),
        "{err}"
    );
}

/// `headroom drill --without sizing` hands `up` the text engine's flags as one value that starts
/// with a dash; clap must take it as the value, and a bad environment pair is one line, exit 2.
#[test]
fn up_takes_hand_given_text_flags_that_start_with_a_dash() {
    let missing = "/nonexistent-headroom-test/box.up.toml";
    for form in [
        vec!["--text-sized-by-hand", "-c 32768 --parallel 4"],
        vec!["--text-sized-by-hand=-c 32768 --parallel 4"],
    ] {
        let mut args = vec!["up", "--check"];
        args.extend(form.iter().copied());
        args.extend(["--config", missing]);
        let out = headroom(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        // The flags were taken: what fails is the missing box file, not the command line.
        assert!(
            err.contains("box.up.toml") && !err.contains("unexpected argument"),
            "{err}"
        );
    }
    let out = headroom(&[
        "up",
        "--config",
        missing,
        "--text-sized-by-hand=",
        "--text-sized-by-hand-env",
        "NOEQUALS",
    ]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("`NOEQUALS` is not KEY=VALUE"), "{err}");
}
