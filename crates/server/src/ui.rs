//! The status page: `GET /ui` (one self-contained HTML page embedded in the binary, rendered on
//! the server so that it reads as a plain table without JavaScript) and `GET /ui/state` (the JSON
//! the page's script polls every second). Everything on the page comes from the gateway's own
//! `/metrics` exposition and the gate's snapshot, sampled once a second into a ten-minute ring, so
//! the page shows exactly what Prometheus would scrape.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use headroom_gate::GateSnapshot;
use serde::Serialize;
use serde_json::Value;

use crate::error::ErrorCode;
use crate::pools::PoolNames;
use crate::telemetry::{
    GPU_MEMORY_USED_BYTES, QUEUE_WAIT_SECONDS, REJECTIONS_TOTAL, REQUESTS_TOTAL, Telemetry,
    UPSTREAM_KV_CACHE_USAGE, UPSTREAM_REQUESTS_RUNNING, UPSTREAM_REQUESTS_WAITING,
};

/// How often the page's ring takes a sample.
pub(crate) const SAMPLE_PERIOD: Duration = Duration::from_secs(1);
/// Samples kept: ten minutes at one a second, plus the one the oldest rate is taken against.
const RING: usize = 601;
/// Window for the rates of 429 and 503 answers.
const RATE_WINDOW_SAMPLES: usize = 10;
/// Window for queue-wait quantiles and the "last minute" rejection counts.
const MINUTE_SAMPLES: usize = 60;

const PAGE_HEAD: &str = include_str!("ui/head.html");
const PAGE_SCRIPT: &str = include_str!("ui/page.js");

/// Cumulative counters and gauges of one lane at one instant.
#[derive(Debug, Clone, Default, PartialEq)]
struct LaneCounts {
    inflight: usize,
    queued: usize,
    /// `headroom_rejections_total` by reason (cumulative).
    rejections: BTreeMap<String, f64>,
    /// `headroom_requests_total` by outcome (cumulative).
    outcomes: BTreeMap<String, f64>,
    /// `headroom_queue_wait_seconds` cumulative buckets: (upper bound, count), `+Inf` last.
    wait_buckets: Vec<(f64, f64)>,
}

/// One engine behind a lane, as the gateway last scraped it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub(crate) struct EngineView {
    pub upstream: String,
    pub kv_cache_usage: Option<f64>,
    pub running: Option<f64>,
    pub waiting: Option<f64>,
}

/// One sample of the ring.
#[derive(Debug, Clone)]
struct Sample {
    unix_ms: u64,
    lanes: BTreeMap<String, LaneCounts>,
    /// Memory in use per device label (`gpu` label of the gauge).
    memory_used: BTreeMap<String, f64>,
    engines: Vec<EngineView>,
}

/// Extra JSON documents the page shows when the process has them (`/admin/box` under `up`, the
/// memory ledger): each a function returning the current document.
pub(crate) type Provider = Arc<dyn Fn() -> Option<Value> + Send + Sync>;

/// The page's ring of samples and optional providers.
pub(crate) struct UiState {
    ring: Mutex<VecDeque<Sample>>,
    providers: Vec<(&'static str, Provider)>,
}

impl Default for UiState {
    fn default() -> Self {
        UiState::new(Vec::new())
    }
}

impl UiState {
    /// An empty ring; `providers` name extra documents (e.g. `("box", …)`).
    pub(crate) fn new(providers: Vec<(&'static str, Provider)>) -> UiState {
        UiState {
            ring: Mutex::new(VecDeque::with_capacity(RING)),
            providers,
        }
    }

    /// Takes one sample from the gate's snapshot and the rendered exposition text.
    pub(crate) fn record(&self, snapshot: &GateSnapshot, exposition: &str) {
        let sample = sample_from(snapshot, exposition, unix_ms());
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        if ring.len() == RING {
            ring.pop_front();
        }
        ring.push_back(sample);
    }

    /// The page's JSON document, computed from the ring (rates over the last ten seconds,
    /// quantiles over the last minute) and the current gate snapshot for limits; `names` names
    /// the memory pools.
    pub(crate) fn view(&self, snapshot: &GateSnapshot, names: &PoolNames) -> UiView {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        let extras = self
            .providers
            .iter()
            .filter_map(|(name, f)| f().map(|v| ((*name).to_string(), v)))
            .collect();
        build_view(snapshot, &ring, extras, names)
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// One lane as the page shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct LaneView {
    pub name: String,
    pub policy: String,
    pub inflight: usize,
    pub max_inflight: usize,
    pub queued: usize,
    pub max_queue: usize,
    pub yielding: bool,
    pub admitted: u64,
    /// 429 answers per second over the last ten seconds.
    pub rate_429: f64,
    /// 503 answers per second over the last ten seconds.
    pub rate_503: f64,
    pub total_429: f64,
    pub total_503: f64,
    /// Queue-wait quantiles of requests admitted in the last minute (`None` when none were).
    pub queue_wait_p50_seconds: Option<f64>,
    pub queue_wait_p99_seconds: Option<f64>,
    /// While requests are queued: what holds the first one.
    pub waiting_for: Option<WaitingView>,
}

/// What holds the head of a lane's queue, as the page shows it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct WaitingView {
    /// The refusal code of the head's last check (`host_memory`, `lane_yielding`, ...).
    pub reason: String,
    /// For memory: the pool (by name) and the figures the check compared.
    pub pool: Option<String>,
    pub need_bytes: Option<u64>,
    pub margin_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// One line saying it: "host RAM: needs 182.3 MiB + 128.0 MiB margin; 94.5 MiB free, …".
    pub text: String,
}

/// One memory pool as the page shows it: the ledger's figures and the pool's name.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PoolView {
    pub name: String,
    #[serde(flatten)]
    pub pool: headroom_gate::PoolSnapshot,
}

/// Rejections of one code on one lane.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct RejectionView {
    pub lane: String,
    pub code: String,
    pub status: u16,
    pub last_minute: f64,
    pub total: f64,
}

