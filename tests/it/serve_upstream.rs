//! An in-process OpenAI-shaped upstream on 127.0.0.1 for the gateway tests: streams timed SSE
//! chunks, can die mid-stream or answer errors in foreign shapes, and records when each request
//! started and ended and whether it was cancelled (its response dropped before completion).
//! Behaviour is chosen per request with `x-test-*` headers, which the gateway forwards.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::StreamExt;
use tokio::time::Instant;

/// One request the upstream saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub id: String,
    pub path: String,
    pub started: Instant,
    pub ended: Option<Instant>,
    /// The response ended before it was complete (client went away).
    pub cancelled: bool,
    pub completed: bool,
    pub max_tokens: Option<u64>,
    pub authorization: Option<String>,
    pub body_len: usize,
}

#[derive(Clone, Default)]
pub struct Log {
    inner: Arc<Mutex<Vec<Seen>>>,
}

impl Log {
    pub fn all(&self) -> Vec<Seen> {
        self.inner.lock().unwrap().clone()
    }

    pub fn get(&self, id: &str) -> Option<Seen> {
        self.all().into_iter().find(|s| s.id == id)
    }

    fn start(&self, seen: Seen) -> usize {
        let mut v = self.inner.lock().unwrap();
        v.push(seen);
        v.len() - 1
    }

    fn end(&self, index: usize, completed: bool) {
        let mut v = self.inner.lock().unwrap();
        let s = &mut v[index];
        if s.ended.is_none() {
            s.ended = Some(Instant::now());
            s.completed = completed;
            s.cancelled = !completed;
        }
    }

