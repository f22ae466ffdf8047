//! One upstream address and its idle keep-alive connections: connecting (under the connect
//! timeout, with TCP_NODELAY), taking an idle connection only after checking that the upstream
//! has not closed it, and taking a connection back when its response has ended cleanly.

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use axum::http::HeaderValue;
use axum::http::uri::Authority;
use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{CONNECT_TIMEOUT, IDLE_TIMEOUT, MAX_IDLE_PER_UPSTREAM, UpstreamError};

/// One HTTP/1 connection: the handle requests go through, and the connection state machine the
/// request's task polls to move bytes (there is no task of its own).
pub(super) struct Conn {
    pub(super) sender: http1::SendRequest<Full<Bytes>>,
    pub(super) driver: http1::Connection<TokioIo<TcpStream>, Full<Bytes>>,
}

impl Conn {
    /// Moves the connection's I/O on; `true` once it has closed (cleanly or not).
    pub(super) fn poll_closed(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.driver).poll(cx).is_ready()
    }

    /// Whether a new request can go out on it now: still open, and done with the last exchange.
    fn ready_for_next(&mut self, cx: &mut Context<'_>) -> bool {
        !self.poll_closed(cx) && self.sender.is_ready()
    }
}

struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

/// An upstream address with its pool of idle connections.
pub struct Endpoint {
    address: String,
    host: String,
    port: u16,
    host_header: HeaderValue,
    idle: Mutex<Vec<Idle>>,
    connects: AtomicU64,
    stale_resends: AtomicU64,
}

impl Endpoint {
    /// The endpoint for a configured upstream (`http://HOST[:PORT]`, no path).
    pub fn parse(address: &str) -> Result<Endpoint, UpstreamError> {
        let bad = || UpstreamError::BadAddress(address.to_string());
        let rest = address.strip_prefix("http://").ok_or_else(bad)?;
        let authority: Authority = rest.trim_end_matches('/').parse().map_err(|_| bad())?;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        if host.is_empty() {
            return Err(bad());
        }
        let host_header = HeaderValue::from_str(authority.as_str()).map_err(|_| bad())?;
        Ok(Endpoint {
            address: address.to_string(),
            port: authority.port_u16().unwrap_or(80),
            host,
            host_header,
            idle: Mutex::new(Vec::new()),
            connects: AtomicU64::new(0),
            stale_resends: AtomicU64::new(0),
        })
    }

    /// The address as configured.
    pub fn address(&self) -> &str {
        &self.address
    }

    pub(super) fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    /// Connections opened so far.
    pub fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    /// Requests sent again on a fresh connection after a pooled one turned out stale.
    pub fn stale_resends(&self) -> u64 {
        self.stale_resends.load(Ordering::Relaxed)
    }

    pub(super) fn count_stale_resend(&self) {
        self.stale_resends.fetch_add(1, Ordering::Relaxed);
    }

    /// Idle connections in the pool now.
    pub fn idle_count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a new connection.
    pub(super) async fn connect(&self) -> Result<Box<Conn>, UpstreamError> {
        self.connects.fetch_add(1, Ordering::Relaxed);
        let tcp = tokio::time::timeout(
            CONNECT_TIMEOUT,
            TcpStream::connect((self.host.as_str(), self.port)),
        )
        .await
        .map_err(|_| UpstreamError::ConnectTimeout {
            upstream: self.address.clone(),
        })?
        .map_err(|source| UpstreamError::Connect {
            upstream: self.address.clone(),
            source,
        })?;
        // Requests and their bodies go out whole; Nagle would only hold back small writes.
        let _ = tcp.set_nodelay(true);
        let (sender, driver) = http1::Builder::new()
            .handshake(TokioIo::new(tcp))
            .await
            .map_err(UpstreamError::Http)?;
        Ok(Box::new(Conn { sender, driver }))
    }

    /// The most recently used idle connection that is still open and ready, if any. Each one
    /// is polled first: a connection the upstream closed while it sat idle reads its end of file
    /// here and is dropped, so a request is not written into it.
    pub(super) async fn checkout(&self) -> Option<Box<Conn>> {
        loop {
            let mut idle = self.lock().pop()?;
            if idle.since.elapsed() > IDLE_TIMEOUT {
                continue;
            }
            let ready = std::future::poll_fn(|cx| Poll::Ready(idle.conn.ready_for_next(cx))).await;
            if ready {
                return Some(idle.conn);
            }
        }
    }

    /// Takes back a connection whose exchange ended cleanly, when it can carry another request.
    pub(super) fn checkin(&self, mut conn: Box<Conn>, cx: &mut Context<'_>) {
        if !conn.ready_for_next(cx) {
            return;
        }
        let now = Instant::now();
        let mut idle = self.lock();
        idle.retain(|i| now.duration_since(i.since) <= IDLE_TIMEOUT);
        if idle.len() < MAX_IDLE_PER_UPSTREAM {
            idle.push(Idle { conn, since: now });
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}
