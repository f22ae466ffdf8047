//! Upstream choice and passive health. Which of a lane's upstreams takes an admitted request: the
//! least loaded by in-flight requests *to that upstream* (counted over every lane that uses it),
//! then by the engine's reported queue, among those whose engine metrics admit new work and that
//! are not ejected. An upstream that fails [`EJECT_AFTER_FAILURES`] times in a row (connection
//! refused or reset, or a 5xx) is ejected for a back-off that doubles up to [`MAX_BACKOFF`];
//! when it ends one request goes to it as a probe, and its outcome lets it back or ejects it
//! again for longer.

use std::time::Duration;

use tokio::time::Instant;

use crate::lane::LaneSpec;
use crate::pressure::EngineLoad;

/// Consecutive failures that eject an upstream.
pub const EJECT_AFTER_FAILURES: u32 = 3;
/// First ejection's length; each failed probe doubles it.
pub const FIRST_BACKOFF: Duration = Duration::from_secs(1);
/// Longest ejection.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One upstream's shared state, keyed by its URL.
#[derive(Debug, Default, Clone)]
pub(crate) struct Health {
    /// Requests in flight to this upstream, from every lane.
    pub(crate) inflight: usize,
    pub(crate) failures: u32,
    pub(crate) ejected_until: Option<Instant>,
    backoff: Duration,
    /// A probe request is out after an ejection ended.
    probe_out: bool,
}

impl Health {
    /// Whether the upstream is ejected at `now` (a probe in flight counts as ejected for others).
    pub(crate) fn ejected(&self, now: Instant) -> bool {
        match self.ejected_until {
            None => false,
            Some(until) => now < until || self.probe_out,
        }
    }

    /// A request was sent to the upstream (the first after an ejection is the probe).
    pub(crate) fn taken(&mut self, now: Instant) {
        self.inflight += 1;
        if self.ejected_until.is_some_and(|until| now >= until) {
            self.probe_out = true;
        }
    }

    pub(crate) fn released(&mut self) {
        self.inflight = self.inflight.saturating_sub(1);
    }

    /// The outcome of one request: a success lets the upstream back at once; a failure counts
    /// towards (or, for a probe, renews) an ejection.
    pub(crate) fn record(&mut self, ok: bool, now: Instant) {
        if ok {
            *self = Health {
                inflight: self.inflight,
                ..Health::default()
            };
            return;
        }
        self.failures = self.failures.saturating_add(1);
        let probe_failed = self.ejected_until.is_some_and(|until| now >= until);
        if probe_failed || (self.ejected_until.is_none() && self.failures >= EJECT_AFTER_FAILURES) {
            self.backoff = if self.backoff.is_zero() {
                FIRST_BACKOFF
            } else {
                (self.backoff * 2).min(MAX_BACKOFF)
            };
            self.ejected_until = Some(now + self.backoff);
            self.probe_out = false;
        }
    }
}

/// Index of the upstream to use, or `None` when every upstream's engine is saturated (or its
/// metrics are stale and the lane fails closed). Upstreams in `exclude` (already tried for this
/// request) are skipped. When every admissible upstream is ejected, the one whose ejection ends
/// first is used rather than refusing: its failure answers at once, and it is the next probe.
pub(crate) fn choose(
    spec: &LaneSpec,
    health: &crate::Map<String, Health>,
    engine: &crate::Map<String, EngineLoad>,
    now: Instant,
    exclude: &[usize],
) -> Option<usize> {
    let url = |u: usize| spec.upstreams[u].as_str();
    // Walked twice rather than collected: one allocation fewer on every admission.
    let admissible = || {
        (0..spec.upstreams.len())
            .filter(|u| !exclude.contains(u))
            .filter(|&u| match &spec.engine {
                None => true,
                Some(limits) => limits.admits(engine.get(url(u)), now),
            })
    };
    let mut candidates = admissible();
    let first = candidates.next()?;
    if candidates.next().is_none() {
        // The only admissible upstream is the answer whether it is ejected or not (the rule
        // below falls back to it): no health to look up.
        return Some(first);
    }
    let h = |u: usize| health.get(url(u));
    let inflight = |u: usize| h(u).map_or(0, |h| h.inflight);
    let waiting = |u: usize| engine.get(url(u)).and_then(|l| l.waiting).unwrap_or(0.0);
    let healthy = admissible()
        .filter(|&u| !h(u).is_some_and(|h| h.ejected(now)))
        .min_by(|&a, &b| {
            inflight(a)
                .cmp(&inflight(b))
                .then(waiting(a).total_cmp(&waiting(b)))
                .then(a.cmp(&b))
        });
    healthy.or_else(|| admissible().min_by_key(|&u| h(u).and_then(|h| h.ejected_until)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn failures_eject_with_doubling_backoff_and_a_probe_lets_back() {
        let spec = LaneSpec::new("t", &["http://a", "http://b"]);
        let mut health: crate::Map<String, Health> = Default::default();
        let engine = Default::default();
        let now = Instant::now();
        // Equal load: the first one. Two failures do not eject yet.
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(0));
        let a = health.entry("http://a".into()).or_default();
        a.record(false, now);
        a.record(false, now);
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(0));
        health.get_mut("http://a").unwrap().record(false, now);
        // Ejected: b takes everything, even with more in flight.
        health.entry("http://b".into()).or_default().inflight = 5;
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(1));
        assert_eq!(
            choose(&spec, &health, &engine, now, &[1]),
            Some(0),
            "last resort"
        );
        // After the back-off one probe goes to a; while it is out, a stays out of rotation.
        let later = now + FIRST_BACKOFF;
        assert_eq!(choose(&spec, &health, &engine, later, &[]), Some(0));
        health.get_mut("http://a").unwrap().taken(later);
        assert_eq!(choose(&spec, &health, &engine, later, &[]), Some(1));
        // The probe fails: ejected again, twice as long.
        health.get_mut("http://a").unwrap().record(false, later);
        let a = &health["http://a"];
        assert_eq!(a.ejected_until, Some(later + FIRST_BACKOFF * 2));
        // The next probe succeeds: back at once.
        let again = later + FIRST_BACKOFF * 2;
        let a = health.get_mut("http://a").unwrap();
        a.released();
        a.taken(again);
        a.record(true, again);
        assert!(!health["http://a"].ejected(again));
        assert_eq!(choose(&spec, &health, &engine, again, &[]), Some(0));
    }
}
