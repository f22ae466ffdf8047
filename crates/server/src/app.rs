//! The axum application: routes, API-key and header-size checks, the rule-based cleanup fallback,
//! and the admin/health endpoints. The proxied request path itself lives in [`crate::request`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use headroom_gate::{Gate, clean_transcript};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::inspect::last_user_text;
use crate::live_config::ServeConfig;
use crate::proxy::header as hname;
use crate::request::{self, Reply, Route, Timer};
use crate::telemetry::{BAD_REQUESTS_TOTAL, Telemetry};

/// Header a client may send to shorten its own deadline (milliseconds).
pub const TIMEOUT_HEADER: &str = "x-headroom-timeout-ms";
/// Header naming the lane a request wants.
pub const LANE_HEADER: &str = "x-headroom-lane";
/// The `model` of a fallback answer: the rule-based cleanup, not the requested LLM.
pub const FALLBACK_MODEL: &str = "headroom-rule-based-cleanup";
/// Header marking a fallback answer.
pub const FALLBACK_HEADER: &str = "x-headroom-fallback";

/// Shared state of one gateway.
pub struct AppState {
    /// Each lane's upstreams (by lane, then upstream index as the gate numbers them), parsed
    /// once, with their keep-alive pools; lanes that name the same upstream share one.
    pub endpoints: Vec<Vec<Option<Arc<crate::upstream::Endpoint>>>>,
    pub config: ServeConfig,
    pub gate: Gate,
    pub client: reqwest::Client,
    pub telemetry: Arc<Telemetry>,
    /// The status page's ring of samples (`/ui`).
    pub ui: Arc<crate::ui::UiState>,
    /// The last load figure and readiness for a load balancer (agent check, ORCA header).
    pub balancer: crate::balancer::Signals,
    /// What each memory pool is called (host RAM, GPU N with its name).
    pub pool_names: Arc<crate::pools::PoolNames>,
    /// Set by `headroom up`: the box's backends, for `/admin/box` and 503s while one restarts.
    pub box_provider: std::sync::OnceLock<Arc<dyn crate::admin_box::BoxProvider>>,
    fallback_ids: AtomicU64,
    /// Clients refused with a Retry-After, to notice the ones that come back before it.
    pub(crate) retries: crate::retry_watch::RetryWatch,
    /// Set when `shutdown_grace` ran out: what is still in flight ends with `shutting_down`.
    pub(crate) cut: Arc<std::sync::atomic::AtomicBool>,
    /// Request-body bytes held in memory, under `max_body_memory`.
    pub body_memory: crate::body_memory::BodyMemory,
    /// Each upstream's last `GET /health` answer, refreshed in the background for `/readyz`.
    pub(crate) health: crate::health::HealthCache,
}

impl AppState {
    pub fn new(
        config: ServeConfig,
        gate: Gate,
        client: reqwest::Client,
        telemetry: Arc<Telemetry>,
    ) -> AppState {
        let endpoints = endpoints_of(&config);
        let body_memory =
            crate::body_memory::BodyMemory::new(config.body_memory_cap(crate::health::mem_total()));
        let health = crate::health::HealthCache::new(upstream_list_of(&config));
        let pool_names = Arc::new(crate::pools::PoolNames::new(config.memory.probe));
        AppState {
            pool_names,
            endpoints,
            config,
            gate,
            client,
            telemetry,
            ui: Arc::new(crate::ui::UiState::default()),
            balancer: crate::balancer::Signals::default(),
            box_provider: std::sync::OnceLock::new(),
            fallback_ids: AtomicU64::new(1),
            retries: Default::default(),
            cut: Arc::default(),
            body_memory,
            health,
        }
    }

    /// The shutdown's grace ran out: every request still in flight ends now.
    pub(crate) fn cut(&self) {
        self.cut.store(true, Ordering::Relaxed);
    }
}

