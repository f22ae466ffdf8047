//! Upstream choice and passive health (outlier detection, after Envoy's). Which of a lane's
//! upstreams takes an admitted request: the least loaded by in-flight requests *to that upstream*
//! (counted over every lane that uses it), then by the engine's reported queue, among those whose
//! engine metrics admit new work and that are not ejected. An upstream that fails the lane's
//! [`Outlier::eject_after_failures`] times in a row (refused, reset or closed before or while it
//! answered, a malformed response, a 5xx, or a request it held past the deadline) is ejected for
//! [`Outlier::base_ejection_time`] times the number of ejections it has had in a row (which
//! decays by one for every base ejection time it then serves well), up to
//! [`Outlier::max_ejection_time`]. At most [`Outlier::max_ejection_percent`] of a lane's
//! upstreams are ejected at once, and never the last one in rotation. When an ejection ends one
//! request goes to the upstream as a probe: its success lets the upstream back, its failure
//! ejects it again, for longer.
//!
//! Every outcome is recorded in O(1) under the gate's lock (one map look-up); only a failure that
//! reaches the threshold looks at the lane's other upstreams.

use std::time::Duration;

use tokio::time::Instant;

use crate::lane::LaneSpec;
use crate::pressure::EngineLoad;

/// A lane's passive-health settings. An upstream several lanes share is judged by the settings
/// of the lane whose request it served or failed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outlier {
    /// Consecutive failures that eject an upstream (at least 1).
    pub eject_after_failures: u32,
    /// The first ejection's length; the n-th in a row lasts n times this.
    pub base_ejection_time: Duration,
    /// The longest ejection.
    pub max_ejection_time: Duration,
    /// Most of a lane's upstreams ejected at once, in percent (at least one of two or more may
    /// be; the last one in rotation never is).
    pub max_ejection_percent: u8,
}

impl Default for Outlier {
    fn default() -> Self {
        Outlier {
            eject_after_failures: 3,
            base_ejection_time: Duration::from_secs(5),
            max_ejection_time: Duration::from_secs(300),
            max_ejection_percent: 50,
        }
    }
}

/// One upstream's shared state, keyed by its URL.
#[derive(Debug, Default, Clone)]
pub(crate) struct Health {
    /// Requests in flight to this upstream, from every lane.
    pub(crate) inflight: usize,
    pub(crate) failures: u32,
    pub(crate) ejected_until: Option<Instant>,
    /// Ejections in a row: the multiplier of the next ejection's length.
    pub(crate) ejections: u32,
    /// When the upstream was last let back in after an ejection (its good standing since).
    back_since: Option<Instant>,
    /// Until when the upstream counts as failing for readiness: it reached the failure
    /// threshold, ejected or not (the last upstream in rotation is never ejected).
    failing_until: Option<Instant>,
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

