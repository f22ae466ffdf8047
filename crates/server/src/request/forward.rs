//! Forwarding: the upstream URL (the permit's upstream, the route, the client's query), the
//! headers that cross the gateway (plus the lane's own upstream key), and the send itself.

use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use bytes::Bytes;

use super::{Lane, Route};
use headroom_gate::Permit;

use crate::app::AppState;
use crate::error::ApiError;
use crate::proxy::{Flight, never_reached_upstream, upstream_request_headers};

/// The URL on the permit's upstream for this route and query: the lane's parsed base with the
/// route's path and the client's query, or (for a base that did not parse) the joined text.
pub(super) fn url(
    s: &AppState,
    lane: Lane<'_>,
    permit: &Permit,
    route: Route,
    uri: &Uri,
) -> Target {
    let parsed = s
        .upstream_urls
        .get(lane.index)
        .and_then(|l| l.get(permit.upstream_index()))
        .and_then(Option::as_ref);
    match parsed {
        Some(base) if base.path() == "/" => {
            let mut u = base.clone();
            u.set_path(route.path());
            u.set_query(uri.query());
            Target::Parsed(u)
        }
        _ => Target::Text(format!(
            "{}{}{}",
            permit.upstream(),
            route.path(),
            uri.query().map(|q| format!("?{q}")).unwrap_or_default()
        )),
    }
}

/// Where a request goes: a parsed URL, or text the client parses (and reports if it cannot).
pub(super) enum Target {
    Parsed(reqwest::Url),
    Text(String),
}

/// Sends the request upstream; resolves when the response head arrives.
pub(super) fn send(
    s: &AppState,
    lane: Lane<'_>,
    incoming: &HeaderMap,
    url: Target,
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
    let request = match url {
        Target::Parsed(u) => s.client.request(Method::POST, u),
        Target::Text(t) => s.client.request(Method::POST, t),
    };
    crate::proxy::send_resending_stale(request.headers(headers).body(body))
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
