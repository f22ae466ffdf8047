//! The gateway's own Prometheus metrics: one recorder per gateway (no global state, so several
//! gateways can share a process), the metric names, each lane's per-request handles (registered
//! once, so the request path builds no label strings), rendering for `/metrics`, and the upkeep
//! task that folds recorded histogram samples into their buckets so memory stays bounded whether
//! or not anyone scrapes.

use std::sync::OnceLock;

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use headroom_gate::GateSnapshot;
use headroom_gate::LaneMemorySnapshot;

pub(crate) const REQUESTS_TOTAL: &str = "headroom_requests_total";
pub(crate) const LANE_INFLIGHT: &str = "headroom_lane_inflight";
pub(crate) const LANE_QUEUE_DEPTH: &str = "headroom_lane_queue_depth";
pub(crate) const QUEUE_WAIT_SECONDS: &str = "headroom_queue_wait_seconds";
pub const TTFT_SECONDS: &str = "headroom_ttft_seconds";
pub(crate) const REQUEST_DURATION_SECONDS: &str = "headroom_request_duration_seconds";
pub(crate) const REJECTIONS_TOTAL: &str = "headroom_rejections_total";
pub(crate) const FALLBACKS_TOTAL: &str = "headroom_fallbacks_total";
/// Requests from a client refused on the lane less than its Retry-After earlier (see
/// `retry_watch`).
pub(crate) const EARLY_RETRIES_TOTAL: &str = "headroom_early_retries_total";
/// Requests refused for their input (4xx other than 429), by error code.
pub(crate) const BAD_REQUESTS_TOTAL: &str = "headroom_bad_requests_total";
/// Client connections the gateway closed itself, by `reason`: `header_timeout`, `idle_timeout`,
/// `send_timeout` (a client that stopped reading its response), `deadline` (the response's
/// deadline passed while the client was slow to read it) and `shed` (idle, closed at the
/// open-file limit to take a new client).
pub(crate) const CONNECTIONS_CLOSED_TOTAL: &str = "headroom_connections_closed_total";
/// Requests that waited for room under `max_body_memory` before their body was read, and those
/// refused (503) when none came in time, by `outcome` (`waited`, `refused`).
pub(crate) const BODY_MEMORY_WAITS_TOTAL: &str = "headroom_body_memory_waits_total";
pub(crate) const GPU_MEMORY_USED_BYTES: &str = "headroom_gpu_memory_used_bytes";
/// Memory ledger, per device: free in the last reading, reserved by admitted jobs, the part of
/// that the reading does not show yet, and the number of reservations.
pub(crate) const MEMORY_FREE_BYTES: &str = "headroom_memory_free_bytes";
pub(crate) const MEMORY_RESERVED_BYTES: &str = "headroom_memory_reserved_bytes";
pub(crate) const MEMORY_HIDDEN_BYTES: &str = "headroom_memory_unseen_reserved_bytes";
pub(crate) const MEMORY_RESERVATIONS: &str = "headroom_memory_reservations";
/// A lane's memory need per job and per audio second, by `source`: configured, learned, in_force.
pub(crate) const LANE_MEMORY_PER_JOB_BYTES: &str = "headroom_lane_memory_per_job_bytes";
pub(crate) const LANE_MEMORY_PER_AUDIO_SECOND_BYTES: &str =
    "headroom_lane_memory_per_audio_second_bytes";
/// Jobs whose peak the lane has measured since start.
pub(crate) const LANE_MEMORY_MEASURED_JOBS: &str = "headroom_lane_memory_measured_jobs";
pub(crate) const UPSTREAM_KV_CACHE_USAGE: &str = "headroom_upstream_kv_cache_usage";
pub(crate) const UPSTREAM_REQUESTS_WAITING: &str = "headroom_upstream_requests_waiting";
pub(crate) const UPSTREAM_REQUESTS_RUNNING: &str = "headroom_upstream_requests_running";
/// Unix time of the last good scrape of an engine's `/metrics`, per upstream (alerting on
/// staleness: `time() - …`).
pub(crate) const UPSTREAM_LAST_SCRAPE_TIMESTAMP: &str =
    "headroom_upstream_last_scrape_timestamp_seconds";
