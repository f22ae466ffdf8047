//! The gateway's lanes, derived from the box and its measured figures: one lane per backend,
//! named after it. Audio lanes admit a job only while the pool has the backend's measured
//! per-job memory free (its peak − resident, plus per audio-second where measured); the text
//! lane runs as many requests at once as the engine has sequences, which [`text_slots`] keeps
//! below the device-wide cap less the audio lanes' slots, and gives way to the audio lanes whose
//! jobs were measured to slow beside a generation (`yield_to`, and `preempt`: llama.cpp paused by
//! `up` while they run, `preempt_mode = "pause"`; another engine's running requests stopped,
//! with `preempt_settle`; [`crate::contention`]). `[serve.lanes.NAME]` keys override what is
//! derived.
//! The result is `serve`'s own settings (`ServeSettings`), validated by `serve` from the table
//! built here; no configuration text is written or parsed on the way.

use std::time::Duration;

use headroom_server::ServeSettings;

use crate::UpError;
use crate::boxfile::{BackendConfig, BoxConfig, Engine, Role};

/// What one lane is derived from.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneFigures {
    pub backend: String,
    /// Memory one job adds at its peak (audio).
    pub per_job_bytes: u64,
    /// Memory per second of audio on top (audio, where the warm-up clip had a duration).
    pub per_audio_second_bytes: Option<u64>,
    /// Requests at once (text: the engine's sequences; audio: 1).
    pub max_inflight: u64,
    /// Text: the audio lanes it gives way to (their jobs slow beside a generation: it yields to
    /// them and stops every running request when one of their jobs is admitted).
    pub gives_way_to: Vec<String>,
    /// Text: how long an admitted audio job waits for stopped generations to leave the engine.
    pub preempt_settle: Option<Duration>,
    /// Speech: seconds of speech per input character, measured by the warm-up (the lane's
    /// `speech_seconds_per_char`, from which its jobs' audio seconds are estimated).
    pub speech_seconds_per_char: Option<f64>,
}

impl LaneFigures {
    /// An audio lane's figures, or a text lane that gives way to nothing.
    pub fn new(backend: &str, per_job_bytes: u64, max_inflight: u64) -> LaneFigures {
        LaneFigures {
            backend: backend.to_string(),
            per_job_bytes,
            per_audio_second_bytes: None,
            max_inflight,
            gives_way_to: Vec::new(),
            preempt_settle: None,
            speech_seconds_per_char: None,
        }
    }
}

/// The text engine's sequences: at most `max_parallel`, and, under a device-wide cap
/// (`[serve] max_inflight_total`), at most what the cap leaves beside the audio lanes' own
/// slots (at least one). A text lane that could fill the cap would keep an arriving audio job
/// waiting until a generation ends; sequences the gateway never sends are memory better spent
/// on context.
pub fn text_slots(max_parallel: u64, max_inflight_total: Option<u64>, audio_slots: u64) -> u64 {
    match max_inflight_total {
        Some(total) => max_parallel.min(total.saturating_sub(audio_slots).max(1)),
        None => max_parallel,
    }
    .max(1)
}

fn audio_paths(b: &BackendConfig) -> Vec<String> {
    match b.engine {
        Engine::Whisper => vec![
            "/v1/audio/transcriptions".into(),
            "/v1/audio/translations".into(),
        ],
        _ => match &b.warmup {
            Some(w) if !w.path.is_empty() => vec![w.path.clone()],
            // An audio vLLM (VibeVoice-ASR's plugin) takes audio in chat requests.
            _ if b.audio_vllm.is_some() => vec!["/v1/chat/completions".into()],
            _ => vec!["/v1/audio/speech".into()],
        },
    }
}

fn paths_take_chat(b: &BackendConfig) -> bool {
    audio_paths(b).iter().any(|p| p == "/v1/chat/completions")
}

