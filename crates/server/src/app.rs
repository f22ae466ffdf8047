//! The axum application: routes, API-key and header-size checks, lane selection, request limits,
//! admission through the gate, the rule-based cleanup fallback, and the admin/health endpoints.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use headroom_gate::{AdmitRequest, Gate, Rejection, clean_transcript};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::config::{FallbackKind, LaneConfig, OutputTokensMode, ServeConfig};
use crate::error::{ApiError, from_upstream};
use crate::inspect::{JsonRoute, audio_seconds, last_user_text, parse_json};
use crate::multipart;
use crate::proxy::{
    Flight, Passthrough, client_response_headers, header as hname, is_event_stream,
    upstream_request_headers,
};
use crate::telemetry::{
    BAD_REQUESTS_TOTAL, FALLBACKS_TOTAL, QUEUE_WAIT_SECONDS, REJECTIONS_TOTAL, Telemetry,
};

/// Largest upstream error body read to rewrite it into OpenAI's shape.
const MAX_UPSTREAM_ERROR_BYTES: usize = 64 * 1024;
/// Header a client may send to shorten its own deadline (milliseconds).
pub const TIMEOUT_HEADER: &str = "x-headroom-timeout-ms";
/// Header naming the lane a request wants.
pub const LANE_HEADER: &str = "x-headroom-lane";
/// Header marking a fallback answer.
pub const FALLBACK_HEADER: &str = "x-headroom-fallback";

/// Shared state of one gateway.
pub struct AppState {
    pub config: ServeConfig,
    pub gate: Gate,
    pub client: reqwest::Client,
    pub telemetry: Arc<Telemetry>,
    /// Set by `headroom up`: the box's backends, for `/admin/box` and 503s while one restarts.
    pub box_provider: std::sync::OnceLock<Arc<dyn crate::admin_box::BoxProvider>>,
    fallback_ids: AtomicU64,
}

impl AppState {
    pub fn new(
        config: ServeConfig,
        gate: Gate,
        client: reqwest::Client,
        telemetry: Arc<Telemetry>,
    ) -> AppState {
        AppState {
            config,
            gate,
            client,
            telemetry,
            box_provider: std::sync::OnceLock::new(),
            fallback_ids: AtomicU64::new(1),
        }
    }
}

type Shared = Arc<AppState>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Chat,
    Completions,
    Transcriptions,
    Translations,
    Speech,
}

impl Route {
    fn path(self) -> &'static str {
        match self {
            Route::Chat => "/v1/chat/completions",
            Route::Completions => "/v1/completions",
            Route::Transcriptions => "/v1/audio/transcriptions",
            Route::Translations => "/v1/audio/translations",
            Route::Speech => "/v1/audio/speech",
        }
    }

    fn json(self) -> Option<JsonRoute> {
        match self {
            Route::Chat => Some(JsonRoute::Chat),
            Route::Completions => Some(JsonRoute::Completions),
            Route::Speech => Some(JsonRoute::Speech),
            Route::Transcriptions | Route::Translations => None,
        }
    }
}

/// Builds the router for a gateway.
pub fn router(state: Shared) -> Router {
    let proxied = |route: Route| {
        post(move |State(s): State<Shared>, req: Request| async move {
            let telemetry = s.telemetry.clone();
            handle(s, route, req).await.unwrap_or_else(|e| {
                // Refused input (gate refusals are counted per lane where they happen).
                if e.status.is_client_error() && e.status != StatusCode::TOO_MANY_REQUESTS {
                    telemetry
                        .counter(BAD_REQUESTS_TOTAL, &[("code", e.code.as_str())])
                        .increment(1);
                }
                e.into_response()
            })
        })
    };
    Router::new()
        .route("/v1/chat/completions", proxied(Route::Chat))
        .route("/v1/completions", proxied(Route::Completions))
        .route("/v1/audio/transcriptions", proxied(Route::Transcriptions))
        .route("/v1/audio/translations", proxied(Route::Translations))
        .route("/v1/audio/speech", proxied(Route::Speech))
        .route("/v1/models", get(models))
        .route(
            "/healthz",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/admin/lanes", get(admin_lanes))
        .route("/admin/box", get(crate::admin_box::handler))
        .fallback(|req: Request| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_route",
                format!("no route {} {}", req.method(), req.uri().path()),
            )
            .closing()
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{} is not allowed on {}", req.method(), req.uri().path()),
            )
            .closing()
        })
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Compares a presented key with every configured key without early exit.
pub fn key_matches(presented: &[u8], keys: &[String]) -> bool {
    let mut any = 0u8;
    for key in keys {
        let key = key.as_bytes();
        let mut diff = (presented.len() != key.len()) as u8;
        for i in 0..presented.len().max(key.len()) {
            diff |= presented.get(i).copied().unwrap_or(0) ^ key.get(i).copied().unwrap_or(0);
        }
        any |= (diff == 0) as u8;
    }
    any == 1
}

