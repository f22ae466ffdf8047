//! `preempt_mode = "pause"`: pauses a lane's engines while a lane it yields to has work in
//! flight and resumes them when the last job ends, instead of stopping running requests.
//!
//! The calls are vLLM's development endpoints (the server runs with `VLLM_SERVER_DEV_MODE=1`):
//! `POST /sleep?level=0&mode=keep` stops scheduling and keeps every request where it is (its KV
//! cache stays allocated, nothing is recomputed; level 0 frees no memory), `POST
//! /wake_up?tags=scheduling` resumes them. A pause left behind (the gateway killed while audio
//! ran) is undone by the resume sent when the loop starts, and the gateway resumes on shutdown.
//! An engine with no such call is paused by whoever owns its processes, through a [`PauseHook`]
//! (`up` stops and continues llama.cpp's process group).

use std::time::Duration;

use headroom_gate::Gate;
use tokio::sync::watch;

use crate::live_config::LaneConfig;

/// How long one pause or resume call may take; a slow engine must not hold the next transition.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Pauses (`true`) or resumes (`false`) a lane's engines; called on every change of the lane's
/// pause signal, once with the current state at the start, and with `false` at shutdown.
pub type PauseHook = std::sync::Arc<dyn Fn(bool) + Send + Sync>;

/// [`pause_loop`] for a lane whose engines are paused through `hook`.
pub(crate) async fn hook_loop(hook: PauseHook, mut paused: watch::Receiver<bool>) {
    loop {
        let now = *paused.borrow_and_update();
        hook(now);
        if paused.changed().await.is_err() {
            return;
        }
    }
}

/// The lanes whose engines are paused rather than preempted, with their pause signal.
pub(crate) fn pausing_lanes(
    gate: &Gate,
    lanes: &[LaneConfig],
) -> Vec<(LaneConfig, watch::Receiver<bool>)> {
    lanes
        .iter()
        .enumerate()
        .filter_map(|(i, lane)| gate.pause_signal(i).map(|rx| (lane.clone(), rx)))
        .collect()
}

/// Follows one lane's pause signal for ever, pausing or resuming every upstream of the lane on
/// each change (and setting the current state, a resume, once at the start).
pub(crate) async fn pause_loop(
    client: reqwest::Client,
    lane: LaneConfig,
    mut paused: watch::Receiver<bool>,
) {
    loop {
        let now = *paused.borrow_and_update();
        set_all(&client, &lane, now).await;
        if paused.changed().await.is_err() {
            return;
        }
    }
}

/// Pauses (`true`) or resumes every upstream of `lane`, all at once.
pub(crate) async fn set_all(client: &reqwest::Client, lane: &LaneConfig, pause: bool) {
    let calls = lane
        .spec
        .upstreams
        .iter()
        .map(|upstream| set_one(client, lane, upstream, pause));
    futures_util::future::join_all(calls).await;
}

async fn set_one(client: &reqwest::Client, lane: &LaneConfig, upstream: &str, pause: bool) {
    let path = if pause {
        "/sleep?level=0&mode=keep"
    } else {
        "/wake_up?tags=scheduling"
    };
    let mut req = client
        .post(format!("{upstream}{path}"))
        .timeout(CALL_TIMEOUT);
    if let Some(key) = &lane.upstream_api_key {
        req = req.bearer_auth(key);
    }
    let name = &lane.spec.name;
    match req.send().await {
        Ok(r) if r.status().is_success() => {}
        Ok(r) => crate::stderr::line(&format!(
            "headroom serve: lane {name}: {upstream} answered {} to {path} (preempt_mode = \"pause\" \
             needs vLLM started with VLLM_SERVER_DEV_MODE=1)",
            r.status().as_u16()
        )),
        Err(e) => crate::stderr::line(&format!(
            "headroom serve: lane {name}: {upstream}{path} failed: {e}"
        )),
    }
}
