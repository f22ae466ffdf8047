//! The fast HTTP/1.1 path for proxied requests that arrive whole. A client connection starts here:
//! the head is parsed with `httparse` into fixed slots, and a `POST` on a proxied route with a
//! `content-length` body that is already in the buffer (a small request nearly always is) goes to
//! the request path as it stands, without hyper's dispatcher, its body channel and its second
//! header pass. The answer is written head and body in one buffer (a stream chunk by chunk, each
//! sent at once), and the client is watched the whole time so a request whose client left is
//! dropped (cancelled), as hyper's server drops it. The client's side is timed on the
//! connection's own timer ([`super::due`]): the head, the idle wait for a next request, and each
//! write the client must make room for.
//!
//! Anything else — another route or method, HTTP/1.0, a head over 16 KiB or 64 fields, a
//! chunked or unsized body, `Expect`, `Upgrade`, a query string, no `Host`, a body still on its
//! way, input `httparse` refuses — is handed to hyper with every byte read so far put back in front
//! ([`super::rewind`]), and the connection stays with hyper from then on. hyper's server so keeps
//! every edge behaviour (100-continue, slow and oversize bodies, 400/431 answers, pipelining
//! after a handover); this path only serves what it can serve completely.

use std::future::{Future, poll_fn};
use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::sync::LazyLock;
use std::task::Poll;

use axum::body::{Body, HttpBody};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Uri, header};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncWrite, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::due::{self, Wait};
use super::slots::Held;
use crate::closed::Closed;
use crate::edge;
use crate::request::{Reply, Route};
use crate::state::{AppState, Shared};
use crate::upstream::wire::{Forwarded, header_line, list_tokens};

/// Longest head this path parses; a longer one goes to hyper (which has its own limits).
const MAX_HEAD: usize = 16 * 1024;
/// Most header fields this path parses.
const MAX_FIELDS: usize = 64;
/// Largest body this path takes whole; a larger one goes to hyper's streaming body.
const MAX_BODY: usize = 1 << 20;
/// Whether a short read shows the socket drained: true where tokio's reactor is epoll
/// (edge-triggered), as tokio's own `poll_read` assumes there.
const DRAINED_BY_A_SHORT_READ: bool = cfg!(any(target_os = "linux", target_os = "android"));
/// Room reserved for each read from the client.
const READ_CHUNK: usize = 16 * 1024;
/// Most bytes of a next (pipelined) request read ahead while an answer is pending.
const MAX_AHEAD: usize = 64 * 1024;
/// Where the connection's deadline timer stands before its first request.
const IDLE_TIMER: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);
/// A data frame at least this large is written from its own buffer, not copied.
const COPY_LIMIT: usize = 16 * 1024;

/// How the fast path left a connection.
pub(super) enum Ended {
    /// Closed: by the client, after a `connection: close`, on an error, or drained.
    Closed,
    /// For hyper, with the bytes already read from the client.
    Handover(Bytes, TcpStream),
}

/// What a parse of the buffered bytes found. Returned once per request and taken apart at
/// once, so the large variant is not boxed (a box would be one more allocation per request).
#[allow(clippy::large_enum_variant)]
enum Parsed {
    /// A request this path serves, and whether the connection closes after it.
    Fast(Route, Request<Body>, bool),
    /// The head is not complete yet.
    Partial,
    /// The head is complete; its body is `total - buffered` bytes short.
    Short(usize),
    /// Not for this path.
    Slow,
}

/// What one read from the client brought.
enum Read {
    Got(usize),
    /// Nothing yet (a spurious wake-up).
    NotYet,
    /// The client closed, or the socket failed.
    Closed,
}

/// One client connection on the fast path.
struct Conn<'a> {
    tcp: TcpStream,
    buf: BytesMut,
    out: Vec<u8>,
    /// The shutdown future has been polled (and holds this task's waker).
    stop_armed: bool,
    /// The cut future has been polled (and holds this task's waker).
    cut_armed: bool,
    /// The connection's client-side timer (see [`super::due`]).
    timer: Pin<&'a mut Sleep>,
    slot: &'a Held,
    state: &'a AppState,
    /// The deadline of the response being written.
    deadline: Option<Instant>,
}

