//! HTTP/1.1 on the wire for the upstream client, without I/O: the request head written in one
//! buffer, the response head parsed with `httparse` (the parser hyper itself uses), the body's
//! framing chosen as RFC 9112 section 6.3 orders it, and a decoder that hands out body bytes as
//! they arrive (a chunked SSE stream is passed on event by event, not reassembled).
//!
//! Hand-written rather than hyper's client connection because the proxied path's cost was in
//! that state machine (a quarter of the gateway's CPU per request at full speed); everything here
//! is bounded: a response head of at most [`MAX_HEAD_BYTES`] and [`MAX_HEADERS`] fields, chunk
//! size lines and trailers of at most [`MAX_HEAD_BYTES`].

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use bytes::{Buf, Bytes, BytesMut};

/// Largest response head (status line and fields) read; larger is a protocol error.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields a response head may carry.
pub(crate) const MAX_HEADERS: usize = 128;

/// A response the upstream sent that HTTP/1.1 does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub &'static str);

/// The head of a request: request line, `host`, the forwarded header block (lines written by
/// [`header_line`]) and the body's length.
pub(crate) fn request_head(
    path: &str,
    query: Option<&str>,
    host: &HeaderValue,
    header_block: &[u8],
    body_len: usize,
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(b"POST ");
    out.extend_from_slice(path.as_bytes());
    if let Some(q) = query {
        out.push(b'?');
        out.extend_from_slice(q.as_bytes());
    }
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(host.as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(header_block);
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body_len).as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
}

/// One header field as a request head carries it (`HeaderValue` holds no CR or LF).
pub(crate) fn header_line(name: &str, value: &HeaderValue, out: &mut Vec<u8>) {
    field_line(name.as_bytes(), value.as_bytes(), out);
}

/// The elements of a field value that is a comma-separated list (RFC 9110 section 5.6.1), each
/// without the whitespace around it; empty elements are skipped.
pub(crate) fn list_tokens(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value
        .split(|b| *b == b',')
        .map(<[u8]>::trim_ascii)
        .filter(|t| !t.is_empty())
}

/// Whether a query string may go into a request line as it is (visible ASCII, no `#`).
pub(crate) fn valid_query(q: &str) -> bool {
    q.bytes().all(|b| b.is_ascii_graphic() && b != b'#')
}

/// How the response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `Content-Length` bytes (0 for 1xx/204/304).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
    /// Until the upstream closes the connection.
    Close,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    /// The end-to-end fields, for the client: the hop-by-hop ones (RFC 9110 section 7.6.1, and
    /// those `Connection` lists) and the framing (`content-length`, `transfer-encoding`) are
    /// this connection's and were consumed here.
    pub forwarded: Forwarded,
    pub framing: Framing,
    /// The connection may carry another request once this body has ended.
    pub keep_alive: bool,
}

/// The end-to-end fields of a response head as the upstream wrote them, one `name: value\r\n`
/// line each, in its order (names in the upstream's case, as nginx passes them), then the lines
/// the gateway adds for every response ([`Forwarded::add`]). Kept as bytes rather than a
/// `HeaderMap`: the fast path writes them to the client as they are, so no name is looked up and
/// no map is built and dropped per response; hyper's path makes a map of them
/// ([`Forwarded::into_map`]). `httparse` admits exactly the names and values `HeaderName` and
/// `HeaderValue` do (tokens; tab, visible ASCII, space and obs-text).
#[derive(Debug, Clone, Default)]
pub struct Forwarded {
    lines: Vec<u8>,
    /// Where the gateway's lines begin (the upstream's come before).
    own_at: usize,
    /// The first `content-type` names an event stream.
    event_stream: bool,
    /// A `date` field is among the lines.
    date: bool,
    /// A field the gateway also sets on responses is among the upstream's ([`set_by_gateway`]):
    /// the gateway's value replaces it.
    shadowed: bool,
}