async fn guard(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > s.config.max_header_bytes {
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers exceed {} bytes", s.config.max_header_bytes),
        )
        .closing()
        .into_response();
    }
    let open = matches!(req.uri().path(), "/healthz" | "/readyz");
    if !open && !s.config.api_keys.is_empty() {
        let presented = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        let ok = presented.is_some_and(|p| key_matches(p.as_bytes(), &s.config.api_keys));
        if !ok {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_api_key",
                "a valid API key is required (Authorization: Bearer KEY)",
            )
            .closing()
            .into_response();
        }
    }
    next.run(req).await
}

fn model_matches(patterns: &[String], model: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => model.starts_with(prefix),
        None => p == model,
    })
}

/// What the gateway read from a request body before choosing a lane.
struct Inspected {
    model: Option<String>,
    stream: bool,
    has_audio: bool,
    audio_seconds: Option<f64>,
    input_tokens: u64,
    texts: Vec<String>,
    token_ids: u64,
    max_tokens: Option<(&'static str, u64)>,
    json: Option<Value>,
    audio_param: &'static str,
    input_param: &'static str,
}

fn content_type(headers: &HeaderMap) -> String {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string()
}

fn inspect(route: Route, headers: &HeaderMap, body: &[u8]) -> Result<Inspected, ApiError> {
    let ctype = content_type(headers);
    if let Some(json_route) = route.json() {
        let mime = ctype.split(';').next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("{} takes application/json, not `{mime}`", route.path()),
            ));
        }
        let r = parse_json(json_route, body)?;
        let input_param = match route {
            Route::Chat => "messages",
            Route::Completions => "prompt",
            _ => "input",
        };
        return Ok(Inspected {
            model: Some(r.model),
            stream: r.stream,
            has_audio: r.has_audio,
            audio_seconds: r.audio_seconds,
            input_tokens: r.input_tokens_estimate,
            texts: r.texts,
            token_ids: r.token_ids,
            max_tokens: r.max_tokens,
            json: Some(r.value),
            audio_param: "messages",
            input_param,
        });
    }
    let boundary = match multipart::boundary(&ctype) {
        None => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("{} takes multipart/form-data", route.path()),
            ));
        }
        Some(Err(e)) => {
            return Err(ApiError::bad_request(
                "invalid_multipart",
                None,
                e.to_string(),
            ));
        }
        Some(Ok(b)) => b,
    };
    let parts = multipart::parse(body, &boundary)
        .map_err(|e| ApiError::bad_request("invalid_multipart", None, e.to_string()))?;
    let field = |name: &str| {
        parts
            .iter()
            .find(|p| p.name == name && p.filename.is_none())
            .map(|p| {
                String::from_utf8_lossy(&body[p.data.clone()])
                    .trim()
                    .to_string()
            })
    };
    let file = parts.iter().find(|p| p.name == "file").ok_or_else(|| {
        ApiError::bad_request("missing_file", Some("file"), "the form has no `file` part")
    })?;
    let data = &body[file.data.clone()];
    if data.is_empty() {
        return Err(ApiError::bad_request(
            "missing_file",
            Some("file"),
            "the `file` part is empty",
        ));
    }
    let seconds = audio_seconds(data, "file")?;
    Ok(Inspected {
        model: field("model")
            .or_else(|| field("model_name"))
            .filter(|m| !m.is_empty()),
        stream: field("stream").is_some_and(|s| s == "true"),
        has_audio: true,
        audio_seconds: seconds,
        input_tokens: 0,
        texts: Vec::new(),
        token_ids: 0,
        max_tokens: None,
        json: None,
        audio_param: "file",
        input_param: "prompt",
    })
}

