//! Talking to upstreams: which headers cross the gateway, sending the request under its deadline,
//! and passing the response body through chunk by chunk while holding the lane permit. The permit
//! and the upstream connection are dropped together the moment the client leaves, the deadline
//! passes, or the upstream fails; SSE streams end with a final `data: {"error":…}` event then.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderName, StatusCode};
use bytes::Bytes;
use futures_util::Stream;
use headroom_gate::Permit;
use tokio::sync::futures::OwnedNotified;
use tokio::time::{Instant, Sleep};

use crate::error::ApiError;
use crate::telemetry::{REQUEST_DURATION_SECONDS, TTFT_SECONDS, Telemetry};

const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    // The gateway has already read the body; the upstream gets it whole.
    "expect",
];

fn connection_listed(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect()
}

/// Headers to send upstream: no hop-by-hop headers, no host or length, no gateway headers, and no
/// client Authorization when the gateway itself checked it.
pub fn upstream_request_headers(incoming: &HeaderMap, drop_authorization: bool) -> HeaderMap {
    let listed = connection_listed(incoming);
    let mut out = HeaderMap::new();
    for (name, value) in incoming {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n)
            || listed.iter().any(|l| l == n)
            || n == "host"
            || n == "content-length"
            || n.starts_with("x-headroom-")
            || (drop_authorization && n == "authorization")
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// Headers to send back to the client from an upstream response.
pub fn client_response_headers(upstream: &HeaderMap) -> HeaderMap {
    let listed = connection_listed(upstream);
    let mut out = HeaderMap::new();
    for (name, value) in upstream {
        let n = name.as_str();
        if HOP_BY_HOP.contains(&n) || listed.iter().any(|l| l == n) || n == "content-length" {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    out
}

/// One admitted request's bookkeeping: outcome counted and permit released exactly once, on
/// whichever path ends it (including the client going away, which drops this).
pub struct Flight {
    telemetry: Arc<Telemetry>,
    lane: String,
    arrival: Instant,
    permit: Option<Permit>,
    finished: bool,
}

impl Flight {
    pub fn new(telemetry: Arc<Telemetry>, lane: &str, arrival: Instant, permit: Permit) -> Flight {
        Flight {
            telemetry,
            lane: lane.to_string(),
            arrival,
            permit: Some(permit),
            finished: false,
        }
    }

    pub fn lane(&self) -> &str {
        &self.lane
    }

    /// The held permit (until the flight finishes).
    pub fn permit_mut(&mut self) -> Option<&mut Permit> {
        self.permit.as_mut()
    }

    /// Records the outcome and releases the permit; later calls do nothing.
    pub fn finish(&mut self, outcome: &str) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.permit.take();
        self.telemetry.outcome(&self.lane, outcome);
        self.telemetry
            .histogram(REQUEST_DURATION_SECONDS, &[("lane", &self.lane)])
            .record(self.arrival.elapsed().as_secs_f64());
    }

    fn first_byte(&self) {
        self.telemetry
            .histogram(TTFT_SECONDS, &[("lane", &self.lane)])
            .record(self.arrival.elapsed().as_secs_f64());
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        self.finish("client_disconnected");
    }
}

type UpstreamBody = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;

/// The response body handed to the client: upstream bytes as they arrive.
pub struct Passthrough {
    inner: Option<UpstreamBody>,
    flight: Flight,
    deadline: Pin<Box<Sleep>>,
    request_timeout: std::time::Duration,
    sse: bool,
    first: bool,
    done: bool,
    preempted: Option<Pin<Box<OwnedNotified>>>,
    /// The last bytes passed to the client (at most 4), to tell whether an SSE event is open.
    tail: Vec<u8>,
}

/// Whether an SSE stream whose last bytes were `tail` stands between two events (nothing sent
/// yet, or the last event ended with a blank line).
pub fn at_event_boundary(tail: &[u8]) -> bool {
    tail.is_empty()
        || tail.ends_with(b"\n\n")
        || tail.ends_with(b"\r\r")
        || tail.ends_with(b"\r\n\r\n")
        || tail.ends_with(b"\n\r\n")
}

/// The error event to append to an SSE stream that ends early: on its own, after a blank line
/// that closes any event the upstream left half-sent, so a client never reads it glued to (and
/// lost inside) the upstream's last event.
pub fn closing_error_event(tail: &[u8], error: &ApiError) -> String {
    let event = error.sse_event();
    if at_event_boundary(tail) {
        event
    } else {
        format!("\n\n{event}")
    }
}

impl Passthrough {
    pub fn new(
        response: reqwest::Response,
        flight: Flight,
        deadline: Instant,
        request_timeout: std::time::Duration,
        sse: bool,
    ) -> Passthrough {
        Passthrough {
            inner: Some(Box::pin(response.bytes_stream())),
            flight,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            request_timeout,
            sse,
            first: true,
            done: false,
            preempted: None,
            tail: Vec::new(),
        }
    }

    /// Ends the response with a `preempted` error (and cancels the upstream) when `waiter` fires.
    pub fn preemptible(mut self, waiter: Option<Pin<Box<OwnedNotified>>>) -> Passthrough {
        self.preempted = waiter;
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
        if this.deadline.as_mut().poll(cx).is_ready() {
            let e = ApiError::deadline(this.flight.lane(), this.request_timeout);
            return this.end_with(e, "deadline");
        }
        if let Some(waiter) = this.preempted.as_mut()
            && waiter.as_mut().poll(cx).is_ready()
        {
            this.preempted = None;
            let e = ApiError::preempted(this.flight.lane());
            return this.end_with(e, "preempted");
        }
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match inner.as_mut().poll_next(cx) {
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
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(_))) => {
                let e = ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_stream_error",
                    "the upstream connection failed in the middle of the response",
                );
                this.end_with(e, "upstream_error")
            }
            Poll::Ready(None) => {
                this.done = true;
                this.inner = None;
                this.flight.finish("ok");
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Whether a failed upstream send proves the request never reached the upstream: the pooled
/// connection was closed or reset under it before any response byte came back (not a failure to
/// connect, not a timeout). An engine that closes a keep-alive connection right after a stream
/// (llama.cpp does) leaves such a connection in the pool; the next request written into it
/// within microseconds is never read by the engine.
pub fn never_reached_upstream(e: &reqwest::Error) -> bool {
    if e.is_connect() || e.is_timeout() || e.status().is_some() {
        return false;
    }
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            )
        {
            return true;
        }
        if s.to_string()
            .contains("connection closed before message completed")
        {
            return true;
        }
        source = s.source();
    }
    false
}

/// Resends made for one request when pooled connections turn out stale (each one is a request
/// the upstream never saw, so resending cannot run it twice).
pub const MAX_STALE_RESENDS: usize = 2;

/// Sends `request`; when it meets a stale pooled connection ([`never_reached_upstream`]), sends
/// it again (its body is in memory, so it can be cloned), at most [`MAX_STALE_RESENDS`] times.
pub async fn send_resending_stale(
    request: reqwest::RequestBuilder,
) -> Result<reqwest::Response, reqwest::Error> {
    let mut next = request;
    let mut resends = 0;
    loop {
        let again = next.try_clone();
        match next.send().await {
            Err(e) if resends < MAX_STALE_RESENDS && never_reached_upstream(&e) => {
                match again {
                    Some(a) => next = a,
                    None => return Err(e),
                }
                resends += 1;
            }
            other => return other,
        }
    }
}

/// Whether a response is an SSE stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.to_ascii_lowercase().starts_with("text/event-stream"))
}

/// A header name the gateway adds to responses.
pub fn header(name: &'static str) -> HeaderName {
    HeaderName::from_static(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn an_error_event_after_a_half_sent_event_is_framed_on_its_own() {
        let e = ApiError::new(StatusCode::BAD_GATEWAY, "upstream_stream_error", "x");
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
        let out = upstream_request_headers(&h, true);
        let names: Vec<&str> = out.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, vec!["content-type", "openai-organization"]);
        let with_auth = upstream_request_headers(&h, false);
        assert!(with_auth.contains_key("authorization"));
        let back = client_response_headers(&h);
        assert!(!back.contains_key("transfer-encoding") && !back.contains_key("x-secret"));
        assert!(back.contains_key("content-type"));
    }
}