/// Room left after the upstream's lines for the gateway's own.
const OWN_LINES: usize = 64;

impl Forwarded {
    /// Whether the body is a server-sent event stream (`content-type: text/event-stream`).
    pub fn is_event_stream(&self) -> bool {
        self.event_stream
    }

    /// Whether the upstream sent a `date`.
    pub fn has_date(&self) -> bool {
        self.date
    }

    /// The value of the upstream's first field `name` (any case), as it sent it.
    pub fn upstream_field(&self, name: &[u8]) -> Option<&[u8]> {
        let (mut upstream, _) = self.split();
        upstream
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    }

    /// Adds one of the gateway's own fields (a name no other line of the gateway's has); it
    /// replaces an upstream field of the same name.
    pub fn add(&mut self, name: &'static str, value: &[u8]) {
        field_line(name.as_bytes(), value, &mut self.lines);
    }

    /// The upstream's fields and the gateway's, each as its name and value.
    fn split(&self) -> (Lines<'_>, Lines<'_>) {
        let (upstream, own) = self.lines.split_at(self.own_at);
        (Lines(upstream), Lines(own))
    }

    /// Whether the upstream's field `name` gives way to one of the gateway's, in `own` or
    /// `map`. Only an upstream that sent a field of a name the gateway sets needs the look.
    fn replaced(&self, name: &[u8], mut own: Lines<'_>, map: &HeaderMap) -> bool {
        self.shadowed
            && (own.any(|(n, _)| n.eq_ignore_ascii_case(name))
                || map.contains_key(std::str::from_utf8(name).unwrap_or("")))
    }

    /// Writes the lines into a response head whose other fields are `map`'s.
    pub fn write(&self, map: &HeaderMap, out: &mut Vec<u8>) {
        if !self.shadowed {
            out.extend_from_slice(&self.lines);
            return;
        }
        let (upstream, own) = self.split();
        for (name, value) in upstream {
            if !self.replaced(name, own, map) {
                field_line(name, value, out);
            }
        }
        out.extend_from_slice(own.0);
    }

    /// The fields as a map, followed by `map`'s (whose fields replace those of the same name).
    pub fn into_map(self, map: HeaderMap) -> HeaderMap {
        if self.lines.is_empty() {
            return map;
        }
        let mut out = HeaderMap::with_capacity(map.len() + 8);
        let (upstream, own) = self.split();
        // Checked when the head was parsed (and the gateway's are its own): neither conversion
        // fails.
        let field = |(name, value): (&[u8], &[u8])| {
            Some((
                HeaderName::from_bytes(name).ok()?,
                HeaderValue::from_bytes(value).ok()?,
            ))
        };
        for (name, value) in upstream.filter_map(field) {
            if !self.replaced(name.as_str().as_bytes(), own, &map) {
                out.append(name, value);
            }
        }
        for (name, value) in own.filter_map(field) {
            out.insert(name, value);
        }
        out.extend(map);
        out
    }
}

/// Field lines (`name: value\r\n`, as [`field_line`] writes them), each as its name and value.
#[derive(Clone, Copy)]
struct Lines<'a>(&'a [u8]);

impl<'a> Iterator for Lines<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let colon = self.0.iter().position(|&b| b == b':')?;
        let eol = self.0.iter().position(|&b| b == b'\r')?;
        let field = (&self.0[..colon], &self.0[colon + 2..eol]);
        self.0 = &self.0[eol + 2..];
        Some(field)
    }
}

/// Fields the gateway sets on the responses it passes on: its own `x-headroom-*` ones and the
/// ORCA load report. An upstream's field of such a name gives way to the gateway's.
fn set_by_gateway(name: &[u8]) -> bool {
    const OWN: &[u8] = crate::headers::OWN_PREFIX.as_bytes();
    name.get(..OWN.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(OWN))
        || name.eq_ignore_ascii_case(crate::headers::ORCA.as_bytes())
}