/// One [`Endpoint`](crate::upstream::Endpoint) per distinct upstream address, laid out by lane
/// and upstream index; an address that does not parse has none (its requests answer 502).
fn endpoints_of(config: &ServeConfig) -> Vec<Vec<Option<Arc<crate::upstream::Endpoint>>>> {
    let mut seen: Vec<Arc<crate::upstream::Endpoint>> = Vec::new();
    let mut endpoint = |u: &str| {
        if let Some(e) = seen.iter().find(|e| e.address() == u) {
            return Some(e.clone());
        }
        let e = Arc::new(crate::upstream::Endpoint::parse(u).ok()?);
        seen.push(e.clone());
        Some(e)
    };
    config
        .lanes
        .iter()
        .map(|l| l.spec.upstreams.iter().map(|u| endpoint(u)).collect())
        .collect()
}

pub(crate) type Shared = Arc<AppState>;

/// A proxied route's request with the edge checks around it, as the router's `edge`
/// middleware applies them to every other route: the header-size and key checks, the request
/// path, then the overload status and the load header.
pub(crate) async fn proxied(s: Shared, route: Route, req: Request, timer: Timer<'_>) -> Reply {
    let mut reply = match refused_at_edge(&s, &req) {
        Some(refusal) => Reply::from(refusal),
        None => {
            // Pinned in place: the request path's future (kilobytes) is not moved.
            let answer = std::pin::pin!(answer(s.clone(), route, req, timer));
            until_cut(&s, answer).await
        }
    };
    reply.response = load_header(&s, overload_status(&s, reply.response));
    reply
}

/// `answer`, unless the shutdown's grace runs out first: then 503 `shutting_down` (the answer's
/// future is dropped, which cancels the request wherever it was). The connection's task is
/// woken at the cut; the flag is read only when the answer is not ready.
async fn until_cut<A>(s: &AppState, mut answer: std::pin::Pin<&mut A>) -> Reply
where
    A: std::future::Future<Output = Reply>,
{
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(reply) = answer.as_mut().poll(cx) {
            return std::task::Poll::Ready(reply);
        }
        if s.cut.load(Ordering::Relaxed) {
            return std::task::Poll::Ready(Reply::from(ApiError::cut().into_response()));
        }
        std::task::Poll::Pending
    })
    .await
}

/// The request path's answer, or its error as a response. Refused input is counted here (gate
/// refusals are counted per lane where they happen).
async fn answer(s: Shared, route: Route, req: Request, timer: Timer<'_>) -> Reply {
    let telemetry = s.telemetry.clone();
    request::handle(s, route, req, timer)
        .await
        .unwrap_or_else(|e| {
            if e.status.is_client_error() && e.status != StatusCode::TOO_MANY_REQUESTS {
                telemetry
                    .counter(
                        BAD_REQUESTS_TOTAL,
                        &[("code", crate::error::code_label(&e.code))],
                    )
                    .increment(1);
            }
            Reply::from(e.into_response())
        })
}

