//! The proxied path's upstream HTTP/1 client (hyper's client connection, no connection task):
//! one keep-alive pool per upstream address ([`Endpoint`]), each exchange driven inside the
//! request's own task, so a proxied request costs no hand-off between tasks or worker threads.
//! A pooled connection the upstream has closed is noticed before reuse; one that turns out stale
//! only after the request went out (it provably never reached the upstream) is sent again once
//! on a fresh connection. No redirects are followed (a 3xx is passed back as it is), connects
//! are bounded by a timeout, and plain HTTP only (the config refuses `https://` upstreams).

mod pool;
mod response;

use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, Method, Request, Uri, header};
use bytes::Bytes;
use http_body_util::Full;

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
    /// The request path and query did not make a URI.
    #[error("invalid request target: {0}")]
    BadTarget(#[from] axum::http::uri::InvalidUri),
    /// The HTTP exchange failed on an open connection.
    #[error("upstream HTTP error: {0}")]
    Http(#[from] hyper::Error),
}

impl UpstreamError {
    /// The upstream could not be reached at all.
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. }
        )
    }

    /// Whether the request provably never reached the upstream: it could not connect, or the
    /// connection was closed or reset under the request before any response byte came back.
    pub fn never_reached(&self) -> bool {
        match self {
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. } => true,
            UpstreamError::BadAddress(_) | UpstreamError::BadTarget(_) => false,
            UpstreamError::Http(e) => hyper_never_reached(e),
        }
    }
}

/// A hyper error that means the request was not taken by the upstream: canceled before it was
/// written, the connection closed before any response byte, or reset/broken under the write.
fn hyper_never_reached(e: &hyper::Error) -> bool {
    if e.is_canceled() || e.is_incomplete_message() {
        return true;
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
        source = s.source();
    }
    false
}

/// One request to send: its target (path and query), headers and whole body.
pub struct Outgoing<'a> {
    pub path: &'static str,
    pub query: Option<&'a str>,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Outgoing<'_> {
    fn uri(&self) -> Result<Uri, UpstreamError> {
        Ok(match self.query {
            None => Uri::from_static(self.path),
            Some(q) => Uri::try_from(format!("{}?{q}", self.path))?,
        })
    }

    fn request(&self, endpoint: &Endpoint) -> Result<Request<Full<Bytes>>, UpstreamError> {
        let mut request = Request::new(Full::new(self.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = self.uri()?;
        let headers = request.headers_mut();
        *headers = self.headers.clone();
        headers.insert(header::HOST, endpoint.host_header().clone());
        Ok(request)
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
        let pooled = if resent {
            None
        } else {
            endpoint.checkout().await
        };
        let reused = pooled.is_some();
        let conn = match pooled {
            Some(c) => c,
            None => endpoint.connect().await?,
        };
        match response::exchange(endpoint.clone(), conn, outgoing.request(endpoint)?).await {
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