/// One field as a head carries it.
fn field_line(name: &[u8], value: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Header fields that belong to one connection (RFC 9110 section 7.6.1, and the older ones
/// proxies still meet), and `expect`: none crosses the gateway in either direction.
const HOP_BY_HOP: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "expect",
];

/// Whether a field named in lower case is one of [`HOP_BY_HOP`].
pub(crate) fn hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.contains(&name)
}

/// What a response field is to this connection, by its name in any case.
#[derive(PartialEq, Eq)]
enum Field {
    ContentLength,
    TransferEncoding,
    Connection,
    /// Another of [`HOP_BY_HOP`].
    OtherHop,
    EndToEnd,
}

impl Field {
    fn of(name: &str) -> Field {
        let is = |known: &str| name.eq_ignore_ascii_case(known);
        // By length first: most fields are compared with nothing.
        match name.len() {
            14 if is("content-length") => Field::ContentLength,
            17 if is("transfer-encoding") => Field::TransferEncoding,
            10 if is("connection") => Field::Connection,
            2 | 6..=8 | 10 | 16..=19 if HOP_BY_HOP.iter().any(|h| is(h)) => Field::OtherHop,
            _ => Field::EndToEnd,
        }
    }
}

/// What the connection-level fields of a head said, gathered while the others are kept.
#[derive(Default)]
struct Hop {
    /// A `transfer-encoding` field was present, and whether its last coding is `chunked`.
    transfer_encoding: Option<bool>,
    /// The one `content-length` (or why there is none that can be used).
    length: Option<Result<u64, Malformed>>,
    close: bool,
    keep_alive: bool,
    /// Other fields `connection` names (dropped at the end of the head).
    listed: Vec<String>,
}

impl Hop {
    /// Takes a connection-level field (its name in any case); `false` for an end-to-end one.
    fn take(&mut self, name: &str, value: &[u8]) -> bool {
        match Field::of(name) {
            Field::ContentLength => {
                self.length = Some(match self.length.take() {
                    Some(Err(e)) => Err(e),
                    earlier => content_length(value, earlier.and_then(Result::ok)),
                });
            }
            Field::TransferEncoding => {
                if let Some(last) = list_tokens(value).last() {
                    self.transfer_encoding = Some(last.eq_ignore_ascii_case(b"chunked"));
                } else {
                    self.transfer_encoding.get_or_insert(false);
                }
            }
            Field::Connection => {
                for token in list_tokens(value) {
                    if token.eq_ignore_ascii_case(b"close") {
                        self.close = true;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        self.keep_alive = true;
                    } else {
                        self.listed
                            .push(String::from_utf8_lossy(token).to_ascii_lowercase());
                    }
                }
            }
            Field::OtherHop => {}
            Field::EndToEnd => return false,
        }
        true
    }

    /// The body's framing (RFC 9112 section 6.3): none for 204/304, chunked when it is the last
    /// transfer coding, until close for any other transfer coding, else the one `content-length`
    /// (several that disagree, or one that is not a number, are an error), else until close.
    fn framing(&mut self, status: StatusCode) -> Result<Framing, Malformed> {
        if status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
            return Ok(Framing::Length(0));
        }
        match self.transfer_encoding {
            Some(true) => return Ok(Framing::Chunked),
            Some(false) => return Ok(Framing::Close),
            None => {}
        }
        match self.length.take() {
            Some(Ok(n)) => Ok(Framing::Length(n)),
            Some(Err(e)) => Err(e),
            None => Ok(Framing::Close),
        }
    }
}

