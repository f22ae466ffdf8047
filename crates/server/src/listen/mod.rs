//! The HTTP/1 server in front of the routes: accepts connections (TCP_NODELAY on each) and serves
//! each on a task of its own, first on the fast path for whole proxied requests ([`h1`]), then,
//! from the first request that path does not serve, with hyper's HTTP/1 connection, which hands
//! the proxied OpenAI routes (`POST` on the chat, completion and audio paths) straight to the
//! request path and every other request to the axum router (admin, health, UI, `/v1/models`,
//! the 404/405 answers).
//! The hot path so skips the router's layers: their boxed futures, service clones and the moves
//! of the request's future through each of them. On shutdown it stops accepting, lets each
//! connection finish its in-flight request and close, and resolves once every connection ended.

use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::Service;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::app::{self, Shared};
use crate::request::Route;

pub mod h1;
mod rewind;

/// Serves `listener` until `shutdown` resolves, then drains the open connections.
pub(crate) async fn serve<F>(listener: TcpListener, state: Shared, router: Router, shutdown: F)
where
    F: Future<Output = ()>,
{
    // Connections hold a sender and learn of the shutdown when the one receiver is dropped;
    // `closed` is a receiver each connection holds until it ends.
    let (stop_tx, stop_rx) = watch::channel(());
    let (closed_tx, closed_rx) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    accept_error(e).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        // Responses are written whole (head and body together) or as SSE events that must
        // leave at once: Nagle's algorithm would only hold small writes back for the ACK.
        let _ = tcp.set_nodelay(true);
        tokio::spawn(connection(
            tcp,
            state.clone(),
            router.clone(),
            stop_tx.clone(),
            closed_rx.clone(),
        ));
    }
    drop(stop_rx);
    drop(closed_rx);
    drop(listener);
    closed_tx.closed().await;
}

/// One client connection, until it closes; a shutdown lets its in-flight request finish first.
/// It starts on the fast path ([`h1`]) and goes to hyper for the first request that path does
/// not serve.
async fn connection(
    tcp: TcpStream,
    state: Shared,
    router: Router,
    stop: watch::Sender<()>,
    closed: watch::Receiver<()>,
) {
    let mut stopping = pin!(stop.closed());
    let mut draining = false;
    if let h1::Ended::Handover(read, tcp) = h1::serve(
        tcp,
        &state,
        stopping.as_mut(),
        || stop.is_closed(),
        &mut draining,
    )
    .await
    {
        let io = rewind::Rewind::new(read, tcp);
        with_hyper(io, state, router, stopping, draining).await;
    }
    drop(closed);
}

/// Serves the rest of a connection with hyper's HTTP/1 server: the proxied routes go to the
/// request path, every other request through the router.
async fn with_hyper<F>(
    io: rewind::Rewind,
    state: Shared,
    router: Router,
    mut stopping: Pin<&mut F>,
    mut draining: bool,
) where
    F: Future<Output = ()>,
{
    let admin = TowerToHyperService::new(router);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let state = state.clone();
        let admin = admin.clone();
        async move {
            Ok::<Response, Infallible>(
                match Route::proxied(req.method().as_str(), req.uri().path()) {
                    Some(route) => app::proxied(state, route, req.map(Body::new), None)
                        .await
                        .into_response(),
                    None => admin.call(req).await?,
                },
            )
        }
    });
    let conn = http1::Builder::new()
        .writev(false)
        .serve_connection(TokioIo::new(io), service);
    let mut conn = pin!(conn);
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            biased;
            _ = conn.as_mut() => break,
            _ = stopping.as_mut(), if !draining => {
                draining = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// An accept that failed: a connection error (the client gave up) is skipped; anything else
/// (out of file descriptors) waits a second before the next accept, as hyper's servers do.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::*;
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    eprintln!("headroom serve: accept failed ({e}); retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