fn lane_table(b: &BackendConfig, f: &LaneFigures, device: u32) -> toml::Table {
    let mut t = toml::Table::new();
    let s = |v: &str| toml::Value::String(v.into());
    let i = |v: u64| toml::Value::Integer(v.min(i64::MAX as u64) as i64);
    t.insert("name".into(), s(&b.name));
    t.insert(
        "upstreams".into(),
        toml::Value::Array(vec![s(&b.upstream())]),
    );
    t.insert("max_inflight".into(), i(f.max_inflight.max(1)));
    t.insert("policy".into(), s("queue"));
    t.insert("request_timeout".into(), s("120s"));
    match b.role {
        Role::Audio => {
            let paths = audio_paths(b).iter().map(|p| s(p)).collect();
            t.insert("paths".into(), toml::Value::Array(paths));
            t.insert("max_queue".into(), i(8));
            t.insert("queue_timeout".into(), s("30s"));
            t.insert("priority".into(), i(10));
            t.insert("gpu_device".into(), i(device as u64));
            t.insert("gpu_memory_per_job".into(), i(f.per_job_bytes));
            // serve's ledger refines the measured figure from real jobs (kept in the calibration file).
            t.insert("learn".into(), toml::Value::Boolean(true));
            if paths_take_chat(b) {
                // Chat requests that carry audio parts come here; plain text chats go on to
                // the text lane.
                t.insert("chat_audio".into(), toml::Value::Boolean(true));
            }
            if let Some(a) = &b.audio_vllm {
                // Its --max-model-len was sized for this much audio: longer clips get 413.
                t.insert(
                    "max_audio_seconds".into(),
                    toml::Value::Float(a.max_audio_seconds),
                );
            }
            if let Some(rate) = f.speech_seconds_per_char {
                t.insert("speech_seconds_per_char".into(), toml::Value::Float(rate));
            }
            if let Some(per_second) = f.per_audio_second_bytes {
                t.insert("gpu_memory_per_audio_second".into(), i(per_second));
                // Audio of unknown length is counted as this long (overridable per lane).
                if !t.contains_key("max_audio_seconds") {
                    t.insert("max_audio_seconds".into(), toml::Value::Float(600.0));
                }
            }
        }
        Role::Text => {
            t.insert(
                "paths".into(),
                toml::Value::Array(vec![s("/v1/chat/completions"), s("/v1/completions")]),
            );
            t.insert("max_queue".into(), i(4));
            t.insert("queue_timeout".into(), s("10s"));
            t.insert("priority".into(), i(1));
            if let Some(engine) = match b.engine {
                Engine::Vllm => Some("vllm"),
                Engine::LlamaCpp => Some("llamacpp"),
                _ => None,
            } {
                t.insert("engine".into(), s(engine));
            }
            if !f.gives_way_to.is_empty() {
                let to = f.gives_way_to.iter().map(|n| s(n)).collect();
                t.insert("yield_to".into(), toml::Value::Array(to));
                t.insert("preempt".into(), toml::Value::Boolean(true));
                if b.engine == Engine::LlamaCpp {
                    // llama.cpp notices a dropped request only when it writes a token, so a
                    // stopped request still evaluating its prompt runs on beside the audio job
                    // (seconds for a long prompt on a CPU). `up` owns its processes: it pauses
                    // the engine (SIGSTOP of its group, SIGCONT when the audio lanes are idle),
                    // which keeps every request where it is.
                    // (A box that sets preempt_mode = "abort" stops them instead, below.)
                    t.insert("preempt_mode".into(), s("pause"));
                }
                t.insert("preempt_per_job".into(), s("all"));
                // The settle waits on the engine's metrics, which only a known engine has.
                if let (Some(settle), true) = (f.preempt_settle, t.contains_key("engine")) {
                    t.insert(
                        "preempt_settle".into(),
                        s(&format!("{}ms", settle.as_millis())),
                    );
                }
            }
        }
    }
    t
}