/// A `content-length` value (a list of equal numbers is one), checked against an earlier one.
fn content_length(value: &[u8], earlier: Option<u64>) -> Result<u64, Malformed> {
    let invalid = Malformed("the upstream sent an invalid content-length");
    let mut length = earlier;
    for part in value.split(|&b| b == b',') {
        let part = part.trim_ascii();
        if part.is_empty() || !part.iter().all(u8::is_ascii_digit) {
            return Err(invalid);
        }
        let n = part.iter().try_fold(0u64, |n, &d| {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        });
        let n = n.ok_or(invalid.clone())?;
        if length.is_some_and(|l| l != n) {
            return Err(Malformed("the upstream sent conflicting content-lengths"));
        }
        length = Some(n);
    }
    length.ok_or(invalid)
}

/// Parses a response head from the start of `buf`, taking it out of `buf` when complete.
/// `Ok(None)`: more bytes are needed. Interim (1xx) responses are skipped.
pub fn parse_head(buf: &mut BytesMut) -> Result<Option<Head>, Malformed> {
    loop {
        // Uninitialised slots: a zeroed array of MAX_HEADERS fields per response costs more
        // than parsing a short head.
        let mut fields = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut []);
        let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut response,
            buf,
            &mut fields,
        );
        let consumed = match parsed {
            Ok(httparse::Status::Complete(n)) => n,
            Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                return Err(Malformed("the upstream's response head is too large"));
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(Malformed(
                    "the upstream's response has too many header fields",
                ));
            }
            Err(_) => return Err(Malformed("the upstream sent a malformed response head")),
        };
        let code = response.code.unwrap_or(0);
        let status = StatusCode::from_u16(code)
            .map_err(|_| Malformed("the upstream sent an invalid status code"))?;
        if status == StatusCode::SWITCHING_PROTOCOLS {
            return Err(Malformed("the upstream switched protocols unasked"));
        }
        if status.is_informational() {
            buf.advance(consumed);
            continue;
        }
        let mut hop = Hop::default();
        // Which fields are end-to-end (a bit each: at most MAX_HEADERS = 128 of them), known
        // only once `connection` has been read, wherever it stands.
        let mut kept = 0u128;
        for (i, f) in response.headers.iter().enumerate() {
            if f.name.is_empty() {
                return Err(Malformed("the upstream sent an invalid header name"));
            }
            if !hop.take(f.name, f.value) {
                kept |= 1 << i;
            }
        }
        let framing = hop.framing(status)?;
        let http11 = response.version == Some(1);
        let keep_alive =
            framing != Framing::Close && if http11 { !hop.close } else { hop.keep_alive };
        let forwarded = forwarded(response.headers, kept, &hop.listed, consumed);
        buf.advance(consumed);
        return Ok(Some(Head {
            status,
            forwarded,
            framing,
            keep_alive,
        }));
    }
}

/// The end-to-end fields (`kept`, a bit per field) as lines, less those `connection` listed.
fn forwarded(
    fields: &[httparse::Header<'_>],
    kept: u128,
    listed: &[String],
    head_len: usize,
) -> Forwarded {
    let mut out = Forwarded::default();
    if kept == 0 {
        return out;
    }
    let mut lines = Vec::with_capacity(head_len + OWN_LINES);
    let mut content_type = false;
    for (i, f) in fields.iter().enumerate() {
        if kept & (1 << i) == 0 || listed.iter().any(|l| f.name.eq_ignore_ascii_case(l)) {
            continue;
        }
        let name = f.name.as_bytes();
        if !content_type && name.eq_ignore_ascii_case(b"content-type") {
            content_type = true;
            const SSE: &[u8] = b"text/event-stream";
            out.event_stream = f
                .value
                .get(..SSE.len())
                .is_some_and(|v| v.eq_ignore_ascii_case(SSE));
        }
        out.date |= name.eq_ignore_ascii_case(b"date");
        out.shadowed |= set_by_gateway(name);
        field_line(name, f.value, &mut lines);
    }
    out.own_at = lines.len();
    out.lines = lines;
    out
}

/// Where a body decoder is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// This many bytes of a sized body (or of the current chunk) are still to come.
    Data {
        left: u64,
        chunked: bool,
    },
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// A chunk-size line.
    ChunkSize,
    /// Trailer fields after the last chunk, up to the empty line.
    Trailers {
        read: usize,
    },
    /// Bytes until the connection closes.
    UntilClose,
    Done,
}