/// One point of the memory chart.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct MemoryPoint {
    pub unix_ms: u64,
    pub used_bytes: f64,
}

/// The whole page document (`GET /ui/state`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct UiView {
    /// When the newest sample was taken (0 before the first); the page calls data stale when
    /// this stops moving.
    pub sampled_unix_ms: u64,
    pub samples: usize,
    pub draining: bool,
    pub lanes: Vec<LaneView>,
    pub rejections: Vec<RejectionView>,
    /// Memory in use per device, newest sample.
    pub memory_used_bytes: BTreeMap<String, f64>,
    /// The name of each device of `memory_used_bytes` and `ledger` ("host RAM", "GPU 0 (NAME)").
    pub pool_names: BTreeMap<String, String>,
    /// Memory in use summed over devices, the last ten minutes.
    pub memory_history: Vec<MemoryPoint>,
    pub engines: Vec<EngineView>,
    /// The memory ledger's pools (reading, reservations) when lanes admit on memory.
    pub ledger: Vec<PoolView>,
    /// Documents from providers (`box`, `ledger`) when present.
    pub extras: BTreeMap<String, Value>,
}

/// Status code a rejection reason is answered with (as `ApiError::from_rejection` maps it).
fn status_of(reason: &str) -> u16 {
    match reason {
        "queue_timeout" | "shutting_down" => 503,
        _ => 429,
    }
}

fn sample_from(snapshot: &GateSnapshot, exposition: &str, unix_ms: u64) -> Sample {
    let mut lanes: BTreeMap<String, LaneCounts> = snapshot
        .lanes
        .iter()
        .map(|l| {
            (
                l.name.clone(),
                LaneCounts {
                    inflight: l.inflight,
                    queued: l.queued,
                    ..LaneCounts::default()
                },
            )
        })
        .collect();
    let mut memory_used = BTreeMap::new();
    let mut engines: BTreeMap<String, EngineView> = BTreeMap::new();
    // Our own exposition, read with the same maintained parser as the engines' (a partial
    // result still counts: the metrics before a bad line are kept).
    let (metrics, _) = prom_text_format_parser::parse_scrape(exposition);
    for m in &metrics {
        for s in &m.samples {
            let label = |k: &str| {
                s.labels
                    .iter()
                    .find(|l| l.key == k)
                    .map(|l| l.value.clone())
                    .unwrap_or_default()
            };
            let Ok(v) = s.value.value.parse::<f64>() else {
                continue;
            };
            let plain = s.value.value_type == prom_text_format_parser::ValueType::Sample;
            match m.name.as_str() {
                REJECTIONS_TOTAL if plain => {
                    if let Some(lane) = lanes.get_mut(&label("lane")) {
                        *lane.rejections.entry(label("reason")).or_default() += v;
                    }
                }
                REQUESTS_TOTAL if plain => {
                    if let Some(lane) = lanes.get_mut(&label("lane")) {
                        *lane.outcomes.entry(label("outcome")).or_default() += v;
                    }
                }
                GPU_MEMORY_USED_BYTES if plain => {
                    memory_used.insert(label("gpu"), v);
                }
                UPSTREAM_KV_CACHE_USAGE | UPSTREAM_REQUESTS_RUNNING | UPSTREAM_REQUESTS_WAITING
                    if plain =>
                {
                    let upstream = label("upstream");
                    let e = engines
                        .entry(upstream.clone())
                        .or_insert_with(|| EngineView {
                            upstream,
                            ..EngineView::default()
                        });
                    match m.name.as_str() {
                        UPSTREAM_KV_CACHE_USAGE => e.kv_cache_usage = Some(v),
                        UPSTREAM_REQUESTS_RUNNING => e.running = Some(v),
                        _ => e.waiting = Some(v),
                    }
                }
                QUEUE_WAIT_SECONDS if plain => {
                    let le = label("le");
                    let bound = if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        match le.parse::<f64>() {
                            Ok(b) => b,
                            Err(_) => continue,
                        }
                    };
                    if let Some(lane) = lanes.get_mut(&label("lane")) {
                        lane.wait_buckets.push((bound, v));
                    }
                }
                _ => {}
            }
        }
    }
    for lane in lanes.values_mut() {
        lane.wait_buckets
            .sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap_or(std::cmp::Ordering::Equal));
    }
    Sample {
        unix_ms,
        lanes,
        memory_used,
        engines: engines.into_values().collect(),
    }
}

