//! Live diagnosis from two `/metrics` readings taken an interval apart: which server wrote them
//! (a headroom gateway, vLLM or llama.cpp), rates from counters, quantiles from histograms, and
//! the findings — each with its figures and the setting to change. Pure functions over parsed
//! snapshots; fetching the readings is the caller's job.

mod engine;
mod gateway;
pub mod snapshot;

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

pub use snapshot::{Histogram, MetricsError, Snapshot};

/// The server a reading came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MetricsSource {
    Gateway,
    Vllm,
    LlamaCpp,
    Unknown,
}

impl MetricsSource {
    pub fn as_str(self) -> &'static str {
        match self {
            MetricsSource::Gateway => "gateway",
            MetricsSource::Vllm => "vllm",
            MetricsSource::LlamaCpp => "llama_cpp",
            MetricsSource::Unknown => "unknown",
        }
    }

    /// Which server's names the reading carries (a gateway first: it also republishes engine
    /// gauges under its own names).
    pub fn of(s: &Snapshot) -> MetricsSource {
        if s.has_prefix("headroom_") {
            MetricsSource::Gateway
        } else if s.has_prefix("vllm:") {
            MetricsSource::Vllm
        } else if s.has_prefix("llamacpp:") {
            MetricsSource::LlamaCpp
        } else {
            MetricsSource::Unknown
        }
    }
}

/// What a live reading can say is wrong: exactly the vocabulary `--format json` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LiveCause {
    /// Text refused (429/503) during normal operation: audio idle, so nothing needed the room.
    RejectingWhileAudioIdle,
    /// Queue waits close to `queue_timeout`, or requests timing out in the queue.
    QueueWaitNearTimeout,
    /// A large share of a lane's requests answered by its fallback.
    FallbackShareHigh,
    /// Text streams stopped by audio work, per audio job.
    PreemptionsPerAudioJob,
    /// Audio waits in its queue while a text lane that does not yield to it keeps running.
    AudioWaitsBehindText,
    /// Clients come back within the Retry-After they were given.
    RetryAfterIgnored,
    /// vLLM's KV cache is (nearly) full while requests wait.
    KvPressureWithWaiting,
    /// vLLM preempted running sequences for lack of KV.
    EnginePreemptions,
    /// Most of vLLM's time to first token is spent in its queue.
    TtftDominatedByQueueing,
    /// llama.cpp deferred requests: more streams than slots.
    DeferredRequests,
}

impl LiveCause {
    pub fn as_str(self) -> &'static str {
        match self {
            LiveCause::RejectingWhileAudioIdle => "rejecting_while_audio_idle",
            LiveCause::QueueWaitNearTimeout => "queue_wait_near_timeout",
            LiveCause::FallbackShareHigh => "fallback_share_high",
            LiveCause::PreemptionsPerAudioJob => "preemptions_per_audio_job",
            LiveCause::AudioWaitsBehindText => "audio_waits_behind_text",
            LiveCause::RetryAfterIgnored => "retry_after_ignored",
            LiveCause::KvPressureWithWaiting => "kv_pressure_with_waiting",
            LiveCause::EnginePreemptions => "engine_preemptions",
            LiveCause::TtftDominatedByQueueing => "ttft_dominated_by_queueing",
            LiveCause::DeferredRequests => "deferred_requests",
        }
    }
}

/// One thing wrong, with the measured figures and the setting to change.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveFinding {
    pub cause: LiveCause,
    /// The gateway lane the finding is about, when it is about one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// Measured or computed figures: shares are fractions, times in seconds, rates per second.
    pub numbers: BTreeMap<String, f64>,
    /// What the figures say and the setting to change, with computed values.
    pub fix: String,
}

impl LiveFinding {
    fn new(cause: LiveCause, lane: Option<&str>) -> LiveFinding {
        LiveFinding {
            cause,
            lane: lane.map(str::to_owned),
            numbers: BTreeMap::new(),
            fix: String::new(),
        }
    }

    fn num(mut self, name: &str, value: Option<f64>) -> LiveFinding {
        if let Some(v) = value.filter(|v| v.is_finite()) {
            self.numbers.insert(name.to_owned(), v);
        }
        self
    }

    fn fix(mut self, text: String) -> LiveFinding {
        self.fix = text;
        self
    }
}