    /// Whether the upstream can be counted on to serve: not ejected, and not failing over and
    /// over (an upstream kept in rotation because it is the lane's last still is).
    pub(crate) fn healthy(&self, now: Instant) -> bool {
        !self.ejected(now) && self.failing_until.is_none_or(|until| now >= until)
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

    /// A request the upstream answered well: the count of failures starts again, and an
    /// ejected upstream (its probe answered) is back in rotation.
    pub(crate) fn succeeded(&mut self, now: Instant) {
        self.failures = 0;
        self.failing_until = None;
        self.probe_out = false;
        if self.ejected_until.take().is_some() {
            self.back_since = Some(now);
        }
    }

    /// A request the upstream failed. A failed probe (or any failure once the ejection has run
    /// out) ejects it again at once, for longer; otherwise returns whether this failure calls
    /// for a new ejection, which the caller makes ([`Health::eject`]) when the lane's
    /// [`Outlier::max_ejection_percent`] allows it.
    pub(crate) fn failed(&mut self, now: Instant, rule: &Outlier) -> bool {
        self.failures = self.failures.saturating_add(1);
        if self.failures >= rule.eject_after_failures {
            self.failing_until = Some(now + rule.base_ejection_time);
        }
        match self.ejected_until {
            Some(until) if now >= until => {
                self.eject(now, rule);
                false
            }
            Some(_) => false,
            None => self.failures >= rule.eject_after_failures,
        }
    }

    /// Takes the upstream out of rotation for the base ejection time times its ejections in a
    /// row (less one for every base ejection time it served well since the last one).
    pub(crate) fn eject(&mut self, now: Instant, rule: &Outlier) {
        let base = rule.base_ejection_time.max(Duration::from_millis(1));
        let calm = self.back_since.map_or(0, |since| {
            now.saturating_duration_since(since).as_nanos() / base.as_nanos()
        });
        let calm = u32::try_from(calm).unwrap_or(u32::MAX);
        self.ejections = self.ejections.saturating_sub(calm).saturating_add(1);
        self.back_since = None;
        self.ejected_until = Some(
            now + base
                .saturating_mul(self.ejections)
                .min(rule.max_ejection_time),
        );
        self.probe_out = false;
    }
}

/// Whether the lane may eject its upstream `candidate` now: afterwards at most
/// `max_ejection_percent` of its upstreams (at least one, when it has two or more) are ejected,
/// and one at least is still in rotation.
pub(crate) fn may_eject(
    spec: &LaneSpec,
    health: &crate::Map<String, Health>,
    now: Instant,
    candidate: usize,
) -> bool {
    let n = spec.upstreams.len();
    let allowed = (n * usize::from(spec.outlier.max_ejection_percent.min(100)) / 100)
        .max(1)
        .min(n.saturating_sub(1));
    let out = (0..n)
        .filter(|&u| u != candidate)
        .filter(|&u| {
            health
                .get(&spec.upstreams[u])
                .is_some_and(|h| h.ejected(now))
        })
        .count();
    out < allowed
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

    type Healths = crate::Map<String, Health>;

    fn lane(upstreams: &[&str]) -> (LaneSpec, Healths) {
        let spec = LaneSpec::new("t", upstreams);
        let health = upstreams
            .iter()
            .map(|u| (u.to_string(), Health::default()))
            .collect();
        (spec, health)
    }

    /// One failure of upstream `u`, ejecting it when the lane allows (as the gate does).
    fn fail(spec: &LaneSpec, health: &mut Healths, u: usize, now: Instant) {
        let url = spec.upstreams[u].clone();
        let due = health.get_mut(&url).unwrap().failed(now, &spec.outlier);
        if due && may_eject(spec, health, now, u) {
            health.get_mut(&url).unwrap().eject(now, &spec.outlier);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failures_eject_for_longer_each_time_in_a_row_and_a_probe_lets_back() {
        let (spec, mut health) = lane(&["http://a", "http://b"]);
        let engine = Default::default();
        let base = spec.outlier.base_ejection_time;
        let now = Instant::now();
        // Equal load: the first one. Two failures do not eject yet.
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(0));
        fail(&spec, &mut health, 0, now);
        fail(&spec, &mut health, 0, now);
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(0));
        fail(&spec, &mut health, 0, now);
        // Ejected: b takes everything, even with more in flight.
        health.get_mut("http://b").unwrap().inflight = 5;
        assert_eq!(choose(&spec, &health, &engine, now, &[]), Some(1));
        assert_eq!(
            choose(&spec, &health, &engine, now, &[1]),
            Some(0),
            "last resort"
        );
        assert_eq!(health["http://a"].ejected_until, Some(now + base));
        // After the ejection one probe goes to a; while it is out, a stays out of rotation.
        let later = now + base;
        assert_eq!(choose(&spec, &health, &engine, later, &[]), Some(0));
        health.get_mut("http://a").unwrap().taken(later);
        assert_eq!(choose(&spec, &health, &engine, later, &[]), Some(1));
        // The probe fails: ejected again at once, for the base time twice (the second in a row).
        fail(&spec, &mut health, 0, later);
        assert_eq!(health["http://a"].ejected_until, Some(later + base * 2));
        // The third in a row lasts three times the base: linear, as Envoy's.
        let third = later + base * 2;
        health.get_mut("http://a").unwrap().taken(third);
        fail(&spec, &mut health, 0, third);
        assert_eq!(health["http://a"].ejected_until, Some(third + base * 3));
        // The next probe succeeds: back at once.
        let again = third + base * 3;
        let a = health.get_mut("http://a").unwrap();
        a.released();
        a.taken(again);
        a.succeeded(again);
        assert!(health["http://a"].healthy(again));
        assert_eq!(choose(&spec, &health, &engine, again, &[]), Some(0));
        // Three failures soon after: the fourth ejection in a row, less one for the base time
        // it served well.
        let soon = again + base + Duration::from_millis(1);
        for _ in 0..3 {
            fail(&spec, &mut health, 0, soon);
        }
        assert_eq!(health["http://a"].ejections, 3);
        assert_eq!(health["http://a"].ejected_until, Some(soon + base * 3));
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejection_is_capped_and_a_long_good_run_forgets_the_earlier_ones() {
        let (mut spec, mut health) = lane(&["http://a", "http://b"]);
        spec.outlier = Outlier {
            eject_after_failures: 1,
            base_ejection_time: Duration::from_secs(10),
            max_ejection_time: Duration::from_secs(25),
            max_ejection_percent: 50,
        };
        let mut now = Instant::now();
        for _ in 0..4 {
            fail(&spec, &mut health, 0, now);
            now = health["http://a"].ejected_until.unwrap();
            health.get_mut("http://a").unwrap().taken(now);
        }
        assert_eq!(health["http://a"].ejections, 4);
        let a = health.get_mut("http://a").unwrap();
        a.released();
        a.succeeded(now);
        // An hour of good service: the next ejection is a first one again.
        now += Duration::from_secs(3600);
        fail(&spec, &mut health, 0, now);
        assert_eq!(health["http://a"].ejections, 1);
        assert_eq!(
            health["http://a"].ejected_until,
            Some(now + Duration::from_secs(10))
        );
        // And the cap holds however many come in a row.
        let (spec, mut health) = lane(&["http://a", "http://b"]);
        let capped = Outlier {
            max_ejection_time: Duration::from_secs(7),
            ..spec.outlier
        };
        let spec = LaneSpec {
            outlier: capped,
            ..spec
        };
        let now = Instant::now();
        for _ in 0..3 {
            fail(&spec, &mut health, 0, now);
        }
        let h = health.get_mut("http://a").unwrap();
        h.ejections = 100;
        h.eject(now, &spec.outlier);
        assert_eq!(h.ejected_until, Some(now + Duration::from_secs(7)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lane_never_ejects_its_last_upstream_in_rotation_nor_more_than_its_share() {
        let now = Instant::now();
        // Two upstreams, both failing: one is ejected, the other stays in rotation, unhealthy.
        let (spec, mut health) = lane(&["http://a", "http://b"]);
        for u in [0, 1] {
            for _ in 0..3 {
                fail(&spec, &mut health, u, now);
            }
        }
        assert!(health["http://a"].ejected(now));
        assert!(!health["http://b"].ejected(now), "the last one in rotation");
        assert!(!health["http://b"].healthy(now), "but it is failing");
        // A lane's only upstream is never ejected; it reads unhealthy while it keeps failing,
        // and healthy again once it has not failed for a base ejection time.
        let (spec, mut health) = lane(&["http://only"]);
        for _ in 0..5 {
            fail(&spec, &mut health, 0, now);
        }
        assert!(!health["http://only"].ejected(now));
        assert!(!health["http://only"].healthy(now));
        assert!(health["http://only"].healthy(now + spec.outlier.base_ejection_time));
        // Ten upstreams at 20 %: two out at most.
        let urls: Vec<String> = (0..10).map(|i| format!("http://u{i}")).collect();
        let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
        let (mut spec, mut health) = lane(&refs);
        spec.outlier.max_ejection_percent = 20;
        for u in 0..10 {
            for _ in 0..3 {
                fail(&spec, &mut health, u, now);
            }
        }
        let out = urls.iter().filter(|u| health[*u].ejected(now)).count();
        assert_eq!(out, 2);
    }
}
