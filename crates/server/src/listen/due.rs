//! The client-side timeouts of a connection, on one timer the connection owns: the wait for a
//! request head (`client_header_timeout`), an idle kept-alive connection (`keepalive_timeout`) and
//! a write the client makes no room for (`send_timeout`, or the response's deadline when that
//! comes first). The timer is moved only when it fires early or stands later than the wait at
//! hand, so a connection that carries request after request costs no timer-wheel work per
//! request: each wait only notes when it ends, and the timer catches up when it fires.

use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

use crate::closed::Closed;

/// A wait on the client: when it ends, and what it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wait {
    pub(crate) at: Instant,
    pub(crate) why: Closed,
}

/// The wait of a write the client does not make room for, from now: `send_timeout`, or the
/// response's `deadline` when that comes first.
pub(crate) fn stalled_write(send_timeout: Duration, deadline: Option<Instant>) -> Wait {
    let at = Instant::now() + send_timeout;
    match deadline {
        Some(d) if d < at => Wait {
            at: d,
            why: Closed::Deadline,
        },
        _ => Wait {
            at,
            why: Closed::SendTimeout,
        },
    }
}

/// Polls `timer` as a timer due at `at`: ready once `at` has passed. A timer that stands later
/// is brought forward (a rare case: a wait shorter than the one before it); one that fires
/// earlier is moved on to `at`.
pub(crate) fn poll_due(mut timer: Pin<&mut Sleep>, at: Instant, cx: &mut Context<'_>) -> Poll<()> {
    if timer.deadline() > at {
        timer.as_mut().reset(at);
    }
    loop {
        ready!(timer.as_mut().poll(cx));
        if timer.deadline() >= at {
            return Poll::Ready(());
        }
        timer.as_mut().reset(at);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;
    use std::pin::pin;

    #[tokio::test(start_paused = true)]
    async fn a_timer_that_fires_early_waits_on_and_a_late_one_is_brought_forward() {
        let start = Instant::now();
        let mut timer = pin!(tokio::time::sleep_until(start + Duration::from_secs(1)));
        // Due later than the timer stands: it fires at 1 s and waits on to 3 s.
        let at = start + Duration::from_secs(3);
        poll_fn(|cx| poll_due(timer.as_mut(), at, cx)).await;
        assert_eq!(Instant::now(), at);
        // Due earlier than it stands: brought forward.
        timer.as_mut().reset(start + Duration::from_secs(100));
        let at = Instant::now() + Duration::from_secs(2);
        poll_fn(|cx| poll_due(timer.as_mut(), at, cx)).await;
        assert_eq!(Instant::now(), at);
        // A write's wait is its send timeout, or the deadline when that is sooner.
        let now = Instant::now();
        let w = stalled_write(Duration::from_secs(60), Some(now + Duration::from_secs(5)));
        assert_eq!(
            (w.at, w.why),
            (now + Duration::from_secs(5), Closed::Deadline)
        );
        let w = stalled_write(Duration::from_secs(60), None);
        assert_eq!(
            (w.at, w.why),
            (now + Duration::from_secs(60), Closed::SendTimeout)
        );
    }
}
