//! The response: an upstream 4xx/5xx rewritten into OpenAI's error shape (reading a bounded part
//! of its body; a 429 or 503 always with a Retry-After), or the upstream's status and headers with the gateway's own added and the body
//! passed through chunk by chunk under the deadline and preemption.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::Response;
use tokio::time::Instant;

use super::preempt::Waiter;
use super::{Deadline, Lane, Reply};
use crate::error::{ApiError, from_upstream, upstream_retry_after};
use crate::proxy::{Flight, Passthrough};
use crate::upstream::UpstreamResponse;

/// Largest upstream error body read to rewrite it into OpenAI's shape.
const MAX_UPSTREAM_ERROR_BYTES: usize = 64 * 1024;

/// Builds the client's response from the upstream's.
pub(super) async fn respond(
    lane: Lane<'_>,
    mut response: UpstreamResponse,
    mut flight: Flight,
    deadline: Deadline,
    queue_wait: std::time::Duration,
    preempted: Option<Waiter>,
    cut: &std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> Result<Reply, ApiError> {
    let status = response.status();
    if status.is_client_error() || status.is_server_error() {
        let retry = upstream_retry_after(
            status,
            response
                .forwarded()
                .upstream_field(crate::headers::RETRY_AFTER.as_bytes()),
        );
        let body = read_limited(response, deadline.at).await;
        flight.finish("upstream_error");
        let mut err = from_upstream(status, &body);
        err.retry_after = retry;
        return Err(err);
    }
    // The upstream client has already taken out the connection's own fields (hop-by-hop and
    // framing): what is left crosses to the client, beside the gateway's own.
    let mut forwarded = response.take_forwarded();
    let sse = forwarded.is_event_stream();
    // The gateway's fields of every response go with the upstream's, as lines: no map is built
    // for them.
    forwarded.add(crate::headers::LANE, lane.config.lane_header.as_bytes());
    forwarded.add(
        crate::headers::QUEUE_WAIT,
        itoa::Buffer::new()
            .format(queue_wait.as_millis() as u64)
            .as_bytes(),
    );
    let mut out_headers = HeaderMap::new();
    // A sized, non-SSE body that arrived whole with its head (the common case for a short
    // completion) goes to the client as one buffer, the flight done, instead of through the
    // stream; whatever that first look read otherwise leads the stream.
    let length = response.content_length().filter(|_| !sse);
    let declared = length.filter(|&n| n > 0);
    let early = match declared {
        Some(_) => futures_util::FutureExt::now_or_never(response.chunk()),
        None => None,
    };
    let body = match early {
        Some(Ok(Some(whole))) if Some(whole.len() as u64) == declared => {
            flight.answered_whole();
            Body::from(whole)
        }
        early => {
            // Keep the upstream's length so the client gets the body as sent rather than
            // re-chunked (one write instead of a chunk and a terminator). Not for SSE: a stream
            // cut short by the deadline or a preemption ends with an extra error event of its
            // own. (A body sent whole above is sized by itself: its exact length frames it.)
            if let Some(len) = length {
                out_headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
            }
            Body::from_stream(
                Passthrough::new(response, flight, deadline.at, deadline.timeout, sse)
                    .preemptible(preempted)
                    .cut_by(cut.clone())
                    .read_ahead(early.and_then(Result::transpose), declared),
            )
        }
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    *resp.headers_mut() = out_headers;
    Ok(Reply {
        response: resp,
        forwarded,
        deadline: Some(deadline.at),
    })
}

async fn read_limited(mut response: UpstreamResponse, deadline: Instant) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < MAX_UPSTREAM_ERROR_BYTES {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(c))) => out.extend_from_slice(&c),
            _ => break,
        }
    }
    out.truncate(MAX_UPSTREAM_ERROR_BYTES);
    out
}