/// `serve`'s configuration for the box, as the table `serve` validates: the `[serve]` keys of
/// the box file, the derived lanes with each lane's `[serve.lanes.NAME]` keys over them, and the
/// box's `[memory]`.
pub fn serve_table(config: &BoxConfig, figures: &[LaneFigures]) -> toml::Table {
    let mut top = config.serve.top.clone();
    top.insert(
        "listen".into(),
        toml::Value::String(config.serve.listen.to_string()),
    );
    // The same [memory] table, so serve's ledger reads the pool `up` measured.
    top.insert(
        "memory".into(),
        toml::Value::Table(config.memory.to_table()),
    );
    let mut lanes = Vec::new();
    for b in &config.backends {
        let Some(f) = figures.iter().find(|f| f.backend == b.name) else {
            continue;
        };
        let mut t = lane_table(b, f, config.memory.device);
        let overrides = config.serve.lanes.get(&b.name);
        for (k, v) in overrides.into_iter().flatten() {
            t.insert(k.clone(), v.clone());
        }
        // A lane that does not stop requests (no preempt, or it pauses instead) drops the
        // derived settle and count, which only stopping uses.
        let stops = t.get("preempt").and_then(toml::Value::as_bool) == Some(true)
            && t.get("preempt_mode").and_then(toml::Value::as_str) != Some("pause");
        let set = |key: &str| overrides.is_some_and(|o| o.contains_key(key));
        if !stops && !set("preempt_settle") {
            t.remove("preempt_settle");
        }
        if !stops && !set("preempt_per_job") {
            t.remove("preempt_per_job");
        }
        let preempts = t.get("preempt").and_then(toml::Value::as_bool) == Some(true);
        if !preempts && !set("preempt_mode") {
            t.remove("preempt_mode");
        }
        lanes.push(toml::Value::Table(t));
    }
    top.insert("lanes".into(), toml::Value::Array(lanes));
    top
}