/// What the server and the connection lend the fast path: `stopping` resolves when the server
/// shuts down, and `stopped` says whether it has: `stopping` is polled once, which leaves this
/// task's waker with the shutdown, and from then on the cheap `stopped` is read whenever the
/// task wakes (an idle wait, an answer done). `cutting` resolves when the shutdown's grace ran
/// out (polled once likewise, so the task wakes and its request sees the cut). `timer` times the
/// client's side; `slot` is the connection's place in the table of connections.
pub(super) struct Edges<'a, F, G> {
    pub(super) stopping: Pin<&'a mut F>,
    pub(super) stopped: &'a (dyn Fn() -> bool + Sync),
    pub(super) cutting: Pin<&'a mut G>,
    pub(super) timer: Pin<&'a mut Sleep>,
    pub(super) slot: &'a Held,
}

/// Serves `tcp` until it closes or a request needs hyper. From the shutdown on (`draining`) an
/// idle connection closes and a busy one closes after its answer.
pub(super) async fn serve<F, G>(
    tcp: TcpStream,
    state: &Shared,
    edges: Edges<'_, F, G>,
    draining: &mut bool,
) -> Ended
where
    F: Future<Output = ()>,
    G: Future<Output = ()>,
{
    let Edges {
        mut stopping,
        stopped,
        mut cutting,
        timer: io_timer,
        slot,
    } = edges;
    let config = &state.core.config;
    // The deadline timer of every request this connection carries (none is armed until the
    // first request); see [`crate::request::Timer`].
    let mut timer = pin!(tokio::time::sleep_until(
        tokio::time::Instant::now() + IDLE_TIMER
    ));
    let mut conn = Conn {
        tcp,
        buf: BytesMut::new(),
        out: Vec::with_capacity(1024),
        stop_armed: false,
        cut_armed: false,
        timer: io_timer,
        slot,
        state,
        deadline: None,
    };
    // The first request's head is due `client_header_timeout` after the accept (where the timer
    // stands already).
    let mut wait = Wait {
        at: conn.timer.deadline(),
        why: Closed::HeaderTimeout,
    };
    loop {
        let (route, request, asked_close) = loop {
            let parsed = if conn.buf.is_empty() {
                Parsed::Partial
            } else {
                parse(&mut conn.buf)
            };
            match parsed {
                Parsed::Fast(route, request, close) => {
                    conn.slot.slot().busy();
                    break (route, request, close);
                }
                Parsed::Slow => return Ended::Handover(conn.buf.freeze(), conn.tcp),
                Parsed::Short(missing) => {
                    // The rest of a body the socket already holds is read now; one that is
                    // still on its way is hyper's (its reads are timed and bounded).
                    if !conn.read_ready(missing) {
                        return Ended::Handover(conn.buf.freeze(), conn.tcp);
                    }
                }
                Parsed::Partial => {
                    if conn.buf.is_empty() && *draining {
                        return Ended::Closed;
                    }
                    if !conn.buf.is_empty() && wait.why == Closed::IdleTimeout {
                        // The next request's head has begun: it is due whole within
                        // `client_header_timeout`.
                        wait = Wait {
                            at: Instant::now() + config.client_header_timeout,
                            why: Closed::HeaderTimeout,
                        };
                    }
                    if !conn
                        .read_more(stopping.as_mut(), stopped, draining, wait)
                        .await
                    {
                        return Ended::Closed;
                    }
                }
            }
        };
        // Pinned here, in this loop's own state, and lent to `answer`: the request path's
        // future (kilobytes) is then not moved again into `answer`'s arguments and its pin.
        let answer = pin!(edge::proxied(
            state.clone(),
            route,
            request,
            Some(timer.as_mut())
        ));
        let Some(reply) = conn.answer(answer, cutting.as_mut()).await else {
            return Ended::Closed;
        };
        *draining |= stopped();
        let close = asked_close || *draining || closes(reply.response.headers());
        if !conn.write(reply, close).await || close {
            let _ = conn.tcp.shutdown().await;
            return Ended::Closed;
        }
        let now = Instant::now();
        conn.slot.slot().idle(conn.slot.slots(), now);
        wait = Wait {
            at: now + config.keepalive_timeout,
            why: Closed::IdleTimeout,
        };
    }
}

