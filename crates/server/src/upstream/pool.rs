//! One upstream address and its idle keep-alive connections: connecting (under the connect
//! timeout, with TCP_NODELAY), the connection's socket and read buffer and what was written and
//! read on it, taking an idle connection only after checking that the upstream has not closed it
//! (one whose last response was a stream only after a rest), and taking a connection back when
//! its response has ended cleanly.

use std::io::ErrorKind;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::http::HeaderValue;
use axum::http::uri::Authority;
use bytes::BytesMut;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{CONNECT_TIMEOUT, IDLE_TIMEOUT, MAX_IDLE_PER_UPSTREAM, UpstreamError};

/// Bytes a read asks the socket for at most (the buffer grows to this when it runs low).
const READ_CHUNK: usize = 16 * 1024;
/// Largest body written in one buffer after its head (a larger one is written from its own).
pub(super) const BODY_WITH_HEAD: usize = READ_CHUNK;
/// How long a connection whose last response was a stream rests in the pool before it is
/// reused (see [`Endpoint::checkout`]). llama.cpp closed within 0.1 ms of its last chunk when
/// measured; the rest is room for a loaded machine's scheduling.
pub(super) const STREAM_SETTLE: Duration = Duration::from_millis(20);

/// One HTTP/1 connection: the socket and the bytes read from it that are not yet used.
pub(super) struct Conn {
    tcp: TcpStream,
    pub(super) buf: BytesMut,
    /// Some byte of the current exchange's request has been written.
    pub(super) wrote: bool,
    /// Some response byte has arrived on the current exchange.
    pub(super) answered: bool,
    /// The last response's body was chunked (a stream).
    pub(super) streamed: bool,
}

/// What a read from the connection came to.
pub(super) enum Read {
    /// Bytes were added to the buffer.
    Bytes,
    /// The upstream closed the connection.
    Closed,
}

impl Conn {
    fn new(tcp: TcpStream) -> Box<Conn> {
        Box::new(Conn {
            tcp,
            buf: BytesMut::new(),
            wrote: false,
            answered: false,
            streamed: false,
        })
    }

    /// Writes a request: its head and body, in one write when the body is small (the head was
    /// given room for it, [`BODY_WITH_HEAD`]). [`Conn::wrote`] says afterwards whether any of it
    /// went out, so a failure can tell a request never sent from one that was.
    pub(super) async fn write(&mut self, mut head: Vec<u8>, body: &[u8]) -> std::io::Result<()> {
        self.answered = false;
        self.wrote = false;
        if body.len() <= BODY_WITH_HEAD {
            head.extend_from_slice(body);
            return self.write_all(&head).await;
        }
        self.write_all(&head).await?;
        self.write_all(body).await
    }

    /// `write_all`, noting the first byte written.
    async fn write_all(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            match self.tcp.write(bytes).await? {
                0 => return Err(ErrorKind::WriteZero.into()),
                n => {
                    self.wrote = true;
                    bytes = &bytes[n..];
                }
            }
        }
        Ok(())
    }

    /// Reads what the socket has into the buffer, waiting for it. (Through `AsyncRead`, which
    /// takes a read shorter than the buffer as the socket drained: the next read waits for the
    /// reactor instead of costing a system call that would only say "try again".)
    pub(super) fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<Read>> {
        if self.buf.capacity() - self.buf.len() < READ_CHUNK / 4 {
            self.buf.reserve(READ_CHUNK);
        }
        let read = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.tcp),
            cx,
            &mut self.buf
        ));
        Poll::Ready(match read {
            Ok(0) => Ok(Read::Closed),
            Ok(_) => {
                self.answered = true;
                Ok(Read::Bytes)
            }
            Err(e) => Err(e),
        })
    }

    /// Whether the connection can carry a new request: nothing unread is buffered and the
    /// socket has neither data nor an end of file waiting (as far as the reactor has seen).
    fn still_open(&mut self) -> bool {
        let mut probe = [0u8; 1];
        self.buf.is_empty()
            && matches!(self.tcp.try_read(&mut probe), Err(e) if e.kind() == ErrorKind::WouldBlock)
    }

    /// [`Conn::still_open`], asking the socket itself (one `recv` with `MSG_PEEK`): the reactor
    /// learns of an end of file only when it next polls, and a busy runtime polls late.
    fn surely_open(&mut self) -> bool {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        self.still_open()
            && matches!(
                socket2::SockRef::from(&self.tcp).peek(&mut probe),
                Err(e) if e.kind() == ErrorKind::WouldBlock
            )
    }
}

struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

/// An upstream address with its pool of idle connections.
pub(crate) struct Endpoint {
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
    pub(crate) fn parse(address: &str) -> Result<Endpoint, UpstreamError> {
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
    pub(crate) fn address(&self) -> &str {
        &self.address
    }

    pub(super) fn host_header(&self) -> &HeaderValue {
        &self.host_header
    }

    #[cfg(test)]
    /// Connections opened so far.
    pub(crate) fn connects(&self) -> u64 {
        self.connects.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    /// Requests sent again on a fresh connection after a pooled one turned out stale.
    pub(crate) fn stale_resends(&self) -> u64 {
        self.stale_resends.load(Ordering::Relaxed)
    }

    pub(super) fn count_stale_resend(&self) {
        self.stale_resends.fetch_add(1, Ordering::Relaxed);
    }

    #[cfg(test)]
    /// Idle connections in the pool now.
    pub(crate) fn idle_count(&self) -> usize {
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
        Ok(Conn::new(tcp))
    }

    /// The most recently used idle connection that is still open, if any. Each one is tried
    /// first: a connection the upstream closed while it sat idle reads its end of file here and
    /// is dropped, so a request is not written into it. A connection whose last response was a
    /// stream waits [`STREAM_SETTLE`] before it is taken, and then the socket itself is asked
    /// ([`Conn::surely_open`]): llama.cpp's server closes its connection after every stream,
    /// reading a request that arrived first and dropping it unanswered, which on the wire is an
    /// engine that took the request and died (measured: 7 % of back-to-back streams through a
    /// busy gateway met it, and none of them had run). Such a request could not be sent again,
    /// so the one taken next opens a fresh connection instead.
    pub(super) fn checkout(&self) -> Option<Box<Conn>> {
        let now = Instant::now();
        let mut idle = self.lock();
        let mut i = idle.len();
        while i > 0 {
            i -= 1;
            let entry = &mut idle[i];
            let age = now.saturating_duration_since(entry.since);
            let usable = if age > IDLE_TIMEOUT {
                false
            } else if entry.conn.streamed {
                if age < STREAM_SETTLE {
                    // Not yet: its upstream may still be closing it.
                    continue;
                }
                entry.conn.surely_open()
            } else {
                entry.conn.still_open()
            };
            let entry = idle.remove(i);
            if usable {
                return Some(entry.conn);
            }
        }
        None
    }

    /// Takes back a connection whose exchange ended cleanly, when it can carry another request.
    pub(super) fn checkin(&self, mut conn: Box<Conn>) {
        if !conn.still_open() {
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
