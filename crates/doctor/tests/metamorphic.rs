//! Metamorphic tests: every fixture log under tests/data/logs keeps its diagnosis after each way
//! the same log reaches a user — a process, rank, timestamp, container, orchestrator or
//! log-level prefix on every line, colour codes (with and without the ESC byte a paste loses),
//! CRLF line ends, a console that hard-wrapped it at 80 or 120 columns, another letter case, and
//! Docker's JSON log lines. "Keeps its diagnosis" means the same causes in the same order, the
//! same numbers in the first finding, and the same fix text (letter case aside).

mod common;

use common::fixtures;
use headroom_doctor::{Diagnosis, diagnose_str};

/// True when the fixture's expectation says a console already wrapped it (`console_wrapped`).
fn console_wrapped(log_name: &str) -> bool {
    let stem = log_name.trim_end_matches(".log");
    let path = common::logs_dir()
        .join("expected")
        .join(format!("{stem}.json"));
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|v| v.get("console_wrapped").is_some())
}

fn each_line(text: &str, f: impl Fn(&str) -> String) -> String {
    let body = text.strip_suffix('\n').unwrap_or(text);
    let mut out: Vec<String> = body.split('\n').map(f).collect();
    if text.ends_with('\n') {
        out.push(String::new());
    }
    out.join("\n")
}

fn prefixed(text: &str, prefix: &str) -> String {
    each_line(text, |l| format!("{prefix}{l}"))
}

/// What a console does to a long line: cut it every `width` characters, mid-word.
fn wrapped(text: &str, width: usize) -> String {
    each_line(text, |l| {
        let chars: Vec<char> = l.chars().collect();
        if chars.len() <= width {
            return l.to_owned();
        }
        chars
            .chunks(width)
            .map(|c| c.iter().collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    })
}

/// Colour on the first word of every line, as loggers that colour their level do.
fn coloured(text: &str, esc: &str) -> String {
    each_line(text, |l| match l.find(' ') {
        Some(at) => format!("{esc}[1;36m{}{esc}[0m{}", &l[..at], &l[at..]),
        None if !l.is_empty() => format!("{esc}[31m{l}{esc}[0m"),
        None => String::new(),
    })
}

/// Docker's json-file driver: one JSON object per line, the line in `log`.
fn docker_json(text: &str) -> String {
    each_line(text, |l| {
        serde_json::json!({"log": format!("{l}\n"), "stream": "stderr", "time": "2025-11-03T10:21:44.123456789Z"})
            .to_string()
    })
}

type Transform = (&'static str, fn(&str) -> String);

const TRANSFORMS: &[Transform] = &[
    ("prefix: Ray worker tag", |t| {
        prefixed(t, "(RayWorkerWrapper pid=3164, ip=10.0.0.1) ")
    }),
    ("prefix: process tag", |t| prefixed(t, "(Worker pid=4711) ")),
    ("prefix: rank tag", |t| prefixed(t, "[rank0]: ")),
    ("prefix: ISO timestamp", |t| {
        prefixed(t, "2025-11-03T10:21:44.123456789Z ")
    }),
    ("prefix: Python logging", |t| {
        prefixed(t, "2025-11-03 10:21:44,123 - server - ERROR - ")
    }),
    ("prefix: compose service", |t| prefixed(t, "engine-1  | ")),
    ("prefix: compose and timestamp", |t| {
        prefixed(t, "engine-1  | 2025-11-03T10:21:44.123Z ")
    }),
    ("prefix: kubectl --prefix", |t| {
        prefixed(t, "[pod/engine-7d9f5/engine] ")
    }),
    ("prefix: syslog", |t| {
        prefixed(t, "Nov  3 10:21:44 gpu-box engine[1234]: ")
    }),
    ("prefix: SGLang-style time and rank", |t| {
        prefixed(t, "[2025-11-03 10:21:44 TP0] ")
    }),
    ("prefix: log level", |t| prefixed(t, "ERROR ")),
    ("colour codes", |t| coloured(t, "\x1b")),
    ("colour codes without ESC (pasted)", |t| coloured(t, "")),
    ("CRLF", |t| t.replace('\n', "\r\n")),
    ("wrapped at 80 columns", |t| wrapped(t, 80)),
    ("wrapped at 120 columns", |t| wrapped(t, 120)),
    ("lower case", |t| t.to_lowercase()),
    ("upper case", |t| t.to_uppercase()),
    ("Docker JSON lines", docker_json),
];

/// The parts of a diagnosis that must not move: causes, first finding's numbers, every fix.
fn signature(d: &Diagnosis) -> (Vec<&'static str>, Vec<(String, String)>, Vec<String>) {
    let causes = d.findings.iter().map(|f| f.cause.as_str()).collect();
    let numbers = d
        .findings
        .first()
        .map(|f| {
            f.numbers
                .iter()
                .map(|(k, v)| (k.clone(), format!("{v:.6}")))
                .collect()
        })
        .unwrap_or_default();
    let fixes = d.findings.iter().map(|f| f.fix.to_lowercase()).collect();
    (causes, numbers, fixes)
}

#[test]
fn every_fixture_keeps_its_diagnosis_under_every_transformation() {
    let mut failures = Vec::new();
    let mut checked = 0;
    for (name, text) in fixtures() {
        let base = diagnose_str(&text);
        let want = signature(&base);
        let wrapped_already = console_wrapped(&name);
        for (what, transform) in TRANSFORMS {
            // A log a console already wrapped is itself the wrapping case: wrapping it again at
            // another width makes a doubly-wrapped log no console produces.
            if wrapped_already && what.starts_with("wrapped") {
                continue;
            }
            let got_d = diagnose_str(&transform(&text));
            let got = signature(&got_d);
            checked += 1;
            if got.0 != want.0 {
                failures.push(format!(
                    "{name} [{what}]: causes {:?}, untransformed {:?}",
                    got.0, want.0
                ));
            } else if got.1 != want.1 {
                failures.push(format!(
                    "{name} [{what}]: numbers {:?}, untransformed {:?}",
                    got.1, want.1
                ));
            } else if got.2 != want.2 {
                failures.push(format!(
                    "{name} [{what}]: fix {:?}, untransformed {:?}",
                    got.2, want.2
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} transformed logs changed their diagnosis:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn transformations_really_change_the_text() {
    // Guards the test above against transformations that silently do nothing.
    let sample = "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.57 GiB of which 1.50 GiB is free. Process 1 has 20 GiB memory in use.\n";
    for (what, transform) in TRANSFORMS {
        assert_ne!(transform(sample), sample, "{what}");
    }
    assert!(wrapped(sample, 80).lines().all(|l| l.chars().count() <= 80));
}
