//! Preemption: for a lane with `preempt`, the waiter that fires when a lane it yields to admits
//! work, armed the moment the permit is held so no notification is missed, and the race of the
//! upstream request (under the deadline) against it; for the job that stopped requests, the
//! wait (`preempt_settle`) until their engine has really stopped them.

use std::future::Future;
use std::pin::{Pin, pin};
use std::task::Poll;
use std::time::Duration;

use headroom_gate::Permit;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};

use super::{Deadline, Timer};
use crate::core_state::Core;
use crate::error::ApiError;
use crate::proxy::Flight;
use crate::scrape::{self, ScrapeTarget};

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

/// Awaits `send` until the deadline (on the connection's `timer` when there is one, else on a
/// timer of its own); a preemption or the deadline ends the flight with its error. Dropping the
/// request future closes its connection, so the engine stops. An upstream that held the request
/// for half the lane's own `request_timeout` or more without a response head has failed it (its
/// passive health counts the timeout); a shorter wait (a client's shorter deadline, most of the
/// time spent queued) is nobody's failure.
pub(super) async fn race<T>(
    send: impl Future<Output = T>,
    preempted: Option<&mut Waiter>,
    deadline: Deadline,
    timer: Timer<'_>,
    flight: &mut Flight,
) -> Result<T, ApiError> {
    let send = pin!(send);
    let sent = match timer {
        Some(mut timer) => {
            timer.as_mut().reset(deadline.at);
            until(send, timer, preempted).await
        }
        None => until(send, pin!(tokio::time::sleep_until(deadline.at)), preempted).await,
    };
    match sent {
        Ended::Sent(r) => Ok(r),
        Ended::Preempted => {
            flight.finish("preempted");
            Err(ApiError::preempted(flight.lane()))
        }
        Ended::Deadline => {
            if let Some(p) = flight.permit_mut()
                && p.admitted_at().elapsed() >= deadline.lane_timeout / 2
            {
                p.mark_upstream(false);
            }
            flight.finish("deadline");
            Err(ApiError::deadline(flight.lane(), deadline.timeout))
        }
    }
}

/// How [`race`]'s wait ended.
enum Ended<T> {
    Sent(T),
    Preempted,
    Deadline,
}

/// `send`'s output, unless the preemption or the timer comes first.
async fn until<T>(
    mut send: Pin<&mut impl Future<Output = T>>,
    mut timer: Pin<&mut Sleep>,
    mut preempted: Option<&mut Waiter>,
) -> Ended<T> {
    std::future::poll_fn(|cx| {
        if let Poll::Ready(r) = send.as_mut().poll(cx) {
            return Poll::Ready(Ended::Sent(r));
        }
        if let Some(waiter) = preempted.as_mut()
            && waiter.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Ended::Preempted);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Ended::Deadline),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// The job behind `permit` stopped running requests: for each lane it stopped with a
/// `preempt_settle`, waits until that lane's engines report no request running, for at most
/// `preempt_settle`. An engine reads a cancel only between two decode steps (llama.cpp's task
/// loop handles cancels, and answers `/metrics`, between two `update_slots` batches), and a step
/// that runs beside the job on the same cores is slowed by it, and slows it, many times over;
/// waiting for the step to end alone is shorter than racing it. Returns how long it waited
/// (`None`: it had nothing to wait for).
pub(super) async fn settle(s: &Core, permit: &Permit) -> Option<Duration> {
    if permit.stopped_lanes().is_empty() {
        // Nearly every request: no clock read, and the waiting below (a large future) is
        // neither built nor moved.
        return None;
    }
    Box::pin(settle_stopped(s, permit)).await
}

/// [`settle`] for a permit that stopped requests.
async fn settle_stopped(s: &Core, permit: &Permit) -> Option<Duration> {
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
async fn engine_idle(s: &Core, target: &ScrapeTarget, until: Instant) -> bool {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return true;
    }
    let load = scrape::scrape_once(&s.client, target, left).await;
    load.and_then(|l| l.running)
        .is_some_and(|running| running < 0.5)
        || Instant::now() >= until
}
