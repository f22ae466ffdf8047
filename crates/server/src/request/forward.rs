//! Forwarding: the permit's upstream, the headers that cross the gateway (plus the lane's own
//! upstream key), the send itself, and what a failed send means for the upstream's health.

use std::sync::Arc;

use axum::http::{HeaderMap, StatusCode, Uri, header};
use bytes::Bytes;

use super::{Lane, Route};
use headroom_gate::Permit;

use crate::core_state::Core;
use crate::error::{ApiError, ErrorCode};
use crate::proxy::{Flight, connection_listed, crosses_upstream};
use crate::upstream::{self, Endpoint, Outgoing, UpstreamError, UpstreamResponse};

/// The request as it goes upstream: the route's path with the client's query, the header
/// fields that cross the gateway (the lane's own key replacing the client's) written once as
/// the header block every attempt sends, and the body.
pub(super) fn outgoing<'a>(
    s: &Core,
    lane: Lane<'_>,
    route: Route,
    uri: &'a Uri,
    incoming: &HeaderMap,
    body: Bytes,
) -> Outgoing<'a> {
    let drop_authorization =
        !s.config.api_keys.is_empty() || lane.config.upstream_api_key.is_some();
    let listed = connection_listed(incoming);
    let mut headers = Vec::with_capacity(256);
    for (name, value) in incoming {
        if crosses_upstream(name.as_str(), &listed, drop_authorization) {
            upstream::wire::header_line(name.as_str(), value, &mut headers);
        }
    }
    if let Some(v) = lane
        .config
        .upstream_api_key
        .as_deref()
        .and_then(upstream::bearer)
    {
        upstream::wire::header_line(header::AUTHORIZATION.as_str(), &v, &mut headers);
    }
    Outgoing {
        path: route.path(),
        query: uri.query(),
        headers,
        body,
        idempotent: lane.config.idempotent,
    }
}

/// The upstream the permit names (parsed once when the gateway started).
pub(super) fn endpoint(
    s: &Core,
    lane: Lane<'_>,
    permit: &Permit,
) -> Result<Arc<Endpoint>, UpstreamError> {
    s.endpoints
        .get(lane.index)
        .and_then(|l| l.get(permit.upstream_index()))
        .cloned()
        .flatten()
        .ok_or_else(|| UpstreamError::BadAddress(permit.upstream().to_string()))
}

/// Sends the request upstream; resolves when the response head arrives.
pub(super) async fn send(
    endpoint: Result<Arc<Endpoint>, UpstreamError>,
    outgoing: &Outgoing<'_>,
) -> Result<UpstreamResponse, UpstreamError> {
    upstream::send(&endpoint?, outgoing).await
}

/// What one attempt to reach the upstream came to.
pub(super) enum Attempt {
    /// A response head arrived (any status).
    Answered(UpstreamResponse),
    /// The request may go elsewhere and another upstream of the lane takes it.
    Rerouted,
}

/// The upstream's response head, a reroute to another upstream of the lane for a request that
/// may be sent again ([`crate::upstream::UpstreamError::may_reroute`]: none of it was written, or
/// the lane is `idempotent` and no response byte came back), or the 502. Every outcome feeds the
/// upstream's passive health: a 5xx or a failed exchange counts as a failure, any other answer
/// as a success.
pub(super) fn received(
    sent: Result<UpstreamResponse, UpstreamError>,
    flight: &mut Flight,
    idempotent: bool,
) -> Result<Attempt, ApiError> {
    match sent {
        Ok(response) => {
            if let Some(p) = flight.permit_mut() {
                p.mark_upstream(!response.status().is_server_error());
            }
            Ok(Attempt::Answered(response))
        }
        Err(e) => {
            if let Some(p) = flight.permit_mut() {
                if e.may_reroute(idempotent) && p.reroute().is_some() {
                    return Ok(Attempt::Rerouted);
                }
                p.mark_upstream(false);
            }
            flight.finish("upstream_error");
            let message = if e.is_connect() {
                "the upstream could not be reached"
            } else if e.unsent() {
                "the connection to the upstream failed before the request was sent"
            } else if e.unanswered() && idempotent {
                "the upstream failed before it answered, on every replica tried"
            } else if e.unanswered() {
                "the upstream failed before it answered; the request was not sent again, since it \
                 may have run (a lane whose requests may run twice says idempotent = true)"
            } else {
                "the upstream request failed before a response arrived"
            };
            Err(ApiError::new(
                StatusCode::BAD_GATEWAY,
                ErrorCode::UpstreamUnreachable,
                message,
            ))
        }
    }
}
