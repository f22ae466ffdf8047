//! Pausing a backend by signal: which lanes it applies to (llama.cpp, a batch audio engine: any
//! engine `up` runs that has no pause call of its own), the hook the gateway calls, and which
//! backends the gateway wants paused now (a backend started again meanwhile starts paused).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard};

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

/// The backends the gateway wants paused by signal now. A backend started again while its lane
/// is paused (llama.cpp after a `kill -9`, loading its model on every core) starts stopped, and
/// the gateway's resume continues it: before, it ran beside the audio job it yields to (a
/// narration sent at the text engine's kill took 1.74× its idle figure on the hour of 16:37).
#[derive(Default)]
pub(crate) struct SignalPauses(Mutex<HashSet<String>>);

impl SignalPauses {
    fn held(&self) -> MutexGuard<'_, HashSet<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `pid` the running group of `backend` and stops it when the gateway wants the
    /// backend paused now (one lock with the hook, so no pause or resume falls between).
    pub(crate) fn adopt(&self, status: &BoxStatus, backend: &str, pid: u32) {
        let held = self.held();
        status.update(backend, |r| r.pid = Some(pid));
        if held.contains(backend) {
            signal(backend, pid, true);
        }
    }
}

/// Pauses `backend` by stopping its process group (SIGSTOP) and resumes it (SIGCONT): the engine
/// stops between two instructions, every request stays where it is and goes on after. The group
/// is the one running now (a restarted backend has a new one, which [`SignalPauses::adopt`]
/// starts paused while the gateway wants it so); a failed signal is said once per change.
pub(crate) fn pause_by_signal(
    status: Arc<BoxStatus>,
    pauses: Arc<SignalPauses>,
    backend: &str,
) -> headroom_server::pause::PauseHook {
    let backend = backend.to_string();
    Arc::new(move |pause: bool| {
        let mut held = pauses.held();
        if pause {
            held.insert(backend.clone());
        } else {
            held.remove(&backend);
        }
        let pid = status
            .lock()
            .backends
            .iter()
            .find(|b| b.name == backend)
            .and_then(|b| b.pid);
        if let Some(pid) = pid {
            signal(&backend, pid, pause);
        }
    })
}

/// Stops or continues `backend`'s group, saying so when the signal fails.
fn signal(backend: &str, pid: u32, pause: bool) {
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
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::{SignalPauses, pause_by_signal, signal_paused_lanes};
    use crate::boxfile::BoxConfig;
    use crate::lanes::{LaneFigures, serve_config};
    use crate::report::{BoxStatus, initial_report};

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

    /// The state letter of `pid` in /proc (T: stopped), once it is `want` or after 5 s.
    fn state_of(pid: u32, want: char) -> char {
        let begin = Instant::now();
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
            let state = stat.rsplit(") ").next().unwrap().chars().next().unwrap();
            if state == want || begin.elapsed() > Duration::from_secs(5) {
                return state;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn a_backend_started_again_while_its_lane_is_paused_starts_stopped_until_the_resume() {
        use std::os::unix::process::CommandExt;
        let b = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let status = Arc::new(BoxStatus {
            report: Mutex::new(initial_report(&b, 1)),
        });
        let pauses = Arc::new(SignalPauses::default());
        let hook = pause_by_signal(Arc::clone(&status), Arc::clone(&pauses), "llm");
        // An audio job starts while llama.cpp is down (killed; no group to stop)…
        hook(true);
        // …and `up` starts it again meanwhile, in a group of its own.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let pid = child.id();
        pauses.adopt(&status, "llm", pid);
        let paused = state_of(pid, 'T');
        // The audio job ends: the gateway's resume continues it.
        hook(false);
        let resumed = state_of(pid, 'S');
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(
            paused, 'T',
            "started again while paused, it must start stopped"
        );
        assert_eq!(resumed, 'S', "the resume continues it");
        assert_eq!(status.report.lock().unwrap().backends[2].pid, Some(pid));
    }
}
