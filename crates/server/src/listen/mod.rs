//! The HTTP/1 server in front of the routes: accepts connections (TCP_NODELAY on each) and serves
//! each on a task of its own, first on the fast path for whole proxied requests ([`h1`]), then,
//! from the first request that path does not serve, with hyper's HTTP/1 connection, which hands
//! the proxied OpenAI routes (`POST` on the chat, completion and audio paths) straight to the
//! request path and every other request to the axum router (admin, health, UI, `/v1/models`,
//! the 404/405 answers).
//! The hot path so skips the router's layers: their boxed futures, service clones and the moves
//! of the request's future through each of them. On shutdown it stops accepting, lets each
//! connection finish its in-flight request and close, and resolves once every connection ended;
//! what is still in flight when `shutdown_grace` runs out is cut: a request not answered yet gets
//! 503 `shutting_down`, a stream its error event.
//!
//! Every connection is timed on the client's side ([`due`]): the request head, the idle wait
//! between requests and each write the client must make room for; and it holds a slot
//! ([`slots`]) so that near the open-file limit the longest-idle connections make room for new
//! clients.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::Service;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use crate::edge;
use crate::error::{ApiError, ErrorCode};
use crate::request::Route;
use crate::state::Shared;

pub(crate) mod due;
pub mod h1;
mod rewind;
pub mod slots;

/// How long, once `shutdown_grace` ran out and in-flight work was cut, connections get to write
/// their last answers (a 503, a stream's error event) before the server returns.
const CUT_LINGER: Duration = Duration::from_secs(2);

/// Serves `listener` until `shutdown` resolves, then drains the open connections for at most
/// `grace` and cuts what is still in flight.
pub(crate) async fn serve<F>(
    listener: TcpListener,
    state: Shared,
    router: Router,
    shutdown: F,
    grace: Duration,
) where
    F: Future<Output = ()>,
{
    // Connections hold a sender and learn of the shutdown (and of the cut) when the one
    // receiver is dropped; `closed` is a receiver each connection holds until it ends.
    let (stop_tx, stop_rx) = watch::channel(());
    let (cut_tx, cut_rx) = watch::channel(());
    let (closed_tx, closed_rx) = watch::channel(());
    let slots = Arc::new(slots::Slots::new(slots::open_file_limit()));
    let mut shutdown = pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    accept_error(e, &slots, &state).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Responses are written whole (head and body together) or as SSE events that must
        // leave at once: Nagle's algorithm would only hold small writes back for the ACK.
        let _ = tcp.set_nodelay(true);
        let held = slots.take();
        tokio::spawn(connection(
            tcp,
            state.clone(),
            router.clone(),
            Signals {
                stop: stop_tx.clone(),
                cut: cut_tx.clone(),
                closed: closed_rx.clone(),
            },
            held,
        ));
        slots.make_room(&state.core.telemetry).await;
    }
    drop(stop_rx);
    drop(closed_rx);
    drop(listener);
    if tokio::time::timeout(grace, closed_tx.closed())
        .await
        .is_err()
    {
        state.core.cut();
        drop(cut_rx);
        let _ = tokio::time::timeout(CUT_LINGER, closed_tx.closed()).await;
    }
}

/// What a connection learns from the server: the shutdown (`stop`), the cut at the end of
/// `shutdown_grace` (`cut`), each when its receiver is dropped; `closed` is held until the
/// connection ends.
struct Signals {
    stop: watch::Sender<()>,
    cut: watch::Sender<()>,
    closed: watch::Receiver<()>,
}

/// One client connection, until it closes; a shutdown lets its in-flight request finish first.
/// It starts on the fast path ([`h1`]) and goes to hyper for the first request that path does
/// not serve.
async fn connection(
    tcp: TcpStream,
    state: Shared,
    router: Router,
    signals: Signals,
    held: slots::Held,
) {
    let mut stopping = pin!(signals.stop.closed());
    // Fused: polled once on the fast path to arm it, it may be polled again by hyper's loop.
    let mut cutting = pin!(futures_util::FutureExt::fuse(signals.cut.closed()));
    let mut draining = false;
    // The connection's client-side timer: the first request's head is due within
    // `client_header_timeout` of the accept.
    let mut timer = pin!(tokio::time::sleep_until(
        Instant::now() + state.core.config.client_header_timeout
    ));
    let ended = h1::serve(
        tcp,
        &state,
        h1::Edges {
            stopping: stopping.as_mut(),
            stopped: &|| signals.stop.is_closed(),
            cutting: cutting.as_mut(),
            timer: timer.as_mut(),
            slot: &held,
        },
        &mut draining,
    )
    .await;
    if let h1::Ended::Handover(read, tcp) = ended {
        // hyper serves the rest; such a connection is never closed to make room (its state,
        // idle or not, is hyper's).
        held.slot().busy();
        let io = Guarded {
            io: rewind::Rewind::new(read, tcp),
            timer: timer.as_mut(),
            stalled: None,
            deadline: Arc::default(),
            send_timeout: state.core.config.send_timeout,
            state: state.clone(),
        };
        with_hyper(io, state, router, stopping, cutting, draining).await;
    }
    drop(held);
    drop(signals.closed);
}

