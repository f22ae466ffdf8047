//! `headroom serve --config` errors a user can act on: the key, its line and the nearest valid
//! key for a typo; listen and upstream messages that say what to write instead; `localhost`
//! accepted and a trailing `/v1` dropped with a note. Through the built binary.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const LANE: &str = "[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\n";

/// Runs `headroom serve` on a config whose start-up fails; returns (exit code, stderr).
fn refused(toml: &str) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_key_typo_names_the_key_the_line_and_the_nearest_key() {
    let (code, err) = refused(&format!(
        "listen = \"127.0.0.1:20640\"\n{LANE}upstreams = [\"http://127.0.0.1:20641\"]\nmax_inflite = 4\n"
    ));
    assert_eq!(code, Some(2));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("line 6"), "{err}");
    assert!(err.contains("`max_inflite`"), "{err}");
    assert!(err.contains("did you mean `max_inflight`"), "{err}");
    assert!(!err.contains("not valid TOML"), "{err}");
    assert!(err.len() < 200, "no list of every key: {err}");
    let (_, err) = refused(&format!("lisen = \"127.0.0.1:20640\"\n{LANE}"));
    assert!(
        err.contains("line 1") && err.contains("did you mean `listen`"),
        "{err}"
    );
}

#[test]
fn a_duration_without_quotes_names_its_key() {
    let (code, err) = refused(&format!(
        "listen = \"127.0.0.1:20640\"\n{LANE}upstreams = [\"http://127.0.0.1:20641\"]\nqueue_timeout = 5\n"
    ));
    assert_eq!(code, Some(2));
    assert!(
        err.contains("line 6") && err.contains("`queue_timeout`"),
        "{err}"
    );
    assert!(err.contains("queue_timeout = \"5s\""), "{err}");
    // A value error found after parsing names its line too.
    let (_, err) = refused(&format!(
        "listen = \"127.0.0.1:20640\"\n{LANE}upstreams = [\"http://127.0.0.1:20641\"]\nmax_inflight = 0\n"
    ));
    assert!(
        err.contains("line 6") && err.contains("max_inflight"),
        "{err}"
    );
}

#[test]
fn upstream_messages_say_what_to_write_instead() {
    for (upstream, needle) in [
        (
            "https://127.0.0.1:20641",
            "https upstreams are not supported",
        ),
        ("127.0.0.1:20641", "write \"http://127.0.0.1:20641\""),
        (
            "http://127.0.0.1:20641/api",
            "write the engine's address only",
        ),
    ] {
        let (code, err) = refused(&format!(
            "listen = \"127.0.0.1:20640\"\n{LANE}upstreams = [\"{upstream}\"]\n"
        ));
        assert_eq!(code, Some(2), "{upstream}");
        assert!(err.contains(needle), "{upstream}: {err}");
        assert!(err.contains("line 5"), "{upstream}: {err}");
    }
    let (_, err) = refused(&format!(
        "listen = \"myhost:20640\"\n{LANE}upstreams = [\"http://127.0.0.1:20641\"]\n"
    ));
    assert!(
        err.contains("line 1") && err.contains("\"127.0.0.1:20640\""),
        "{err}"
    );
}

/// Starts the gateway, waits for "listening on", stops it; returns (stdout line, stderr).
fn starts(toml: &str) -> (String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, toml).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--config"])
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let started = Instant::now();
    let mut listening = String::new();
    while started.elapsed() < Duration::from_secs(30) {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("listening on") => {
                listening = l;
                break;
            }
            Some(_) => {}
            None => break,
        }
    }
    child.kill().unwrap();
    let out = child.wait_with_output().unwrap();
    (listening, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn localhost_is_accepted_and_a_trailing_v1_is_dropped_with_a_note() {
    let (listening, err) = starts(&format!(
        "listen = \"localhost:20642\"\n{LANE}upstreams = [\"http://127.0.0.1:20643/v1\"]\n"
    ));
    assert_eq!(listening, "listening on 127.0.0.1:20642", "{err}");
    assert!(err.contains("trailing /v1 was dropped"), "{err}");
}
