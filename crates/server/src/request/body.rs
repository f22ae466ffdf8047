//! Reading the request body: no more than the largest cap that could apply (each lane checks its
//! own cap later), bounded in time so a slow upload cannot hold the connection longer than the
//! request could run, and an oversize body answered with a 413 the client can read. A client that
//! sent `Expect: 100-continue` is answered before it sends the body (hyper sends the interim
//! `100 Continue` only once the body is read, so it never is); any other client's body is read and
//! discarded first, for a bounded size and time as nginx's lingering close does, because closing
//! a socket with unread data in it makes the kernel send a reset that destroys the 413 before the
//! client reads it. Before a byte is read the body's room is reserved under `max_body_memory`
//! ([`crate::body_memory`]); a request that finds none within its lanes' `queue_timeout` gets 503
//! `body_memory_full` (its body unread, answered as an oversize one is).

use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use super::asked::Asked;
use super::lane::Targets;
use crate::body_memory::Reserved;
use crate::core_state::Core;
use crate::error::{ApiError, ErrorCode};
use crate::telemetry::BODY_MEMORY_WAITS_TOTAL;

/// Most bytes of an oversize body read and thrown away before the 413 is sent.
pub(super) const MAX_DRAIN_BYTES: u64 = 256 * 1024 * 1024;
/// Longest time spent reading and throwing away an oversize body.
pub(super) const MAX_DRAIN_TIME: Duration = Duration::from_secs(5);

/// 413 naming the limit.
pub(super) fn too_large(limit: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        ErrorCode::BodyTooLarge,
        format!("request body is larger than this lane's limit of {limit} bytes"),
    )
}

/// Reads and drops what is left of `stream`, within [`MAX_DRAIN_BYTES`] and [`MAX_DRAIN_TIME`].
/// `true` when the body ended (the connection can stay open), `false` when a limit cut it short.
async fn drain<S>(mut stream: S) -> bool
where
    S: futures_util::Stream<Item = Result<Bytes, axum::Error>> + Unpin,
{
    let mut drained = 0u64;
    let read = async {
        while let Some(chunk) = stream.next().await {
            let Ok(chunk) = chunk else { return false };
            drained += chunk.len() as u64;
            if drained > MAX_DRAIN_BYTES {
                return false;
            }
        }
        true
    };
    tokio::time::timeout(MAX_DRAIN_TIME, read)
        .await
        .unwrap_or(false)
}

/// `error` for a body that is not read, after the body was drained (or, when the client waits
/// for `100 Continue` and reading has not `started`, never sent).
async fn refuse_unread<S>(stream: S, error: ApiError, asked: &Asked<'_>, started: bool) -> ApiError
where
    S: futures_util::Stream<Item = Result<Bytes, axum::Error>> + Unpin,
{
    if !started && asked.expects_continue() {
        // The client waits for `100 Continue` before sending; it gets the error instead.
        return error.closing();
    }
    if drain(stream).await {
        error
    } else {
        error.closing()
    }
}

/// 503 for a body that found no room under `max_body_memory` in time.
fn no_body_memory(cap: u64) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        ErrorCode::BodyMemoryFull,
        format!(
            "request bodies held by the gateway reached max_body_memory ({cap} bytes); retry shortly"
        ),
    );
    e.retry_after = Some(Duration::from_secs(1));
    e
}

/// Reads the whole body under the widest cap and deadline (counted from the request's
/// `arrival`) of the candidate lanes, with its room under `max_body_memory` reserved first;
/// the reservation is the request's to hold until it ends.
pub(super) async fn read<'s>(
    s: &'s Core,
    body: Body,
    asked: &Asked<'_>,
    targets: &Targets<'_>,
    arrival: tokio::time::Instant,
) -> Result<(Bytes, Reserved<'s>), ApiError> {
    let read_cap = targets.widest(|l| l.max_body_bytes);
    let declared = asked
        .content_length
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let known = declared.or(axum::body::HttpBody::size_hint(&body).exact());
    let mut stream = body.into_data_stream();
    if declared.is_some_and(|len| len > read_cap) {
        return Err(refuse_unread(stream, too_large(read_cap), asked, false).await);
    }
    let read_deadline = targets.widest(|l| l.spec.request_timeout);
    // Room for the body is waited for no longer than a queued request would wait.
    let room_by = arrival + targets.widest(|l| l.spec.queue_timeout).min(read_deadline);
    let mut reserved = s.body_memory.empty();
    if !reserved.try_grow(known.unwrap_or(0)) {
        let counter = |outcome| {
            s.telemetry
                .counter(BODY_MEMORY_WAITS_TOTAL, &[("outcome", outcome)])
                .increment(1)
        };
        if !reserved.grow(known.unwrap_or(0), room_by).await {
            counter("refused");
            let e = no_body_memory(s.body_memory.cap());
            return Err(refuse_unread(stream, e, asked, false).await);
        }
        counter("waited");
    }
    // A declared length sizes the buffer up front (never past the cap): its room is reserved
    // under max_body_memory already, and pages the body never fills are never touched. Grown by
    // doubling instead, a 45 MiB body held 64 MiB.
    let capacity = declared.unwrap_or(0).min(read_cap) as usize;
    // A body that arrives in one chunk (a small request always does) is kept as it came; only
    // a second chunk starts a buffer.
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| {
                ApiError::bad_request(
                    ErrorCode::BodyReadError,
                    None,
                    "the request body could not be read",
                )
                .closing()
            })?;
            let held = first.as_ref().map_or(0, Bytes::len) + buf.len();
            if (held + chunk.len()) as u64 > read_cap {
                let e = too_large(read_cap);
                return Err(refuse_unread(&mut stream, e, asked, true).await);
            }
            // A body longer than it said, or of unknown length, reserves as it arrives.
            let beyond = ((held + chunk.len()) as u64).saturating_sub(reserved.bytes());
            if !reserved.grow(beyond, room_by).await {
                let e = no_body_memory(s.body_memory.cap());
                return Err(refuse_unread(&mut stream, e, asked, true).await);
            }
            if first.is_none() && buf.is_empty() {
                first = Some(chunk);
                continue;
            }
            if let Some(first) = first.take() {
                buf.reserve(capacity.max(first.len() + chunk.len()));
                buf.extend_from_slice(&first);
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(())
    };
    // A timeout too far away to be an instant cannot run out.
    let outcome = match arrival.checked_add(read_deadline) {
        Some(at) => tokio::time::timeout_at(at, read).await,
        None => Ok(read.await),
    };
    match outcome {
        Ok(Ok(())) => Ok((
            match first {
                Some(whole) => whole,
                None => buf.freeze(),
            },
            reserved,
        )),
        Ok(Err(e)) => Err(e),
        Err(_) => {
            // A slow body is answered 408; what is still arriving is read and dropped first
            // (bounded like an oversize body's), or the close would reset the connection and
            // destroy the 408 before the client reads it. This is what a loaded machine showed
            // as `IncompleteMessage` in the fault test: a 150 ms lane timeout ran out mid-upload.
            let timeout = ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                ErrorCode::BodyTimeout,
                "the request body did not arrive in time",
            );
            Err(if drain(&mut stream).await {
                timeout
            } else {
                timeout.closing()
            })
        }
    }
}
