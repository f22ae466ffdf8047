//! Preemption: for a lane with `preempt`, the waiter that fires when a lane it yields to admits
//! work, armed the moment the permit is held so no notification is missed, and the race of the
//! upstream request (under the deadline) against it.

use std::future::Future;
use std::pin::Pin;

use headroom_gate::Permit;
use tokio::sync::futures::OwnedNotified;

use super::Deadline;
use crate::error::ApiError;
use crate::proxy::Flight;

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