/// The quantile `q` of a histogram given as cumulative buckets, interpolated linearly inside
/// the bucket it falls in (Prometheus's `histogram_quantile` rule); `None` without observations.
pub(crate) fn bucket_quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut lower = 0.0;
    let mut below = 0.0;
    for &(upper, count) in buckets {
        if count >= rank {
            if upper.is_infinite() {
                // Above the highest finite bound: report that bound, as Prometheus does.
                return Some(lower);
            }
            let inside = count - below;
            let fraction = if inside > 0.0 {
                (rank - below) / inside
            } else {
                1.0
            };
            return Some(lower + (upper - lower) * fraction);
        }
        lower = upper;
        below = count;
    }
    Some(lower)
}

/// `now − then` per bucket (counters only grow; a reset counts from zero).
fn bucket_delta(now: &[(f64, f64)], then: &[(f64, f64)]) -> Vec<(f64, f64)> {
    now.iter()
        .map(|&(le, n)| {
            let before = then.iter().find(|b| b.0 == le).map(|b| b.1).unwrap_or(0.0);
            (le, if n >= before { n - before } else { n })
        })
        .collect()
}

fn counter_delta(now: f64, then: f64) -> f64 {
    if now >= then { now - then } else { now }
}

/// The sum of `values`, +0.0 when there are none (`Iterator::sum` of floats starts from -0.0,
/// which JSON would show as `-0.0`).
fn total(values: impl Iterator<Item = f64>) -> f64 {
    values.fold(0.0, |sum, v| sum + v)
}

fn sum_where(map: &BTreeMap<String, f64>, status: u16) -> f64 {
    total(
        map.iter()
            .filter(|(reason, _)| status_of(reason) == status)
            .map(|(_, v)| *v),
    )
}

/// Bytes as MiB with one decimal.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// What holds a lane's queue, with its pool's name and, for memory, the figures in one line.
fn waiting_view(lane: &headroom_gate::LaneSnapshot, names: &PoolNames) -> Option<WaitingView> {
    let waiting = lane.waiting_for.as_ref()?;
    let Some(m) = &waiting.memory else {
        return Some(WaitingView {
            reason: waiting.reason.to_string(),
            pool: None,
            need_bytes: None,
            margin_bytes: None,
            free_bytes: None,
            reserved_bytes: None,
            text: waiting.reason.to_string(),
        });
    };
    let pool = names.name(m.device);
    let free = m
        .free_bytes
        .map_or("no reading".to_string(), |f| format!("{} free", mib(f)));
    Some(WaitingView {
        reason: waiting.reason.to_string(),
        text: format!(
            "{pool}: needs {} + {} margin; {free}, {} reserved",
            mib(m.need_bytes),
            mib(m.margin_bytes),
            mib(m.reserved_bytes)
        ),
        pool: Some(pool),
        need_bytes: Some(m.need_bytes),
        margin_bytes: Some(m.margin_bytes),
        free_bytes: m.free_bytes,
        reserved_bytes: Some(m.reserved_bytes),
    })
}