/// `serve`'s validated configuration for the box.
pub fn serve_config(config: &BoxConfig, figures: &[LaneFigures]) -> Result<ServeSettings, UpError> {
    ServeSettings::from_table(serve_table(config, figures)).map_err(|e| UpError::Config {
        key: "serve".into(),
        message: format!("the derived gateway configuration is refused: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    const BOX: &str = r#"
[memory]
probe = "host"
capacity = "4GiB"
[[backends]]
name = "stt"
role = "audio"
engine = "whisper"
command = "x"
port = 20081
[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "y"
port = 20080
model = "m.gguf"
[serve]
listen = "127.0.0.1:20000"
[serve.lanes.llm]
yield_to = ["stt"]
max_output_tokens = 128
"#;

    #[test]
    fn lanes_carry_the_measured_figures() {
        let b = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let figures = [
            LaneFigures {
                per_audio_second_bytes: Some(1_000_000),
                ..LaneFigures::new("stt", 40 << 20, 1)
            },
            LaneFigures::new("llm", 0, 3),
        ];
        let c = serve_config(&b, &figures).unwrap();
        assert_eq!(c.listen.port(), 20000);
        let stt = &c.lanes[0];
        assert_eq!(stt.spec.name, "stt");
        assert_eq!(stt.spec.upstreams, vec!["http://127.0.0.1:20081"]);
        let gpu = stt.spec.gpu.as_ref().unwrap();
        assert_eq!(gpu.bytes_per_job, 40 << 20);
        assert_eq!(gpu.bytes_per_audio_second, 1_000_000);
        let llm = &c.lanes[1];
        assert_eq!(llm.spec.max_inflight, 3);
        assert_eq!(llm.spec.yield_to, vec!["stt"]);
        assert_eq!(llm.max_output_tokens, Some(128));
        assert!(llm.paths.contains(&"/v1/chat/completions".to_string()));
    }

    #[test]
    fn a_speech_lane_takes_the_measured_speech_rate_and_serve_its_default_without_one() {
        let with_tts = BOX.replace(
            "[[backends]]\nname = \"llm\"",
            "[[backends]]\nname = \"tts\"\nrole = \"audio\"\ncommand = \"z\"\nport = 20082\n[backends.warmup]\npath = \"/v1/audio/speech\"\njson = '{\"input\":\"hi\"}'\n\n[[backends]]\nname = \"llm\"",
        );
        let b = BoxConfig::parse(&with_tts, Path::new("/")).unwrap();
        assert_eq!(
            b.backends.len(),
            3,
            "the box file gained its speech backend"
        );
        let figures = |rate: Option<f64>| {
            [
                LaneFigures::new("stt", 40 << 20, 1),
                LaneFigures {
                    speech_seconds_per_char: rate,
                    ..LaneFigures::new("tts", 30 << 20, 1)
                },
                LaneFigures::new("llm", 0, 2),
            ]
        };
        let c = serve_config(&b, &figures(Some(0.0612))).unwrap();
        let tts = c.lanes.iter().find(|l| l.spec.name == "tts").unwrap();
        assert_eq!(tts.paths, vec!["/v1/audio/speech".to_string()]);
        assert_eq!(tts.speech_seconds_per_char, 0.0612);
        let c = serve_config(&b, &figures(None)).unwrap();
        let tts = c.lanes.iter().find(|l| l.spec.name == "tts").unwrap();
        assert_eq!(tts.speech_seconds_per_char, 0.07);
    }

    #[test]
    fn text_that_slows_audio_gives_way_to_it_and_the_box_file_still_has_the_last_word() {
        let b =
            BoxConfig::parse(&BOX.replace("yield_to = [\"stt\"]\n", ""), Path::new("/")).unwrap();
        let figures = [
            LaneFigures::new("stt", 40 << 20, 1),
            LaneFigures {
                gives_way_to: vec!["stt".into()],
                preempt_settle: Some(Duration::from_millis(800)),
                ..LaneFigures::new("llm", 0, 2)
            },
        ];
        // llama.cpp is paused while audio runs (`up` stops its process group).
        let c = serve_config(&b, &figures).unwrap();
        let llm = &c.lanes[1].spec;
        assert_eq!(llm.yield_to, vec!["stt"]);
        assert!(llm.preempt);
        assert_eq!(llm.preempt_mode, headroom_gate::PreemptMode::Pause);
        assert_eq!(c.lanes[1].preempt_settle, Duration::ZERO);
        // A box that asks for stopping gets every running request stopped, with the settle.
        let abort = BoxConfig::parse(
            &BOX.replace("yield_to = [\"stt\"]\n", "preempt_mode = \"abort\"\n"),
            Path::new("/"),
        )
        .unwrap();
        let c = serve_config(&abort, &figures).unwrap();
        let llm = &c.lanes[1].spec;
        assert_eq!(llm.preempt_mode, headroom_gate::PreemptMode::Abort);
        assert_eq!(llm.preempt_per_job, usize::MAX, "every running request");
        assert_eq!(c.lanes[1].preempt_settle, Duration::from_millis(800));
        // vLLM has no process-level pause from `up`: its requests are stopped.
        let vllm = BoxConfig::parse(
            &BOX.replace("yield_to = [\"stt\"]\n", "")
                .replace("engine = \"llamacpp\"", "engine = \"vllm\""),
            Path::new("/"),
        )
        .unwrap();
        let c = serve_config(&vllm, &figures).unwrap();
        let llm = &c.lanes[1].spec;
        assert_eq!(llm.preempt_mode, headroom_gate::PreemptMode::Abort);
        assert_eq!(llm.preempt_per_job, usize::MAX, "every running request");
        assert_eq!(c.lanes[1].preempt_settle, Duration::from_millis(800));
        // `[serve.lanes.llm] preempt = false` turns it off (and what only stopping uses goes).
        let off = BoxConfig::parse(
            &BOX.replace("max_output_tokens = 128", "preempt = false"),
            Path::new("/"),
        )
        .unwrap();
        let c = serve_config(&off, &figures).unwrap();
        assert!(!c.lanes[1].spec.preempt);
        // Text that does not slow audio runs on beside it.
        let c = serve_config(
            &b,
            &[LaneFigures::new("stt", 1, 1), LaneFigures::new("llm", 0, 2)],
        )
        .unwrap();
        assert!(c.lanes[1].spec.yield_to.is_empty() && !c.lanes[1].spec.preempt);
    }

    #[test]
    fn text_never_fills_the_device_cap_an_audio_job_needs() {
        // The CPU box: 3 in flight on the device, whisper takes 1: text gets 2 of its 4.
        assert_eq!(text_slots(4, Some(3), 1), 2);
        assert_eq!(text_slots(1, Some(3), 1), 1);
        assert_eq!(text_slots(4, None, 1), 4);
        // A cap no larger than the audio slots still leaves text one.
        assert_eq!(text_slots(4, Some(1), 1), 1);
    }

    #[test]
    fn a_bad_override_is_reported_by_serve_s_own_validation() {
        let b = BoxConfig::parse(
            &BOX.replace("max_output_tokens = 128", "policy = \"sometimes\""),
            Path::new("/"),
        )
        .unwrap();
        let figures = [LaneFigures::new("llm", 0, 1)];
        let e = serve_config(&b, &figures).unwrap_err().to_string();
        assert!(e.contains("sometimes"), "{e}");
    }
}