impl Conn<'_> {
    /// Waits for more bytes from the client. `false` when it closed, the `wait` ran out, the
    /// connection was shed to make room, or the server is draining and nothing of a next
    /// request arrived.
    async fn read_more<F>(
        &mut self,
        mut stopping: Pin<&mut F>,
        stopped: &(dyn Fn() -> bool + Sync),
        draining: &mut bool,
        wait: Wait,
    ) -> bool
    where
        F: Future<Output = ()>,
    {
        poll_fn(|cx| {
            loop {
                let stop = if self.stop_armed {
                    stopped()
                } else {
                    self.stop_armed = true;
                    stopping.as_mut().poll(cx).is_ready()
                };
                if !*draining && stop {
                    *draining = true;
                    if self.buf.is_empty() {
                        return Poll::Ready(false);
                    }
                }
                // The socket's own reader wake-up slot, not a waiter queued (and unqueued) on
                // it for each wait, as `readable()` is.
                match self.tcp.poll_read_ready(cx) {
                    Poll::Ready(Ok(())) => {}
                    Poll::Ready(Err(_)) => return Poll::Ready(false),
                    Poll::Pending => {
                        if self.slot.slot().shed(cx.waker()) {
                            return Poll::Ready(false);
                        }
                        if due::poll_due(self.timer.as_mut(), wait.at, cx).is_ready() {
                            self.state.core.telemetry.connection_closed(wait.why);
                            return Poll::Ready(false);
                        }
                        return Poll::Pending;
                    }
                }
                match self.read_once() {
                    Read::Got(_) => return Poll::Ready(true),
                    Read::NotYet => {}
                    Read::Closed => return Poll::Ready(false),
                }
            }
        })
        .await
    }

    /// One read from the client into the buffer, without waiting.
    ///
    /// A read that fills less than the room it was given has drained the socket: epoll is
    /// edge-triggered, so bytes that come later raise a new event. The closure then answers
    /// `WouldBlock`, which makes tokio clear the readiness it caches (only if no event came
    /// since the read), and the next read waits for that event instead of costing a system call
    /// that answers `EAGAIN` (one per request: the client is read again while its answer is
    /// awaited). Tokio's own `poll_read` clears readiness the same way; `try_read_buf` does not.
    fn read_once(&mut self) -> Read {
        self.buf.reserve(READ_CHUNK);
        let room = self.buf.capacity() - self.buf.len();
        let (tcp, buf) = (&self.tcp, &mut self.buf);
        let mut got = None;
        let read = tcp.try_io(Interest::READABLE, || {
            let n = tcp.try_read_buf(buf)?;
            got = Some(n);
            if DRAINED_BY_A_SHORT_READ && n > 0 && n < room {
                return Err(ErrorKind::WouldBlock.into());
            }
            Ok(())
        });
        match (got, read) {
            (Some(0), _) => Read::Closed,
            (Some(n), _) => Read::Got(n),
            (None, Err(e)) if e.kind() == ErrorKind::WouldBlock => Read::NotYet,
            (None, _) => Read::Closed,
        }
    }

    /// Reads what the socket already holds, without waiting, until `missing` more bytes are
    /// buffered. `true` when they are.
    fn read_ready(&mut self, mut missing: usize) -> bool {
        while missing > 0 {
            self.buf.reserve(missing);
            match self.read_once() {
                Read::Got(n) => missing = missing.saturating_sub(n),
                Read::NotYet | Read::Closed => return false,
            }
        }
        true
    }

    /// The request path's answer, or `None` when the client left first (the answer's future is
    /// dropped, which cancels the request wherever it was). Bytes of a next request that arrive
    /// meanwhile are kept. The first answer arms `cutting`, so the task wakes at the cut.
    async fn answer<A, G>(
        &mut self,
        mut answer: Pin<&mut A>,
        mut cutting: Pin<&mut G>,
    ) -> Option<Reply>
    where
        A: Future<Output = Reply>,
        G: Future<Output = ()>,
    {
        let mut watching = true;
        poll_fn(|cx| {
            if let Poll::Ready(reply) = answer.as_mut().poll(cx) {
                return Poll::Ready(Some(reply));
            }
            if !self.cut_armed {
                self.cut_armed = true;
                let _ = cutting.as_mut().poll(cx);
            }
            while watching {
                match self.tcp.poll_read_ready(cx) {
                    Poll::Pending => break,
                    Poll::Ready(Err(_)) => return Poll::Ready(None),
                    Poll::Ready(Ok(())) => {
                        if !self.read_ahead(&mut watching) {
                            return Poll::Ready(None);
                        }
                    }
                }
            }
            Poll::Pending
        })
        .await
    }

    /// One read while an answer is pending: `false` when the client closed.
    fn read_ahead(&mut self, watching: &mut bool) -> bool {
        match self.read_once() {
            Read::Closed => false,
            Read::NotYet => true,
            Read::Got(_) => {
                *watching = self.buf.len() < MAX_AHEAD;
                true
            }
        }
    }

    /// Writes `response`; `false` when the connection cannot carry another request (the client
    /// left, the body failed, or it did not match its declared length).
    async fn write(&mut self, reply: Reply, close: bool) -> bool {
        self.deadline = reply.deadline;
        let (parts, mut body) = reply.response.into_parts();
        let framing = framing(parts.status, &parts.headers, &body);
        self.out.clear();
        write_head(&mut self.out, &parts, &reply.forwarded, framing, close);
        if framing == Framing::None {
            return self.flush().await;
        }
        let mut sent = 0u64;
        loop {
            let frame = match poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    // Nothing more for now: what is buffered leaves at once (an SSE event must).
                    if !self.flush().await {
                        return false;
                    }
                    match self.next_frame(&mut body).await {
                        Some(frame) => frame,
                        None => return false,
                    }
                }
            };
            let data = match frame {
                None => break,
                Some(Err(_)) => {
                    // hyper's server ends such a response by closing the connection.
                    let _ = self.flush().await;
                    return false;
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => data,
                    _ => continue,
                },
            };
            sent += data.len() as u64;
            if !self.push(data, framing == Framing::Chunked).await {
                return false;
            }
        }
        if framing == Framing::Chunked {
            self.out.extend_from_slice(b"0\r\n\r\n");
        }
        // A body shorter or longer than its declared length leaves the connection unusable.
        self.flush().await && !matches!(framing, Framing::Length(n) if n != sent)
    }

    /// The body's next frame while the client is watched; `None` when the client left.
    async fn next_frame(
        &mut self,
        body: &mut Body,
    ) -> Option<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let mut watching = self.buf.len() < MAX_AHEAD;
        loop {
            tokio::select! {
                biased;
                frame = poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)) => return Some(frame),
                ready = self.tcp.readable(), if watching => {
                    if ready.is_err() || !self.read_ahead(&mut watching) {
                        return None;
                    }
                }
            }
        }
    }

    /// Adds one data frame to the output (chunk-framed when `chunked`); a large one is written
    /// from its own buffer.
    async fn push(&mut self, data: Bytes, chunked: bool) -> bool {
        if chunked {
            write_hex(&mut self.out, data.len());
            self.out.extend_from_slice(b"\r\n");
        }
        if data.len() >= COPY_LIMIT {
            if !self.flush().await || !self.send(&data).await {
                return false;
            }
        } else {
            self.out.extend_from_slice(&data);
        }
        if chunked {
            self.out.extend_from_slice(b"\r\n");
        }
        true
    }

    /// Sends what the output buffer holds.
    async fn flush(&mut self) -> bool {
        if self.out.is_empty() {
            return true;
        }
        let out = std::mem::take(&mut self.out);
        let ok = self.send(&out).await;
        self.out = out;
        self.out.clear();
        ok
    }

    /// Writes all of `data`. `false` when the client left, or made no room for it within
    /// `send_timeout` (or by the response's deadline, when sooner): the connection is then
    /// dropped, and the request with it. A write that goes out at once reads no clock and
    /// touches no timer.
    async fn send(&mut self, mut data: &[u8]) -> bool {
        let mut stalled: Option<Wait> = None;
        poll_fn(|cx| {
            loop {
                if data.is_empty() {
                    return Poll::Ready(true);
                }
                match Pin::new(&mut self.tcp).poll_write(cx, data) {
                    Poll::Ready(Ok(n)) if n > 0 => {
                        data = &data[n..];
                        stalled = None;
                    }
                    Poll::Ready(_) => return Poll::Ready(false),
                    Poll::Pending => {
                        let send_timeout = self.state.core.config.send_timeout;
                        let wait = *stalled
                            .get_or_insert_with(|| due::stalled_write(send_timeout, self.deadline));
                        if due::poll_due(self.timer.as_mut(), wait.at, cx).is_pending() {
                            return Poll::Pending;
                        }
                        self.state.core.telemetry.connection_closed(wait.why);
                        return Poll::Ready(false);
                    }
                }
            }
        })
        .await
    }
}

