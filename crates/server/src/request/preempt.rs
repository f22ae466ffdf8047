//! Preemption: for a lane with `preempt`, the waiter that fires when a lane it yields to admits
//! work, armed the moment the permit is held so no notification is missed, and the race of the
//! upstream request (under the deadline) against it; for the job that stopped requests, the
//! wait (`preempt_settle`) until their engine has really stopped them.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use headroom_gate::Permit;
use tokio::sync::futures::OwnedNotified;
use tokio::time::Instant;

use super::Deadline;
use crate::app::Shared;
use crate::error::ApiError;
use crate::proxy::Flight;
use crate::scrape::{self, ScrapeTarget};

/// Response header: milliseconds this job waited, after admission, for the requests it stopped
/// to end on their engine (`preempt_settle`); absent when it waited for none.
pub(super) const SETTLE_HEADER: &str = "x-headroom-preempt-settle-ms";

/// Pause between two readings of an engine that still runs stopped requests. Each reading is
/// itself answered only between two of the engine's decode steps (llama.cpp serves `/metrics`
/// and `/slots` from its task loop), so this only keeps the poll from spinning.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// An armed preemption waiter.
pub(super) type Waiter = Pin<Box<OwnedNotified>>;

/// Arms the permit's preemption waiter, when its lane has one.
pub(super) fn arm(permit: &Permit) -> Option<Waiter> {
    permit.preemption().map(|notify| {
        let mut waiter = Box::pin(notify.notified_owned());
        waiter.as_mut().enable();
        waiter
    })
}

/// Awaits `send` until the deadline; a preemption or the deadline ends the flight with its error.
/// Dropping the request future closes its connection, so the engine stops.
pub(super) async fn race<T>(
    send: impl Future<Output = T>,
    preempted: Option<&mut Waiter>,
    deadline: Deadline,
    flight: &mut Flight,
) -> Result<T, ApiError> {
    let send = tokio::time::timeout_at(deadline.at, send);
    let sent = match preempted {
        None => send.await,
        Some(waiter) => tokio::select! {
            r = send => r,
            _ = waiter.as_mut() => {
                flight.finish("preempted");
                return Err(ApiError::preempted(flight.lane()));
            }
        },
    };
    sent.map_err(|_| {
        flight.finish("deadline");
        ApiError::deadline(flight.lane(), deadline.timeout)
    })
}

/// The job behind `permit` stopped running requests: for each lane it stopped with a
/// `preempt_settle`, waits until that lane's engines report no request running, for at most
/// `preempt_settle`. An engine reads a cancel only between two decode steps (llama.cpp's task
/// loop handles cancels, and answers `/metrics`, between two `update_slots` batches), and a step
/// that runs beside the job on the same cores is slowed by it, and slows it, many times over;
/// waiting for the step to end alone is shorter than racing it. Returns how long it waited
/// (`None`: it had nothing to wait for).
pub(super) async fn settle(s: &Shared, permit: &Permit) -> Option<Duration> {
    if permit.stopped_lanes().is_empty() {
        // Nearly every request: no clock read, and the waiting below (a large future) is
        // neither built nor moved.
        return None;
    }
    Box::pin(settle_stopped(s, permit)).await
}

/// [`settle`] for a permit that stopped requests.
async fn settle_stopped(s: &Shared, permit: &Permit) -> Option<Duration> {
    let started = Instant::now();
    let mut waited = false;
    for &lane in permit.stopped_lanes() {
        let Some(config) = s.config.lanes.get(lane) else {
            continue;
        };
        let Some(kind) = config.engine else { continue };
        if config.preempt_settle.is_zero() {
            continue;
        }
        let until = started + config.preempt_settle;
        waited = true;
        for upstream in &config.spec.upstreams {
            let target = ScrapeTarget {
                upstream: upstream.clone(),
                kind,
                metrics_path: config.metrics_path.clone(),
            };
            while !engine_idle(s, &target, until).await {
                tokio::time::sleep_until((Instant::now() + SETTLE_POLL).min(until)).await;
            }
        }
    }
    waited.then(|| started.elapsed())
}

/// Whether `target` reports no request running; also true once `until` has passed (the wait is
/// over either way). An engine that cannot be read counts as not idle until then.
async fn engine_idle(s: &Shared, target: &ScrapeTarget, until: Instant) -> bool {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return true;
    }
    let load = scrape::scrape_once(&s.client, target, left).await;
    load.and_then(|l| l.running)
        .is_some_and(|running| running < 0.5)
        || Instant::now() >= until
}