/// The diagnosis of one `/metrics` endpoint.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveDiagnosis {
    pub source: MetricsSource,
    pub interval_seconds: f64,
    /// What was measured over the interval, whether or not anything is wrong.
    pub figures: BTreeMap<String, f64>,
    pub findings: Vec<LiveFinding>,
    /// Signals the reading lacks (so a finding could not be judged), in words.
    pub not_judged: Vec<String>,
}

impl LiveDiagnosis {
    /// "nothing wrong" or how many findings.
    pub fn verdict(&self) -> String {
        match self.findings.len() {
            0 => "nothing wrong in this interval".to_owned(),
            1 => "1 finding".to_owned(),
            n => format!("{n} findings"),
        }
    }
}

/// Thresholds the findings use (defaults documented in docs/doctor.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    /// Share of text requests refused while audio is idle that counts as a wrong policy.
    pub reject_share: f64,
    /// Queue wait p90 at this fraction of `queue_timeout` counts as "near the timeout".
    pub queue_near_timeout: f64,
    /// Share of a lane's requests answered by the fallback.
    pub fallback_share: f64,
    /// Text preemptions per finished audio job.
    pub preemptions_per_audio_job: f64,
    /// Audio queue wait p90 (seconds) that counts as audio waiting.
    pub audio_wait_seconds: f64,
    /// Share of refused requests whose client came back before its Retry-After.
    pub early_retry_share: f64,
    /// vLLM KV-cache usage that counts as full.
    pub kv_full: f64,
    /// Share of vLLM's TTFT spent queued.
    pub queue_share_of_ttft: f64,
    /// Fewest requests in the interval before a share is judged.
    pub min_requests: f64,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds {
            reject_share: 0.05,
            queue_near_timeout: 0.8,
            fallback_share: 0.10,
            preemptions_per_audio_job: 0.5,
            audio_wait_seconds: 0.25,
            early_retry_share: 0.2,
            kv_full: 0.9,
            queue_share_of_ttft: 0.5,
            min_requests: 5.0,
        }
    }
}

/// Diagnoses one endpoint from a reading and a later one `interval` apart.
pub fn diagnose_live(
    before: &Snapshot,
    after: &Snapshot,
    interval: Duration,
    thresholds: &Thresholds,
) -> LiveDiagnosis {
    let seconds = interval.as_secs_f64().max(1e-3);
    let source = MetricsSource::of(after);
    let mut d = LiveDiagnosis {
        source,
        interval_seconds: seconds,
        figures: BTreeMap::new(),
        findings: Vec::new(),
        not_judged: Vec::new(),
    };
    let w = Window {
        before,
        after,
        seconds,
        t: thresholds,
    };
    match source {
        MetricsSource::Gateway => gateway::diagnose(&w, &mut d),
        MetricsSource::Vllm => engine::vllm(&w, &mut d),
        MetricsSource::LlamaCpp => engine::llamacpp(&w, &mut d),
        MetricsSource::Unknown => d.not_judged.push(
            "the reading carries no headroom_, vllm: or llamacpp: metrics, so no rule applies"
                .to_owned(),
        ),
    }
    d.figures.retain(|_, v| v.is_finite());
    d
}

/// Two readings and what the rules need to compare them.
struct Window<'a> {
    before: &'a Snapshot,
    after: &'a Snapshot,
    seconds: f64,
    t: &'a Thresholds,
}

impl Window<'_> {
    /// Counter increase over the interval (a reset counts from zero).
    fn delta(&self, name: &str, filter: &[(&str, &str)]) -> f64 {
        let after = self.after.sum(name, filter).unwrap_or(0.0);
        let before = self.before.sum(name, filter).unwrap_or(0.0);
        if after >= before {
            after - before
        } else {
            after
        }
    }

    /// A gauge's largest value in either reading.
    fn gauge_max(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        match (self.before.max(name, filter), self.after.max(name, filter)) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        }
    }

    /// A histogram's observations over the interval.
    fn histogram(&self, name: &str, filter: &[(&str, &str)]) -> Option<Histogram> {
        let after = self.after.histogram(name, filter)?;
        Some(after.since(self.before.histogram(name, filter).as_ref()))
    }
}

/// `12.3%`.
fn pct(share: f64) -> String {
    format!("{:.1}%", share * 100.0)
}

/// Seconds with sensible precision.
fn secs(v: f64) -> String {
    if v >= 10.0 {
        format!("{v:.0} s")
    } else if v >= 1.0 {
        format!("{v:.1} s")
    } else {
        format!("{:.0} ms", v * 1000.0)
    }
}

#[cfg(test)]
mod tests;