/// Reads the buffered bytes as the start of a request.
fn parse(buf: &mut BytesMut) -> Parsed {
    let mut slots = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
    let mut head = httparse::Request::new(&mut []);
    let head_len = match head.parse_with_uninit_headers(buf, &mut slots) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => return Parsed::Partial,
        _ => return Parsed::Slow,
    };
    if head.version != Some(1) {
        return Parsed::Slow;
    }
    let (Some(method), Some(path)) = (head.method, head.path) else {
        return Parsed::Slow;
    };
    let Some(route) = Route::proxied(method, path) else {
        return Parsed::Slow;
    };
    let base = buf.as_ptr() as usize;
    let mut length = None;
    let mut close = false;
    let mut host = false;
    let mut fields = Vec::with_capacity(head.headers.len());
    for field in head.headers.iter() {
        let Ok(name) = HeaderName::from_bytes(field.name.as_bytes()) else {
            return Parsed::Slow;
        };
        if name == header::CONTENT_LENGTH {
            match (length, plain_number(field.value)) {
                (None, Some(n)) => length = Some(n),
                _ => return Parsed::Slow,
            }
        } else if name == header::TRANSFER_ENCODING
            || name == header::EXPECT
            || name == header::UPGRADE
        {
            return Parsed::Slow;
        } else if name == header::HOST {
            host = true;
        } else if name == header::CONNECTION {
            for token in list_tokens(field.value) {
                if token.eq_ignore_ascii_case(b"close") {
                    close = true;
                } else if token.eq_ignore_ascii_case(b"upgrade") {
                    return Parsed::Slow;
                }
            }
        }
        let start = field.value.as_ptr() as usize - base;
        fields.push((name, start, start + field.value.len()));
    }
    // A request without `Host` is refused (400) on hyper's path.
    let Some(length) = length.filter(|n| *n <= MAX_BODY && host) else {
        return Parsed::Slow;
    };
    let total = head_len + length;
    if buf.len() < total {
        return Parsed::Short(total - buf.len());
    }
    let whole = buf.split_to(total).freeze();
    let mut headers = HeaderMap::with_capacity(fields.len());
    for (name, start, end) in fields {
        let Ok(value) = HeaderValue::from_maybe_shared(whole.slice(start..end)) else {
            // httparse and `http` admit the same field-value bytes; should they ever disagree,
            // hyper gets the request back, every byte of it.
            let mut all = BytesMut::from(&whole[..]);
            all.extend_from_slice(buf);
            *buf = all;
            return Parsed::Slow;
        };
        headers.append(name, value);
    }
    let mut request = Request::new(Body::from(whole.slice(head_len..)));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = uri_of(route);
    *request.headers_mut() = headers;
    Parsed::Fast(route, request, close)
}