fn too_large(limit: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("request body is larger than this lane's limit of {limit} bytes"),
    )
}

/// Picks the lane for a request, after the body has been read.
fn choose_lane<'a>(
    lanes: &[(usize, &'a LaneConfig)],
    named: Option<usize>,
    route: Route,
    seen: &Inspected,
) -> Result<(usize, &'a LaneConfig), ApiError> {
    if let Some(i) = named {
        return Ok(*lanes
            .iter()
            .find(|(j, _)| *j == i)
            .expect("named lane was checked"));
    }
    if route == Route::Chat
        && seen.has_audio
        && let Some(l) = lanes.iter().find(|(_, l)| l.chat_audio)
    {
        return Ok(*l);
    }
    if let Some(model) = &seen.model
        && let Some(l) = lanes.iter().find(|(_, l)| model_matches(&l.models, model))
    {
        return Ok(*l);
    }
    lanes
        .iter()
        .find(|(_, l)| l.models.is_empty() && !(l.chat_audio && !seen.has_audio && lanes.len() > 1))
        .or_else(|| lanes.iter().find(|(_, l)| l.models.is_empty()))
        .copied()
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "model_not_found",
                format!(
                    "no lane serves model `{}` on {}",
                    seen.model.as_deref().unwrap_or(""),
                    route.path()
                ),
            )
            .with_param(Some("model"))
        })
}

