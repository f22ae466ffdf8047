//! Requests to the Hub: the revision's file list, whole small files, and the first bytes of a
//! safetensors shard by HTTP range. Redirects are followed here (at most [`MAX_REDIRECTS`]) so the
//! Hub's own headers (`X-Repo-Commit`, `X-Linked-Etag`, `ETag`) are read from its first answer,
//! not from the CDN's, and the token goes only to the Hub's host. A server that ignores the range
//! and sends the whole shard is read only as far as the header, then dropped. hyper with rustls
//! (ring, the system's roots); every wait is bounded by the configured timeout.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, HeaderMap, LOCATION, RANGE, USER_AGENT};
use hyper::{Request, Response, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::{FIRST_RANGE_BYTES, HubConfig, HubError};

/// Redirects followed per request.
pub const MAX_REDIRECTS: usize = 5;

/// Largest config.json or index accepted.
const MAX_SMALL_FILE: usize = 32 << 20;

pub struct Hub {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Empty<Bytes>>,
    endpoint: Uri,
    token: Option<String>,
    repo: String,
    timeout: Duration,
}

/// The revision: its commit and its files.
pub struct RevisionInfo {
    pub commit: String,
    pub files: Vec<String>,
}

/// A file's bytes (or a header's) and the blob name the cache keeps it under.
pub struct Got {
    pub etag: String,
    pub bytes: Vec<u8>,
}

/// The Hub's headers of a file, read from its first answer.
#[derive(Default)]
struct Meta {
    etag: Option<String>,
}

/// `W/"abc"` → `abc`, as huggingface_hub normalizes an etag.
fn normalize_etag(raw: &str) -> String {
    raw.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .filter(|v| !v.is_empty())
}

/// TLS settings: ring, and the system's certificate store (none found: https fails with a
/// certificate error naming the URL, plain http still works).
fn tls_config() -> rustls::ClientConfig {
    // ring rather than aws-lc-rs: no cmake/C build on a 2-core CI; its lack of post-quantum key
    // exchange, the deprecation's reason, does not matter for reading public headers.
    #[allow(deprecated)]
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
    let mut roots = rustls::RootCertStore::empty();
    // Certificates that fail to load one by one are skipped, as hyper-rustls does.
    roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
    builder.with_root_certificates(roots).with_no_client_auth()
}

impl Hub {
    pub fn new(cfg: &HubConfig, repo: &str) -> Result<Hub, HubError> {
        let endpoint: Uri =
            format!("{}/", cfg.endpoint)
                .parse()
                .map_err(|e| HubError::Malformed {
                    url: cfg.endpoint.clone(),
                    reason: format!("HF_ENDPOINT is not a URL: {e}"),
                })?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(cfg.timeout.min(Duration::from_secs(10))));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls_config())
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Hub {
            client: Client::builder(TokioExecutor::new()).build(https),
            endpoint,
            token: cfg.token.clone(),
            repo: repo.to_string(),
            timeout: cfg.timeout,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.endpoint)
    }

    /// `{endpoint}/{repo}/resolve/{rev}/{file}`.
    pub fn resolve_url(&self, revision: &str, file: &str) -> String {
        self.url(&format!("{}/resolve/{revision}/{file}", self.repo))
    }

    /// GET `url` (with `range`, inclusive), following redirects; the Hub's headers come from the
    /// first answer. Errors name the URL first asked.
    async fn get(
        &self,
        url: &str,
        range: Option<(u64, u64)>,
    ) -> Result<(Response<Incoming>, Meta), HubError> {
        let malformed = |reason: String| HubError::Malformed {
            url: url.to_string(),
            reason,
        };
        let mut current: Uri = url.parse().map_err(|e| malformed(format!("{e}")))?;
        let mut meta = Meta::default();
        for _ in 0..=MAX_REDIRECTS {
            let mut req = Request::get(current.clone())
                .header(USER_AGENT, concat!("headroom/", env!("CARGO_PKG_VERSION")));
            if let Some((from, to)) = range {
                req = req.header(RANGE, format!("bytes={from}-{to}"));
            }
            if let Some(t) = &self.token
                && same_origin(&current, &self.endpoint)
            {
                req = req.header(AUTHORIZATION, format!("Bearer {t}"));
            }
            let req = req
                .body(Empty::new())
                .map_err(|e| malformed(e.to_string()))?;
            let resp = tokio::time::timeout(self.timeout, self.client.request(req))
                .await
                .map_err(|_| HubError::Unreachable {
                    url: url.to_string(),
                    reason: format!("no answer within {} s", self.timeout.as_secs()),
                })?
                .map_err(|e| HubError::Unreachable {
                    url: url.to_string(),
                    reason: error_chain(&e),
                })?;
            let h = resp.headers();
            if meta.etag.is_none() {
                meta.etag = header(h, "x-linked-etag")
                    .or_else(|| header(h, "etag"))
                    .map(|e| normalize_etag(&e));
            }
            if resp.status().is_redirection() {
                let Some(location) = header(h, LOCATION.as_str()) else {
                    return Err(malformed(format!("{} without a Location", resp.status())));
                };
                current = join(&current, &location)
                    .ok_or_else(|| malformed(format!("bad redirect '{location}'")))?;
                continue;
            }
            self.check(url, &resp)?;
            return Ok((resp, meta));
        }
        Err(malformed(format!("more than {MAX_REDIRECTS} redirects")))
    }

    /// Turns an error status into the error that says what to do.
    fn check(&self, url: &str, resp: &Response<Incoming>) -> Result<(), HubError> {
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        let code = header(resp.headers(), "x-error-code").unwrap_or_default();
        let had_token = self.token.is_some();
        let repo = self.repo.clone();
        let url = url.to_string();
        let status = status.as_u16();
        Err(match code.as_str() {
            "GatedRepo" => HubError::Gated {
                repo,
                url,
                status,
                had_token,
            },
            "RepoNotFound" | "RevisionNotFound" => HubError::NotFound {
                repo,
                url,
                status,
                had_token,
            },
            // The Hub answers 401 for a missing, private or gated repository alike.
            _ if status == 401 || (status == 404 && code != "EntryNotFound") => {
                HubError::NotFound {
                    repo,
                    url,
                    status,
                    had_token,
                }
            }
            _ => HubError::Status { url, status },
        })
    }

    /// `/api/models/{repo}/revision/{rev}`: the commit and the files.
    pub async fn revision_info(&self, revision: &str) -> Result<RevisionInfo, HubError> {
        let url = self.url(&format!("api/models/{}/revision/{revision}", self.repo));
        let (resp, _) = self.get(&url, None).await?;
        let bytes = read_capped(&url, resp, MAX_SMALL_FILE, self.timeout).await?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| HubError::Malformed {
                url: url.clone(),
                reason: format!("not JSON: {e}"),
            })?;
        let commit = v
            .get("sha")
            .and_then(serde_json::Value::as_str)
            .filter(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric()))
            .ok_or_else(|| HubError::Malformed {
                url: url.clone(),
                reason: "no commit ('sha')".into(),
            })?
            .to_string();
        let files = v
            .get("siblings")
            .and_then(serde_json::Value::as_array)
            .map(|s| {
                s.iter()
                    .filter_map(|f| f.get("rfilename")?.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        Ok(RevisionInfo { commit, files })
    }

    /// A whole small file at `commit`.
    pub async fn whole_file(&self, commit: &str, file: &str) -> Result<Got, HubError> {
        let url = self.resolve_url(commit, file);
        let (resp, meta) = self.get(&url, None).await?;
        let bytes = read_capped(&url, resp, MAX_SMALL_FILE, self.timeout).await?;
        Ok(Got {
            etag: blob_name(&url, meta)?,
            bytes,
        })
    }

    /// The first `8 + n` bytes of a safetensors shard: its header, nothing of its tensors.
    pub async fn safetensors_header(&self, commit: &str, shard: &str) -> Result<Got, HubError> {
        let url = self.resolve_url(commit, shard);
        let (resp, meta) = self.get(&url, Some((0, FIRST_RANGE_BYTES - 1))).await?;
        let etag = blob_name(&url, meta)?;
        let mut bytes = read_prefix(&url, resp, FIRST_RANGE_BYTES, self.timeout).await?;
        if bytes.len() < 8 {
            return Err(HubError::Malformed {
                url,
                reason: format!("{} bytes: not a safetensors file", bytes.len()),
            });
        }
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        if n == 0 || n > headroom_inspect::safetensors::MAX_HEADER_BYTES {
            return Err(HubError::Malformed {
                url,
                reason: format!("header length {n}: not a safetensors file"),
            });
        }
        let want = 8 + n;
        if (bytes.len() as u64) < want {
            let from = bytes.len() as u64;
            let (rest, _) = self.get(&url, Some((from, want - 1))).await?;
            if rest.status() != StatusCode::PARTIAL_CONTENT {
                return Err(HubError::Malformed {
                    url,
                    reason: format!(
                        "asked for bytes {from}-{} and got HTTP {} instead of 206",
                        want - 1,
                        rest.status().as_u16()
                    ),
                });
            }
            bytes.extend(read_prefix(&url, rest, want - from, self.timeout).await?);
        }
        bytes.truncate(want as usize);
        if (bytes.len() as u64) < want {
            return Err(HubError::Malformed {
                url,
                reason: format!("the header declares {n} bytes; the file ends sooner"),
            });
        }
        // The header must parse as what it claims to be before it is kept.
        headroom_inspect::safetensors::read_header(&bytes[..], &url).map_err(|e| {
            HubError::Malformed {
                url: url.clone(),
                reason: e.to_string(),
            }
        })?;
        Ok(Got { etag, bytes })
    }
}

fn blob_name(url: &str, meta: Meta) -> Result<String, HubError> {
    meta.etag
        .filter(|e| !e.is_empty() && !e.contains(['/', '\\']) && e != "." && e != "..")
        .ok_or_else(|| HubError::Malformed {
            url: url.to_string(),
            reason: "no ETag to name the file by".into(),
        })
}

/// True when `a` and `b` have the same scheme, host and port.
fn same_origin(a: &Uri, b: &Uri) -> bool {
    let port = |u: &Uri| {
        u.port_u16().unwrap_or(match u.scheme_str() {
            Some("https") => 443,
            _ => 80,
        })
    };
    a.scheme_str() == b.scheme_str() && a.host() == b.host() && port(a) == port(b)
}

/// A `Location` resolved against the URL it came from (absolute, or a path on the same origin).
fn join(base: &Uri, location: &str) -> Option<Uri> {
    if location.contains("://") {
        return location.parse().ok();
    }
    if !location.starts_with('/') {
        return None;
    }
    let authority = base.authority()?;
    format!("{}://{authority}{location}", base.scheme_str()?)
        .parse()
        .ok()
}

/// The whole body, refused past `cap` bytes.
async fn read_capped(
    url: &str,
    resp: Response<Incoming>,
    cap: usize,
    timeout: Duration,
) -> Result<Vec<u8>, HubError> {
    let bytes = read_prefix(url, resp, cap as u64 + 1, timeout).await?;
    if bytes.len() > cap {
        return Err(HubError::Malformed {
            url: url.to_string(),
            reason: format!("larger than {cap} bytes"),
        });
    }
    Ok(bytes)
}

/// At most `limit` bytes of the body; the rest is never read (the connection is dropped).
async fn read_prefix(
    url: &str,
    resp: Response<Incoming>,
    limit: u64,
    timeout: Duration,
) -> Result<Vec<u8>, HubError> {
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while (out.len() as u64) < limit {
        let frame = tokio::time::timeout(timeout, body.frame())
            .await
            .map_err(|_| HubError::Unreachable {
                url: url.to_string(),
                reason: format!("the body stalled for {} s", timeout.as_secs()),
            })?;
        match frame {
            Some(Ok(frame)) => {
                if let Ok(chunk) = frame.into_data() {
                    let room = (limit - out.len() as u64) as usize;
                    out.extend_from_slice(&chunk[..chunk.len().min(room)]);
                }
            }
            Some(Err(e)) => {
                return Err(HubError::Unreachable {
                    url: url.to_string(),
                    reason: error_chain(&e),
                });
            }
            None => break,
        }
    }
    Ok(out)
}

/// An error with its causes on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects_resolve_and_origins_compare_by_scheme_host_and_port() {
        let base: Uri = "http://127.0.0.1:8080/a/resolve/main/x".parse().unwrap();
        assert_eq!(
            join(&base, "/cdn/y").unwrap().to_string(),
            "http://127.0.0.1:8080/cdn/y"
        );
        assert_eq!(
            join(&base, "https://cdn.example/z?sig=1")
                .unwrap()
                .to_string(),
            "https://cdn.example/z?sig=1"
        );
        assert!(join(&base, "relative").is_none());
        let hub: Uri = "https://huggingface.co/".parse().unwrap();
        assert!(same_origin(
            &"https://huggingface.co:443/x".parse().unwrap(),
            &hub
        ));
        assert!(!same_origin(
            &"https://cdn-lfs.hf.co/x".parse().unwrap(),
            &hub
        ));
        assert!(!same_origin(
            &"http://huggingface.co/x".parse().unwrap(),
            &hub
        ));
    }

    #[test]
    fn etags_lose_weak_markers_and_quotes() {
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(normalize_etag("\"sha\""), "sha");
        assert_eq!(normalize_etag("plain"), "plain");
    }
}
