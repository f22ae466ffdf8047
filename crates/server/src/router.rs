//! The router: every route the gateway answers, `GET /v1/models` (the upstreams' lists merged),
//! and the 404/405 answers for the rest.

use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use crate::admin;
use crate::edge::{answer, edge};
use crate::error::{ApiError, ErrorCode};
use crate::request::Route;
use crate::state::Shared;

/// Builds the router for a gateway. The server ([`crate::listen`]) sends `POST`s on the
/// proxied routes to [`proxied`] without it; the router still serves them (through the same
/// function) for anyone who mounts it on its own, and answers their other methods with 405.
pub(crate) fn router(state: Shared) -> Router {
    let proxied = |route: Route| {
        post(move |State(s): State<Shared>, req: Request| async move {
            answer(s.core.clone(), route, req, None)
                .await
                .into_response()
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
        .route("/readyz", get(crate::readiness::readyz))
        .route("/metrics", get(crate::metrics::metrics))
        .route("/admin/lanes", get(admin::admin_lanes))
        .route("/admin/load", get(admin::admin_load))
        .route("/ui", get(crate::ui::serve_page))
        .route("/ui/state", get(crate::ui::serve_state))
        .route("/admin/box", get(admin::box_handler))
        .fallback(|req: Request| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                ErrorCode::UnknownRoute,
                format!("no route {} {}", req.method(), req.uri().path()),
            )
            .closing()
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorCode::MethodNotAllowed,
                format!("{} is not allowed on {}", req.method(), req.uri().path()),
            )
            .closing()
        })
        .layer(middleware::from_fn_with_state(state.clone(), edge))
        .with_state(state)
}

async fn models(State(s): State<Shared>) -> Response {
    let mut data: Vec<Value> = Vec::new();
    let mut reached = 0;
    let upstreams = crate::health::upstream_list_of(&s.core.config);
    let fetches = upstreams.iter().map(|u| {
        let client = s.core.client.clone();
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
            ErrorCode::UpstreamUnreachable,
            "no upstream answered /v1/models",
        )
        .into_response();
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}