async fn handle(s: Shared, route: Route, req: Request) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    let (parts, body) = req.into_parts();
    let candidates: Vec<(usize, &LaneConfig)> = s
        .config
        .lanes
        .iter()
        .enumerate()
        .filter(|(_, l)| l.paths.iter().any(|p| p == route.path()))
        .collect();
    if candidates.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_route",
            format!("no lane serves {}", route.path()),
        )
        .closing());
    }
    let named = match parts.headers.get(LANE_HEADER) {
        None => None,
        Some(v) => {
            let name = v.to_str().unwrap_or("");
            match candidates.iter().find(|(_, l)| l.spec.name == name) {
                Some((i, _)) => Some(*i),
                None => {
                    return Err(ApiError::bad_request(
                        "unknown_lane",
                        Some(LANE_HEADER),
                        format!("no lane named `{name}` serves {}", route.path()),
                    )
                    .closing());
                }
            }
        }
    };
    // Read no more than the largest cap that could apply; lanes check their own cap below.
    let read_cap = match named {
        Some(i) => s.config.lanes[i].max_body_bytes,
        None => candidates
            .iter()
            .map(|(_, l)| l.max_body_bytes)
            .max()
            .unwrap_or(0),
    };
    if let Some(len) = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > read_cap
    {
        return Err(too_large(read_cap).closing());
    }
    // A slow upload may not hold the connection longer than the request could run.
    let read_deadline = match named {
        Some(i) => s.config.lanes[i].spec.request_timeout,
        None => candidates
            .iter()
            .map(|(_, l)| l.spec.request_timeout)
            .max()
            .unwrap_or_default(),
    };
    let read = axum::body::to_bytes(body, read_cap.min(usize::MAX as u64) as usize);
    let bytes: Bytes = tokio::time::timeout(read_deadline, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                "the request body did not arrive in time",
            )
            .closing()
        })?
        .map_err(|e| {
            let text = e.to_string();
            if text.contains("length limit") {
                too_large(read_cap).closing()
            } else {
                ApiError::bad_request(
                    "body_read_error",
                    None,
                    "the request body could not be read",
                )
                .closing()
            }
        })?;
    let seen = inspect(route, &parts.headers, &bytes)?;
    let (lane_index, lane) = choose_lane(&candidates, named, route, &seen)?;
    let lane_name = lane.spec.name.as_str();

    if bytes.len() as u64 > lane.max_body_bytes {
        return Err(too_large(lane.max_body_bytes));
    }
    if let Some(max) = lane.max_input_tokens {
        let (tokens, how) = match &lane.tokenizer {
            Some(counter) => {
                let (counter, texts) = (counter.clone(), seen.texts.clone());
                let counted = tokio::task::spawn_blocking(move || counter.count(&texts))
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r);
                match counted {
                    Ok(n) => (
                        n + seen.token_ids,
                        "counted with the lane's tokenizer".to_string(),
                    ),
                    Err(_) => (
                        seen.input_tokens,
                        format!(
                            "estimated as characters / {}",
                            crate::inspect::CHARS_PER_TOKEN
                        ),
                    ),
                }
            }
            None => (
                seen.input_tokens,
                format!(
                    "estimated as characters / {}",
                    crate::inspect::CHARS_PER_TOKEN
                ),
            ),
        };
        if tokens > max {
            return Err(ApiError::bad_request(
                "input_too_long",
                Some(seen.input_param),
                format!("input is {tokens} tokens ({how}), over this lane's limit of {max}"),
            ));
        }
    }
    if let Some(max) = lane.max_audio_seconds
        && seen.has_audio
    {
        match seen.audio_seconds {
            Some(secs) if secs > max => {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "audio_too_long",
                    format!("audio is {secs:.1} s long, over this lane's limit of {max} s"),
                )
                .with_param(Some(seen.audio_param)));
            }
            Some(_) => {}
            // Admission counts it as the longest allowed clip, so its memory is covered.
            None if lane
                .spec
                .gpu
                .as_ref()
                .is_some_and(|g| g.bytes_per_audio_second > 0) => {}
            None => {
                return Err(ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "audio_duration_unknown",
                    "this lane limits audio length, and the duration of this container (MP4/M4A/WebM or a header without length) cannot be read; send WAV, FLAC, MP3 or OGG",
                )
                .with_param(Some(seen.audio_param)));
            }
        }
    }
    // Output-token limit: reject, or lower the ask (adding one when the request has none).
    let mut forward_body = bytes.clone();
    if let (Some(cap), Some(json)) = (lane.max_output_tokens, &seen.json)
        && matches!(route, Route::Chat | Route::Completions)
    {
        let over = seen.max_tokens.filter(|(_, n)| *n > cap);
        match (lane.output_tokens_mode, over, seen.max_tokens) {
            (OutputTokensMode::Reject, Some((field, n)), _) => {
                return Err(ApiError::bad_request(
                    "max_tokens_too_large",
                    Some(field),
                    format!("`{field}` is {n}, over this lane's limit of {cap}"),
                ));
            }
            (OutputTokensMode::Cap, Some((field, _)), _) => {
                let mut v = json.clone();
                v[field] = json!(cap);
                forward_body = Bytes::from(v.to_string());
            }
            (OutputTokensMode::Cap, None, None) => {
                let mut v = json.clone();
                v["max_tokens"] = json!(cap);
                forward_body = Bytes::from(v.to_string());
            }
            _ => {}
        }
    }

    let mut deadline = arrival + lane.spec.request_timeout;
    let mut timeout = lane.spec.request_timeout;
    if let Some(ms) = parts
        .headers
        .get(TIMEOUT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        let asked = Duration::from_millis(ms);
        if asked < timeout {
            timeout = asked;
            deadline = arrival + asked;
        }
    }
    if let Some(e) = crate::admin_box::unavailable(&s, lane_name, &lane.spec.upstreams) {
        s.telemetry.outcome(lane_name, "backend_unavailable");
        return Err(e);
    }
    let admitted = s
        .gate
        .admit(
            lane_index,
            AdmitRequest {
                audio_seconds: seen.audio_seconds,
                wait_until: Some(deadline),
                audio_unknown: seen.has_audio && seen.audio_seconds.is_none(),
            },
        )
        .await;
    let permit = match admitted {
        Ok(p) => p,
        Err(rejection) => {
            s.telemetry
                .counter(
                    REJECTIONS_TOTAL,
                    &[("lane", lane_name), ("reason", rejection.reason.code())],
                )
                .increment(1);
            if rejection.fallback
                && lane.fallback == Some(FallbackKind::RuleBasedCleanup)
                && route == Route::Chat
                && let Some(json) = &seen.json
            {
                return Ok(fallback_response(&s, lane_name, json, seen.stream));
            }
            s.telemetry.outcome(lane_name, outcome_of(&rejection));
            return Err(ApiError::from_rejection(&rejection));
        }
    };
    s.telemetry
        .histogram(QUEUE_WAIT_SECONDS, &[("lane", lane_name)])
        .record(permit.queue_wait().as_secs_f64());
    let queue_wait_ms = permit.queue_wait().as_millis() as u64;
    let url = format!(
        "{}{}{}",
        permit.upstream(),
        route.path(),
        parts
            .uri
            .query()
            .map(|q| format!("?{q}"))
            .unwrap_or_default()
    );
    let mut preempted = permit.preemption().map(|notify| {
        let mut waiter = Box::pin(notify.notified_owned());
        waiter.as_mut().enable();
        waiter
    });
    let mut flight = Flight::new(s.telemetry.clone(), lane_name, arrival, permit);

    let mut headers = upstream_request_headers(
        &parts.headers,
        !s.config.api_keys.is_empty() || lane.upstream_api_key.is_some(),
    );
    if let Some(key) = &lane.upstream_api_key
        && let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}"))
    {
        headers.insert(header::AUTHORIZATION, v);
    }
    let send = s
        .client
        .request(Method::POST, url)
        .headers(headers)
        .body(forward_body)
        .send();
    let response = tokio::time::timeout_at(deadline, send);
    let response = match &mut preempted {
        None => response.await,
        Some(waiter) => tokio::select! {
            r = response => r,
            _ = waiter.as_mut() => {
                // Dropping the request future closes its connection: the engine stops.
                flight.finish("preempted");
                return Err(ApiError::preempted(lane_name));
            }
        },
    };
    let response = match response {
        Err(_) => {
            flight.finish("deadline");
            return Err(ApiError::deadline(lane_name, timeout));
        }
        Ok(Err(e)) => {
            flight.finish("upstream_error");
            let message = if e.is_connect() {
                "the upstream could not be reached"
            } else {
                "the upstream request failed before a response arrived"
            };
            return Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                message,
            ));
        }
        Ok(Ok(r)) => r,
    };
    let status =
        StatusCode::from_u16(response.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    if status.is_client_error() || status.is_server_error() {
        let body = read_limited(response, deadline).await;
        flight.finish("upstream_error");
        return Err(from_upstream(status, &body));
    }
    let mut out_headers = client_response_headers(response.headers());
    let sse = is_event_stream(response.headers());
    out_headers.insert(
        hname("x-headroom-lane"),
        HeaderValue::from_str(lane_name).unwrap_or(HeaderValue::from_static("?")),
    );
    out_headers.insert(
        hname("x-headroom-queue-wait-ms"),
        HeaderValue::from(queue_wait_ms),
    );
    let body = Passthrough::new(response, flight, deadline, timeout, sse).preemptible(preempted);
    let mut resp = Response::new(Body::from_stream(body));
    *resp.status_mut() = status;
    *resp.headers_mut() = out_headers;
    Ok(resp)
}