fn lane_view(
    lane: &headroom_gate::LaneSnapshot,
    newest: Option<&LaneCounts>,
    rate_base: Option<(&LaneCounts, f64)>,
    minute_base: Option<&LaneCounts>,
    names: &PoolNames,
) -> LaneView {
    let empty = LaneCounts::default();
    let now = newest.unwrap_or(&empty);
    // Preempted requests end with 503 too, counted by outcome rather than by rejection.
    let preempted = |c: &LaneCounts| c.outcomes.get("preempted").copied().unwrap_or(0.0);
    let total_429 = sum_where(&now.rejections, 429);
    let total_503 = sum_where(&now.rejections, 503) + preempted(now);
    let (rate_429, rate_503) = match rate_base {
        Some((base, seconds)) if seconds > 0.0 => (
            counter_delta(total_429, sum_where(&base.rejections, 429)) / seconds,
            counter_delta(
                total_503,
                sum_where(&base.rejections, 503) + preempted(base),
            ) / seconds,
        ),
        _ => (0.0, 0.0),
    };
    let recent = match minute_base {
        Some(base) => bucket_delta(&now.wait_buckets, &base.wait_buckets),
        None => now.wait_buckets.clone(),
    };
    LaneView {
        name: lane.name.clone(),
        policy: format!("{:?}", lane.policy).to_lowercase(),
        inflight: lane.inflight,
        max_inflight: lane.max_inflight,
        queued: lane.queued,
        max_queue: lane.max_queue,
        yielding: lane.yielding,
        admitted: lane.admitted,
        rate_429,
        rate_503,
        total_429,
        total_503,
        queue_wait_p50_seconds: bucket_quantile(0.5, &recent),
        queue_wait_p99_seconds: bucket_quantile(0.99, &recent),
        waiting_for: waiting_view(lane, names),
    }
}

fn build_view(
    snapshot: &GateSnapshot,
    ring: &VecDeque<Sample>,
    extras: BTreeMap<String, Value>,
    names: &PoolNames,
) -> UiView {
    let newest = ring.back();
    let back = |n: usize| ring.len().checked_sub(n + 1).and_then(|i| ring.get(i));
    let rate_base = back(RATE_WINDOW_SAMPLES.min(ring.len().saturating_sub(1)));
    let minute_base = back(MINUTE_SAMPLES).or_else(|| ring.front());
    let seconds = match (newest, rate_base) {
        (Some(n), Some(b)) => (n.unix_ms.saturating_sub(b.unix_ms)) as f64 / 1000.0,
        _ => 0.0,
    };
    let lanes = snapshot
        .lanes
        .iter()
        .map(|l| {
            let now = newest.and_then(|s| s.lanes.get(&l.name));
            let rate = rate_base
                .and_then(|s| s.lanes.get(&l.name))
                .map(|c| (c, seconds));
            let minute = minute_base
                .filter(|b| newest.is_some_and(|n| n.unix_ms != b.unix_ms))
                .and_then(|s| s.lanes.get(&l.name));
            lane_view(l, now, rate, minute, names)
        })
        .collect();
    let mut rejections = Vec::new();
    if let Some(now) = newest {
        for (lane, counts) in &now.lanes {
            for (code, total) in &counts.rejections {
                let before = minute_base
                    .and_then(|b| b.lanes.get(lane))
                    .and_then(|c| c.rejections.get(code))
                    .copied()
                    .unwrap_or(0.0);
                rejections.push(RejectionView {
                    lane: lane.clone(),
                    code: code.clone(),
                    status: status_of(code),
                    last_minute: counter_delta(*total, before),
                    total: *total,
                });
            }
        }
    }
    rejections.sort_by(|a, b| {
        b.last_minute
            .partial_cmp(&a.last_minute)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(
                b.total
                    .partial_cmp(&a.total)
                    .unwrap_or(std::cmp::Ordering::Equal),
            )
    });
    let memory_history = ring
        .iter()
        .filter(|s| !s.memory_used.is_empty())
        .map(|s| MemoryPoint {
            unix_ms: s.unix_ms,
            used_bytes: total(s.memory_used.values().copied()),
        })
        .collect();
    let memory_used_bytes: BTreeMap<String, f64> =
        newest.map(|s| s.memory_used.clone()).unwrap_or_default();
    let pool_names = memory_used_bytes
        .keys()
        .filter_map(|k| Some((k.clone(), names.name(k.parse().ok()?))))
        .chain(
            snapshot
                .memory
                .iter()
                .map(|p| (p.device.to_string(), names.name(p.device))),
        )
        .collect();
    UiView {
        sampled_unix_ms: newest.map_or(0, |s| s.unix_ms),
        samples: ring.len(),
        draining: snapshot.draining,
        lanes,
        rejections,
        memory_used_bytes,
        pool_names,
        memory_history,
        engines: newest.map(|s| s.engines.clone()).unwrap_or_default(),
        ledger: snapshot
            .memory
            .iter()
            .map(|p| PoolView {
                name: names.name(p.device),
                pool: p.clone(),
            })
            .collect(),
        extras,
    }
}

