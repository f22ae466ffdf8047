//! Pausing a backend by signal: which lanes it applies to (llama.cpp, a batch audio engine: any
//! engine `up` runs that has no pause call of its own) and the hook the gateway calls.

use std::sync::Arc;

use crate::boxfile::{BoxConfig, Engine};
use crate::process::{self};
use crate::report::BoxStatus;

/// The lanes whose engine `up` pauses by signal: `preempt_mode = "pause"` on a backend with no
/// pause call of its own (llama.cpp, Whisper, a speech server; vLLM has its HTTP one).
pub(crate) fn signal_paused_lanes(
    config: &BoxConfig,
    serve: &headroom_server::ServeSettings,
) -> Vec<String> {
    serve
        .lanes
        .iter()
        .filter(|l| l.spec.preempt_mode == headroom_gate::PreemptMode::Pause)
        .filter(|l| {
            config
                .backends
                .iter()
                .any(|b| b.name == l.spec.name && b.engine != Engine::Vllm)
        })
        .map(|l| l.spec.name.clone())
        .collect()
}

/// Pauses `backend` by stopping its process group (SIGSTOP) and resumes it (SIGCONT): the engine
/// stops between two instructions, every request stays where it is and goes on after. The group
/// is the one running now (a restarted backend has a new one); a failed signal is said once per
/// change.
pub(crate) fn pause_by_signal(
    status: Arc<BoxStatus>,
    backend: &str,
) -> headroom_server::pause::PauseHook {
    let backend = backend.to_string();
    Arc::new(move |pause: bool| {
        let pid = status
            .lock()
            .backends
            .iter()
            .find(|b| b.name == backend)
            .and_then(|b| b.pid);
        let Some(pid) = pid else { return };
        if let Err(e) = process::signal_group(pid, pause) {
            let what = if pause {
                "pause (SIGSTOP)"
            } else {
                "resume (SIGCONT)"
            };
            headroom_server::stderr::line(&format!(
                "up: [{backend}] could not {what} process group {pid}: {e}"
            ));
        }
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::signal_paused_lanes;
    use crate::boxfile::BoxConfig;
    use crate::lanes::{LaneFigures, serve_config};

    /// Two Whispers (one for recordings, paused while dictation runs), llama.cpp paused for
    /// both audio lanes, and a vLLM text lane, which has its own pause call.
    const BOX: &str = r#"
[memory]
probe = "host"
capacity = "4GiB"
[[backends]]
name = "stt"
role = "audio"
engine = "whisper"
command = "x"
port = 20181
[[backends]]
name = "stt-batch"
role = "audio"
engine = "whisper"
command = "x"
port = 20182
[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "y"
port = 20180
model = "m.gguf"
[serve]
listen = "127.0.0.1:20100"
[serve.lanes.stt-batch]
models = ["whisper-batch"]
yield_to = ["stt"]
preempt = true
preempt_mode = "pause"
"#;

    #[test]
    fn every_engine_up_runs_without_a_pause_call_of_its_own_is_paused_by_signal() {
        let figures = [
            LaneFigures::new("stt", 40 << 20, 1),
            LaneFigures::new("stt-batch", 60 << 20, 1),
            LaneFigures {
                gives_way_to: vec!["stt".into()],
                ..LaneFigures::new("llm", 0, 2)
            },
        ];
        let b = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let serve = serve_config(&b, &figures).unwrap();
        // The batch Whisper as well as llama.cpp: before, only llama.cpp was, and the batch
        // lane's pause went to vLLM's HTTP call on a Whisper server (a 404 and no pause).
        assert_eq!(signal_paused_lanes(&b, &serve), ["stt-batch", "llm"]);
        // vLLM pauses over HTTP: not by signal.
        let vllm = BoxConfig::parse(
            &BOX.replace("engine = \"llamacpp\"", "engine = \"vllm\"")
                .replace("model = \"m.gguf\"", "model = \"m\""),
            Path::new("/"),
        )
        .unwrap();
        let serve = serve_config(&vllm, &figures).unwrap();
        assert_eq!(signal_paused_lanes(&vllm, &serve), ["stt-batch"]);
    }
}