    /// Waits until request `id` has reached this upstream (bounded by `within`, at least
    /// [`crate::serve::SETTLE`]); `None` if it never did.
    pub async fn wait_started(&self, id: &str, within: Duration) -> Option<Seen> {
        let until = Instant::now() + within.max(crate::serve::SETTLE);
        loop {
            if let Some(s) = self.get(id) {
                return Some(s);
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Waits until request `id` has ended (bounded by `within`, at least
    /// [`crate::serve::SETTLE`]: the end is an event, a loaded machine may delay it).
    pub async fn wait_ended(&self, id: &str, within: Duration) -> Option<Seen> {
        let until = Instant::now() + within.max(crate::serve::SETTLE);
        while Instant::now() < until {
            if let Some(s) = self.get(id)
                && s.ended.is_some()
            {
                return Some(s);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        self.get(id)
    }
}

/// Marks a request ended when dropped; `completed` says whether it got to the end.
struct EndGuard {
    log: Log,
    index: usize,
    completed: bool,
}

impl Drop for EndGuard {
    fn drop(&mut self) {
        self.log.end(self.index, self.completed);
    }
}

#[derive(Clone)]
struct Up {
    log: Log,
    metrics_text: Arc<Mutex<String>>,
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub log: Log,
    pub metrics_text: Arc<Mutex<String>>,
}

impl Upstream {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

fn header_u64(h: &HeaderMap, name: &str, default: u64) -> u64 {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn header_str(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(String::from)
}

pub async fn start() -> Upstream {
    let log = Log::default();
    let metrics_text = Arc::new(Mutex::new(String::new()));
    let state = Up {
        log: log.clone(),
        metrics_text: metrics_text.clone(),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(generate))
        .route("/v1/completions", post(generate))
        .route("/v1/audio/transcriptions", post(transcribe))
        .route("/v1/audio/translations", post(transcribe))
        .route("/v1/audio/speech", post(speech))
        .route(
            "/metrics",
            get(|State(s): State<Up>| async move { s.metrics_text.lock().unwrap().clone() }),
        )
        .route(
            "/v1/models",
            get(|| async { axum::Json(serde_json::json!({"object":"list","data":[{"id":"test-model","object":"model"}]})) }),
        )
        .route("/health", get(|| async { "ok" }))
        // vLLM's development endpoints for `preempt_mode = "pause"`: each call is logged with
        // its path and query as the id (e.g. `/sleep?level=0&mode=keep`).
        .route("/sleep", post(engine_control))
        .route("/wake_up", post(engine_control))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Upstream {
        addr,
        log,
        metrics_text,
    }
}

fn begin(s: &Up, path: &str, headers: &HeaderMap, body: &[u8]) -> (EndGuard, serde_json::Value) {
    let json: serde_json::Value = serde_json::from_slice(body).unwrap_or(serde_json::Value::Null);
    let index = s.log.start(Seen {
        id: header_str(headers, "x-test-id").unwrap_or_default(),
        path: path.to_string(),
        started: Instant::now(),
        ended: None,
        cancelled: false,
        completed: false,
        max_tokens: json.get("max_tokens").and_then(|v| v.as_u64()),
        authorization: header_str(headers, "authorization"),
        body_len: body.len(),
    });
    (
        EndGuard {
            log: s.log.clone(),
            index,
            completed: false,
        },
        json,
    )
}

fn error_reply(headers: &HeaderMap) -> Option<Response> {
    let status = header_u64(headers, "x-test-status", 0);
    if status == 0 {
        return None;
    }
    let body = header_str(headers, "x-test-error-body").unwrap_or_default();
    let mut response = (StatusCode::from_u16(status as u16).unwrap(), body).into_response();
    if let Some(ra) = header_str(headers, "x-test-retry-after") {
        response
            .headers_mut()
            .insert("retry-after", ra.parse().unwrap());
    }
    Some(response)
}

async fn generate(State(s): State<Up>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let (mut guard, json) = begin(&s, parts.uri.path(), &parts.headers, &body);
    tokio::time::sleep(Duration::from_millis(header_u64(
        &parts.headers,
        "x-test-delay-ms",
        0,
    )))
    .await;
    if let Some(r) = error_reply(&parts.headers) {
        guard.completed = true;
        return r;
    }
    let chunks = header_u64(&parts.headers, "x-test-chunks", 3);
    let interval = Duration::from_millis(header_u64(&parts.headers, "x-test-interval-ms", 10));
    let die_after = parts
        .headers
        .get("x-test-die-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let stream = json
        .get("stream")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    if !stream {
        tokio::time::sleep(interval * chunks as u32).await;
        guard.completed = true;
        let text: String = (0..chunks).map(|i| format!("tok{i} ")).collect();
        return axum::Json(serde_json::json!({
            "id": "cmpl-test", "object": "chat.completion", "created": 0, "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]
        }))
        .into_response();
    }
    let mid_event = parts.headers.contains_key("x-test-die-mid-event");
    let events = futures_util::stream::unfold((0u64, Some(guard)), move |(i, guard)| async move {
        let mut guard = guard?;
        if i > 0 {
            tokio::time::sleep(interval).await;
        }
        if mid_event && die_after.is_some_and(|d| d >= 1 && i == d - 1 && i < chunks) {
            // Half an event, then (next step) the connection dies inside it.
            return Some((
                Ok(Bytes::from("data: {\"id\":\"cmpl-test\",\"choi")),
                (die_after.unwrap_or(i + 1), Some(guard)),
            ));
        }
        if Some(i) == die_after {
            // Abort the response mid-body: hyper drops the connection.
            return Some((Err(std::io::Error::other("upstream died")), (i + 1, None)));
        }
        if i == chunks {
            guard.completed = true;
            return Some((Ok(Bytes::from("data: [DONE]\n\n")), (i + 1, None)));
        }
        let chunk = serde_json::json!({
            "id": "cmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "test-model",
            "choices": [{"index": 0, "delta": {"content": format!("tok{i} ")}, "finish_reason": null}]
        });
        Some((
            Ok(Bytes::from(format!("data: {chunk}\n\n"))),
            (i + 1, Some(guard)),
        ))
    });
    let mut r = Response::new(Body::from_stream(events));
    r.headers_mut()
        .insert("content-type", "text/event-stream".parse().unwrap());
    r
}

async fn transcribe(State(s): State<Up>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let (mut guard, _) = begin(&s, parts.uri.path(), &parts.headers, &body);
    tokio::time::sleep(Duration::from_millis(header_u64(
        &parts.headers,
        "x-test-delay-ms",
        20,
    )))
    .await;
    if let Some(r) = error_reply(&parts.headers) {
        guard.completed = true;
        return r;
    }
    guard.completed = true;
    axum::Json(serde_json::json!({"text": "hello from the gateway test"})).into_response()
}

async fn speech(State(s): State<Up>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let (guard, _) = begin(&s, parts.uri.path(), &parts.headers, &body);
    let chunks = futures_util::stream::iter(0..4u8)
        .then(|i| async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok::<_, std::io::Error>(Bytes::from(vec![i; 1000]))
        })
        .chain(futures_util::stream::once(async move {
            let mut g = guard;
            g.completed = true;
            Ok(Bytes::new())
        }));
    let mut r = Response::new(Body::from_stream(chunks));
    r.headers_mut()
        .insert("content-type", "audio/wav".parse().unwrap());
    r
}

async fn engine_control(State(s): State<Up>, req: Request) -> Response {
    let uri = req.uri();
    let id = format!("{}?{}", uri.path(), uri.query().unwrap_or(""));
    let index = s.log.start(Seen {
        id,
        path: uri.path().to_string(),
        started: Instant::now(),
        ended: None,
        cancelled: false,
        completed: false,
        max_tokens: None,
        authorization: None,
        body_len: 0,
    });
    s.log.end(index, true);
    axum::Json(serde_json::json!({"status": "ok"})).into_response()
}