/// Samples the gateway once a second, forever.
pub(crate) async fn sample_loop(
    ui: Arc<UiState>,
    gate: headroom_gate::Gate,
    telemetry: Arc<Telemetry>,
) {
    let mut tick = tokio::time::interval(SAMPLE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let snapshot = gate.snapshot();
        let text = telemetry.render(&snapshot);
        ui.record(&snapshot, &text);
    }
}

/// The page's document now, with the box's backends when `headroom up` runs this gateway.
fn current_view(s: &crate::state::AppState) -> UiView {
    let mut view = s.ui.view(&s.core.gate.snapshot(), &s.pool_names);
    if let Some(provider) = s.core.box_provider.get()
        && let Ok(report) = serde_json::to_value(provider.report())
    {
        view.extras.insert("box".to_string(), report);
    }
    view
}

/// `GET /ui`: the page, rendered with the current figures.
pub(crate) async fn serve_page(
    axum::extract::State(s): axum::extract::State<crate::state::Shared>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let view = current_view(&s);
    (
        [
            (axum::http::header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (axum::http::header::CACHE_CONTROL, "no-store"),
            (
                axum::http::header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 connect-src 'self'; img-src 'self' data:",
            ),
        ],
        page(&view),
    )
        .into_response()
}

/// `GET /ui/state`: the page's JSON document.
pub(crate) async fn serve_state(
    axum::extract::State(s): axum::extract::State<crate::state::Shared>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let view = current_view(&s);
    (
        [(axum::http::header::CACHE_CONTROL, "no-store")],
        axum::Json(view),
    )
        .into_response()
}

/// A browser cannot add a bearer token to a page it navigates to, so the page also accepts the
/// key as the password of HTTP Basic authentication (any user name); the browser then resends it
/// with the page's own polls.
pub(crate) fn basic_key_matches(headers: &axum::http::HeaderMap, keys: &[String]) -> bool {
    use base64::Engine as _;
    let Some(encoded) = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
    else {
        return false;
    };
    let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(encoded.trim()) else {
        return false;
    };
    let Some(colon) = decoded.iter().position(|&b| b == b':') else {
        return false;
    };
    crate::edge::key_matches(&decoded[colon + 1..], keys)
}

/// 401 that makes a browser ask for the key (as the Basic password).
pub(crate) fn ask_for_key() -> axum::response::Response {
    use axum::response::IntoResponse;
    let mut r = crate::error::ApiError::new(
        axum::http::StatusCode::UNAUTHORIZED,
        ErrorCode::InvalidApiKey,
        "a valid API key is required (Authorization: Bearer KEY, or the key as the Basic password)",
    )
    .into_response();
    r.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Basic realm=\"headroom\", charset=\"UTF-8\""),
    );
    r
}

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn seconds_cell(v: Option<f64>) -> String {
    match v {
        Some(s) if s < 1.0 => format!("{:.0} ms", s * 1000.0),
        Some(s) => format!("{s:.2} s"),
        None => "–".to_string(),
    }
}

fn bytes_cell(v: f64) -> String {
    format!("{:.2} GiB", v / (1u64 << 30) as f64)
}

/// The lanes table, rendered on the server (what a browser without JavaScript shows).
fn lanes_table(view: &UiView) -> String {
    let mut t = String::from(
        "<table id=\"lanes\"><thead><tr><th>lane</th><th>policy</th><th>in flight</th>\
         <th>queued</th><th>429/s</th><th>503/s</th><th>429 total</th><th>503 total</th>\
         <th>queue wait p50</th><th>queue wait p99</th><th>waiting for</th></tr></thead><tbody>",
    );
    for l in &view.lanes {
        let _ = write!(
            t,
            "<tr data-lane=\"{name}\"><td>{name}{y}</td><td>{policy}</td>\
             <td class=\"inflight\">{}/{}</td><td class=\"queued\">{}/{}</td>\
             <td class=\"r429\">{:.2}</td><td class=\"r503\">{:.2}</td>\
             <td class=\"t429\">{}</td><td class=\"t503\">{}</td>\
             <td class=\"p50\">{}</td><td class=\"p99\">{}</td>\
             <td class=\"waiting\">{}</td></tr>",
            l.inflight,
            l.max_inflight,
            l.queued,
            l.max_queue,
            l.rate_429,
            l.rate_503,
            l.total_429,
            l.total_503,
            seconds_cell(l.queue_wait_p50_seconds),
            seconds_cell(l.queue_wait_p99_seconds),
            l.waiting_for
                .as_ref()
                .map_or(String::new(), |w| escape(&w.text)),
            name = escape(&l.name),
            policy = escape(&l.policy),
            y = if l.yielding { " (yielding)" } else { "" },
        );
    }
    t.push_str("</tbody></table>");
    t
}

