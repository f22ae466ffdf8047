//! A Hub on 127.0.0.1 for tests (feature `test-server`), answering as huggingface.co does:
//! `/api/models/{org}/{name}/revision/{rev}` with the commit and file list; small files from
//! `/{org}/{name}/resolve/{rev}/{file}` with `ETag` and `X-Repo-Commit`; large files (safetensors)
//! with a 302 to a CDN path on another host name (`localhost`), carrying `X-Linked-Etag`,
//! `X-Linked-Size` and `X-Repo-Commit`; the CDN honours `Range` (206 with `Content-Range`).
//! Missing repositories are 401 with `X-Error-Code: RepoNotFound`; a gated one lists its files
//! to anyone but serves them only with its token (else 401 with `GatedRepo`). Shards are generated, never stored: their header, then zeros, so a
//! checkpoint can declare gigabytes. It counts what it served, and the Authorization headers the
//! CDN saw.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

/// One file of a fake repository.
#[derive(Debug, Clone)]
pub enum FakeFile {
    /// Served whole from the Hub (config.json, the index).
    Small(Vec<u8>),
    /// A safetensors shard: `header` (8-byte length + JSON) and `data_len` bytes of zeros after it,
    /// served from the CDN.
    Shard { header: Vec<u8>, data_len: u64 },
}

/// A fake repository.
#[derive(Debug, Clone)]
pub struct FakeRepo {
    pub id: String,
    pub commit: String,
    pub files: BTreeMap<String, FakeFile>,
    /// Served only with `Authorization: Bearer <token>`.
    pub gated_token: Option<String>,
}

/// What the server saw.
#[derive(Debug, Default)]
pub struct Served {
    pub requests: AtomicU64,
    /// Bytes of shard content sent by the CDN.
    pub shard_bytes: AtomicU64,
    /// CDN requests that carried an Authorization header (must stay 0).
    pub cdn_authorized: AtomicU64,
    /// Hub requests that carried the token.
    pub hub_authorized: AtomicU64,
}

struct Hub {
    repos: Vec<FakeRepo>,
    served: Arc<Served>,
    port: u16,
    /// The CDN sends whole shards, ignoring `Range` (a misbehaving mirror).
    ignore_range: bool,
}

/// A running fake Hub.
pub struct FakeHub {
    pub addr: SocketAddr,
    pub served: Arc<Served>,
    task: tokio::task::JoinHandle<()>,
}

impl FakeHub {
    /// `http://127.0.0.1:PORT`, for `HF_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Serves `repos` on 127.0.0.1 (port 0) until dropped.
pub async fn start(repos: Vec<FakeRepo>, ignore_range: bool) -> FakeHub {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(Served::default());
    let state = Arc::new(Hub {
        repos,
        served: served.clone(),
        port: addr.port(),
        ignore_range,
    });
    let app = Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(revision))
        .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
        .route("/cdn/{org}/{name}/{*file}", get(cdn))
        .with_state(state);
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    FakeHub { addr, served, task }
}

/// A safetensors header (length + JSON) declaring bf16 `tensors` of `[rows, cols]`, and the
/// bytes of tensor data it declares.
pub fn shard_header(tensors: &[(String, u64, u64)]) -> (Vec<u8>, u64) {
    let mut offset = 0u64;
    let mut entries = Vec::new();
    for (name, rows, cols) in tensors {
        let bytes = rows * cols * 2;
        entries.push(format!(
            r#""{name}":{{"dtype":"BF16","shape":[{rows},{cols}],"data_offsets":[{offset},{}]}}"#,
            offset + bytes
        ));
        offset += bytes;
    }
    let json = format!(
        "{{\"__metadata__\":{{\"format\":\"pt\"}},{}}}",
        entries.join(",")
    );
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    (out, offset)
}

