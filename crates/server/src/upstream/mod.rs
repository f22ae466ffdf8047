//! The proxied path's upstream HTTP/1 client (HTTP/1.1 on the wire in [`wire`], no connection
//! task): one keep-alive pool per upstream address ([`Endpoint`]), each exchange driven inside
//! the request's own task, so a proxied request costs no hand-off between tasks or worker threads.
//! A pooled connection the upstream has closed is noticed before reuse; one that turns out stale
//! only after the request went out (it provably never reached the upstream) is sent again once
//! on a fresh connection. No redirects are followed (a 3xx is passed back as it is), connects
//! are bounded by a timeout, and plain HTTP only (the config refuses `https://` upstreams).

mod pool;
mod response;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use bytes::Bytes;

pub use pool::Endpoint;
pub use response::UpstreamResponse;

/// How long a connect may take before the upstream counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle keep-alive connections kept per upstream; more are closed when they come back.
pub const MAX_IDLE_PER_UPSTREAM: usize = 256;
/// An idle connection unused for this long is closed rather than reused.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// No connection could be made (refused, no route, name not resolved).
    #[error("cannot connect to {upstream}: {source}")]
    Connect {
        upstream: String,
        source: std::io::Error,
    },
    /// The connect did not finish within [`CONNECT_TIMEOUT`].
    #[error("connecting to {upstream} timed out")]
    ConnectTimeout { upstream: String },
    /// The configured address is not `http://HOST[:PORT]`.
    #[error("`{0}` is not an http://HOST:PORT address")]
    BadAddress(String),
    /// The request's query cannot go into a request line.
    #[error("invalid request target: {0}")]
    BadTarget(String),
    /// The connection failed (`answered`: after some of the response had arrived).
    #[error("upstream connection error: {source}")]
    Io {
        source: std::io::Error,
        answered: bool,
    },
    /// The upstream closed the connection before the response was complete.
    #[error("the upstream closed the connection before the response {}", if *.answered { "was complete" } else { "began" })]
    Closed { answered: bool },
    /// The upstream's response broke HTTP/1.1.
    #[error("malformed upstream response: {0}")]
    Malformed(#[from] wire::Malformed),
}

impl UpstreamError {
    /// The upstream could not be reached at all.
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. }
        )
    }

    fn io(source: std::io::Error, answered: bool) -> UpstreamError {
        UpstreamError::Io { source, answered }
    }

    /// Whether the request provably never reached the upstream: it could not connect, or the
    /// connection was closed or reset under the request before any response byte came back.
    pub fn never_reached(&self) -> bool {
        use std::io::ErrorKind::*;
        match self {
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. } => true,
            UpstreamError::Closed { answered } => !answered,
            UpstreamError::Io { source, answered } => {
                !answered
                    && matches!(
                        source.kind(),
                        ConnectionReset | ConnectionAborted | BrokenPipe
                    )
            }
            UpstreamError::BadAddress(_)
            | UpstreamError::BadTarget(_)
            | UpstreamError::Malformed(_) => false,
        }
    }
}

/// One request to send: its target (path and query), header fields (as lines, written with
/// [`wire::header_line`]; no `host` or `content-length`, which the client writes) and whole body.
pub struct Outgoing<'a> {
    pub path: &'static str,
    pub query: Option<&'a str>,
    pub headers: Vec<u8>,
    pub body: Bytes,
}

impl Outgoing<'_> {
    /// The request head as it goes on the wire, with room after it for a body that is written in
    /// the same buffer.
    fn head(&self, host: &HeaderValue) -> Result<Vec<u8>, UpstreamError> {
        if let Some(q) = self.query
            && !wire::valid_query(q)
        {
            return Err(UpstreamError::BadTarget(q.to_string()));
        }
        let body = match self.body.len() {
            n if n <= pool::BODY_WITH_HEAD => n,
            _ => 0,
        };
        let mut head = Vec::with_capacity(128 + self.headers.len() + body);
        wire::request_head(
            self.path,
            self.query,
            host,
            &self.headers,
            self.body.len(),
            &mut head,
        );
        Ok(head)
    }
}

/// Sends `outgoing` to `endpoint`; resolves when the response head arrives. A reused connection
/// that fails in a way that proves the upstream never took the request is replaced by a fresh
/// connection and the request sent once more (the body is in memory; it cannot run twice).
pub async fn send(
    endpoint: &Arc<Endpoint>,
    outgoing: &Outgoing<'_>,
) -> Result<UpstreamResponse, UpstreamError> {
    let mut resent = false;
    loop {
        let pooled = if resent { None } else { endpoint.checkout() };
        let reused = pooled.is_some();
        let conn = match pooled {
            Some(c) => c,
            None => endpoint.connect().await?,
        };
        match response::exchange(endpoint.clone(), conn, outgoing).await {
            Err(e) if reused && !resent && e.never_reached() => {
                endpoint.count_stale_resend();
                resent = true;
            }
            other => return other,
        }
    }
}

/// The value of a `Bearer` Authorization header, if `key` makes a valid header value.
pub fn bearer(key: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(&format!("Bearer {key}")).ok()
}

#[cfg(test)]
mod tests;