fn outcome_of(r: &Rejection) -> &'static str {
    match r.reason {
        headroom_gate::RejectReason::QueueTimeout => "queue_timeout",
        headroom_gate::RejectReason::ShuttingDown => "shutting_down",
        _ => "rejected",
    }
}

async fn read_limited(mut response: reqwest::Response, deadline: Instant) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < MAX_UPSTREAM_ERROR_BYTES {
        match tokio::time::timeout_at(deadline, response.chunk()).await {
            Ok(Ok(Some(c))) => out.extend_from_slice(&c),
            _ => break,
        }
    }
    out.truncate(MAX_UPSTREAM_ERROR_BYTES);
    out
}

fn fallback_response(s: &AppState, lane: &str, request: &Value, stream: bool) -> Response {
    s.telemetry
        .counter(FALLBACKS_TOTAL, &[("lane", lane)])
        .increment(1);
    s.telemetry.outcome(lane, "fallback");
    let text = clean_transcript(&last_user_text(request));
    let model = request
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or("headroom-fallback");
    let id = format!(
        "chatcmpl-headroom-{}",
        s.fallback_ids.fetch_add(1, Ordering::Relaxed)
    );
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let completion_tokens = text
        .chars()
        .count()
        .div_ceil(crate::inspect::CHARS_PER_TOKEN);
    let mut response = if stream {
        let chunk = |delta: Value, finish: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            })
        };
        let events = [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": text}), Value::Null),
            chunk(json!({}), json!("stop")),
        ];
        let mut body = String::new();
        for e in events {
            body.push_str(&format!("data: {e}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        let mut r = Response::new(Body::from(body));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": completion_tokens, "total_tokens": completion_tokens}
        }))
        .into_response()
    };
    response.headers_mut().insert(
        hname("x-headroom-fallback"),
        HeaderValue::from_static("rule-based-cleanup"),
    );
    response.headers_mut().insert(
        hname("x-headroom-lane"),
        HeaderValue::from_str(lane).unwrap_or(HeaderValue::from_static("?")),
    );
    response
}