fn rejections_table(view: &UiView) -> String {
    let mut t = String::from(
        "<table id=\"rejections\"><thead><tr><th>lane</th><th>code</th><th>status</th>\
         <th>last minute</th><th>total</th></tr></thead><tbody>",
    );
    for r in &view.rejections {
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&r.lane),
            escape(&r.code),
            r.status,
            r.last_minute,
            r.total
        );
    }
    if view.rejections.is_empty() {
        t.push_str("<tr><td colspan=\"5\">no rejections</td></tr>");
    }
    t.push_str("</tbody></table>");
    t
}

fn memory_table(view: &UiView) -> String {
    let mut t = String::from(
        "<table id=\"memory\"><thead><tr><th>device</th><th>in use</th></tr></thead><tbody>",
    );
    for (device, used) in &view.memory_used_bytes {
        let name = view
            .pool_names
            .get(device)
            .cloned()
            .unwrap_or_else(|| format!("GPU {device}"));
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td></tr>",
            escape(&name),
            bytes_cell(*used)
        );
    }
    if view.memory_used_bytes.is_empty() {
        t.push_str("<tr><td colspan=\"2\">no memory probe</td></tr>");
    }
    t.push_str("</tbody></table>");
    t
}

fn backends_table(view: &UiView) -> String {
    let Some(report) = view.extras.get("box") else {
        return String::new();
    };
    let Some(backends) = report["backends"].as_array() else {
        return String::new();
    };
    let mut t = enforce_line(&report["enforce"]);
    t.push_str(
        "<h3>Backends</h3><table id=\"backends\"><thead><tr><th>backend</th><th>role</th>\
         <th>state</th><th>memory now</th><th>measured idle</th><th>peak</th><th>restarts</th>\
         <th>last exit</th></tr></thead><tbody>",
    );
    for b in backends {
        let bytes = |k: &str| b[k].as_f64().map_or("–".to_string(), bytes_cell);
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"now\">{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            escape(b["name"].as_str().unwrap_or("")),
            escape(b["role"].as_str().unwrap_or("")),
            escape(b["state"].as_str().unwrap_or("")),
            bytes("current_bytes"),
            bytes("resident_bytes"),
            bytes("peak_bytes"),
            b["restarts"].as_u64().unwrap_or(0),
            escape(b["last_exit"].as_str().unwrap_or("–"))
        );
    }
    t.push_str("</tbody></table>");
    t
}

/// The box's enforced memory limit, its cgroup's reading and OOM kills (empty when not enforced).
fn enforce_line(e: &serde_json::Value) -> String {
    if !e.is_object() {
        return String::new();
    }
    let bytes = |k: &str| e[k].as_f64().map_or("–".to_string(), bytes_cell);
    format!(
        "<p id=\"enforce\">limit {} enforced by memory cgroup {} <code>{}</code>: \
         in use {} (charged {}), <span class=\"oom\">OOM kills {}</span></p>",
        bytes("limit_bytes"),
        escape(e["version"].as_str().unwrap_or("")),
        escape(e["cgroup"].as_str().unwrap_or("")),
        bytes("working_set_bytes"),
        bytes("usage_bytes"),
        e["oom_kills"].as_u64().unwrap_or(0)
    )
}

fn ledger_table(view: &UiView) -> String {
    if view.ledger.is_empty() {
        return String::new();
    }
    let mut t = String::from(
        "<h3>Memory ledger</h3><table id=\"ledger-table\"><thead><tr><th>pool</th><th>total</th>\
         <th>free (read)</th><th>reserved</th><th>reservations</th><th>reading age</th></tr>\
         </thead><tbody>",
    );
    let bytes = |v: Option<u64>| v.map_or("–".to_string(), |b| bytes_cell(b as f64));
    for p in &view.ledger {
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"reserved\">{}</td>\
             <td class=\"reservations\">{}</td><td>{}</td></tr>",
            escape(&p.name),
            bytes(p.pool.total_bytes),
            bytes(p.pool.free_bytes),
            bytes_cell(p.pool.reserved_bytes as f64),
            p.pool.reservations,
            p.pool
                .reading_age_seconds
                .map_or("none".to_string(), |a| format!("{a:.1} s"))
        );
    }
    t.push_str("</tbody></table>");
    t
}