/// The route's path as a request URI (parsed once; a clone of a static `Uri` copies no bytes).
fn uri_of(route: Route) -> Uri {
    static URIS: LazyLock<[Uri; 5]> =
        LazyLock::new(|| Route::ALL.map(|r| Uri::from_static(r.path())));
    URIS[route as usize].clone()
}

/// A `content-length` value: digits only, at most 19 of them.
fn plain_number(value: &[u8]) -> Option<usize> {
    if value.is_empty() || value.len() > 19 || !value.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(value).ok()?.parse().ok()
}

/// What [`parse`] makes of `data`, for the fuzz harness: the bytes a served request consumed
/// (0 when it was not served), or the invariant that broke. Bytes not consumed stay buffered,
/// every byte of them for a request that goes to hyper.
#[doc(hidden)]
pub fn fuzz_parse(data: &[u8]) -> Result<usize, String> {
    let mut buf = BytesMut::from(data);
    match parse(&mut buf) {
        Parsed::Fast(_, request, _) => {
            let consumed = data.len() - buf.len();
            let body = request.body().size_hint().exact().unwrap_or(u64::MAX) as usize;
            if body > consumed || body > MAX_BODY || buf[..] != data[consumed..] {
                return Err(format!("{body} body bytes of {consumed} consumed"));
            }
            Ok(consumed)
        }
        Parsed::Short(missing) if missing == 0 || missing > MAX_BODY => {
            Err(format!("{missing} bytes missing"))
        }
        Parsed::Partial | Parsed::Short(_) | Parsed::Slow if buf[..] == *data => Ok(0),
        _ => Err("bytes lost on the way to hyper".into()),
    }
}