fn upstream_list(s: &AppState) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for l in &s.config.lanes {
        for u in &l.spec.upstreams {
            if !all.contains(u) {
                all.push(u.clone());
            }
        }
    }
    all
}

async fn models(State(s): State<Shared>) -> Response {
    let mut data: Vec<Value> = Vec::new();
    let mut reached = 0;
    let upstreams = upstream_list(&s);
    let fetches = upstreams.iter().map(|u| {
        let client = s.client.clone();
        let url = format!("{u}/v1/models");
        async move {
            let resp = tokio::time::timeout(Duration::from_secs(2), client.get(url).send())
                .await
                .ok()?
                .ok()?;
            if !resp.status().is_success() {
                return None;
            }
            let body = tokio::time::timeout(Duration::from_secs(2), resp.bytes())
                .await
                .ok()?
                .ok()?;
            serde_json::from_slice::<Value>(&body).ok()
        }
    });
    for v in futures_util::future::join_all(fetches)
        .await
        .into_iter()
        .flatten()
    {
        reached += 1;
        if let Some(items) = v.get("data").and_then(Value::as_array) {
            for item in items {
                let id = item.get("id");
                if id.is_some() && !data.iter().any(|d| d.get("id") == id) {
                    data.push(item.clone());
                }
            }
        }
    }
    if reached == 0 && !upstreams.is_empty() {
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_unreachable",
            "no upstream answered /v1/models",
        )
        .into_response();
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn readyz(State(s): State<Shared>) -> Response {
    let upstreams = upstream_list(&s);
    let checks = upstreams.iter().map(|u| {
        let client = s.client.clone();
        let url = format!("{u}/health");
        let u = u.clone();
        async move {
            let status = tokio::time::timeout(Duration::from_secs(2), client.get(url).send())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|r| r.status().as_u16());
            json!({"url": u, "reachable": status.is_some(), "status": status})
        }
    });
    let results = futures_util::future::join_all(checks).await;
    let ready = results.iter().all(|r| r["reachable"] == json!(true));
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        axum::Json(json!({"ready": ready, "upstreams": results})),
    )
        .into_response()
}

async fn metrics(State(s): State<Shared>) -> Response {
    let text = s.telemetry.render(&s.gate.snapshot()) + &crate::admin_box::render_metrics(&s);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn admin_lanes(State(s): State<Shared>) -> Response {
    axum::Json(s.gate.snapshot()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_compare_is_exact() {
        let keys = vec!["secret-one".to_string(), "two".to_string()];
        assert!(key_matches(b"secret-one", &keys));
        assert!(key_matches(b"two", &keys));
        assert!(!key_matches(b"secret-on", &keys));
        assert!(!key_matches(b"secret-one!", &keys));
        assert!(!key_matches(b"", &keys));
        assert!(!key_matches(b"two", &[]));
    }

    #[test]
    fn model_patterns() {
        let p = vec!["whisper-*".to_string(), "exact".to_string()];
        assert!(model_matches(&p, "whisper-large-v3"));
        assert!(model_matches(&p, "exact"));
        assert!(!model_matches(&p, "exactly"));
    }
}
