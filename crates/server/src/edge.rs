//! The edge every request passes: the header-size and API-key checks before the route, the
//! shutdown's cut around a proxied request, and the overload status and ORCA load header on
//! every response.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::core_state::Core;
use crate::error::{ApiError, ErrorCode};
use crate::request::{self, Reply, Route, Timer};
use crate::state::{AppState, Shared};
use crate::telemetry::BAD_REQUESTS_TOTAL;

/// A proxied route's request with the edge checks around it, as the router's `edge`
/// middleware applies them to every other route: the header-size and key checks, the request
/// path, then the overload status and the load header.
pub(crate) async fn proxied(s: Shared, route: Route, req: Request, timer: Timer<'_>) -> Reply {
    let mut reply = match refused_at_edge(&s, &req) {
        Some(refusal) => Reply::from(refusal),
        None => {
            // Pinned in place: the request path's future (kilobytes) is not moved.
            let answer = std::pin::pin!(answer(s.core.clone(), route, req, timer));
            until_cut(&s.core, answer).await
        }
    };
    reply.response = load_header(&s, overload_status(&s, reply.response));
    reply
}

/// `answer`, unless the shutdown's grace runs out first: then 503 `shutting_down` (the answer's
/// future is dropped, which cancels the request wherever it was). The connection's task is
/// woken at the cut; the flag is read only when the answer is not ready.
async fn until_cut<A>(s: &Core, mut answer: std::pin::Pin<&mut A>) -> Reply
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
pub(crate) async fn answer(s: Arc<Core>, route: Route, req: Request, timer: Timer<'_>) -> Reply {
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

/// Compares a presented key with every configured key without early exit.
pub(crate) fn key_matches(presented: &[u8], keys: &[String]) -> bool {
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
pub(crate) async fn edge(State(s): State<Shared>, req: Request, next: Next) -> Response {
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
    if header_bytes > s.core.config.max_header_bytes {
        return Some(
            ApiError::new(
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                ErrorCode::HeadersTooLarge,
                format!(
                    "request headers exceed {} bytes",
                    s.core.config.max_header_bytes
                ),
            )
            .closing()
            .into_response(),
        );
    }
    let open = matches!(req.uri().path(), "/healthz" | "/readyz");
    if !open && !s.core.config.api_keys.is_empty() {
        let presented = bearer_token(req.headers());
        let page = req.uri().path().starts_with("/ui");
        let ok = presented.is_some_and(|p| key_matches(p.as_bytes(), &s.core.config.api_keys))
            || (page && crate::ui::basic_key_matches(req.headers(), &s.core.config.api_keys));
        if !ok && page {
            return Some(crate::ui::ask_for_key());
        }
        if !ok {
            return Some(
                ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    ErrorCode::InvalidApiKey,
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
pub(crate) fn has_key(s: &AppState, headers: &axum::http::HeaderMap) -> bool {
    s.core.config.api_keys.is_empty()
        || bearer_token(headers).is_some_and(|p| key_matches(p.as_bytes(), &s.core.config.api_keys))
}

/// Answers lane-full refusals with `[balancer] overload_status` (503 for a balancer that
/// retries 503 on another box but not 429); every other response passes unchanged.
fn overload_status(s: &AppState, response: Response) -> Response {
    let wanted = s.core.config.balancer.overload_status;
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
    if s.core.config.balancer.load_header
        && let Some(v) = s.balancer.orca()
    {
        response.headers_mut().insert(crate::headers::ORCA, v);
    }
    response
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