fn engines_table(view: &UiView) -> String {
    let mut t = String::from(
        "<table id=\"engines\"><thead><tr><th>upstream</th><th>KV cache</th><th>running</th>\
         <th>waiting</th></tr></thead><tbody>",
    );
    let num = |v: Option<f64>| v.map_or("–".to_string(), |v| format!("{v}"));
    for e in &view.engines {
        let _ = write!(
            t,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&e.upstream),
            e.kv_cache_usage
                .map_or("–".to_string(), |v| format!("{:.0} %", v * 100.0)),
            num(e.running),
            num(e.waiting)
        );
    }
    if view.engines.is_empty() {
        t.push_str("<tr><td colspan=\"4\">no engine metrics</td></tr>");
    }
    t.push_str("</tbody></table>");
    t
}

/// The whole page: head, server-rendered tables, and the script that takes over when it runs.
pub(crate) fn page(view: &UiView) -> String {
    let mut html = String::with_capacity(16 * 1024);
    html.push_str(PAGE_HEAD);
    let _ = write!(
        html,
        "<main data-sampled=\"{}\">\
         <p id=\"status\" class=\"status\">server-rendered at {} (JavaScript off: reload to refresh)</p>\
         <section class=\"wide\"><h2>Lanes</h2>{}</section>\
         <section><h2>Memory</h2>{}<div id=\"box\">{}</div><div id=\"ledger\">{}</div>\
         <svg id=\"chart\" viewBox=\"0 0 600 120\" preserveAspectRatio=\"none\" role=\"img\" \
         aria-label=\"memory in use, last 10 minutes\"></svg></section>\
         <section><h2>Engines</h2>{}</section>\
         <section><h2>Recent rejections</h2>{}</section></main>",
        view.sampled_unix_ms,
        view.sampled_unix_ms,
        lanes_table(view),
        memory_table(view),
        backends_table(view),
        ledger_table(view),
        engines_table(view),
        rejections_table(view),
    );
    html.push_str("<script>");
    html.push_str(PAGE_SCRIPT);
    html.push_str("</script></body></html>");
    html
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::memory::ProbeKind;

    #[test]
    fn quantile_interpolates_inside_the_bucket() {
        // 100 observations: 50 at or below 0.1 s, 50 more at or below 0.5 s.
        let b = [(0.1, 50.0), (0.5, 100.0), (f64::INFINITY, 100.0)];
        // The median is the 50th observation: the top of the first bucket.
        assert_eq!(bucket_quantile(0.5, &b), Some(0.1));
        // p75 is halfway through the second bucket: 0.1 + 0.4 × 25/50.
        let p75 = bucket_quantile(0.75, &b).unwrap();
        assert!((p75 - 0.3).abs() < 1e-9, "{p75}");
        assert_eq!(
            bucket_quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]),
            None
        );
        // Everything above the last finite bound: that bound.
        assert_eq!(
            bucket_quantile(0.99, &[(1.0, 0.0), (f64::INFINITY, 4.0)]),
            Some(1.0)
        );
    }

    #[test]
    fn bucket_delta_survives_a_reset() {
        let then = [(0.1, 5.0), (f64::INFINITY, 9.0)];
        let now = [(0.1, 7.0), (f64::INFINITY, 3.0)];
        assert_eq!(
            bucket_delta(&now, &then),
            vec![(0.1, 2.0), (f64::INFINITY, 3.0)]
        );
    }

    #[test]
    fn escapes_markup_in_names() {
        assert_eq!(
            escape("<a href='x'>&\""),
            "&lt;a href=&#39;x&#39;&gt;&amp;&quot;"
        );
    }

    fn lane_snapshot() -> headroom_gate::LaneSnapshot {
        headroom_gate::LaneSnapshot {
            name: String::new(),
            inflight: 0,
            queued: 0,
            rejected: 0,
            max_inflight: 1,
            max_queue: 0,
            priority: 0,
            policy: headroom_gate::Policy::Reject,
            admitted: 0,
            completed: 0,
            queue_timeouts: 0,
            cancelled_in_queue: 0,
            mean_service_seconds: None,
            service_rate_per_second: None,
            yielding: false,
            held_by: None,
            upstreams: Vec::new(),
            memory: None,
            waiting_for: None,
        }
    }

    fn one_lane(lane: headroom_gate::LaneSnapshot) -> GateSnapshot {
        GateSnapshot {
            lanes: vec![lane],
            total_inflight: 0,
            max_inflight_total: None,
            draining: false,
            memory: Vec::new(),
        }
    }

    #[test]
    fn no_count_is_negative_zero() {
        // A lane with no rejections and a sample with no memory: sums over nothing.
        let snapshot = one_lane(headroom_gate::LaneSnapshot {
            name: "text".into(),
            ..lane_snapshot()
        });
        let ui = UiState::default();
        ui.record(&snapshot, "");
        ui.record(&snapshot, "");
        let view = ui.view(&snapshot, &PoolNames::new(ProbeKind::Host));
        let json = serde_json::to_string(&view).unwrap();
        assert!(!json.contains("-0.0"), "{json}");
        assert!(json.contains("\"total_429\":0.0"), "{json}");
    }

    #[test]
    fn a_lane_waiting_on_memory_shows_its_need_beside_free_and_reserved() {
        const MIB: u64 = 1 << 20;
        let snapshot = one_lane(headroom_gate::LaneSnapshot {
            name: "whisper".into(),
            queued: 1,
            waiting_for: Some(headroom_gate::WaitingFor {
                reason: "host_memory",
                memory: Some(headroom_gate::MemoryShortfall {
                    device: 0,
                    free_bytes: Some(222 * MIB + MIB / 2),
                    reserved_bytes: 0,
                    need_bytes: 182 * MIB + 3 * MIB / 10,
                    margin_bytes: 128 * MIB,
                    ceiling_bytes: Some(300 * MIB),
                }),
            }),
            ..lane_snapshot()
        });
        let view = UiState::default().view(&snapshot, &PoolNames::new(ProbeKind::Host));
        let waiting = view.lanes[0].waiting_for.clone().unwrap();
        assert_eq!(
            waiting.text,
            "host RAM: needs 182.3 MiB + 128.0 MiB margin; 222.5 MiB free, 0.0 MiB reserved"
        );
        assert_eq!(waiting.pool.as_deref(), Some("host RAM"));
        // The page without JavaScript says the same in the lane's row.
        assert!(page(&view).contains(&waiting.text));
    }

    #[test]
    fn samples_read_labels_from_the_exposition() {
        let snapshot = GateSnapshot {
            lanes: Vec::new(),
            total_inflight: 0,
            max_inflight_total: None,
            draining: false,
            memory: Vec::new(),
        };
        let text = "# TYPE headroom_gpu_memory_used_bytes gauge\n\
                    headroom_gpu_memory_used_bytes{gpu=\"0\"} 1073741824\n\
                    # TYPE headroom_upstream_kv_cache_usage gauge\n\
                    headroom_upstream_kv_cache_usage{upstream=\"http://127.0.0.1:1\"} 0.25\n";
        let s = sample_from(&snapshot, text, 7);
        assert_eq!(s.memory_used.get("0"), Some(&1073741824.0));
        assert_eq!(s.engines.len(), 1);
        assert_eq!(s.engines[0].kv_cache_usage, Some(0.25));
        // A lane's queue-wait histogram, as metrics-exporter-prometheus writes it.
        let snapshot = GateSnapshot {
            lanes: vec![headroom_gate::LaneSnapshot {
                name: "text".into(),
                ..lane_snapshot()
            }],
            ..snapshot
        };
        let hist = "# TYPE headroom_queue_wait_seconds histogram\n\
                    headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"0.1\"} 3\n\
                    headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"1\"} 4\n\
                    headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"+Inf\"} 4\n\
                    headroom_queue_wait_seconds_sum{lane=\"text\"} 1.2\n\
                    headroom_queue_wait_seconds_count{lane=\"text\"} 4\n\
                    # TYPE headroom_rejections_total counter\n\
                    headroom_rejections_total{lane=\"text\",reason=\"lane_saturated\"} 9\n";
        let s = sample_from(&snapshot, hist, 8);
        let lane = &s.lanes["text"];
        assert_eq!(
            lane.wait_buckets,
            vec![(0.1, 3.0), (1.0, 4.0), (f64::INFINITY, 4.0)]
        );
        assert_eq!(lane.rejections.get("lane_saturated"), Some(&9.0));
    }
}
