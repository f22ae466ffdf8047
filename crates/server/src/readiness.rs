//! Which lanes can be served now (`/readyz`, and the balancer's refresh): a lane is ready when
//! some upstream of it answers `/health` and passive health has not ejected it.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use crate::edge::has_key;
use crate::health::{probe_upstreams, upstream_list_of};
use crate::state::{AppState, Shared};

/// One lane's readiness: whether some upstream of it is usable, and which.
#[derive(Debug, Clone)]
pub(crate) struct LaneReadiness {
    pub name: String,
    pub ready: bool,
    pub healthy: Vec<String>,
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
        reachable && s.core.gate.upstream_healthy(u)
    };
    s.core
        .config
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
    let upstreams = upstream_list_of(&s.core.config);
    let statuses = probe_upstreams(&s.core.client, &upstreams, timeout).await;
    readiness_of(s, &upstreams, &statuses)
}

/// `/readyz`: this box can serve every lane on at least one healthy replica, i.e. for each lane
/// some upstream answers `GET /health` (any HTTP status: the process is up) and passive health
/// has not ejected it. 503 otherwise, with the lanes that cannot be served. One replica down
/// out of several keeps the box ready, and so does a box whose lanes are full (it answers 429
/// then, and is still able to serve). (`/healthz` only says the gateway process is alive.)
/// The answers to `/health` are the background check's last ones ([`crate::health`]): a probe
/// calls no upstream. Without a valid key (when keys are set) it says only whether it is ready.
pub(crate) async fn readyz(State(s): State<Shared>, req: Request) -> Response {
    let upstreams = upstream_list_of(&s.core.config);
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
                   "healthy": s.core.gate.upstream_healthy(u)})
        })
        .collect();
    (
        status,
        axum::Json(json!({"ready": ready, "lanes": lanes, "upstreams": results})),
    )
        .into_response()
}