/// Builds the router for a gateway. The server ([`crate::listen`]) sends `POST`s on the
/// proxied routes to [`proxied`] without it; the router still serves them (through the same
/// function) for anyone who mounts it on its own, and answers their other methods with 405.
pub fn router(state: Shared) -> Router {
    let proxied = |route: Route| {
        post(move |State(s): State<Shared>, req: Request| async move {
            answer(s, route, req, None).await.into_response()
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
        .route("/admin/load", get(admin_load))
        .route("/ui", get(crate::ui::serve_page))
        .route("/ui/state", get(crate::ui::serve_state))
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
        .layer(middleware::from_fn_with_state(state.clone(), edge))
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

/// The one middleware around every route (one layer, so a request pays for one boxed future
/// and one service clone, not three): header-size and key checks, then the route, then the
/// overload status and the load header on whatever response came out.
async fn edge(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let response = match refused_at_edge(&s, &req) {
        Some(refusal) => refusal,
        None => next.run(req).await,
    };
    let response = overload_status(&s, response);
    load_header(&s, response)
}

/// The header-size and API-key checks: the refusal, or `None` when the request may pass.
fn refused_at_edge(s: &AppState, req: &Request) -> Option<Response> {
    let header_bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if header_bytes > s.config.max_header_bytes {
        return Some(
            ApiError::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "headers_too_large",
                format!("request headers exceed {} bytes", s.config.max_header_bytes),
            )
            .closing()
            .into_response(),
        );
    }
    let open = matches!(req.uri().path(), "/healthz" | "/readyz");
    if !open && !s.config.api_keys.is_empty() {
        let presented = bearer_token(req.headers());
        let page = req.uri().path().starts_with("/ui");
        let ok = presented.is_some_and(|p| key_matches(p.as_bytes(), &s.config.api_keys))
            || (page && crate::ui::basic_key_matches(req.headers(), &s.config.api_keys));
        if !ok && page {
            return Some(crate::ui::ask_for_key());
        }
        if !ok {
            return Some(
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_api_key",
                    "a valid API key is required (Authorization: Bearer KEY)",
                )
                .closing()
                .into_response(),
            );
        }
    }
    None
}

/// The token of an `Authorization: Bearer TOKEN` field; the scheme is matched without regard to
/// case (RFC 9110 §11.1), and spaces around the token are dropped.
pub(crate) fn bearer_token(headers: &axum::http::HeaderMap) -> Option<&str> {
    let value = headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim_start();
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// Whether a request carries a valid key (or the gateway has none configured).
fn has_key(s: &AppState, headers: &axum::http::HeaderMap) -> bool {
    s.config.api_keys.is_empty()
        || bearer_token(headers).is_some_and(|p| key_matches(p.as_bytes(), &s.config.api_keys))
}

/// The rule-based cleanup answer given instead of the LLM's when a lane's policy falls back.
pub(crate) fn fallback_response(
    s: &AppState,
    lane_index: usize,
    request: &Value,
    stream: bool,
) -> Response {
    s.telemetry.fallback(lane_index);
    s.telemetry.lane_outcome(lane_index, "fallback");
    let lane = s.telemetry.lane_name(lane_index);
    let text = clean_transcript(&last_user_text(request));
    // The answer names what produced it, never the LLM the client asked for.
    let model = FALLBACK_MODEL;
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
    upstream_list_of(&s.config)
}

/// Every distinct upstream of the configuration, in the order lanes name them.
pub(crate) fn upstream_list_of(config: &ServeConfig) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for l in &config.lanes {
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

/// One lane's readiness: whether some upstream of it is usable, and which.
#[derive(Debug, Clone)]
pub(crate) struct LaneReadiness {
    pub name: String,
    pub ready: bool,
    pub healthy: Vec<String>,
}

/// Each upstream's `GET /health` (any HTTP status means the process is up) within `timeout`,
/// in the order of [`upstream_list`].
pub(crate) async fn probe_upstreams(
    s: &AppState,
    upstreams: &[String],
    timeout: Duration,
) -> Vec<Option<u16>> {
    let checks = upstreams.iter().map(|u| {
        let client = s.client.clone();
        let url = format!("{u}/health");
        async move {
            tokio::time::timeout(timeout, client.get(url).send())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|r| r.status().as_u16())
        }
    });
    futures_util::future::join_all(checks).await
}

fn readiness_of(
    s: &AppState,
    upstreams: &[String],
    statuses: &[Option<u16>],
) -> Vec<LaneReadiness> {
    let usable = |u: &str| {
        let reachable = upstreams
            .iter()
            .position(|x| x == u)
            .is_some_and(|i| statuses[i].is_some());
        reachable && s.gate.upstream_healthy(u)
    };
    s.config
        .lanes
        .iter()
        .map(|l| {
            let healthy: Vec<String> = l
                .spec
                .upstreams
                .iter()
                .filter(|u| usable(u))
                .cloned()
                .collect();
            LaneReadiness {
                name: l.spec.name.clone(),
                ready: !healthy.is_empty(),
                healthy,
            }
        })
        .collect()
}

/// Which lanes can be served now: a lane is ready when some upstream of it answers `/health`
/// within `timeout` and passive health has not ejected it.
pub(crate) async fn lane_readiness(s: &AppState, timeout: Duration) -> Vec<LaneReadiness> {
    let upstreams = upstream_list(s);
    let statuses = probe_upstreams(s, &upstreams, timeout).await;
    readiness_of(s, &upstreams, &statuses)
}

/// `/readyz`: this box can serve every lane on at least one healthy replica, i.e. for each lane
/// some upstream answers `GET /health` (any HTTP status: the process is up) and passive health
/// has not ejected it. 503 otherwise, with the lanes that cannot be served. One replica down
/// out of several keeps the box ready, and so does a box whose lanes are full (it answers 429
/// then, and is still able to serve). (`/healthz` only says the gateway process is alive.)
/// The answers to `/health` are the background check's last ones ([`crate::health`]): a probe
/// calls no upstream. Without a valid key (when keys are set) it says only whether it is ready.
async fn readyz(State(s): State<Shared>, req: Request) -> Response {
    let upstreams = upstream_list(&s);
    let statuses = s.health.statuses().await;
    let readiness = readiness_of(&s, &upstreams, &statuses);
    let ready = readiness.iter().all(|l| l.ready);
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    if !has_key(&s, req.headers()) {
        return (status, axum::Json(json!({"ready": ready}))).into_response();
    }
    let lanes: Vec<Value> = readiness
        .into_iter()
        .map(|l| json!({"name": l.name, "ready": l.ready, "healthy_upstreams": l.healthy}))
        .collect();
    let results: Vec<Value> = upstreams
        .iter()
        .zip(&statuses)
        .map(|(u, status)| {
            json!({"url": u, "reachable": status.is_some(), "status": status,
                   "healthy": s.gate.upstream_healthy(u)})
        })
        .collect();
    (
        status,
        axum::Json(json!({"ready": ready, "lanes": lanes, "upstreams": results})),
    )
        .into_response()
}

/// `GET /admin/load`: the load figure and its parts, as the balancer signals carry them.
async fn admin_load(State(s): State<Shared>) -> Response {
    axum::Json(s.balancer.get()).into_response()
}

/// Answers lane-full refusals with `[balancer] overload_status` (503 for a balancer that
/// retries 503 on another box but not 429); every other response passes unchanged.
fn overload_status(s: &AppState, response: Response) -> Response {
    let wanted = s.config.balancer.overload_status;
    if response.status() == wanted {
        return response;
    }
    match response.extensions().get::<crate::error::LaneFull>() {
        Some(crate::error::LaneFull(e)) => e.clone().with_overload_status(wanted).into_response(),
        None => response,
    }
}

/// Adds the ORCA load report to every response when `[balancer] load_header` is on.
fn load_header(s: &AppState, mut response: Response) -> Response {
    if s.config.balancer.load_header
        && let Ok(v) = HeaderValue::from_str(&s.balancer.get().orca_value())
    {
        response
            .headers_mut()
            .insert(crate::balancer::ORCA_HEADER, v);
    }
    response
}

async fn metrics(State(s): State<Shared>) -> Response {
    let text = s.telemetry.render(&s.gate.snapshot()) + &crate::admin_box::render_metrics(&s);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /admin/lanes`: the gate's snapshot, each memory pool and each memory lane with the name
/// of its pool (`name`, `pool`).
async fn admin_lanes(State(s): State<Shared>) -> Response {
    let mut doc = serde_json::to_value(s.gate.snapshot()).unwrap_or_default();
    let name = |device: &serde_json::Value| {
        serde_json::Value::from(s.pool_names.name(device.as_u64().unwrap_or(0) as u32))
    };
    if let Some(pools) = doc["memory"].as_array_mut() {
        for pool in pools {
            pool["name"] = name(&pool["device"]);
        }
    }
    if let Some(lanes) = doc["lanes"].as_array_mut() {
        for lane in lanes.iter_mut().filter(|l| l["memory"].is_object()) {
            lane["memory"]["pool"] = name(&lane["memory"]["device"]);
        }
    }
    axum::Json(doc).into_response()
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
}
