//! The admin routes: `GET /admin/lanes` (the gate's snapshot with the pools' names),
//! `GET /admin/load` (the balancer signals) and `GET /admin/box` (the supervisor's report, 404
//! without one).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::admin_box::BoxReport;
use crate::error::{ApiError, ErrorCode};
use crate::state::{AppState, Shared};

/// `GET /admin/load`: the load figure and its parts, as the balancer signals carry them.
pub(crate) async fn admin_load(State(s): State<Shared>) -> Response {
    axum::Json(s.balancer.get()).into_response()
}

/// `GET /admin/lanes`: the gate's snapshot, each memory pool and each memory lane with the name
/// of its pool (`name`, `pool`).
pub(crate) async fn admin_lanes(State(s): State<Shared>) -> Response {
    let mut doc = serde_json::to_value(s.core.gate.snapshot()).unwrap_or_default();
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

/// The pool as the gateway's memory feed last read it: `name`, `device`, `total_bytes`,
/// `used_bytes`, `free_bytes`, `reading_age_seconds` (a tool without NVML, such as `top` on a CPU
/// box, reads the pool from here). Without a reading: the capacity and the backends' memory now.
fn pool_figures(s: &AppState, report: &BoxReport) -> serde_json::Value {
    let device = s.core.config.memory.device;
    let reading = s
        .core
        .gate
        .snapshot()
        .memory
        .into_iter()
        .find(|p| p.device == device)
        .and_then(|p| Some((p.total_bytes?, p.free_bytes?, p.reading_age_seconds)));
    let (total, used, age) = match reading {
        Some((total, free, age)) => (total, total.saturating_sub(free), age),
        None => (
            report.capacity_bytes,
            report.backends.iter().map(|b| b.current_bytes).sum(),
            None,
        ),
    };
    serde_json::json!({
        "name": s.pool_names.name(device),
        "device": device,
        "total_bytes": total,
        "used_bytes": used,
        "free_bytes": total.saturating_sub(used),
        "reading_age_seconds": age,
    })
}

/// The `/admin/box` handler: the supervisor's report, with the pool's figures now (`pool`).
pub(crate) async fn box_handler(State(s): State<Shared>) -> Response {
    match s.core.box_provider.get() {
        Some(provider) => {
            let report = provider.report();
            let pool = pool_figures(&s, &report);
            let mut doc = serde_json::to_value(&report).unwrap_or_default();
            doc["pool"] = pool;
            axum::Json(doc).into_response()
        }
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::UnknownRoute,
            "no route GET /admin/box (this gateway does not run under headroom up)",
        )
        .into_response(),
    }
}
