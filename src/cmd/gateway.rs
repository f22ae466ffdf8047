//! Reads a running `headroom serve` or `headroom up` gateway's admin documents: its lanes
//! (`GET /admin/lanes`, for `top`) and its box (`GET /admin/box`, the pool `up` measures, for
//! `top`, `bench` and `soak` where there is no NVML). A plain HTTP/1.0 GET over a TCP socket with
//! short timeouts: the admin endpoints listen on loopback and answer small JSON documents, so no
//! HTTP client library is pulled in for them (and the pool reader runs on a plain thread).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use headroom_top::{Lane, parse_lanes};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
const IO_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_REPLY_BYTES: u64 = 1 << 20;

/// A validated gateway address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gateway {
    /// `host:port` as given.
    authority: String,
    /// Path prefix without a trailing slash (empty for the root).
    base_path: String,
    /// Sent as `Authorization: Bearer KEY` (a gateway off loopback requires one).
    api_key: Option<String>,
}

impl Gateway {
    /// Accepts `http://host:port[/prefix]` given as `--gateway`; `host:port` alone means http.
    pub fn parse(url: &str) -> Result<Self, String> {
        Self::parse_flag("--gateway", url)
    }

    /// [`Gateway::parse`] for a URL given as `flag` (named in the errors).
    pub fn parse_flag(flag: &str, url: &str) -> Result<Self, String> {
        let rest = if let Some(rest) = url.strip_prefix("http://") {
            rest
        } else if url.starts_with("https://") {
            return Err(format!(
                "{flag} {url}: https is not supported; the admin endpoint of headroom serve is plain http on loopback"
            ));
        } else if url.contains("://") {
            return Err(format!("{flag} {url}: only http:// URLs are supported"));
        } else {
            url
        };
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(format!("{flag} {url}: no host"));
        }
        let authority = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        Ok(Gateway {
            authority,
            base_path: path.trim_end_matches('/').to_string(),
            api_key: None,
        })
    }

    /// Sends `key` with every request. A key with control characters or spaces is refused (it
    /// could not be a header value, and would let text into the request head).
    pub fn with_api_key(mut self, key: Option<&str>) -> Result<Self, String> {
        if let Some(k) = key {
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(
                    "--api-key must be printable ASCII without spaces (as the gateway's api_keys are)"
                        .to_string(),
                );
            }
            self.api_key = Some(k.to_string());
        }
        Ok(self)
    }

    /// The URL of the lanes document, for messages.
    pub fn lanes_url(&self) -> String {
        format!("http://{}{}/admin/lanes", self.authority, self.base_path)
    }

    /// Fetches and parses the lanes. Errors are one line, naming the URL.
    pub fn fetch_lanes(&self) -> Result<Vec<Lane>, String> {
        let url = self.lanes_url();
        let body = self
            .get("/admin/lanes")
            .map_err(|e| format!("{url}: {e}"))?;
        parse_lanes(&body).map_err(|e| format!("{url}: {e}"))
    }

    /// The URL of the box document, for messages.
    pub fn box_url(&self) -> String {
        format!("http://{}{}/admin/box", self.authority, self.base_path)
    }

    /// The pool of the `headroom up` behind this gateway, read from `/admin/box` every `every`
    /// on a thread of its own. Fails (one line, naming the URL) when there is none: a plain
    /// `serve` answers 404 there.
    pub fn box_pool(&self, every: Duration) -> Result<headroom_gpu::RemotePool, String> {
        let url = self.box_url();
        let gateway = self.clone();
        headroom_gpu::RemotePool::start(move || gateway.get("/admin/box"), every)
            .map_err(|e| format!("{url}: {e}"))
    }

    fn get(&self, path: &str) -> Result<String, String> {
        let addr = self
            .authority
            .to_socket_addrs()
            .map_err(|e| e.to_string())?
            .next()
            .ok_or_else(|| "host has no address".to_string())?;
        let mut stream =
            TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| e.to_string())?;
        stream
            .set_read_timeout(Some(IO_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(IO_TIMEOUT)))
            .map_err(|e| e.to_string())?;
        let host = self.authority.as_str();
        let auth = self
            .api_key
            .as_ref()
            .map(|k| format!("Authorization: Bearer {k}\r\n"))
            .unwrap_or_default();
        let request = format!(
            "GET {}{path} HTTP/1.0\r\nHost: {host}\r\nAccept: application/json\r\nUser-Agent: headroom-top\r\n{auth}\r\n",
            self.base_path
        );
        stream
            .write_all(request.as_bytes())
            .map_err(|e| e.to_string())?;
        let mut reply = Vec::new();
        stream
            .take(MAX_REPLY_BYTES)
            .read_to_end(&mut reply)
            .map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&reply);
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| "reply is not HTTP".to_string())?;
        let status = head
            .lines()
            .next()
            .and_then(|line| line.split_whitespace().nth(1))
            .and_then(|code| code.parse::<u16>().ok())
            .ok_or_else(|| "reply has no HTTP status".to_string())?;
        if status == 401 {
            return Err(if self.api_key.is_some() {
                "HTTP 401: the gateway refused the API key".to_string()
            } else {
                "HTTP 401: the gateway requires an API key (--api-key or HEADROOM_API_KEY)"
                    .to_string()
            });
        }
        if status != 200 {
            return Err(format!("HTTP {status}"));
        }
        Ok(body.to_string())
    }
}