/// 1 per lane, with its `kind` (`audio` or `text`), for dashboards and alert rules to join on.
pub(crate) const LANE_INFO: &str = "headroom_lane_info";
/// Lane settings, published once at start so `headroom doctor --metrics` can judge the figures
/// against them: `max_inflight`, `max_queue`, `queue_timeout` (seconds), `policy` (label, value
/// 1), `yield_to` (one series per lane yielded to, value 1) and `preempt` (0/1).
pub(crate) const LANE_MAX_INFLIGHT: &str = "headroom_lane_max_inflight";
pub(crate) const LANE_MAX_QUEUE: &str = "headroom_lane_max_queue";
pub(crate) const LANE_QUEUE_TIMEOUT_SECONDS: &str = "headroom_lane_queue_timeout_seconds";
pub(crate) const LANE_POLICY: &str = "headroom_lane_policy";
pub(crate) const LANE_YIELDS_TO: &str = "headroom_lane_yields_to";
pub(crate) const LANE_PREEMPT: &str = "headroom_lane_preempt";

const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// How often recorded histogram samples are folded into buckets when nobody scrapes. Between two
/// upkeeps the raw samples wait in a lock-free list (8 bytes each), so this bounds that list to
/// what one interval's traffic records.
pub(crate) const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// Request outcomes the gateway counts; any other outcome is registered on use.
const OUTCOMES: &[&str] = &[
    "ok",
    "client_disconnected",
    "deadline",
    "preempted",
    "upstream_error",
    "queue_timeout",
    "shutting_down",
    "rejected",
    "fallback",
];

/// Rejection reasons (the gate's codes); any other is registered on use.
const REASONS: &[&str] = &[
    "lane_queue_full",
    "lane_saturated",
    "gpu_memory",
    "engine_saturated",
    "lane_yielding",
    "device_saturated",
    "queue_timeout",
    "shutting_down",
];

/// One lane's per-request metric handles. Each is registered the first time it is used (so
/// `/metrics` shows only series that happened) and then reused: recording is an atomic update.
struct LaneMetrics {
    name: String,
    queue_wait: OnceLock<Histogram>,
    ttft: OnceLock<Histogram>,
    duration: OnceLock<Histogram>,
    fallbacks: OnceLock<Counter>,
    outcomes: Vec<OnceLock<Counter>>,
    rejections: Vec<OnceLock<Counter>>,
}

impl LaneMetrics {
    fn new(name: &str) -> LaneMetrics {
        LaneMetrics {
            name: name.to_string(),
            queue_wait: OnceLock::new(),
            ttft: OnceLock::new(),
            duration: OnceLock::new(),
            fallbacks: OnceLock::new(),
            outcomes: OUTCOMES.iter().map(|_| OnceLock::new()).collect(),
            rejections: REASONS.iter().map(|_| OnceLock::new()).collect(),
        }
    }
}

/// The gateway's metrics registry.
pub struct Telemetry {
    recorder: PrometheusRecorder,
    lanes: Vec<LaneMetrics>,
    closed: [OnceLock<Counter>; 5],
}

impl Default for Telemetry {
    fn default() -> Self {
        Self::new()
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect();
    Key::from_parts(name, labels)
}

impl Telemetry {
    pub fn new() -> Telemetry {
        Telemetry::for_lanes(&[])
    }

    /// A registry with per-request handles for these lanes (by index, as the gate numbers them).
    pub fn for_lanes(lanes: &[&str]) -> Telemetry {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .expect("bucket list is not empty");
        Telemetry {
            recorder: builder.build_recorder(),
            lanes: lanes.iter().map(|l| LaneMetrics::new(l)).collect(),
            closed: Default::default(),
        }
    }

