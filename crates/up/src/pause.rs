//! Pausing llama.cpp by signal: which lanes it applies to and the hook the gateway calls.

use std::sync::Arc;

use crate::boxfile::{BoxConfig, Engine};
use crate::process::{self};
use crate::report::BoxStatus;

/// The text lanes whose engine `up` pauses by signal: `preempt_mode = "pause"` on a backend with
/// no pause call of its own (llama.cpp; vLLM has its HTTP one).
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
                .any(|b| b.name == l.spec.name && b.engine == Engine::LlamaCpp)
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
