//! One exchange on a connection: the request written and the response head awaited while the
//! request's task drives the connection, then the response body read chunk by chunk the same
//! way. A body that ends cleanly hands its connection back to the endpoint's pool; dropping the
//! response before that closes the connection, which is how the upstream learns that the client
//! left (an engine stops generating).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, Request, StatusCode};
use bytes::Bytes;
use futures_util::Stream;
use http_body_util::Full;
use hyper::body::{Body, Incoming};

use super::UpstreamError;
use super::pool::{Conn, Endpoint};

/// Writes `request` on `conn` and waits for the response head, driving the connection.
pub(super) async fn exchange(
    endpoint: Arc<Endpoint>,
    mut conn: Box<Conn>,
    request: Request<Full<Bytes>>,
) -> Result<UpstreamResponse, UpstreamError> {
    let mut head = std::pin::pin!(conn.sender.send_request(request));
    let mut open = true;
    let response = std::future::poll_fn(|cx| {
        loop {
            if let Poll::Ready(r) = head.as_mut().poll(cx) {
                return Poll::Ready(r);
            }
            if !open {
                return Poll::Pending;
            }
            if !conn.poll_closed(cx) {
                // Driving the connection may just have read the head: take it now rather
                // than after a wake-up of the task.
                return head.as_mut().poll(cx);
            }
            // Once the connection has ended, hyper has already answered the request future
            // (with the response or the error that ended it); poll it again.
            open = false;
        }
    })
    .await?;
    let (parts, body) = response.into_parts();
    Ok(UpstreamResponse {
        status: parts.status,
        headers: parts.headers,
        body,
        conn: open.then_some(conn),
        endpoint,
        ended: false,
    })
}

/// An upstream response: its head, and its body still to read through the connection.
pub struct UpstreamResponse {
    status: StatusCode,
    headers: HeaderMap,
    body: Incoming,
    /// `None` once the connection has ended (or gone back to the pool).
    conn: Option<Box<Conn>>,
    endpoint: Arc<Endpoint>,
    /// The body has been read whole.
    ended: bool,
}

impl UpstreamResponse {
    pub fn status(&self) -> StatusCode {
        self.status
    }

    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// Moves the response headers out (they are left empty).
    pub fn take_headers(&mut self) -> HeaderMap {
        std::mem::take(&mut self.headers)
    }

    /// The body length the upstream declared, if any (read from the body, so it holds after
    /// [`UpstreamResponse::take_headers`]).
    pub fn content_length(&self) -> Option<u64> {
        self.body.size_hint().exact()
    }

    /// The next body chunk; `None` at the end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        std::future::poll_fn(|cx| self.poll_chunk(cx))
            .await
            .transpose()
    }

    /// Polls for the next body chunk, moving the connection's I/O on while it waits.
    pub fn poll_chunk(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, UpstreamError>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let mut driven = false;
        loop {
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => {
                        if self.body.is_end_stream() {
                            self.release(cx);
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                    // Empty chunks and trailers carry nothing to pass on.
                    _ => continue,
                },
                Poll::Ready(Some(Err(e))) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(UpstreamError::Http(e))));
                }
                Poll::Ready(None) => {
                    self.release(cx);
                    return Poll::Ready(None);
                }
                Poll::Pending => {}
            }
            if driven {
                return Poll::Pending;
            }
            let closed = match self.conn.as_mut() {
                Some(conn) => conn.poll_closed(cx),
                None => return Poll::Pending,
            };
            if !closed {
                // Driving the connection may just have handed the body its next bytes: look
                // once more rather than after a wake-up of the task.
                driven = true;
                continue;
            }
            // The connection ended: the body now reads its end (or the error) at once.
            self.conn = None;
        }
    }

    /// The body has ended: the connection goes back to the pool if it can carry another request.
    fn release(&mut self, cx: &mut Context<'_>) {
        self.ended = true;
        if let Some(conn) = self.conn.take() {
            self.endpoint.checkin(conn, cx);
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