    /// Counts one client connection the gateway closed itself.
    pub(crate) fn connection_closed(&self, why: crate::closed::Closed) {
        let i = crate::closed::Closed::ALL
            .iter()
            .position(|c| *c == why)
            .unwrap_or(0);
        self.closed[i]
            .get_or_init(|| self.counter(CONNECTIONS_CLOSED_TOTAL, &[("reason", why.label())]))
            .increment(1);
    }

    /// The name of lane `lane`, as registered.
    pub fn lane_name(&self, lane: usize) -> &str {
        self.lanes.get(lane).map(|l| l.name.as_str()).unwrap_or("?")
    }

    fn lane_histogram(
        &self,
        lane: usize,
        name: &'static str,
        pick: impl Fn(&LaneMetrics) -> &OnceLock<Histogram>,
    ) -> Histogram {
        match self.lanes.get(lane) {
            Some(l) => pick(l)
                .get_or_init(|| self.histogram(name, &[("lane", &l.name)]))
                .clone(),
            None => self.histogram(name, &[("lane", "?")]),
        }
    }

    /// Records how long a request of `lane` waited for admission.
    pub fn queue_wait(&self, lane: usize, seconds: f64) {
        self.lane_histogram(lane, QUEUE_WAIT_SECONDS, |l| &l.queue_wait)
            .record(seconds);
    }

    /// Records the time to the first response byte of a request of `lane`.
    pub fn ttft(&self, lane: usize, seconds: f64) {
        self.lane_histogram(lane, TTFT_SECONDS, |l| &l.ttft)
            .record(seconds);
    }

    /// Records the whole duration of a request of `lane`.
    pub fn request_duration(&self, lane: usize, seconds: f64) {
        self.lane_histogram(lane, REQUEST_DURATION_SECONDS, |l| &l.duration)
            .record(seconds);
    }

    /// Counts one finished request of `lane` by outcome.
    pub fn lane_outcome(&self, lane: usize, outcome: &str) {
        let (Some(l), Some(i)) = (
            self.lanes.get(lane),
            OUTCOMES.iter().position(|o| *o == outcome),
        ) else {
            return self.outcome(self.lane_name(lane), outcome);
        };
        l.outcomes[i]
            .get_or_init(|| {
                self.counter(REQUESTS_TOTAL, &[("lane", &l.name), ("outcome", outcome)])
            })
            .increment(1);
    }

    /// Counts one refusal of `lane` by reason code.
    pub fn rejection(&self, lane: usize, reason: &str) {
        let (Some(l), Some(i)) = (
            self.lanes.get(lane),
            REASONS.iter().position(|r| *r == reason),
        ) else {
            self.counter(
                REJECTIONS_TOTAL,
                &[("lane", self.lane_name(lane)), ("reason", reason)],
            )
            .increment(1);
            return;
        };
        l.rejections[i]
            .get_or_init(|| {
                self.counter(REJECTIONS_TOTAL, &[("lane", &l.name), ("reason", reason)])
            })
            .increment(1);
    }

    /// Counts one fallback answer of `lane`.
    pub fn fallback(&self, lane: usize) {
        match self.lanes.get(lane) {
            Some(l) => l
                .fallbacks
                .get_or_init(|| self.counter(FALLBACKS_TOTAL, &[("lane", &l.name)]))
                .increment(1),
            None => self.counter(FALLBACKS_TOTAL, &[("lane", "?")]).increment(1),
        }
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.recorder
            .register_histogram(&key(name, labels), &METADATA)
    }

    /// Publishes each lane's kind (`headroom_lane_info{lane, kind}` = 1) for joins in dashboards
    /// and alert rules.
    pub fn describe_lane_kinds(&self, lanes: &[crate::live_config::LaneConfig]) {
        for lane in lanes {
            self.gauge(
                LANE_INFO,
                &[("lane", lane.spec.name.as_str()), ("kind", lane.kind())],
            )
            .set(1.0);
        }
    }