/// Serves the rest of a connection with hyper's HTTP/1 server: the proxied routes go to the
/// request path, every other request through the router. A request without `Host` is refused
/// here (hyper serves it otherwise).
async fn with_hyper<F, G>(
    io: Guarded<'_>,
    state: Shared,
    router: Router,
    mut stopping: Pin<&mut F>,
    mut cutting: Pin<&mut G>,
    mut draining: bool,
) where
    F: Future<Output = ()>,
    G: Future<Output = ()>,
{
    let admin = TowerToHyperService::new(router);
    // The deadline of the response being written, for the write timeout (hyper serves one
    // request at a time on a connection).
    let deadline = io.deadline.clone();
    let header_timeout = state
        .core
        .config
        .client_header_timeout
        .min(state.core.config.keepalive_timeout);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let state = state.clone();
        let admin = admin.clone();
        let deadline = deadline.clone();
        async move {
            set_deadline(&deadline, None);
            if let Some(refusal) = missing_host(&req) {
                return Ok(refusal);
            }
            Ok::<Response, Infallible>(
                match Route::proxied(req.method().as_str(), req.uri().path()) {
                    Some(route) => {
                        let reply = edge::proxied(state, route, req.map(Body::new), None).await;
                        set_deadline(&deadline, reply.deadline);
                        reply.into_response()
                    }
                    None => admin.call(req).await?,
                },
            )
        }
    });
    // hyper times the head from the moment it waits for it, so on its connections the idle wait
    // for a next request and that request's head share one timeout: the shorter of the two.
    let conn = http1::Builder::new()
        .writev(false)
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(io), service);
    let mut conn = pin!(conn);
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    let mut cut = false;
    loop {
        tokio::select! {
            biased;
            _ = conn.as_mut() => break,
            _ = stopping.as_mut(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
            // Wakes the connection at the cut: its request answers 503, its stream ends with
            // an error event.
            _ = cutting.as_mut(), if !cut => cut = true,
        }
    }
}

fn set_deadline(cell: &Mutex<Option<Instant>>, deadline: Option<Instant>) {
    *cell.lock().unwrap_or_else(|e| e.into_inner()) = deadline;
}

/// 400 for an HTTP/1.1 request without `Host` (RFC 9112 §3.2: "A server MUST respond with a 400
/// (Bad Request) status code to any HTTP/1.1 request message that lacks a Host header field").
fn missing_host<B>(req: &hyper::Request<B>) -> Option<Response> {
    if req.version() != axum::http::Version::HTTP_11
        || req.headers().contains_key(axum::http::header::HOST)
    {
        return None;
    }
    Some(
        ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::MissingHost,
            "an HTTP/1.1 request must carry a Host header",
        )
        .closing()
        .into_response(),
    )
}

/// The client socket hyper serves, with a timeout on every write: a write the client makes no
/// room for within `send_timeout` (or by the response's deadline, when sooner) fails, which ends
/// the connection and drops its request, freeing the request's slot and memory.
struct Guarded<'t> {
    io: rewind::Rewind,
    timer: Pin<&'t mut Sleep>,
    /// When the write that waits now is due, and why; `None` while writes make progress.
    stalled: Option<due::Wait>,
    deadline: Arc<Mutex<Option<Instant>>>,
    send_timeout: Duration,
    state: Shared,
}

impl Guarded<'_> {
    /// A write's outcome: progress clears the stall; a wait arms (or keeps) the timer, and
    /// fails the write once it is due.
    fn timed<T>(
        &mut self,
        cx: &mut Context<'_>,
        wrote: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if wrote.is_ready() {
            self.stalled = None;
            return wrote;
        }
        let wait = match self.stalled {
            Some(wait) => wait,
            None => {
                let deadline = *self.deadline.lock().unwrap_or_else(|e| e.into_inner());
                *self
                    .stalled
                    .insert(due::stalled_write(self.send_timeout, deadline))
            }
        };
        match due::poll_due(self.timer.as_mut(), wait.at, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.state.core.telemetry.connection_closed(wait.why);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client did not read its response",
                )))
            }
        }
    }
}

impl AsyncRead for Guarded<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Guarded<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let wrote = Pin::new(&mut self.io).poll_write(cx, buf);
        self.timed(cx, wrote)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let wrote = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.timed(cx, wrote)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// An accept that failed: a connection error (the client gave up) is skipped; out of file
/// descriptors, the longest-idle connection makes room; anything else waits a second before the
/// next accept, as hyper's servers do.
async fn accept_error(e: io::Error, slots: &slots::Slots, state: &crate::state::AppState) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    if slots::out_of_descriptors(&e) {
        slots.out_of_descriptors(&state.core.telemetry).await;
        return;
    }
    crate::stderr::line(&format!(
        "headroom serve: accept failed ({e}); retrying in 1 s"
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
}