/// Whether a response asks for the connection to close.
fn closes(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .any(|v| list_tokens(v.as_bytes()).any(|t| t.eq_ignore_ascii_case(b"close")))
}

/// How a response body is framed on the wire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// No body (1xx, 204, 304).
    None,
    Length(u64),
    Chunked,
}

/// The framing hyper would choose: the response's own `content-length`, else the body's exact
/// size, else chunked.
fn framing(status: axum::http::StatusCode, headers: &HeaderMap, body: &Body) -> Framing {
    if status.is_informational() || status.as_u16() == 204 || status.as_u16() == 304 {
        return Framing::None;
    }
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| plain_number(v.as_bytes()));
    match declared.map(|n| n as u64).or(body.size_hint().exact()) {
        Some(n) => Framing::Length(n),
        None => Framing::Chunked,
    }
}

/// Status line and fields (the upstream's, then the gateway's); the framing fields are the ones
/// this writer chose.
fn write_head(
    out: &mut Vec<u8>,
    parts: &axum::http::response::Parts,
    forwarded: &Forwarded,
    framing: Framing,
    close: bool,
) {
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(
        parts
            .status
            .canonical_reason()
            .unwrap_or_default()
            .as_bytes(),
    );
    out.extend_from_slice(b"\r\n");
    forwarded.write(&parts.headers, out);
    for (name, value) in parts.headers.iter() {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        header_line(name.as_str(), value, out);
    }
    match framing {
        Framing::None => {}
        Framing::Length(n) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        Framing::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if close && !parts.headers.contains_key(header::CONNECTION) {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !forwarded.has_date() && !parts.headers.contains_key(header::DATE) {
        out.extend_from_slice(b"date: ");
        date::with(|d| out.extend_from_slice(d));
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// A chunk size in hex.
fn write_hex(out: &mut Vec<u8>, n: usize) {
    use std::io::Write;
    let _ = write!(out, "{n:x}");
}

/// The `date` field's value, formatted once a second per thread (as hyper caches it).
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    thread_local! {
        static CACHE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }

    pub(super) fn with(f: impl FnOnce(&[u8])) {
        let now = SystemTime::now();
        let secs = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        CACHE.with_borrow_mut(|(at, text)| {
            if *at != secs {
                *at = secs;
                *text = httpdate::fmt_http_date(now);
            }
            f(text.as_bytes());
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(raw: &str) -> Parsed {
        parse(&mut BytesMut::from(raw))
    }

    #[test]
    fn a_whole_small_post_is_served_here_and_the_rest_goes_to_hyper() {
        let body = r#"{"model":"m"}"#;
        let raw = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: {}\r\nX-A: 1\r\nx-a: 2\r\n\r\n{body}",
            body.len()
        );
        match parsed(&raw) {
            Parsed::Fast(route, request, close) => {
                assert_eq!(route, Route::Chat);
                assert!(!close);
                assert_eq!(request.uri().path(), "/v1/chat/completions");
                let a: Vec<_> = request.headers().get_all("x-a").iter().collect();
                assert_eq!(a, ["1", "2"]);
                assert_eq!(request.headers()["host"], "gw");
            }
            _ => panic!("a whole POST is served on the fast path"),
        }
        let slow = [
            "GET /v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            "POST /v1/models HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.0\r\ncontent-length: 0\r\n\r\n",
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\ncontent-length: 0\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\n{}",
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: +2\r\n\r\n{}",
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\nexpect: 100-continue\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\nconnection: Upgrade\r\n\r\n{}",
            "POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2000000\r\n\r\n",
            "POST /v1/chat/completions HTTP/1.1\r\nbad header\r\n\r\n",
        ];
        for raw in slow {
            assert!(matches!(parsed(raw), Parsed::Slow), "{raw:?} goes to hyper");
        }
        assert!(matches!(
            parsed("POST /v1/chat/completions HTTP/1.1\r\ncontent-le"),
            Parsed::Partial
        ));
        assert!(matches!(
            parsed(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\ncontent-length: 10\r\n\r\n{}"
            ),
            Parsed::Short(8)
        ));
        // No Host: hyper's path answers it 400.
        assert!(matches!(
            parsed("POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}"),
            Parsed::Slow
        ));
        let long = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nx: {}",
            "a".repeat(MAX_HEAD)
        );
        assert!(matches!(parsed(&long), Parsed::Slow));
    }

    #[test]
    fn a_request_asking_to_close_is_marked_and_the_next_stays_buffered() {
        let one = "POST /v1/completions HTTP/1.1\r\nhost: gw\r\nconnection: keep-alive, Close\r\ncontent-length: 2\r\n\r\n{}";
        let mut buf = BytesMut::from(format!("{one}POST /v1/com").as_str());
        match parse(&mut buf) {
            Parsed::Fast(Route::Completions, _, true) => {}
            _ => panic!("the request is served and the connection closes after it"),
        }
        assert_eq!(&buf[..], b"POST /v1/com");
    }

    #[test]
    fn the_head_written_frames_the_body_as_hyper_would() {
        let response = axum::response::Response::builder()
            .status(200)
            .header("content-type", "application/json")
            .body(Body::from("{}"))
            .unwrap();
        let (parts, body) = response.into_parts();
        let framing = framing(parts.status, &parts.headers, &body);
        assert!(framing == Framing::Length(2));
        let mut out = Vec::new();
        write_head(&mut out, &parts, &Forwarded::default(), framing, true);
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\ndate: "), "{text}");
        assert!(text.ends_with(" GMT\r\n\r\n"), "{text}");
        let stream =
            Body::from_stream(futures_util::stream::empty::<Result<Bytes, std::io::Error>>());
        assert!(framing_of(204, &stream) == Framing::None);
        assert!(framing_of(200, &stream) == Framing::Chunked);
        let mut hex = Vec::new();
        for n in [0, 9, 10, 255, 4096] {
            write_hex(&mut hex, n);
            hex.push(b' ');
        }
        assert_eq!(hex, b"0 9 a ff 1000 ");
        for (n, text) in [(0, "0"), (u64::MAX, "18446744073709551615")] {
            let mut out = Vec::new();
            write_head(
                &mut out,
                &parts,
                &Forwarded::default(),
                Framing::Length(n),
                false,
            );
            let head = String::from_utf8(out).unwrap();
            assert!(
                head.contains(&format!("\r\ncontent-length: {text}\r\n")),
                "{head}"
            );
        }
    }

    #[test]
    fn the_upstreams_fields_are_written_as_sent_and_the_gateways_replace_theirs() {
        let mut wire = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nServer: e\r\nDate: then\r\nX-Headroom-Lane: up\r\n\
               Endpoint-Load-Metrics: up\r\nContent-Type: application/json\r\n\
               Content-Length: 2\r\n\r\n"[..],
        );
        let mut head = crate::upstream::wire::parse_head(&mut wire)
            .unwrap()
            .unwrap();
        head.forwarded.add("x-headroom-lane", b"text");
        let response = axum::response::Response::builder()
            .header("endpoint-load-metrics", "gw")
            .body(Body::from("{}"))
            .unwrap();
        let (parts, _) = response.into_parts();
        let mut out = Vec::new();
        write_head(&mut out, &parts, &head.forwarded, Framing::Length(2), false);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "HTTP/1.1 200 OK\r\nServer: e\r\nDate: then\r\nContent-Type: application/json\r\n\
             x-headroom-lane: text\r\nendpoint-load-metrics: gw\r\ncontent-length: 2\r\n\r\n",
            "the upstream's fields as it wrote them, its date kept (no second one), and its \
             x-headroom-lane and load report giving way to the gateway's"
        );
    }

    fn framing_of(status: u16, body: &Body) -> Framing {
        framing(
            axum::http::StatusCode::from_u16(status).unwrap(),
            &HeaderMap::new(),
            body,
        )
    }
}
