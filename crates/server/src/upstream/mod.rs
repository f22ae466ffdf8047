//! The proxied path's upstream HTTP/1 client (HTTP/1.1 on the wire in [`wire`], no connection
//! task): one keep-alive pool per upstream address ([`Endpoint`]), each exchange driven inside
//! the request's own task, so a proxied request costs no hand-off between tasks or worker threads.
//! A pooled connection the upstream has closed is noticed before reuse, and one whose last
//! response was a stream rests before it is reused (engines close those). A request the upstream
//! may have taken is never sent
//! again, as nginx and Go's client treat a POST: a pooled connection that failed before anything
//! was written, or that the upstream reset with the request unread, takes it again once on a
//! fresh connection; any other failure is the caller's to answer, unless the request says it
//! may run twice ([`Outgoing::idempotent`]). No redirects are followed (a 3xx is passed back as
//! it is), connects are bounded by a timeout, and plain HTTP only (the config refuses
//! `https://` upstreams).

mod pool;
mod response;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderValue;
use bytes::Bytes;

pub(crate) use pool::Endpoint;
pub(crate) use response::UpstreamResponse;

/// How long a connect may take before the upstream counts as unreachable.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle keep-alive connections kept per upstream; more are closed when they come back.
pub(crate) const MAX_IDLE_PER_UPSTREAM: usize = 256;
/// An idle connection unused for this long is closed rather than reused.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum UpstreamError {
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
    /// The connection failed (`written`: after some of the request was written; `answered`:
    /// after some of the response had arrived).
    #[error("upstream connection error: {source}")]
    Io {
        source: std::io::Error,
        written: bool,
        answered: bool,
    },
    /// The upstream closed the connection before the response was complete (the whole request
    /// had been written).
    #[error("the upstream closed the connection before the response {}", if *.answered { "was complete" } else { "began" })]
    Closed { answered: bool },
    /// The upstream's response broke HTTP/1.1.
    #[error("malformed upstream response: {0}")]
    Malformed(#[from] wire::Malformed),
}

impl UpstreamError {
    /// The upstream could not be reached at all.
    pub(crate) fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. }
        )
    }

    fn io(source: std::io::Error, written: bool, answered: bool) -> UpstreamError {
        UpstreamError::Io {
            source,
            written,
            answered,
        }
    }

    /// Whether no byte of the request reached the wire: it could not connect, or the write
    /// failed before its first byte. Such a request may go anywhere else, whatever it is.
    pub(crate) fn unsent(&self) -> bool {
        match self {
            UpstreamError::Connect { .. } | UpstreamError::ConnectTimeout { .. } => true,
            UpstreamError::Io { written, .. } => !written,
            UpstreamError::Closed { .. }
            | UpstreamError::BadAddress(_)
            | UpstreamError::BadTarget(_)
            | UpstreamError::Malformed(_) => false,
        }
    }

    /// Whether the upstream reset the connection before any response byte. A TCP whose
    /// application closes its socket with received data still unread answers with a reset
    /// instead of a close (RFC 1122 section 4.2.2.13: "to show that data was lost"): on a
    /// connection that had carried whole exchanges before, the request was still unread when
    /// the upstream let the connection go, the keep-alive race that llama.cpp's server makes
    /// after every stream. (A clean close is no such sign: an engine that read the request and
    /// then died closes the same way as one that closed an idle connection.)
    pub(crate) fn reset_unread(&self) -> bool {
        use std::io::ErrorKind::*;
        matches!(self, UpstreamError::Io { source, answered: false, .. }
            if matches!(source.kind(), ConnectionReset | ConnectionAborted | BrokenPipe))
    }

    /// Whether the request failed before any response byte came back: unsent, or sent and then
    /// closed or reset under it. The upstream may have run it (an engine that read it and then
    /// died looks the same as one that closed a kept-alive connection as the request arrived),
    /// so only a request that may run twice is sent elsewhere after this.
    pub(crate) fn unanswered(&self) -> bool {
        match self {
            UpstreamError::Closed { answered } => !answered,
            other => other.reset_unread() || other.unsent(),
        }
    }

    /// Whether a request that failed this way may go to another replica: when none of it was
    /// written, or, for a request that may run twice (`idempotent`), when no response byte came
    /// back.
    pub(crate) fn may_reroute(&self, idempotent: bool) -> bool {
        self.unsent() || (idempotent && self.unanswered())
    }

    /// Whether a request that failed this way on a reused keep-alive connection may be sent
    /// again on a fresh one to the same upstream: what may be rerouted, and a request the
    /// upstream reset unread ([`UpstreamError::reset_unread`]).
    fn may_resend_fresh(&self, idempotent: bool) -> bool {
        self.may_reroute(idempotent) || self.reset_unread()
    }
}

/// One request to send: its target (path and query), header fields (as lines, written with
/// [`wire::header_line`]; no `host` or `content-length`, which the client writes), whole body,
/// and whether it may run twice.
pub(crate) struct Outgoing<'a> {
    pub path: &'static str,
    pub query: Option<&'a str>,
    pub headers: Vec<u8>,
    pub body: Bytes,
    /// The request may be sent again after it was written, when no response byte came back
    /// (the lane's `idempotent`). Off: once a byte of it is written it is sent nowhere else.
    pub idempotent: bool,
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
/// that failed before a byte of the request was written, or that the upstream reset with the
/// request unread (or, for a request that may run twice, that failed before any response byte)
/// is replaced by a fresh connection and the request sent once more.
pub(crate) async fn send(
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
            Err(e) if reused && !resent && e.may_resend_fresh(outgoing.idempotent) => {
                endpoint.count_stale_resend();
                resent = true;
            }
            other => return other,
        }
    }
}

/// The value of a `Bearer` Authorization header, if `key` makes a valid header value.
pub(crate) fn bearer(key: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(&format!("Bearer {key}")).ok()
}

#[cfg(test)]
mod tests;