/// A repository of `config` and one shard per entry of `shards` (bf16 tensors `[rows, cols]`),
/// with a `model.safetensors.index.json` whose `total_size` is deliberately wrong when there
/// are several; a single shard is `model.safetensors`. Returns it and the tensor bytes its
/// headers declare.
pub fn repo_with_shards(
    id: &str,
    config: &str,
    shards: &[Vec<(String, u64, u64)>],
    gated_token: Option<&str>,
) -> (FakeRepo, u64) {
    let mut files = BTreeMap::new();
    files.insert("config.json".into(), FakeFile::Small(config.into()));
    files.insert("README.md".into(), FakeFile::Small(b"# readme".to_vec()));
    let mut weight_map = serde_json::Map::new();
    let mut declared = 0;
    for (i, tensors) in shards.iter().enumerate() {
        let name = if shards.len() == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len())
        };
        let (header, data_len) = shard_header(tensors);
        declared += data_len;
        for (tensor, _, _) in tensors {
            weight_map.insert(tensor.clone(), name.clone().into());
        }
        files.insert(name, FakeFile::Shard { header, data_len });
    }
    if shards.len() > 1 {
        let index = serde_json::json!({"metadata": {"total_size": 1}, "weight_map": weight_map});
        files.insert(
            "model.safetensors.index.json".into(),
            FakeFile::Small(index.to_string().into_bytes()),
        );
    }
    let repo = FakeRepo {
        id: id.into(),
        commit: fake_sha(id, 40),
        files,
        gated_token: gated_token.map(String::from),
    };
    (repo, declared)
}

/// A stand-in for a content hash: stable, hex, and different per input.
pub fn fake_sha(seed: &str, len: usize) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut out = String::new();
    let mut i = 0u64;
    while out.len() < len {
        for b in seed.bytes().chain(i.to_le_bytes()) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        out.push_str(&format!("{h:016x}"));
        i += 1;
    }
    out.truncate(len);
    out
}

impl Hub {
    fn repo(&self, org: &str, name: &str) -> Option<&FakeRepo> {
        let id = format!("{org}/{name}");
        self.repos.iter().find(|r| r.id == id)
    }

    /// The repository, or the `X-Error-Code` the Hub answers (with a 401) for a missing one or
    /// a gated one without its token.
    fn access(
        &self,
        org: &str,
        name: &str,
        headers: &HeaderMap,
    ) -> Result<&FakeRepo, &'static str> {
        let Some(repo) = self.repo(org, name) else {
            return Err("RepoNotFound");
        };
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if auth.is_some() {
            self.served.hub_authorized.fetch_add(1, Ordering::Relaxed);
        }
        if let Some(token) = &repo.gated_token
            && auth != Some(format!("Bearer {token}").as_str())
        {
            return Err("GatedRepo");
        }
        Ok(repo)
    }
}

fn error(status: StatusCode, code: &str) -> Response {
    let mut r = (status, format!("{{\"error\":\"{code}\"}}")).into_response();
    r.headers_mut()
        .insert("x-error-code", HeaderValue::from_str(code).unwrap());
    r
}

