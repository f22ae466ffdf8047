//! Forwarding: the upstream URL (the permit's upstream, the route, the client's query), the
//! headers that cross the gateway (plus the lane's own upstream key), and the send itself.

use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use bytes::Bytes;

use super::{Lane, Route};
use crate::app::AppState;
use crate::error::ApiError;
use crate::proxy::{Flight, never_reached_upstream, upstream_request_headers};

/// The URL on `upstream` for this route and query.
pub(super) fn url(upstream: &str, route: Route, uri: &Uri) -> String {
    format!(
        "{}{}{}",
        upstream,
        route.path(),
        uri.query().map(|q| format!("?{q}")).unwrap_or_default()
    )
}

/// Sends the request upstream; resolves when the response head arrives.
pub(super) fn send(
    s: &AppState,
    lane: Lane<'_>,
    incoming: &HeaderMap,
    url: String,
    body: Bytes,
) -> impl Future<Output = reqwest::Result<reqwest::Response>> + use<> {
    let mut headers = upstream_request_headers(
        incoming,
        !s.config.api_keys.is_empty() || lane.config.upstream_api_key.is_some(),
    );
    if let Some(key) = &lane.config.upstream_api_key
        && let Ok(v) = HeaderValue::from_str(&format!("Bearer {key}"))
    {
        headers.insert(header::AUTHORIZATION, v);
    }
    crate::proxy::send_resending_stale(
        s.client
            .request(Method::POST, url)
            .headers(headers)
            .body(body),
    )
}

/// What one attempt to reach the upstream came to.
pub(super) enum Attempt {
    /// A response head arrived (any status).
    Answered(reqwest::Response),
    /// The request never reached the upstream and another upstream of the lane takes it.
    Rerouted,
}

/// The upstream's response head, a reroute to another upstream for a request that provably
/// never reached this one (connection refused, or reset before any response byte), or the 502.
/// Every outcome feeds the upstream's passive health: a 5xx or an unreachable upstream counts
/// as a failure, any other answer as a success.
pub(super) fn received(
    sent: reqwest::Result<reqwest::Response>,
    flight: &mut Flight,
) -> Result<Attempt, ApiError> {
    match sent {
        Ok(response) => {
            if let Some(p) = flight.permit_mut() {
                p.mark_upstream(!response.status().is_server_error());
            }
            Ok(Attempt::Answered(response))
        }
        Err(e) => {
            let never_reached = e.is_connect() || never_reached_upstream(&e);
            if never_reached && let Some(p) = flight.permit_mut() {
                if p.reroute().is_some() {
                    return Ok(Attempt::Rerouted);
                }
                p.mark_upstream(false);
            }
            flight.finish("upstream_error");
            let message = if e.is_connect() {
                "the upstream could not be reached"
            } else {
                "the upstream request failed before a response arrived"
            };
            Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                message,
            ))
        }
    }
}