    /// Publishes each lane's settings as gauges (see [`LANE_MAX_INFLIGHT`]).
    pub fn describe_lanes(&self, lanes: &[headroom_gate::LaneSpec]) {
        for l in lanes {
            let lane = [("lane", l.name.as_str())];
            self.gauge(LANE_MAX_INFLIGHT, &lane)
                .set(l.max_inflight as f64);
            self.gauge(LANE_MAX_QUEUE, &lane).set(l.max_queue as f64);
            self.gauge(LANE_QUEUE_TIMEOUT_SECONDS, &lane)
                .set(l.queue_timeout.as_secs_f64());
            self.gauge(
                LANE_POLICY,
                &[("lane", l.name.as_str()), ("policy", l.policy.as_str())],
            )
            .set(1.0);
            for to in &l.yield_to {
                self.gauge(LANE_YIELDS_TO, &[("lane", l.name.as_str()), ("to", to)])
                    .set(1.0);
            }
            self.gauge(LANE_PREEMPT, &lane)
                .set(if l.preempt { 1.0 } else { 0.0 });
        }
    }

    /// Counts one finished request by outcome.
    pub fn outcome(&self, lane: &str, outcome: &str) {
        self.counter(REQUESTS_TOTAL, &[("lane", lane), ("outcome", outcome)])
            .increment(1);
    }

    /// Folds pending histogram samples into their buckets (what a scrape does first).
    pub fn upkeep(&self) {
        self.recorder.handle().run_upkeep();
    }

    /// Runs [`Telemetry::upkeep`] every `interval`, forever (the gateway aborts it on shutdown).
    pub async fn upkeep_loop(self: std::sync::Arc<Self>, interval: std::time::Duration) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            self.upkeep();
        }
    }

    /// Sets the lane gauges from the gate's snapshot and renders the text exposition format.
    pub fn render(&self, snapshot: &GateSnapshot) -> String {
        for lane in &snapshot.lanes {
            self.gauge(LANE_INFLIGHT, &[("lane", &lane.name)])
                .set(lane.inflight as f64);
            self.gauge(LANE_QUEUE_DEPTH, &[("lane", &lane.name)])
                .set(lane.queued as f64);
            if let Some(m) = &lane.memory {
                self.lane_memory(&lane.name, m);
            }
        }
        for pool in &snapshot.memory {
            let device = pool.device.to_string();
            let labels = [("device", device.as_str())];
            if let Some(free) = pool.free_bytes {
                self.gauge(MEMORY_FREE_BYTES, &labels).set(free as f64);
            }
            self.gauge(MEMORY_RESERVED_BYTES, &labels)
                .set(pool.reserved_bytes as f64);
            self.gauge(MEMORY_HIDDEN_BYTES, &labels)
                .set(pool.hidden_bytes as f64);
            self.gauge(MEMORY_RESERVATIONS, &labels)
                .set(pool.reservations as f64);
        }
        let handle = self.recorder.handle();
        handle.run_upkeep();
        handle.render()
    }

    fn lane_memory(&self, lane: &str, m: &LaneMemorySnapshot) {
        let mut figures = vec![
            (
                "configured",
                m.configured_bytes_per_job,
                m.configured_bytes_per_audio_second,
            ),
            ("in_force", m.bytes_per_job, m.bytes_per_audio_second),
        ];
        if let Some(l) = m.learned {
            figures.push(("learned", l.bytes_per_job, l.bytes_per_audio_second));
        }
        for (source, per_job, per_second) in figures {
            let labels = [("lane", lane), ("source", source)];
            self.gauge(LANE_MEMORY_PER_JOB_BYTES, &labels)
                .set(per_job as f64);
            self.gauge(LANE_MEMORY_PER_AUDIO_SECOND_BYTES, &labels)
                .set(per_second as f64);
        }
        self.gauge(LANE_MEMORY_MEASURED_JOBS, &[("lane", lane)])
            .set(m.measured_jobs as f64);
    }
}
