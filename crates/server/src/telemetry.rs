//! The gateway's own Prometheus metrics: one recorder per gateway (no global state, so several
//! gateways can share a process), the metric names, and rendering for `/metrics`.

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusRecorder};

use headroom_gate::GateSnapshot;
use headroom_gate::LaneMemorySnapshot;

pub const REQUESTS_TOTAL: &str = "headroom_requests_total";
pub const LANE_INFLIGHT: &str = "headroom_lane_inflight";
pub const LANE_QUEUE_DEPTH: &str = "headroom_lane_queue_depth";
pub const QUEUE_WAIT_SECONDS: &str = "headroom_queue_wait_seconds";
pub const TTFT_SECONDS: &str = "headroom_ttft_seconds";
pub const REQUEST_DURATION_SECONDS: &str = "headroom_request_duration_seconds";
pub const REJECTIONS_TOTAL: &str = "headroom_rejections_total";
pub const FALLBACKS_TOTAL: &str = "headroom_fallbacks_total";
/// Requests refused for their input (4xx other than 429), by error code.
pub const BAD_REQUESTS_TOTAL: &str = "headroom_bad_requests_total";
pub const GPU_MEMORY_USED_BYTES: &str = "headroom_gpu_memory_used_bytes";
/// Memory ledger, per device: free in the last reading, reserved by admitted jobs, the part of
/// that the reading does not show yet, and the number of reservations.
pub const MEMORY_FREE_BYTES: &str = "headroom_memory_free_bytes";
pub const MEMORY_RESERVED_BYTES: &str = "headroom_memory_reserved_bytes";
pub const MEMORY_HIDDEN_BYTES: &str = "headroom_memory_unseen_reserved_bytes";
pub const MEMORY_RESERVATIONS: &str = "headroom_memory_reservations";
/// A lane's memory need per job and per audio second, by `source`: configured, learned, in_force.
pub const LANE_MEMORY_PER_JOB_BYTES: &str = "headroom_lane_memory_per_job_bytes";
pub const LANE_MEMORY_PER_AUDIO_SECOND_BYTES: &str = "headroom_lane_memory_per_audio_second_bytes";
/// Jobs whose peak the lane has measured since start.
pub const LANE_MEMORY_MEASURED_JOBS: &str = "headroom_lane_memory_measured_jobs";
pub const UPSTREAM_KV_CACHE_USAGE: &str = "headroom_upstream_kv_cache_usage";
pub const UPSTREAM_REQUESTS_WAITING: &str = "headroom_upstream_requests_waiting";
pub const UPSTREAM_REQUESTS_RUNNING: &str = "headroom_upstream_requests_running";

const SECONDS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The gateway's metrics registry.
pub struct Telemetry {
    recorder: PrometheusRecorder,
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
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .expect("bucket list is not empty");
        Telemetry {
            recorder: builder.build_recorder(),
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

    /// Counts one finished request by outcome.
    pub fn outcome(&self, lane: &str, outcome: &str) {
        self.counter(REQUESTS_TOTAL, &[("lane", lane), ("outcome", outcome)])
            .increment(1);
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
