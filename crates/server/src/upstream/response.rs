//! One exchange on a connection: the request written, the response head read and parsed, then
//! the body read chunk by chunk inside the request's own task (no connection task, no hand-off).
//! A body that ends cleanly hands its connection back to the endpoint's pool; dropping the
//! response before that closes the connection, which is how the upstream learns that the client
//! left (an engine stops generating).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use axum::http::StatusCode;
use bytes::Bytes;
use futures_util::Stream;

use super::pool::{Conn, Endpoint, Read};
use super::wire::{self, Decoder, Forwarded, Framing, Step};
use super::{Outgoing, UpstreamError};

/// Writes the request on `conn` and reads the response head.
pub(super) async fn exchange(
    endpoint: Arc<Endpoint>,
    mut conn: Box<Conn>,
    outgoing: &Outgoing<'_>,
) -> Result<UpstreamResponse, UpstreamError> {
    let head = outgoing.head(endpoint.host_header())?;
    conn.write(head, &outgoing.body)
        .await
        .map_err(|e| UpstreamError::io(e, conn.wrote, false))?;
    let head = std::future::poll_fn(|cx| poll_head(&mut conn, cx)).await?;
    conn.streamed = head.framing == Framing::Chunked;
    let mut response = UpstreamResponse {
        status: head.status,
        forwarded: head.forwarded,
        // A 204/304 has no body whatever it declares, and no length to pass on.
        length: match head.framing {
            Framing::Length(n) if !matches!(head.status.as_u16(), 204 | 304) => Some(n),
            _ => None,
        },
        decoder: Decoder::new(head.framing),
        keep_alive: head.keep_alive,
        conn: Some(conn),
        endpoint,
    };
    response.settle();
    Ok(response)
}

/// Reads until a whole response head is buffered, and parses it.
fn poll_head(conn: &mut Conn, cx: &mut Context<'_>) -> Poll<Result<wire::Head, UpstreamError>> {
    loop {
        if !conn.buf.is_empty()
            && let Some(head) = wire::parse_head(&mut conn.buf)?
        {
            return Poll::Ready(Ok(head));
        }
        let answered = conn.answered;
        match ready!(conn.poll_read(cx)) {
            Ok(Read::Bytes) => {}
            Ok(Read::Closed) => return Poll::Ready(Err(UpstreamError::Closed { answered })),
            Err(e) => return Poll::Ready(Err(UpstreamError::io(e, true, answered))),
        }
    }
}

/// An upstream response: its head, and its body still to read through the connection.
pub(crate) struct UpstreamResponse {
    status: StatusCode,
    forwarded: Forwarded,
    /// The declared body length (`Content-Length`), if the body is sized.
    length: Option<u64>,
    decoder: Decoder,
    keep_alive: bool,
    /// `None` once the connection has ended (or gone back to the pool).
    conn: Option<Box<Conn>>,
    endpoint: Arc<Endpoint>,
}

impl UpstreamResponse {
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// The end-to-end header fields as the upstream sent them.
    pub(crate) fn forwarded(&self) -> &Forwarded {
        &self.forwarded
    }

    /// Moves the end-to-end header fields out (none are left).
    pub(crate) fn take_forwarded(&mut self) -> Forwarded {
        std::mem::take(&mut self.forwarded)
    }

    /// The body length the upstream declared, if any (kept apart from the header fields, so it
    /// holds after [`UpstreamResponse::take_forwarded`]).
    pub(crate) fn content_length(&self) -> Option<u64> {
        self.length
    }

    /// The next body chunk; `None` at the end.
    pub(crate) async fn chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        std::future::poll_fn(|cx| self.poll_chunk(cx))
            .await
            .transpose()
    }

    /// Polls for the next body chunk, reading from the connection while it waits.
    pub(crate) fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, UpstreamError>>> {
        loop {
            if self.decoder.is_done() {
                self.release();
                return Poll::Ready(None);
            }
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(None);
            };
            match self.decoder.step(&mut conn.buf) {
                Ok(Step::Data(data)) => {
                    self.settle();
                    return Poll::Ready(Some(Ok(data)));
                }
                Ok(Step::End) => continue,
                Ok(Step::NeedMore) => {}
                Err(e) => return Poll::Ready(Some(Err(self.fail(e.into())))),
            }
            match ready!(conn.poll_read(cx)) {
                Ok(Read::Bytes) => {}
                Ok(Read::Closed) if self.decoder.ends_at_close() => {
                    self.conn = None;
                    return Poll::Ready(None);
                }
                Ok(Read::Closed) => {
                    let e = UpstreamError::Closed { answered: true };
                    return Poll::Ready(Some(Err(self.fail(e))));
                }
                Err(e) => {
                    let e = UpstreamError::io(e, true, true);
                    return Poll::Ready(Some(Err(self.fail(e))));
                }
            }
        }
    }

    /// Moves past a chunked body's buffered end, and gives the connection back once the body
    /// has ended, so a response read to its last byte frees its connection at once.
    fn settle(&mut self) {
        if let Some(conn) = self.conn.as_mut()
            && self.decoder.settle(&mut conn.buf).is_err()
        {
            // The error comes back on the next read (the decoder is where it was).
            return;
        }
        if self.decoder.is_done() {
            self.release();
        }
    }

    /// The connection ends with an error; the body can read no further.
    fn fail(&mut self, e: UpstreamError) -> UpstreamError {
        self.conn = None;
        e
    }

    /// The body has ended: the connection goes back to the pool if it can carry another request.
    fn release(&mut self) {
        if let Some(conn) = self.conn.take()
            && self.keep_alive
        {
            self.endpoint.checkin(conn);
        }
    }
}

impl Stream for UpstreamResponse {
    type Item = Result<Bytes, UpstreamError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_chunk(cx)
    }
}

impl std::fmt::Debug for UpstreamResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamResponse")
            .field("status", &self.status)
            .finish_non_exhaustive()
    }
}
