//! `GET /metrics`: the gateway's own registry, then the supervisor's box figures (its backends
//! and, when capacity is enforced, its memory cgroup) in Prometheus text format.

use std::fmt::Write as _;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::admin_box::{BackendReport, BackendState, EnforceReport};
use crate::state::{AppState, Shared};

pub(crate) async fn metrics(State(s): State<Shared>) -> Response {
    let text = s.core.telemetry.render(&s.core.gate.snapshot()) + &box_metrics(&s);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// A metric name, its help text and how to read it off a backend.
type Gauge = (&'static str, &'static str, fn(&BackendReport) -> f64);

/// The box's figures in Prometheus text format (appended to `/metrics`); empty without a provider.
fn box_metrics(state: &AppState) -> String {
    let Some(provider) = state.core.box_provider.get() else {
        return String::new();
    };
    let report = provider.report();
    let mut out = String::new();
    let gauges: [Gauge; 6] = [
        (
            "headroom_box_backend_resident_bytes",
            "Steady idle memory measured after warm-up",
            |b| b.resident_bytes as f64,
        ),
        (
            "headroom_box_backend_peak_bytes",
            "Highest memory seen while measuring",
            |b| b.peak_bytes as f64,
        ),
        (
            "headroom_box_backend_memory_bytes",
            "Memory of the backend's process tree now",
            |b| b.current_bytes as f64,
        ),
        (
            "headroom_box_backend_restarts_total",
            "Restarts attempted after the backend exited, counted as each begins",
            |b| b.restarts as f64,
        ),
        (
            "headroom_box_backend_start_failures_total",
            "Restart attempts that did not come up healthy",
            |b| b.start_failures as f64,
        ),
        (
            "headroom_box_backend_drifted",
            "1 when memory grew past the measured peak by more than the margin",
            |b| if b.drifted { 1.0 } else { 0.0 },
        ),
    ];
    for (name, help, value) in gauges {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for b in &report.backends {
            let _ = writeln!(
                out,
                "{name}{{backend=\"{}\",role=\"{}\"}} {}",
                b.name,
                b.role,
                value(b)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP headroom_box_backend_up 1 when the backend is ready\n# TYPE headroom_box_backend_up gauge"
    );
    for b in &report.backends {
        let _ = writeln!(
            out,
            "headroom_box_backend_up{{backend=\"{}\",state=\"{}\"}} {}",
            b.name,
            b.state.as_str(),
            u8::from(b.state == BackendState::Ready)
        );
    }
    let _ = writeln!(
        out,
        "# HELP headroom_box_text_budget_bytes Memory given to the text engine\n# TYPE headroom_box_text_budget_bytes gauge\nheadroom_box_text_budget_bytes {}",
        report.text_budget_bytes
    );
    if let Some(e) = &report.enforce {
        render_enforce(&mut out, e);
    }
    out
}

/// The memory cgroup's figures: OOM kills (a counter), its limit and its charge.
fn render_enforce(out: &mut String, e: &EnforceReport) {
    let rows: [(&str, &str, &str, u64); 4] = [
        (
            "headroom_box_oom_kills_total",
            "counter",
            "Processes of the box the kernel's OOM killer killed inside its memory cgroup",
            e.oom_kills,
        ),
        (
            "headroom_box_memory_limit_bytes",
            "gauge",
            "Hard memory limit of the box's cgroup (the enforced capacity)",
            e.limit_bytes,
        ),
        (
            "headroom_box_memory_usage_bytes",
            "gauge",
            "Memory the kernel charges to the box's cgroup, page cache included",
            e.usage_bytes,
        ),
        (
            "headroom_box_memory_working_set_bytes",
            "gauge",
            "The box's cgroup charge less inactive file cache: the pool's reading",
            e.working_set_bytes,
        ),
    ];
    for (name, kind, help, value) in rows {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
        );
    }
}
