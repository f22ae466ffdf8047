//! Talking to upstreams: which headers cross the gateway, sending the request under its deadline,
//! and passing the response body through chunk by chunk while holding the lane permit. The permit
//! and the upstream connection are dropped together the moment the client leaves, the deadline
//! passes, or the upstream fails; SSE streams end with a final `data: {"error":…}` event then.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use futures_util::Stream;
use headroom_gate::Permit;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};

use crate::error::{ApiError, ErrorCode};
use crate::telemetry::Telemetry;
use crate::upstream::UpstreamResponse;

use crate::upstream::wire::hop_by_hop;

/// Whether a client's header field crosses to the upstream: not hop-by-hop, not one the client's
/// `Connection` header lists (`listed`, from [`connection_listed`]), no host or length (the
/// upstream client writes its own), no gateway headers, and no client Authorization when the
/// gateway itself checked it.
pub(crate) fn crosses_upstream(name: &str, listed: &[String], drop_authorization: bool) -> bool {
    !(hop_by_hop(name)
        || name == "host"
        || name == "content-length"
        || name.starts_with(crate::headers::OWN_PREFIX)
        || (drop_authorization && name == "authorization")
        || listed.iter().any(|l| l == name))
}

/// The header fields `connection` names (lowercase), each to be dropped at this hop.
pub(crate) fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(axum::http::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// One admitted request's bookkeeping: outcome counted and permit released exactly once, on
/// whichever path ends it (including the client going away, which drops this).
pub(crate) struct Flight {
    telemetry: Arc<Telemetry>,
    lane: usize,
    arrival: Instant,
    permit: Option<Permit>,
    finished: bool,
}

impl Flight {
    pub(crate) fn new(telemetry: Arc<Telemetry>, arrival: Instant, permit: Permit) -> Flight {
        Flight {
            telemetry,
            lane: permit.lane_index(),
            arrival,
            permit: Some(permit),
            finished: false,
        }
    }

    pub(crate) fn lane(&self) -> &str {
        self.telemetry.lane_name(self.lane)
    }

    /// The held permit (until the flight finishes).
    pub(crate) fn permit_mut(&mut self) -> Option<&mut Permit> {
        self.permit.as_mut()
    }

    /// Records the outcome and releases the permit; later calls do nothing.
    pub(crate) fn finish(&mut self, outcome: &str) {
        if self.finished {
            return;
        }
        let seconds = self.arrival.elapsed().as_secs_f64();
        self.finish_after(outcome, seconds);
    }

    /// [`Flight::finish`] for a request that took `seconds`.
    fn finish_after(&mut self, outcome: &str, seconds: f64) {
        self.finished = true;
        self.permit.take();
        self.telemetry.lane_outcome(self.lane, outcome);
        self.telemetry.request_duration(self.lane, seconds);
    }

    /// Records a response whose body went out with its head: its first byte and its end are
    /// one moment (one clock read for both), and the flight finishes `ok`.
    pub(crate) fn answered_whole(&mut self) {
        if self.finished {
            return;
        }
        let seconds = self.arrival.elapsed().as_secs_f64();
        self.telemetry.ttft(self.lane, seconds);
        self.finish_after("ok", seconds);
    }

    pub(crate) fn first_byte(&self) {
        self.telemetry
            .ttft(self.lane, self.arrival.elapsed().as_secs_f64());
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.finish("client_disconnected");
    }
}

/// The response body handed to the client: upstream bytes as they arrive.
pub(crate) struct Passthrough {
    inner: Option<UpstreamResponse>,
    flight: Flight,
    /// When the response must be done; its timer is armed only once the upstream makes the body
    /// wait (a body that arrives with its head never registers one).
    deadline: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    request_timeout: std::time::Duration,
    sse: bool,
    first: bool,
    done: bool,
    preempted: Option<Pin<Box<OwnedNotified>>>,
    /// Set when `shutdown_grace` ran out: the response ends with a `shutting_down` error.
    cut: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// The last bytes passed to the client (at most 4), to tell whether an SSE event is open.
    tail: Vec<u8>,
    /// Bytes still to come when the upstream said how many: the server stops polling a sized body
    /// once it has all of them, so the flight ends with the last byte, not with a final poll.
    remaining: Option<u64>,
    /// What was read before the stream started, passed on first.
    ahead: Option<Result<Bytes, crate::upstream::UpstreamError>>,
}

/// Whether an SSE stream whose last bytes were `tail` stands between two events (nothing sent
/// yet, or the last event ended with a blank line).
pub(crate) fn at_event_boundary(tail: &[u8]) -> bool {
    tail.is_empty()
        || tail.ends_with(b"\n\n")
        || tail.ends_with(b"\r\r")
        || tail.ends_with(b"\r\n\r\n")
        || tail.ends_with(b"\n\r\n")
}

/// The error event to append to an SSE stream that ends early: on its own, after a blank line
/// that closes any event the upstream left half-sent, so a client never reads it glued to (and
/// lost inside) the upstream's last event.
pub(crate) fn closing_error_event(tail: &[u8], error: &ApiError) -> String {
    let event = error.sse_event();
    if at_event_boundary(tail) {
        event
    } else {
        format!("\n\n{event}")
    }
}

impl Passthrough {
    pub(crate) fn new(
        response: UpstreamResponse,
        flight: Flight,
        deadline: Instant,
        request_timeout: std::time::Duration,
        sse: bool,
    ) -> Passthrough {
        Passthrough {
            remaining: response.content_length(),
            inner: Some(response),
            flight,
            deadline,
            timer: None,
            request_timeout,
            sse,
            first: true,
            done: false,
            preempted: None,
            cut: None,
            tail: Vec::new(),
            ahead: None,
        }
    }

    /// Starts the stream with `first`, a result already read from the response, the body being
    /// `declared` bytes long as the upstream said before that read.
    pub(crate) fn read_ahead(
        mut self,
        first: Option<Result<Bytes, crate::upstream::UpstreamError>>,
        declared: Option<u64>,
    ) -> Passthrough {
        if first.is_some() {
            self.ahead = first;
            self.remaining = declared;
        }
        self
    }

    /// Ends the response with a `preempted` error (and cancels the upstream) when `waiter` fires.
    pub(crate) fn preemptible(mut self, waiter: Option<Pin<Box<OwnedNotified>>>) -> Passthrough {
        self.preempted = waiter;
        self
    }

    /// Ends the response with a `shutting_down` error when `cut` is set (the connection's task
    /// is woken then).
    pub(crate) fn cut_by(mut self, cut: Arc<std::sync::atomic::AtomicBool>) -> Passthrough {
        self.cut = Some(cut);
        self
    }

    fn end_with(
        &mut self,
        error: ApiError,
        outcome: &str,
    ) -> Poll<Option<Result<Bytes, std::io::Error>>> {
        self.done = true;
        // Dropping the upstream body closes its connection, so the engine stops generating.
        self.inner = None;
        self.flight.finish(outcome);
        if self.sse {
            let event = closing_error_event(&self.tail, &error);
            Poll::Ready(Some(Ok(Bytes::from(event))))
        } else {
            Poll::Ready(Some(Err(std::io::Error::other(error.message))))
        }
    }
}

impl Stream for Passthrough {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        // What the upstream has already sent goes out first: a deadline or a preemption that
        // comes due after the last byte must not turn a complete response into an aborted one
        // (with a known length, the client has it whole and reuses the connection the abort
        // then closes).
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let next = match this.ahead.take() {
            Some(first) => Poll::Ready(Some(first)),
            None => inner.poll_chunk(cx),
        };
        match next {
            Poll::Ready(Some(Ok(chunk))) => {
                if this.first {
                    this.first = false;
                    this.flight.first_byte();
                }
                if this.sse && !chunk.is_empty() {
                    let keep = chunk.len().min(4);
                    this.tail.extend_from_slice(&chunk[chunk.len() - keep..]);
                    let excess = this.tail.len().saturating_sub(4);
                    this.tail.drain(..excess);
                }
                if let Some(left) = this.remaining.as_mut() {
                    *left = left.saturating_sub(chunk.len() as u64);
                    if *left == 0 {
                        this.done = true;
                        this.inner = None;
                        this.flight.finish("ok");
                    }
                }
                return Poll::Ready(Some(Ok(chunk)));
            }
            Poll::Ready(Some(Err(_))) => {
                // A reset or a cut mid-body counts against the upstream's health.
                if let Some(p) = this.flight.permit_mut() {
                    p.mark_upstream(false);
                }
                let e = ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    ErrorCode::UpstreamStreamError,
                    "the upstream connection failed in the middle of the response",
                );
                return this.end_with(e, "upstream_error");
            }
            Poll::Ready(None) => {
                this.done = true;
                this.inner = None;
                this.flight.finish("ok");
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.as_mut().poll(cx).is_ready() {
            let e = ApiError::deadline(this.flight.lane(), this.request_timeout);
            return this.end_with(e, "deadline");
        }
        if this
            .cut
            .as_ref()
            .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
        {
            return this.end_with(ApiError::cut(), "shutting_down");
        }
        if let Some(waiter) = this.preempted.as_mut()
            && waiter.as_mut().poll(cx).is_ready()
        {
            this.preempted = None;
            let e = ApiError::preempted(this.flight.lane());
            return this.end_with(e, "preempted");
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn an_error_event_after_a_half_sent_event_is_framed_on_its_own() {
        let e = ApiError::new(StatusCode::BAD_GATEWAY, ErrorCode::UpstreamStreamError, "x");
        let whole = e.sse_event();
        assert_eq!(closing_error_event(b"", &e), whole);
        assert_eq!(closing_error_event(b"}\n\n", &e), whole);
        assert_eq!(closing_error_event(b"\r\n\r\n", &e), whole);
        // The upstream stopped inside an event: a blank line closes it first.
        assert_eq!(closing_error_event(b"choi", &e), format!("\n\n{whole}"));
        assert_eq!(closing_error_event(b"}\n", &e), format!("\n\n{whole}"));
    }

    #[test]
    fn hop_by_hop_and_gateway_headers_stay_behind() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("connection", "keep-alive, x-secret"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("host", "gw"),
            ("content-length", "10"),
            ("x-headroom-lane", "text"),
            ("authorization", "Bearer k"),
            ("content-type", "application/json"),
            ("openai-organization", "org"),
        ] {
            h.append(k, HeaderValue::from_static(v));
        }
        let listed = connection_listed(&h);
        let crossing = |drop_authorization: bool| {
            let mut names: Vec<&str> = h
                .keys()
                .map(|k| k.as_str())
                .filter(|n| crosses_upstream(n, &listed, drop_authorization))
                .collect();
            names.sort_unstable();
            names
        };
        assert_eq!(crossing(true), vec!["content-type", "openai-organization"]);
        assert_eq!(
            crossing(false),
            vec!["authorization", "content-type", "openai-organization"]
        );
    }
}
