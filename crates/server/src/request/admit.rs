//! Admission: the request's deadline (the lane's timeout or the client's shorter
//! `x-headroom-timeout-ms`), the wait for a gate permit under it, and the answer to a refusal:
//! the rule-based fallback where the lane offers it, or the 429/503 that explains the refusal.

use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::Response;
use headroom_gate::{AdmitRequest, Permit, RejectReason, Rejection};
use tokio::time::Instant;

use super::fallback::fallback_response;
use super::{Deadline, Facts, Lane, Route};
use crate::config::FallbackKind;
use crate::core_state::Core;
use crate::error::ApiError;
use crate::telemetry::EARLY_RETRIES_TOTAL;

/// The deadline of a request that arrived at `arrival`.
pub(super) fn deadline(arrival: Instant, lane: Lane<'_>, asked: Option<&HeaderValue>) -> Deadline {
    let lane_timeout = lane.config.spec.request_timeout;
    let mut deadline = Deadline {
        at: arrival + lane_timeout,
        timeout: lane_timeout,
        lane_timeout,
    };
    if let Some(ms) = asked
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        let asked = Duration::from_millis(ms);
        if asked < deadline.timeout {
            deadline = Deadline {
                at: arrival + asked,
                timeout: asked,
                lane_timeout,
            };
        }
    }
    deadline
}

/// Waits for a permit on the lane (at most until the deadline) and records the queue wait: of
/// the admitted, and of those that timed out in the queue (their whole wait), so the lane's
/// queue-wait quantiles never look short while requests give up waiting.
pub(super) async fn admit(
    s: &Core,
    lane: Lane<'_>,
    seen: &Facts<'_>,
    deadline: Deadline,
) -> Result<Permit, Rejection> {
    let request = AdmitRequest {
        audio_seconds: seen.audio_seconds,
        wait_until: Some(deadline.at),
        audio_unknown: seen.has_audio && seen.audio_seconds.is_none(),
    };
    let asked = Instant::now();
    match s.gate.admit(lane.index, request).await {
        Ok(permit) => {
            s.telemetry
                .queue_wait(lane.index, permit.queue_wait().as_secs_f64());
            Ok(permit)
        }
        Err(rejection) => {
            if rejection.reason == RejectReason::QueueTimeout {
                s.telemetry
                    .queue_wait(lane.index, asked.elapsed().as_secs_f64());
            }
            Err(rejection)
        }
    }
}

/// Counts a refusal and answers it: with the fallback where the lane and policy allow, else an error.
/// Counts a client that is back before the Retry-After it was given (`headroom doctor --metrics`
/// reads the count). Clients are told apart by their key or `x-headroom-client` header.
pub(super) fn note_early_retry(s: &Core, lane: Lane<'_>, client: Option<u64>) {
    if let Some(c) = client
        && s.retries.arrives_early(lane.name(), c, Instant::now())
    {
        s.telemetry
            .counter(EARLY_RETRIES_TOTAL, &[("lane", lane.name())])
            .increment(1);
    }
}

pub(super) fn refused(
    s: &Core,
    lane: Lane<'_>,
    route: Route,
    seen: &Facts<'_>,
    body: &[u8],
    rejection: &Rejection,
) -> Result<Response, ApiError> {
    s.telemetry.rejection(lane.index, rejection.reason.code());
    if rejection.fallback
        && lane.config.fallback == Some(FallbackKind::RuleBasedCleanup)
        && may_fall_back(s, lane, rejection)
        && route == Route::Chat
        && seen.json
        && let Ok(json) = serde_json::from_slice::<serde_json::Value>(body)
    {
        return Ok(fallback_response(s, lane.index, &json, seen.stream));
    }
    s.telemetry.lane_outcome(lane.index, outcome_of(rejection));
    Err(ApiError::from_rejection(rejection))
}

/// Whether this refusal may be answered by the fallback: its reason is one the lane lists in
/// `fallback_reasons` (default: the lane is saturated or its queue is full), and the gateway is
/// not shutting down (a draining gateway says so instead of answering as if it were serving).
fn may_fall_back(s: &Core, lane: Lane<'_>, rejection: &Rejection) -> bool {
    rejection.reason != RejectReason::ShuttingDown
        && !s.gate.is_draining()
        && lane
            .config
            .fallback_reasons
            .iter()
            .any(|r| r == rejection.reason.code())
}

fn outcome_of(r: &Rejection) -> &'static str {
    match r.reason {
        // A request held (for memory) until its queue wait ran out timed out in the queue.
        RejectReason::QueueTimeout => "queue_timeout",
        _ if r.queued_for.is_some() => "queue_timeout",
        RejectReason::ShuttingDown => "shutting_down",
        _ => "rejected",
    }
}