/// What the decoder made of the bytes it has.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Body bytes to pass on.
    Data(Bytes),
    /// More bytes must be read first.
    NeedMore,
    /// The body has ended.
    End,
}

/// Takes body bytes out of a connection's read buffer according to the framing.
#[derive(Debug)]
pub struct Decoder {
    state: State,
}

impl Decoder {
    pub fn new(framing: Framing) -> Decoder {
        let state = match framing {
            Framing::Length(0) => State::Done,
            Framing::Length(n) => State::Data {
                left: n,
                chunked: false,
            },
            Framing::Chunked => State::ChunkSize,
            Framing::Close => State::UntilClose,
        };
        Decoder { state }
    }

    /// Whether the body has been read to its end.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The next step over what `buf` holds (taking what it uses out of it).
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, Malformed> {
        self.run(buf, true)
    }

    /// Moves past what follows a chunk's data when it is already buffered (its CRLF, the last
    /// chunk, the trailers), so a body whose end has arrived reports it without another read;
    /// stops where data begins.
    pub fn settle(&mut self, buf: &mut BytesMut) -> Result<(), Malformed> {
        self.run(buf, false).map(|_| ())
    }

    fn run(&mut self, buf: &mut BytesMut, take_data: bool) -> Result<Step, Malformed> {
        loop {
            match self.state {
                State::Done => return Ok(Step::End),
                State::UntilClose | State::Data { .. } if !take_data => {
                    return Ok(Step::NeedMore);
                }
                State::UntilClose => {
                    if buf.is_empty() {
                        return Ok(Step::NeedMore);
                    }
                    return Ok(Step::Data(buf.split().freeze()));
                }
                State::Data { left, chunked } => {
                    if buf.is_empty() {
                        return Ok(Step::NeedMore);
                    }
                    let n = (buf.len() as u64).min(left) as usize;
                    let data = buf.split_to(n).freeze();
                    let left = left - n as u64;
                    self.state = match (left, chunked) {
                        (0, false) => State::Done,
                        (0, true) => State::ChunkEnd,
                        (left, chunked) => State::Data { left, chunked },
                    };
                    return Ok(Step::Data(data));
                }
                State::ChunkEnd => {
                    if buf.len() < 2 {
                        return Ok(Step::NeedMore);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(Malformed("the upstream's chunk did not end with CRLF"));
                    }
                    buf.advance(2);
                    self.state = State::ChunkSize;
                }
                State::ChunkSize => match httparse::parse_chunk_size(buf) {
                    Ok(httparse::Status::Complete((used, size))) => {
                        buf.advance(used);
                        self.state = if size == 0 {
                            State::Trailers { read: 0 }
                        } else {
                            State::Data {
                                left: size,
                                chunked: true,
                            }
                        };
                    }
                    Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                        return Err(Malformed("the upstream's chunk-size line is too long"));
                    }
                    Ok(httparse::Status::Partial) => return Ok(Step::NeedMore),
                    Err(_) => return Err(Malformed("the upstream sent an invalid chunk size")),
                },
                State::Trailers { read } => {
                    let Some(eol) = buf.windows(2).position(|w| w == b"\r\n") else {
                        if read + buf.len() >= MAX_HEAD_BYTES {
                            return Err(Malformed("the upstream's trailers are too large"));
                        }
                        return Ok(Step::NeedMore);
                    };
                    buf.advance(eol + 2);
                    self.state = if eol == 0 {
                        State::Done
                    } else if read + eol + 2 >= MAX_HEAD_BYTES {
                        return Err(Malformed("the upstream's trailers are too large"));
                    } else {
                        State::Trailers {
                            read: read + eol + 2,
                        }
                    };
                }
            }
        }
    }

    /// Whether the end of the connection's bytes is the end of this body (a close-delimited one).
    pub fn ends_at_close(&self) -> bool {
        self.state == State::UntilClose
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(text: &str) -> Result<Option<Head>, Malformed> {
        parse_head(&mut BytesMut::from(text.as_bytes()))
    }

    fn fields(head: Head) -> HeaderMap {
        head.forwarded.into_map(HeaderMap::new())
    }

    #[test]
    fn the_fields_kept_become_a_map_in_order_and_the_gateways_own_replace_theirs() {
        let mut h = head(
            "HTTP/1.1 200 OK\r\nX-A: 1\r\nSet-Cookie: a=1\r\nX-Headroom-Lane: up\r\n\
             Set-Cookie: b=2\r\nEndpoint-Load-Metrics: up\r\nX-Value: a: b\r\n\
             Content-Length: 0\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        h.forwarded.add("x-headroom-lane", b"text");
        let mut own = HeaderMap::new();
        own.insert("endpoint-load-metrics", HeaderValue::from_static("gw"));
        let map = h.forwarded.into_map(own);
        let pairs: Vec<(&str, &[u8])> = map
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("x-a", &b"1"[..]),
                ("set-cookie", b"a=1"),
                ("set-cookie", b"b=2"),
                ("x-value", b"a: b"),
                ("x-headroom-lane", b"text"),
                ("endpoint-load-metrics", b"gw"),
            ]
        );
        assert!(
            head("HTTP/1.1 200 OK\r\nX-A: a\x7fb\r\n\r\n").is_err(),
            "DEL in a value"
        );
    }

    fn body(framing: Framing, wire: &[u8], piece: usize) -> Result<Vec<u8>, Malformed> {
        let mut d = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match d.step(&mut buf)? {
                Step::Data(b) => out.extend_from_slice(&b),
                Step::End => return Ok(out),
                Step::NeedMore if fed >= wire.len() => return Err(Malformed("ran out")),
                Step::NeedMore => {
                    let end = (fed + piece).min(wire.len());
                    buf.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
            }
        }
    }

    #[test]
    fn a_head_is_parsed_and_taken_out_of_the_buffer() {
        let mut buf =
            BytesMut::from(&b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b\r\n\r\nok"[..]);
        let h = parse_head(&mut buf).unwrap().unwrap();
        assert_eq!(h.status, 200);
        assert_eq!(h.framing, Framing::Length(2));
        assert!(h.keep_alive);
        assert_eq!(fields(h)["x-a"], "b");
        assert_eq!(&buf[..], b"ok");
    }

    #[test]
    fn connection_level_fields_are_consumed_and_the_rest_kept() {
        let h = head(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\n\
             Transfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\nServer: e\r\n\r\n",
        )
        .unwrap()
        .unwrap();
        assert_eq!(h.framing, Framing::Chunked);
        assert!(h.keep_alive && h.forwarded.is_event_stream());
        let map = fields(h);
        let mut names: Vec<&str> = map.keys().map(|k| k.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-type", "server"]);
        let h = head("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nDate: d\r\n\r\nok")
            .unwrap()
            .unwrap();
        assert!(h.forwarded.has_date() && !h.forwarded.is_event_stream());
        let map = fields(h);
        assert!(!map.contains_key("content-length") && map.contains_key("date"));
    }

    #[test]
    fn a_partial_head_asks_for_more_and_a_huge_one_is_refused() {
        assert!(head("HTTP/1.1 200 OK\r\nContent-Le").unwrap().is_none());
        let huge = format!("HTTP/1.1 200 OK\r\nX: {}", "a".repeat(MAX_HEAD_BYTES));
        assert!(head(&huge).is_err());
        let many: String = (0..MAX_HEADERS + 1)
            .map(|i| format!("x{i}: v\r\n"))
            .collect();
        assert!(head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).is_err());
    }

    #[test]
    fn interim_responses_are_skipped() {
        let h =
            head("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
                .unwrap()
                .unwrap();
        assert_eq!(h.status, 201);
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let f = |t: &str| head(t).unwrap().unwrap().framing;
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n"),
            Framing::Chunked
        );
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n"),
            Framing::Close
        );
        assert_eq!(
            f("HTTP/1.1 204 No Content\r\nContent-Length: 9\r\n\r\n"),
            Framing::Length(0)
        );
        assert_eq!(f("HTTP/1.1 200 OK\r\n\r\n"), Framing::Close);
        assert_eq!(
            f("HTTP/1.1 200 OK\r\nContent-Length: 3, 3\r\n\r\n"),
            Framing::Length(3)
        );
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n").is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n").is_err());
        assert!(head("HTTP/1.1 200 OK\r\nContent-Length: +1\r\n\r\n").is_err());
    }

    #[test]
    fn keep_alive_follows_the_version_and_connection_header() {
        let k = |t: &str| head(t).unwrap().unwrap().keep_alive;
        assert!(!k(
            "HTTP/1.1 200 OK\r\nConnection: Close\r\nContent-Length: 0\r\n\r\n"
        ));
        assert!(!k("HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n"));
        assert!(k(
            "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 0\r\n\r\n"
        ));
        assert!(
            !k("HTTP/1.1 200 OK\r\n\r\n"),
            "a body until close ends the connection"
        );
    }

    #[test]
    fn bodies_decode_whatever_the_reads_split_them_into() {
        let chunked = b"6\r\ndata: \r\n8;ext=1\r\n[DONE]\n\n\r\n0\r\nX-T: 1\r\n\r\n";
        for piece in [1, 2, 3, 7, 100] {
            assert_eq!(
                body(Framing::Chunked, chunked, piece).unwrap(),
                b"data: [DONE]\n\n",
                "pieces of {piece}"
            );
            assert_eq!(body(Framing::Length(5), b"hello", piece).unwrap(), b"hello");
        }
        assert!(body(Framing::Chunked, b"zz\r\n", 10).is_err());
        assert!(body(Framing::Chunked, b"2\r\nabXX0\r\n\r\n", 10).is_err());
    }

    #[test]
    fn settle_reaches_the_end_of_a_buffered_chunked_body() {
        let mut d = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"2\r\nok\r\n0\r\n\r\n"[..]);
        assert_eq!(
            d.step(&mut buf).unwrap(),
            Step::Data(Bytes::from_static(b"ok"))
        );
        assert!(!d.is_done());
        d.settle(&mut buf).unwrap();
        assert!(d.is_done() && buf.is_empty());
        // A next chunk that has begun is left for the next step.
        let mut d = Decoder::new(Framing::Chunked);
        let mut buf = BytesMut::from(&b"2\r\nok\r\n3\r\nab"[..]);
        let _ = d.step(&mut buf).unwrap();
        d.settle(&mut buf).unwrap();
        assert_eq!(
            d.step(&mut buf).unwrap(),
            Step::Data(Bytes::from_static(b"ab"))
        );
    }

    #[test]
    fn the_request_head_names_host_and_length() {
        let mut block = Vec::new();
        header_line(
            "content-type",
            &HeaderValue::from_static("application/json"),
            &mut block,
        );
        let mut out = Vec::new();
        request_head(
            "/v1/chat/completions",
            Some("a=1"),
            &HeaderValue::from_static("127.0.0.1:8000"),
            &block,
            12,
            &mut out,
        );
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "POST /v1/chat/completions?a=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n\
             content-type: application/json\r\ncontent-length: 12\r\n\r\n"
        );
        assert!(valid_query("a=1&b=%20"));
        assert!(!valid_query("a=1 HTTP/1.1\r\nx: y"));
    }
}