async fn revision(
    State(hub): State<Arc<Hub>>,
    Path((org, name, rev)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    hub.served.requests.fetch_add(1, Ordering::Relaxed);
    // A gated repository's metadata is public; only its files need the token.
    let repo = match hub.access(&org, &name, &headers) {
        Ok(r) => r,
        Err("GatedRepo") => hub.repo(&org, &name).expect("gated means present"),
        Err(code) => return error(StatusCode::UNAUTHORIZED, code),
    };
    if rev != "main" && rev != repo.commit {
        return error(StatusCode::NOT_FOUND, "RevisionNotFound");
    }
    let siblings: Vec<serde_json::Value> = repo
        .files
        .keys()
        .map(|f| serde_json::json!({ "rfilename": f }))
        .collect();
    axum::Json(serde_json::json!({
        "id": repo.id, "modelId": repo.id, "sha": repo.commit, "siblings": siblings
    }))
    .into_response()
}

async fn resolve(
    State(hub): State<Arc<Hub>>,
    Path((org, name, rev, file)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    hub.served.requests.fetch_add(1, Ordering::Relaxed);
    let repo = match hub.access(&org, &name, &headers) {
        Ok(r) => r,
        Err(code) => return error(StatusCode::UNAUTHORIZED, code),
    };
    if rev != "main" && rev != repo.commit {
        return error(StatusCode::NOT_FOUND, "RevisionNotFound");
    }
    let Some(f) = repo.files.get(&file) else {
        return error(StatusCode::NOT_FOUND, "EntryNotFound");
    };
    let commit = HeaderValue::from_str(&repo.commit).unwrap();
    match f {
        FakeFile::Small(bytes) => {
            let mut r = bytes.clone().into_response();
            let etag = format!("\"{}\"", fake_sha(&format!("{}{file}", repo.commit), 40));
            r.headers_mut()
                .insert(header::ETAG, HeaderValue::from_str(&etag).unwrap());
            r.headers_mut().insert("x-repo-commit", commit);
            r
        }
        FakeFile::Shard { header, data_len } => {
            let sha = fake_sha(&format!("{}{file}", repo.commit), 64);
            // Another host name for the same server: the token must not follow the redirect.
            let location = format!("http://localhost:{}/cdn/{}/{file}", hub.port, repo.id);
            let mut r = StatusCode::FOUND.into_response();
            let h = r.headers_mut();
            h.insert(header::LOCATION, HeaderValue::from_str(&location).unwrap());
            h.insert("x-repo-commit", commit);
            h.insert(
                "x-linked-etag",
                HeaderValue::from_str(&format!("\"{sha}\"")).unwrap(),
            );
            h.insert(
                "x-linked-size",
                HeaderValue::from(header.len() as u64 + data_len),
            );
            h.insert(
                header::ETAG,
                HeaderValue::from_static("W/\"not-the-blob-name\""),
            );
            r
        }
    }
}

/// `bytes=a-b` (inclusive) within `total`.
fn parse_range(h: &HeaderMap, total: u64) -> Option<(u64, u64)> {
    let v = h
        .get(header::RANGE)?
        .to_str()
        .ok()?
        .strip_prefix("bytes=")?;
    let (a, b) = v.split_once('-')?;
    let a: u64 = a.parse().ok()?;
    let b: u64 = if b.is_empty() {
        total - 1
    } else {
        b.parse().ok()?
    };
    (a <= b && a < total).then_some((a, b.min(total - 1)))
}

async fn cdn(
    State(hub): State<Arc<Hub>>,
    Path((org, name, file)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    hub.served.requests.fetch_add(1, Ordering::Relaxed);
    if headers.contains_key(header::AUTHORIZATION) {
        hub.served.cdn_authorized.fetch_add(1, Ordering::Relaxed);
    }
    let Some(FakeFile::Shard {
        header: head,
        data_len,
    }) = hub
        .repo(&org, &name)
        .and_then(|r| r.files.get(&file))
        .cloned()
    else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let total = head.len() as u64 + data_len;
    let range = if hub.ignore_range {
        None
    } else {
        parse_range(&headers, total)
    };
    let (from, to) = range.unwrap_or((0, total - 1));
    let served = hub.served.clone();
    // The body is made as it is sent, 64 KiB at a time, so a client that stops reading stops it.
    let chunks = shard_chunks(head, from, to, served);
    let mut r = Response::new(Body::from_stream(chunks));
    if range.is_some() {
        *r.status_mut() = StatusCode::PARTIAL_CONTENT;
        r.headers_mut().insert(
            header::CONTENT_RANGE,
            HeaderValue::from_str(&format!("bytes {from}-{to}/{total}")).unwrap(),
        );
    }
    r.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(to - from + 1));
    r
}

/// The bytes `from..=to` of a shard (its header, then zeros), generated 64 KiB at a time.
fn shard_chunks(
    head: Vec<u8>,
    from: u64,
    to: u64,
    served: Arc<Served>,
) -> impl futures_util::Stream<Item = Result<Vec<u8>, std::io::Error>> + Send + 'static {
    futures_util::stream::unfold(from, move |next| {
        let head = head.clone();
        let served = served.clone();
        async move {
            if next > to {
                return None;
            }
            let len = (to + 1 - next).min(64 * 1024);
            let mut out = vec![0u8; len as usize];
            for (i, b) in out.iter_mut().enumerate() {
                if let Some(h) = head.get((next + i as u64) as usize) {
                    *b = *h;
                }
            }
            served.shard_bytes.fetch_add(len, Ordering::Relaxed);
            Some((Ok(out), next + len))
        }
    })
}
