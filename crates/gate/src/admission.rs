//! Admission: the one lock that holds every lane's in-flight count and queue, the decision whether a
//! request may start, FIFO queues with timeouts and cancellation, and [`Permit`]s that give their
//! slot back exactly once when dropped. Memory admission asks the [`Ledger`] (readings pushed in
//! by [`Gate::push_memory_reading`], never a probe call).

use std::collections::VecDeque;

use crate::Map;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::lane::{GateError, LaneSpec, Policy, PreemptMode, RejectReason, Rejection};
use crate::ledger::{
    LearnedNeed, Ledger, LedgerSettings, MemoryReading, MemoryShortfall, PoolKind,
};
use crate::pressure::EngineLoad;
use crate::upstream;

mod memory;

/// How often queued requests re-check time- and pressure-based conditions (yield expiry, GPU
/// memory, engine load) that no release event announces.
const RECHECK_INTERVAL: Duration = Duration::from_millis(20);
/// Service time assumed before a lane has finished any request.
const DEFAULT_SERVICE_TIME: Duration = Duration::from_secs(1);
/// Weight of the newest sample in the service-time moving average.
const SERVICE_EWMA_ALPHA: f64 = 0.2;
/// Longest Retry-After the gate suggests.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);

/// What admission needs to know about one request.
#[derive(Debug, Clone, Default)]
pub struct AdmitRequest {
    /// Seconds of input audio, when known (for GPU memory per audio second).
    pub audio_seconds: Option<f64>,
    /// Latest instant the request may still be waiting in the queue (client deadline).
    pub wait_until: Option<Instant>,
    /// The request carries audio whose length could not be read (it counts as the lane's
    /// longest allowed clip).
    pub audio_unknown: bool,
}

/// The gateway core: lanes, their queues and the shared device cap.
#[derive(Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

struct Inner {
    specs: Vec<LaneSpec>,
    /// Lane indexes each lane yields to.
    yield_targets: Vec<Vec<usize>>,
    /// Lane indexes sorted by priority, highest first (stable on declaration order).
    by_priority: Vec<usize>,
    max_inflight_total: Option<usize>,
    next_id: AtomicU64,
    state: Mutex<State>,
    /// Per lane: for a `preempt_mode = pause` lane, whether its engines should be paused now
    /// (a lane it yields to has work in flight).
    pause: Vec<Option<watch::Sender<bool>>>,
}

#[derive(Default)]
struct State {
    lanes: Vec<LaneState>,
    total_inflight: usize,
    engine: Map<String, EngineLoad>,
    /// Per upstream URL: in-flight requests from every lane, and passive health. [`Gate::new`]
    /// makes an entry for every configured upstream, so admissions and releases look it up once
    /// and never copy the URL.
    health: Map<String, upstream::Health>,
    /// Waiters admitted by a dispatch that have not yet picked up their permit.
    granted: Map<u64, Slot>,
    /// Waiters refused by a dispatch (memory could not be read): id -> the refusal.
    refused: Map<u64, Rejection>,
    draining: bool,
    ledger: Option<Ledger>,
    /// Per lane: measured job peaks and the learned need.
    learners: Vec<crate::ledger::Learner>,
    /// The figures of the last memory check that failed (for the refusal built from it).
    shortfall: Option<MemoryShortfall>,
}

/// What an admitted request holds: its upstream, its id, on a `preempt` lane the notification
/// that tells it to stop, and on memory-admitted lanes its reservation (device, id).
#[derive(Debug, Clone)]
struct Slot {
    upstream: usize,
    id: u64,
    preempt: Option<Arc<Notify>>,
    reservation: Option<(u32, u64)>,
    /// Lanes whose running requests this admission told to stop.
    stopped: Vec<usize>,
}

#[derive(Default)]
struct LaneState {
    inflight: usize,
    queue: VecDeque<Waiting>,
    upstream_inflight: Vec<usize>,
    admitted: u64,
    released: u64,
    rejected: u64,
    queue_timeouts: u64,
    cancelled_in_queue: u64,
    mean_service: Option<Duration>,
    /// When this lane first had to hold because a lane it yields to was busy.
    yield_since: Option<Instant>,
    /// When a request of this lane last ended (for the yielding lanes' linger).
    last_release: Option<Instant>,
    /// On a `preempt` lane: running slots not yet told to stop, oldest first.
    preemptible: Vec<(u64, Arc<Notify>)>,
    /// Why the head of the queue was last held (meaningless while the queue is empty), and for
    /// a memory hold the figures of that check.
    held: Option<RejectReason>,
    held_memory: Option<MemoryShortfall>,
}

struct Waiting {
    id: u64,
    request: AdmitRequest,
    notify: Arc<Notify>,
}

/// A lane slot held by one request. Dropping it gives the slot back (exactly once) and lets the
/// next queued request in.
pub struct Permit {
    inner: Arc<Inner>,
    lane: usize,
    upstream: usize,
    slot: u64,
    preempt: Option<Arc<Notify>>,
    reservation: Option<(u32, u64)>,
    /// Lanes whose running requests this request's admission told to stop.
    stopped: Vec<usize>,
    /// Whether the upstream answered well (set by the caller; applied when the permit drops).
    upstream_ok: Option<bool>,
    /// Upstreams this request already tried (see [`Permit::reroute`]).
    tried: Vec<usize>,
    admitted_at: Instant,
    queue_wait: Duration,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit")
            .field("lane", &self.inner.specs[self.lane].name)
            .field("upstream", &self.upstream())
            .field("queue_wait", &self.queue_wait)
            .finish()
    }
}

impl Permit {
    pub fn lane_index(&self) -> usize {
        self.lane
    }

    pub fn lane_name(&self) -> &str {
        &self.inner.specs[self.lane].name
    }

    /// Index of the chosen upstream in the lane's `upstreams`.
    pub fn upstream_index(&self) -> usize {
        self.upstream
    }

    /// The chosen upstream (as configured).
    pub fn upstream(&self) -> &str {
        &self.inner.specs[self.lane].upstreams[self.upstream]
    }

    /// Time spent queued before admission.
    pub fn queue_wait(&self) -> Duration {
        self.queue_wait
    }

    pub fn admitted_at(&self) -> Instant {
        self.admitted_at
    }

    /// For lanes with `preempt`: notified (once) when this request is chosen to stop for work of
    /// a lane it yields to. The notification is stored until awaited (`Notify::notify_one`), so a
    /// waiter armed after it was sent still fires.
    pub fn preemption(&self) -> Option<Arc<Notify>> {
        self.preempt.clone()
    }

    /// The lanes (by index) whose running requests were told to stop when this request was
    /// admitted (see [`Permit::preemption`]); empty when it stopped nothing.
    pub fn stopped_lanes(&self) -> &[usize] {
        &self.stopped
    }

    /// Records how the upstream answered (a connection failure or a 5xx is `false`); applied to
    /// its passive health when the permit is dropped.
    pub fn mark_upstream(&mut self, ok: bool) {
        self.upstream_ok = Some(ok);
    }

    /// The request never reached its upstream (connection refused, or nothing of it written):
    /// counts that failure now and moves the request to the best other upstream of the lane not
    /// tried yet. Returns the new upstream, or `None` when none is left (the request stays on
    /// its upstream, and the failure is counted when the permit drops, as marked).
    pub fn reroute(&mut self) -> Option<&str> {
        let now = Instant::now();
        let mut st = self.inner.lock();
        let spec = &self.inner.specs[self.lane];
        self.tried.push(self.upstream);
        let next = upstream::choose(spec, &st.health, &st.engine, now, &self.tried)?;
        record_outcome(spec, &mut st, self.upstream, false, now);
        let old = spec.upstreams[self.upstream].as_str();
        let ls = &mut st.lanes[self.lane];
        ls.upstream_inflight[self.upstream] = ls.upstream_inflight[self.upstream].saturating_sub(1);
        ls.upstream_inflight[next] += 1;
        if let Some(h) = st.health.get_mut(old) {
            h.released();
        }
        if let Some(h) = st.health.get_mut(&spec.upstreams[next]) {
            h.taken(now);
        }
        self.upstream = next;
        drop(st);
        Some(self.upstream())
    }
}

/// Applies one request's outcome to its upstream's passive health: a success lets it back, a
/// failure counts towards an ejection, which happens when the lane's `max_ejection_percent`
/// allows it. One map look-up for a success; the lane's other upstreams are looked at only
/// when a failure reaches the threshold.
fn record_outcome(spec: &LaneSpec, st: &mut State, upstream: usize, ok: bool, now: Instant) {
    let url = &spec.upstreams[upstream];
    let Some(h) = st.health.get_mut(url) else {
        return;
    };
    if ok {
        h.succeeded(now);
        return;
    }
    if h.failed(now, &spec.outlier)
        && upstream::may_eject(spec, &st.health, now, upstream)
        && let Some(h) = st.health.get_mut(url)
    {
        h.eject(now, &spec.outlier);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let now = Instant::now();
        let service = now.saturating_duration_since(self.admitted_at);
        let mut st = self.inner.lock();
        if let Some(ok) = self.upstream_ok {
            record_outcome(
                &self.inner.specs[self.lane],
                &mut st,
                self.upstream,
                ok,
                now,
            );
        }
        let slot = Slot {
            upstream: self.upstream,
            id: self.slot,
            preempt: None,
            reservation: self.reservation,
            stopped: Vec::new(),
        };
        self.inner
            .release_locked(&mut st, self.lane, slot, Some(service), now);
        self.inner.dispatch_locked(&mut st);
    }
}

/// Removes a queued request when its waiting future is dropped (the client left), or gives back
/// a slot that was granted but never picked up.
struct WaitGuard<'a> {
    inner: &'a Arc<Inner>,
    lane: usize,
    id: u64,
    armed: bool,
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.inner.lock();
        st.refused.remove(&self.id);
        if let Some(slot) = st.granted.remove(&self.id) {
            self.inner
                .release_locked(&mut st, self.lane, slot, None, Instant::now());
        } else {
            let lane = &mut st.lanes[self.lane];
            if let Some(pos) = lane.queue.iter().position(|w| w.id == self.id) {
                lane.queue.remove(pos);
                lane.cancelled_in_queue += 1;
            }
        }
        self.inner.dispatch_locked(&mut st);
    }
}

/// Per-upstream figures in a snapshot.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct UpstreamSnapshot {
    pub url: String,
    pub inflight: usize,
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    pub kv_cache_usage: Option<f64>,
    /// Seconds since the engine metrics were last read; `None` when never.
    pub metrics_age_seconds: Option<f64>,
    /// In flight to this upstream from every lane that uses it.
    pub inflight_all_lanes: usize,
    /// Not ejected by passive health and not failing over and over (see
    /// [`Gate::upstream_healthy`]).
    pub healthy: bool,
    /// Out of rotation now (an ejection running, or its probe out).
    pub ejected: bool,
    pub consecutive_failures: u32,
    /// Ejections in a row: the multiplier of the last ejection's length (it decays while the
    /// upstream serves well).
    pub ejections: u32,
}

/// One lane's state at one instant.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LaneSnapshot {
    pub name: String,
    pub inflight: usize,
    pub queued: usize,
    pub rejected: u64,
    pub max_inflight: usize,
    pub max_queue: usize,
    pub priority: i32,
    pub policy: Policy,
    pub admitted: u64,
    pub completed: u64,
    pub queue_timeouts: u64,
    pub cancelled_in_queue: u64,
    /// Moving average of how long an admitted request holds its slot.
    pub mean_service_seconds: Option<f64>,
    /// Requests the lane completes per second at full concurrency, from the moving average.
    pub service_rate_per_second: Option<f64>,
    pub yielding: bool,
    /// While requests wait: the code of what holds the head of the queue (`host_memory`,
    /// `device_saturated`, ...).
    pub held_by: Option<&'static str>,
    pub upstreams: Vec<UpstreamSnapshot>,
    /// Memory admission figures, for lanes that admit on memory.
    pub memory: Option<LaneMemorySnapshot>,
    /// While requests are queued: why the first one could not start at its last check.
    pub waiting_for: Option<WaitingFor>,
}

/// What holds the head of a lane's queue.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WaitingFor {
    /// The refusal code the check gave (`lane_saturated`, `lane_yielding`, `host_memory`, ...).
    pub reason: &'static str,
    /// For memory: the job's need and margin beside the pool's free and reserved figures.
    pub memory: Option<crate::ledger::MemoryShortfall>,
}

impl WaitingFor {
    /// What held the head at its last check: the reason, with the figures of a memory hold.
    fn from_hold(
        reason: RejectReason,
        memory: Option<crate::ledger::MemoryShortfall>,
    ) -> WaitingFor {
        let is_memory = matches!(reason, RejectReason::GpuMemory | RejectReason::HostMemory);
        WaitingFor {
            reason: reason.code(),
            memory: memory.filter(|_| is_memory),
        }
    }
}

/// A lane's memory need: configured, learned, and the one in force.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LaneMemorySnapshot {
    pub device: u32,
    pub configured_bytes_per_job: u64,
    pub configured_bytes_per_audio_second: u64,
    pub learn: bool,
    /// Learned figures (from this run, or loaded from the calibration file), when any.
    pub learned: Option<LearnedNeed>,
    /// Jobs of this lane measured since start.
    pub measured_jobs: u64,
    /// Bytes per job admission uses now (learned when `learn` and learned figures exist).
    pub bytes_per_job: u64,
    pub bytes_per_audio_second: u64,
    pub margin_bytes: u64,
    /// While the head of the queue waits for memory: the figures of its last check (its need
    /// beside what is free and reserved, and the ceiling).
    pub waiting: Option<MemoryShortfall>,
}

/// One memory pool's ledger at one instant.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PoolSnapshot {
    pub device: u32,
    pub kind: PoolKind,
    /// From the last usable reading; `None` when there is none (failed or stale probe).
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub reading_age_seconds: Option<f64>,
    /// Outstanding reservations and their bytes.
    pub reservations: usize,
    pub reserved_bytes: u64,
    /// Reserved bytes the reading does not show yet.
    pub hidden_bytes: u64,
}

/// The whole gate at one instant.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GateSnapshot {
    pub lanes: Vec<LaneSnapshot>,
    pub total_inflight: usize,
    pub max_inflight_total: Option<usize>,
    pub draining: bool,
    /// Memory pools the lanes admit on.
    pub memory: Vec<PoolSnapshot>,
}

impl Gate {
    /// Builds a gate; lane names must be unique and `yield_to` must name other lanes. `memory`
    /// sets how lanes with a [`crate::GpuNeed`] read the ledger (defaults: a GPU pool).
    pub fn new(
        specs: Vec<LaneSpec>,
        max_inflight_total: Option<usize>,
        memory: Option<LedgerSettings>,
    ) -> Result<Gate, GateError> {
        if specs.is_empty() {
            return Err(GateError::Config("at least one lane is required".into()));
        }
        if max_inflight_total == Some(0) {
            return Err(GateError::Config(
                "max_inflight_total must be at least 1".into(),
            ));
        }
        let lane_err = |lane: &str, message: String| GateError::Lane {
            lane: lane.to_string(),
            message,
        };
        let mut yield_targets = Vec::with_capacity(specs.len());
        for (i, spec) in specs.iter().enumerate() {
            if spec.name.is_empty() {
                return Err(GateError::Config("a lane has an empty name".into()));
            }
            if specs[..i].iter().any(|s| s.name == spec.name) {
                return Err(lane_err(&spec.name, "lane name used twice".into()));
            }
            if spec.max_inflight == 0 {
                return Err(lane_err(
                    &spec.name,
                    "max_inflight must be at least 1".into(),
                ));
            }
            if spec.upstreams.is_empty() {
                return Err(lane_err(&spec.name, "needs at least one upstream".into()));
            }
            let mut targets = Vec::new();
            for target in &spec.yield_to {
                match specs.iter().position(|s| &s.name == target) {
                    Some(t) if t == i => {
                        return Err(lane_err(&spec.name, "cannot yield to itself".into()));
                    }
                    Some(t) => targets.push(t),
                    None => {
                        return Err(lane_err(
                            &spec.name,
                            format!("yield_to names unknown lane `{target}`"),
                        ));
                    }
                }
            }
            yield_targets.push(targets);
        }
        let mut by_priority: Vec<usize> = (0..specs.len()).collect();
        by_priority.sort_by_key(|&i| std::cmp::Reverse(specs[i].priority));
        let lanes = specs
            .iter()
            .map(|s| LaneState {
                upstream_inflight: vec![0; s.upstreams.len()],
                ..LaneState::default()
            })
            .collect();
        let specs_len = specs.len();
        let ledger = specs
            .iter()
            .any(|s| s.gpu.is_some())
            .then(|| Ledger::new(memory.unwrap_or_default()));
        let health = specs
            .iter()
            .flat_map(|s| &s.upstreams)
            .map(|url| (url.clone(), upstream::Health::default()))
            .collect();
        let pause = specs
            .iter()
            .map(|s| {
                (s.preempt && s.preempt_mode == PreemptMode::Pause).then(|| watch::channel(false).0)
            })
            .collect();
        Ok(Gate {
            inner: Arc::new(Inner {
                pause,
                specs,
                yield_targets,
                by_priority,
                max_inflight_total,
                next_id: AtomicU64::new(1),
                state: Mutex::new(State {
                    lanes,
                    ledger,
                    health,
                    learners: (0..specs_len).map(|_| Default::default()).collect(),
                    ..State::default()
                }),
            }),
        })
    }

    pub fn lanes(&self) -> &[LaneSpec] {
        &self.inner.specs
    }

    pub fn lane_index(&self, name: &str) -> Option<usize> {
        self.inner.specs.iter().position(|s| s.name == name)
    }

    /// Records one scrape of an upstream engine's load (keyed by the upstream as configured).
    pub fn set_engine_load(&self, upstream: &str, load: EngineLoad) {
        let mut st = self.inner.lock();
        st.engine.insert(upstream.to_string(), load);
        self.inner.dispatch_locked(&mut st);
    }

    /// Takes one memory reading from the sampler task (the gate never reads a probe itself).
    pub fn push_memory_reading(&self, reading: MemoryReading) {
        let mut st = self.inner.lock();
        if let Some(ledger) = st.ledger.as_mut() {
            ledger.push_reading(reading);
        }
        self.inner.learn_from_ledger(&mut st);
        self.inner.dispatch_locked(&mut st);
    }

    /// The probe failed for `device`: there is no reading until the next good one, and lanes
    /// follow their `fail_open`.
    pub fn memory_unreadable(&self, device: u32) {
        let mut st = self.inner.lock();
        if let Some(ledger) = st.ledger.as_mut() {
            ledger.clear_reading(device);
        }
        self.inner.dispatch_locked(&mut st);
    }

    /// Installs learned figures (read back from the calibration file) for `lane`.
    pub fn set_learned(&self, lane: usize, learned: LearnedNeed) {
        self.inner.lock().learners[lane] = crate::ledger::Learner::with_loaded(learned);
    }

    /// The learned need of `lane`, if any.
    pub fn learned(&self, lane: usize) -> Option<LearnedNeed> {
        self.inner.lock().learners[lane].learned()
    }

    /// For a lane with `preempt` and `preempt_mode = pause`: follows whether its engines should
    /// be paused (true while a lane it yields to has work in flight). `None` for other lanes.
    pub fn pause_signal(&self, lane: usize) -> Option<watch::Receiver<bool>> {
        self.inner
            .pause
            .get(lane)?
            .as_ref()
            .map(|tx| tx.subscribe())
    }

    /// Stops admitting new work; queued and in-flight work continues.
    pub fn start_draining(&self) {
        self.inner.lock().draining = true;
    }

    /// Whether passive health counts on `upstream` (URL as configured) right now: not ejected,
    /// and not failing request after request (the last upstream a lane has in rotation is
    /// never ejected, but it is not healthy either).
    pub fn upstream_healthy(&self, upstream: &str) -> bool {
        let st = self.inner.lock();
        st.health
            .get(upstream)
            .is_none_or(|h| h.healthy(Instant::now()))
    }

    /// Whether [`Gate::start_draining`] was called.
    pub fn is_draining(&self) -> bool {
        self.inner.lock().draining
    }

    /// Returns once nothing is queued or in flight.
    pub async fn wait_idle(&self) {
        loop {
            {
                let st = self.inner.lock();
                if st.total_inflight == 0 && st.lanes.iter().all(|l| l.queue.is_empty()) {
                    return;
                }
            }
            tokio::time::sleep(RECHECK_INTERVAL).await;
        }
    }

    /// Asks for a slot on `lane`. Resolves at once, or after a bounded wait under the `queue` and
    /// `fallback` policies. Dropping the future while it waits removes the request from the queue.
    pub async fn admit(&self, lane: usize, request: AdmitRequest) -> Result<Permit, Rejection> {
        let inner = &self.inner;
        let spec = &inner.specs[lane];
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let enqueued_at = Instant::now();
        let notify = Arc::new(Notify::new());
        {
            let mut st = inner.lock();
            let now = enqueued_at;
            let fifo_blocked = !st.lanes[lane].queue.is_empty();
            let verdict = if fifo_blocked {
                // Arrivals wait behind those already queued; say why the head is waiting.
                inner
                    .check(&mut st, lane, now, &request)
                    .and(Err(RejectReason::Saturated))
            } else {
                let verdict = inner.check(&mut st, lane, now, &request);
                if let Err(reason) = verdict {
                    // Queued, it is the head: what holds it decides who yields to it.
                    inner.note_held(&mut st, lane, reason);
                }
                verdict
            };
            match verdict {
                Ok(upstream) => {
                    let slot = inner.take_slot(&mut st, lane, upstream, now, id, &request);
                    return Ok(inner.permit(lane, slot, Duration::ZERO, now));
                }
                Err(reason) => {
                    let queue_full = st.lanes[lane].queue.len() >= spec.max_queue;
                    let reason = match spec.policy {
                        Policy::Reject => Some(reason),
                        // Without a memory reading, waiting would only wait for the probe; for a
                        // need no admitted job's end can meet, it would only wait for the timeout.
                        _ if memory_refused_now(&st, reason) => Some(reason),
                        Policy::Queue | Policy::Fallback if queue_full => {
                            Some(if reason == RejectReason::ShuttingDown {
                                reason
                            } else {
                                RejectReason::QueueFull
                            })
                        }
                        _ if reason == RejectReason::ShuttingDown => Some(reason),
                        _ => None,
                    };
                    if let Some(reason) = reason {
                        st.lanes[lane].rejected += 1;
                        return Err(inner.rejection(&st, lane, reason, now));
                    }
                    st.lanes[lane].queue.push_back(Waiting {
                        id,
                        request: request.clone(),
                        notify: notify.clone(),
                    });
                }
            }
        }

        let mut guard = WaitGuard {
            inner,
            lane,
            id,
            armed: true,
        };
        let mut deadline = enqueued_at + spec.queue_timeout;
        if let Some(until) = request.wait_until {
            deadline = deadline.min(until);
        }
        loop {
            let timed_out = tokio::select! {
                _ = notify.notified() => false,
                _ = tokio::time::sleep(RECHECK_INTERVAL) => {
                    let mut st = inner.lock();
                    inner.dispatch_locked(&mut st);
                    false
                }
                _ = tokio::time::sleep_until(deadline) => true,
            };
            let mut st = inner.lock();
            if let Some(slot) = st.granted.remove(&id) {
                guard.armed = false;
                let now = Instant::now();
                return Ok(inner.permit(lane, slot, now - enqueued_at, now));
            }
            if let Some(rejection) = st.refused.remove(&id) {
                guard.armed = false;
                st.lanes[lane].rejected += 1;
                return Err(rejection);
            }
            if timed_out || Instant::now() >= deadline {
                guard.armed = false;
                let now = Instant::now();
                let ls = &mut st.lanes[lane];
                if let Some(pos) = ls.queue.iter().position(|w| w.id == id) {
                    ls.queue.remove(pos);
                }
                ls.queue_timeouts += 1;
                ls.rejected += 1;
                // What held the lane's head is what held this request (it was the head, or
                // waited behind it): a memory hold is said as such, with its figures.
                let mut rejection = match (ls.held, ls.held_memory.clone()) {
                    (
                        Some(reason @ (RejectReason::GpuMemory | RejectReason::HostMemory)),
                        Some(m),
                    ) => inner.rejection_for(&st, lane, reason, now, Some(m)),
                    _ => inner.rejection(&st, lane, RejectReason::QueueTimeout, now),
                };
                rejection.queued_for = Some(now.saturating_duration_since(enqueued_at));
                inner.dispatch_locked(&mut st);
                return Err(rejection);
            }
        }
    }

    /// Estimated wait for a new arrival on `lane`, from its measured service time and queue.
    pub fn retry_after(&self, lane: usize) -> Duration {
        let st = self.inner.lock();
        self.inner.estimate_wait(&st, lane)
    }

    pub fn snapshot(&self) -> GateSnapshot {
        let st = self.inner.lock();
        let now = Instant::now();
        let lanes = self
            .inner
            .specs
            .iter()
            .zip(&st.lanes)
            .enumerate()
            .map(|(i, (spec, ls))| {
                let mean = ls.mean_service.map(|d| d.as_secs_f64());
                LaneSnapshot {
                    name: spec.name.clone(),
                    inflight: ls.inflight,
                    queued: ls.queue.len(),
                    rejected: ls.rejected,
                    max_inflight: spec.max_inflight,
                    max_queue: spec.max_queue,
                    priority: spec.priority,
                    policy: spec.policy,
                    admitted: ls.admitted,
                    completed: ls.released,
                    queue_timeouts: ls.queue_timeouts,
                    cancelled_in_queue: ls.cancelled_in_queue,
                    mean_service_seconds: mean,
                    service_rate_per_second: mean
                        .filter(|m| *m > 0.0)
                        .map(|m| spec.max_inflight as f64 / m),
                    yielding: self.inner.higher_busy(&st, i, Instant::now()),
                    held_by: ls.held.filter(|_| !ls.queue.is_empty()).map(|r| r.code()),
                    waiting_for: ls
                        .held
                        .filter(|_| !ls.queue.is_empty())
                        .map(|r| WaitingFor::from_hold(r, ls.held_memory.clone())),
                    memory: spec.gpu.as_ref().map(|need| {
                        let learner = &st.learners[i];
                        let learned = learner.learned();
                        let in_force = learned.filter(|_| need.learn);
                        LaneMemorySnapshot {
                            device: need.device,
                            configured_bytes_per_job: need.bytes_per_job,
                            configured_bytes_per_audio_second: need.bytes_per_audio_second,
                            learn: need.learn,
                            learned,
                            measured_jobs: learner.seen(),
                            bytes_per_job: in_force.map_or(need.bytes_per_job, |l| l.bytes_per_job),
                            bytes_per_audio_second: in_force
                                .map_or(need.bytes_per_audio_second, |l| l.bytes_per_audio_second),
                            margin_bytes: need.margin_bytes,
                            waiting: ls.held_memory.clone().filter(|_| {
                                !ls.queue.is_empty()
                                    && ls.held.is_some_and(|r| {
                                        matches!(
                                            r,
                                            RejectReason::GpuMemory | RejectReason::HostMemory
                                        )
                                    })
                            }),
                        }
                    }),
                    upstreams: spec
                        .upstreams
                        .iter()
                        .zip(&ls.upstream_inflight)
                        .map(|(url, inflight)| {
                            let load = st.engine.get(url);
                            let health = st.health.get(url);
                            UpstreamSnapshot {
                                inflight_all_lanes: health.map_or(0, |h| h.inflight),
                                healthy: health.is_none_or(|h| h.healthy(now)),
                                ejected: health.is_some_and(|h| h.ejected(now)),
                                consecutive_failures: health.map_or(0, |h| h.failures),
                                ejections: health.map_or(0, |h| h.ejections),
                                url: url.clone(),
                                inflight: *inflight,
                                waiting: load.and_then(|l| l.waiting),
                                running: load.and_then(|l| l.running),
                                kv_cache_usage: load.and_then(|l| l.kv_cache_usage),
                                metrics_age_seconds: load.map(|l| {
                                    now.saturating_duration_since(l.observed_at).as_secs_f64()
                                }),
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        GateSnapshot {
            lanes,
            total_inflight: st.total_inflight,
            max_inflight_total: self.inner.max_inflight_total,
            draining: st.draining,
            memory: self.inner.pool_snapshots(&st, now),
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave counts half-updated (every update is a
        // few integer writes), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn permit(
        self: &Arc<Self>,
        lane: usize,
        slot: Slot,
        queue_wait: Duration,
        admitted_at: Instant,
    ) -> Permit {
        Permit {
            inner: self.clone(),
            lane,
            upstream: slot.upstream,
            slot: slot.id,
            preempt: slot.preempt,
            reservation: slot.reservation,
            stopped: slot.stopped,
            upstream_ok: None,
            tried: Vec::new(),
            admitted_at,
            queue_wait,
        }
    }

    fn take_slot(
        &self,
        st: &mut State,
        lane: usize,
        upstream: usize,
        now: Instant,
        id: u64,
        request: &AdmitRequest,
    ) -> Slot {
        let reservation = self.reserve_memory(st, lane, upstream, now, id, request);
        let busy = self.higher_busy(st, lane, now);
        let spec = &self.specs[lane];
        let preempt = (spec.preempt && spec.preempt_mode == PreemptMode::Abort)
            .then(|| Arc::new(Notify::new()));
        let ls = &mut st.lanes[lane];
        ls.inflight += 1;
        ls.upstream_inflight[upstream] += 1;
        ls.admitted += 1;
        if let Some(n) = &preempt {
            ls.preemptible.push((id, n.clone()));
        }
        // Admitting while a yielded-to lane is busy means max_yield ran out: restart the clock.
        ls.yield_since = if busy { Some(now) } else { None };
        if let Some(h) = st.health.get_mut(&self.specs[lane].upstreams[upstream]) {
            h.taken(now);
        }
        st.total_inflight += 1;
        let stopped = self.preempt_for(st, lane);
        self.update_pause(st);
        Slot {
            upstream,
            id,
            preempt,
            reservation,
            stopped,
        }
    }

    /// Work was admitted on `lane`: each preemptible lane that yields to it stops its
    /// `preempt_per_job` youngest running requests (those that have spent least so far). The
    /// notification is stored in each request's own `Notify`, so one whose waiter is not armed
    /// yet still stops when it arms it. Returns the lanes where it stopped any.
    fn preempt_for(&self, st: &mut State, lane: usize) -> Vec<usize> {
        let mut stopped = Vec::new();
        for (other, targets) in self.yield_targets.iter().enumerate() {
            let spec = &self.specs[other];
            if !spec.preempt || spec.preempt_mode != PreemptMode::Abort || !targets.contains(&lane)
            {
                continue;
            }
            let running = &mut st.lanes[other].preemptible;
            let keep = running.len().saturating_sub(spec.preempt_per_job);
            if keep < running.len() {
                stopped.push(other);
            }
            for (_, notify) in running.drain(keep..).rev() {
                notify.notify_one();
            }
        }
        stopped
    }

    /// Publishes, for each pausing lane, whether a lane it yields to has work in flight (only
    /// changes wake the watchers).
    fn update_pause(&self, st: &State) {
        for (lane, tx) in self.pause.iter().enumerate() {
            let Some(tx) = tx else { continue };
            let busy = self.yield_targets[lane]
                .iter()
                .any(|&t| st.lanes[t].inflight > 0);
            tx.send_if_modified(|paused| std::mem::replace(paused, busy) != busy);
        }
    }

    fn release_locked(
        &self,
        st: &mut State,
        lane: usize,
        slot: Slot,
        service: Option<Duration>,
        now: Instant,
    ) {
        let upstream = slot.upstream;
        if let Some((device, id)) = slot.reservation {
            self.release_memory(st, device, id, now);
        }
        let ls = &mut st.lanes[lane];
        ls.preemptible.retain(|(id, _)| *id != slot.id);
        debug_assert!(ls.inflight > 0, "permit released twice");
        ls.inflight = ls.inflight.saturating_sub(1);
        ls.upstream_inflight[upstream] = ls.upstream_inflight[upstream].saturating_sub(1);
        ls.released += 1;
        if let Some(h) = st.health.get_mut(&self.specs[lane].upstreams[upstream]) {
            h.released();
        }
        let ls = &mut st.lanes[lane];
        ls.last_release = Some(now);
        if let Some(sample) = service {
            ls.mean_service = Some(match ls.mean_service {
                None => sample,
                Some(mean) => Duration::from_secs_f64(
                    mean.as_secs_f64() * (1.0 - SERVICE_EWMA_ALPHA)
                        + sample.as_secs_f64() * SERVICE_EWMA_ALPHA,
                ),
            });
        }
        st.total_inflight = st.total_inflight.saturating_sub(1);
        self.update_pause(st);
    }

    /// Whether any lane `lane` yields to has work in flight, work queued that `lane` holding
    /// back can help (see [`Inner::yield_helps`]), or finished work less than `lane`'s
    /// `yield_linger` ago.
    fn higher_busy(&self, st: &State, lane: usize, now: Instant) -> bool {
        let linger = self.specs[lane].yield_linger;
        self.yield_targets[lane].iter().any(|&t| {
            let target = &st.lanes[t];
            target.inflight > 0
                || (!target.queue.is_empty() && self.yield_helps(st, lane, t))
                || target
                    .last_release
                    .is_some_and(|ended| now.saturating_duration_since(ended) < linger)
        })
    }

    /// Whether `lane` holding back can help the head of `target`'s queue, given what holds it:
    /// slots (its own, the device-wide cap) and the engines' load are shared with `lane`;
    /// memory only when `lane`'s own running jobs hold reservations (they give them back when
    /// they end); nothing `lane` does brings a yield of `target`'s own, a timeout or a shutdown
    /// to an end. A head not checked yet counts as helped.
    fn yield_helps(&self, st: &State, lane: usize, target: usize) -> bool {
        match st.lanes[target].held {
            None
            | Some(
                RejectReason::Saturated
                | RejectReason::DeviceSaturated
                | RejectReason::EngineSaturated
                | RejectReason::QueueFull,
            ) => true,
            Some(RejectReason::GpuMemory | RejectReason::HostMemory) => {
                self.specs[lane].gpu.is_some() && st.lanes[lane].inflight > 0
            }
            Some(
                RejectReason::Yielding | RejectReason::QueueTimeout | RejectReason::ShuttingDown,
            ) => false,
        }
    }

    /// Records why the head of `lane`'s queue is held (with the memory figures of a memory hold).
    fn note_held(&self, st: &mut State, lane: usize, reason: RejectReason) {
        let memory = matches!(reason, RejectReason::GpuMemory | RejectReason::HostMemory)
            .then(|| st.shortfall.clone())
            .flatten();
        let ls = &mut st.lanes[lane];
        ls.held = Some(reason);
        ls.held_memory = memory;
    }

    /// Decides whether a request may start on `lane` now; on success returns the upstream to use.
    /// Each concern is one step, in this order: draining, the lane's and the device's caps (with
    /// priority), yielding, GPU memory, then the choice of upstream.
    fn check(
        &self,
        st: &mut State,
        lane: usize,
        now: Instant,
        request: &AdmitRequest,
    ) -> Result<usize, RejectReason> {
        Self::check_draining(st)?;
        self.check_lane_cap(st, lane)?;
        self.check_device_cap(st, lane)?;
        self.check_yield(st, lane, now)?;
        self.check_memory(st, lane, now, request)?;
        let spec = &self.specs[lane];
        upstream::choose(spec, &st.health, &st.engine, now, &[])
            .ok_or(RejectReason::EngineSaturated)
    }

    /// A draining gate admits nothing new.
    fn check_draining(st: &State) -> Result<(), RejectReason> {
        if st.draining {
            return Err(RejectReason::ShuttingDown);
        }
        Ok(())
    }

    /// Every in-flight slot of the lane is taken.
    fn check_lane_cap(&self, st: &State, lane: usize) -> Result<(), RejectReason> {
        if st.lanes[lane].inflight >= self.specs[lane].max_inflight {
            return Err(RejectReason::Saturated);
        }
        Ok(())
    }

    /// The device-wide cap is reached, or a higher-priority lane whose head request waits only for
    /// that cap goes first.
    fn check_device_cap(&self, st: &State, lane: usize) -> Result<(), RejectReason> {
        let Some(total) = self.max_inflight_total else {
            return Ok(());
        };
        if st.total_inflight >= total {
            return Err(RejectReason::DeviceSaturated);
        }
        let priority = self.specs[lane].priority;
        let waiting_higher = self.by_priority.iter().any(|&other| {
            let ls = &st.lanes[other];
            other != lane
                && self.specs[other].priority > priority
                && !ls.queue.is_empty()
                && ls.inflight < self.specs[other].max_inflight
                // Only a head that waits for the cap (not for memory, say) is helped by it.
                && matches!(ls.held, None | Some(RejectReason::DeviceSaturated))
        });
        if waiting_higher {
            return Err(RejectReason::DeviceSaturated);
        }
        Ok(())
    }

    /// A lane it yields to is busy and this lane has not yet yielded for `max_yield`; starts the
    /// yield clock on the first hold and clears it once the yielded-to lanes are idle.
    fn check_yield(&self, st: &mut State, lane: usize, now: Instant) -> Result<(), RejectReason> {
        if !self.higher_busy(st, lane, now) {
            st.lanes[lane].yield_since = None;
            return Ok(());
        }
        let since = *st.lanes[lane].yield_since.get_or_insert(now);
        if now.saturating_duration_since(since) < self.specs[lane].max_yield {
            return Err(RejectReason::Yielding);
        }
        Ok(())
    }

    /// Admits queued requests, highest-priority lanes first, while they fit.
    fn dispatch_locked(&self, st: &mut State) {
        // The clock is read only when someone waits (most releases find every queue empty).
        if st.lanes.iter().all(|l| l.queue.is_empty()) {
            return;
        }
        let now = Instant::now();
        for &lane in &self.by_priority {
            while let Some(head) = st.lanes[lane].queue.front() {
                let request = head.request.clone();
                match self.check(st, lane, now, &request) {
                    Ok(upstream) => {
                        let head = st.lanes[lane]
                            .queue
                            .pop_front()
                            .expect("queue head checked above");
                        let slot = self.take_slot(st, lane, upstream, now, head.id, &request);
                        st.granted.insert(head.id, slot);
                        st.lanes[lane].held = None;
                        head.notify.notify_one();
                    }
                    // No memory reading and the lane is not fail-open, or a need no admitted
                    // job's end can meet: refuse now rather than wait.
                    Err(reason) if memory_refused_now(st, reason) => {
                        let head = st.lanes[lane]
                            .queue
                            .pop_front()
                            .expect("queue head checked above");
                        let rejection = self.rejection(st, lane, reason, now);
                        st.refused.insert(head.id, rejection);
                        head.notify.notify_one();
                    }
                    Err(reason) => {
                        self.note_held(st, lane, reason);
                        break;
                    }
                }
            }
        }
    }

    fn estimate_wait(&self, st: &State, lane: usize) -> Duration {
        let spec = &self.specs[lane];
        let ls = &st.lanes[lane];
        let per_request = ls.mean_service.unwrap_or(DEFAULT_SERVICE_TIME);
        let ahead = ls.queue.len() as f64 + 1.0;
        let wait = per_request.as_secs_f64() * ahead / spec.max_inflight as f64;
        Duration::from_secs_f64(wait.min(MAX_RETRY_AFTER.as_secs_f64()))
    }

    fn rejection(&self, st: &State, lane: usize, reason: RejectReason, now: Instant) -> Rejection {
        let memory = st.shortfall.clone();
        self.rejection_for(st, lane, reason, now, memory)
    }

    /// A refusal; `memory` holds the figures of the memory check behind a memory refusal.
    fn rejection_for(
        &self,
        st: &State,
        lane: usize,
        reason: RejectReason,
        now: Instant,
        memory: Option<MemoryShortfall>,
    ) -> Rejection {
        let spec = &self.specs[lane];
        let mut retry_after = self.estimate_wait(st, lane);
        if reason == RejectReason::Yielding
            && let Some(since) = st.lanes[lane].yield_since
        {
            let left = spec
                .max_yield
                .saturating_sub(now.saturating_duration_since(since));
            retry_after = retry_after.min(left.max(Duration::from_millis(1)));
        }
        let memory =
            memory.filter(|_| matches!(reason, RejectReason::GpuMemory | RejectReason::HostMemory));
        if let Some(wait) = memory
            .as_ref()
            .and_then(|m| self.memory_retry_after(st, m, now))
        {
            retry_after = wait;
        }
        Rejection {
            lane: spec.name.clone(),
            reason,
            retry_after,
            fallback: spec.policy == Policy::Fallback,
            memory,
            queued_for: None,
        }
    }
}

/// Whether `reason` is a memory refusal that waiting cannot help: there was no usable reading,
/// or the need does not fit even once every admitted job has ended.
fn memory_refused_now(st: &State, reason: RejectReason) -> bool {
    matches!(reason, RejectReason::GpuMemory | RejectReason::HostMemory)
        && st
            .shortfall
            .as_ref()
            .is_some_and(|s| s.free_bytes.is_none() || s.never_fits())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(name: &str, max_inflight: usize, max_queue: usize, policy: Policy) -> LaneSpec {
        LaneSpec {
            max_inflight,
            max_queue,
            policy,
            queue_timeout: Duration::from_millis(200),
            ..LaneSpec::new(name, &["http://up-a", "http://up-b"])
        }
    }

    fn gate(specs: Vec<LaneSpec>) -> Gate {
        Gate::new(specs, None, None).expect("valid gate")
    }

    fn counts(g: &Gate, lane: usize) -> (usize, usize) {
        let s = g.snapshot();
        (s.lanes[lane].inflight, s.lanes[lane].queued)
    }

    #[tokio::test(start_paused = true)]
    async fn reject_policy_admits_up_to_max_inflight_and_releases_once() {
        let g = gate(vec![lane("text", 2, 0, Policy::Reject)]);
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let b = g.admit(0, AdmitRequest::default()).await.unwrap();
        let c = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(c.reason, RejectReason::Saturated);
        assert_eq!(c.reason.code(), "lane_saturated");
        // The two permits went to different upstreams (least loaded).
        assert_ne!(a.upstream_index(), b.upstream_index());
        assert_eq!(counts(&g, 0), (2, 0));
        drop(a);
        assert_eq!(counts(&g, 0), (1, 0));
        drop(b);
        let s = g.snapshot();
        assert_eq!((s.lanes[0].inflight, s.total_inflight), (0, 0));
        assert_eq!((s.lanes[0].admitted, s.lanes[0].completed), (2, 2));
        assert_eq!(s.lanes[0].rejected, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn queue_serves_in_order_and_times_out() {
        let g = gate(vec![lane("audio", 1, 4, Policy::Queue)]);
        let first = g.admit(0, AdmitRequest::default()).await.unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let g = g.clone();
            let order = order.clone();
            tasks.push(tokio::spawn(async move {
                let r = g.admit(0, AdmitRequest::default()).await;
                if let Ok(p) = r {
                    order.lock().unwrap().push(i);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    drop(p);
                    Ok(())
                } else {
                    Err(r.unwrap_err())
                }
            }));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(counts(&g, 0), (1, 4));
        // A fifth waiter does not fit the queue.
        let full = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(full.reason, RejectReason::QueueFull);
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(first);
        let mut timeouts = 0;
        for t in tasks {
            if let Err(r) = t.await.unwrap() {
                assert_eq!(r.reason, RejectReason::QueueTimeout);
                timeouts += 1;
            }
        }
        // first released at ~54 ms; waiters served 30 ms apart: 0 at 54, 1 at 84, 2 at 114,
        // 3 at 144 (all before their 200 ms queue timeout).
        assert_eq!(timeouts, 0);
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(counts(&g, 0), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn queued_request_times_out_at_queue_timeout() {
        let g = gate(vec![lane("audio", 1, 4, Policy::Queue)]);
        let _held = g.admit(0, AdmitRequest::default()).await.unwrap();
        let start = Instant::now();
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(r.reason, RejectReason::QueueTimeout);
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        assert_eq!(counts(&g, 0), (1, 0));
        assert_eq!(g.snapshot().lanes[0].queue_timeouts, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_waiter_leaves_the_queue() {
        let g = gate(vec![lane("audio", 1, 4, Policy::Queue)]);
        let held = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let waiter = tokio::spawn(async move { g2.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(counts(&g, 0), (1, 1));
        waiter.abort();
        let _ = waiter.await;
        assert_eq!(counts(&g, 0), (1, 0));
        assert_eq!(g.snapshot().lanes[0].cancelled_in_queue, 1);
        drop(held);
        assert_eq!(counts(&g, 0), (0, 0));
    }

    #[tokio::test(start_paused = true)]
    async fn yield_linger_keeps_text_out_between_two_audio_jobs() {
        let audio = lane("audio", 1, 4, Policy::Queue);
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            max_yield: Duration::from_secs(10),
            yield_linger: Duration::from_millis(300),
            queue_timeout: Duration::from_secs(5),
            ..lane("text", 4, 8, Policy::Queue)
        };
        let g = gate(vec![audio, text]);
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let t = tokio::spawn(async move {
            let p = g2.admit(1, AdmitRequest::default()).await.unwrap();
            (Instant::now(), p)
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ended = Instant::now();
        drop(a);
        // The next utterance comes 200 ms later: text is still held, so it runs alone.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(counts(&g, 1), (0, 1));
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        drop(a);
        let again = Instant::now();
        // Text gets in once audio has been idle for the linger.
        let (admitted_at, _p) = t.await.unwrap();
        assert!(admitted_at - again >= Duration::from_millis(300));
        assert!(admitted_at - again < Duration::from_millis(300) + RECHECK_INTERVAL * 2);
        assert!(admitted_at - ended >= Duration::from_millis(500));
    }

    #[tokio::test(start_paused = true)]
    async fn yielding_lane_holds_until_higher_lane_idle_or_max_yield() {
        let audio = lane("audio", 1, 4, Policy::Queue);
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            max_yield: Duration::from_millis(500),
            queue_timeout: Duration::from_secs(5),
            ..lane("text", 4, 8, Policy::Queue)
        };
        let g = gate(vec![audio, text]);
        // Half one: audio work ends before max_yield, text is admitted right after.
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let start = Instant::now();
        let t = tokio::spawn(async move {
            let p = g2.admit(1, AdmitRequest::default()).await.unwrap();
            (Instant::now(), p)
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(counts(&g, 1), (0, 1));
        assert!(g.snapshot().lanes[1].yielding);
        drop(a);
        let (admitted_at, p) = t.await.unwrap();
        assert_eq!(admitted_at - start, Duration::from_millis(100));
        drop(p);

        // Half two: audio stays busy; text is admitted once max_yield has passed.
        let _a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let start = Instant::now();
        let p = g.admit(1, AdmitRequest::default()).await.unwrap();
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(500) && waited < Duration::from_millis(560),
            "{waited:?}"
        );
        drop(p);
    }

    #[tokio::test(start_paused = true)]
    async fn reject_policy_yielding_answers_lane_yielding() {
        let audio = lane("audio", 1, 0, Policy::Reject);
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            ..lane("text", 4, 0, Policy::Reject)
        };
        let g = gate(vec![audio, text]);
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let r = g.admit(1, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(r.reason.code(), "lane_yielding");
        drop(a);
        assert!(g.admit(1, AdmitRequest::default()).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn device_cap_prefers_higher_priority_waiters() {
        let audio = LaneSpec {
            priority: 10,
            ..lane("audio", 2, 4, Policy::Queue)
        };
        let text = lane("text", 2, 4, Policy::Queue);
        let g = Gate::new(vec![text, audio], Some(2), None).unwrap();
        let t1 = g.admit(0, AdmitRequest::default()).await.unwrap();
        let t2 = g.admit(0, AdmitRequest::default()).await.unwrap();
        let (ga, gt) = (g.clone(), g.clone());
        let audio_wait = tokio::spawn(async move { ga.admit(1, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        let text_wait = tokio::spawn(async move { gt.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(t1);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let s = g.snapshot();
        assert_eq!((s.lanes[1].inflight, s.lanes[0].inflight), (1, 1));
        assert_eq!(s.lanes[0].queued, 1);
        drop(t2);
        let a = audio_wait.await.unwrap().unwrap();
        let t = text_wait.await.unwrap().unwrap();
        drop((a, t));
        assert_eq!(g.snapshot().total_inflight, 0);
    }

    fn memory_lane(policy: Policy, fail_open: bool) -> LaneSpec {
        LaneSpec {
            gpu: Some(crate::GpuNeed {
                device: 0,
                bytes_per_job: 1000,
                bytes_per_audio_second: 100,
                margin_bytes: 500,
                fail_open,
                learn: false,
                longest_clip_seconds: Some(30.0),
            }),
            ..lane("audio", 8, 8, policy)
        }
    }

    fn free(g: &Gate, free_bytes: u64, owner_use: u64) {
        g.push_memory_reading(MemoryReading {
            device: 0,
            total_bytes: 100_000,
            free_bytes,
            owners: vec![("http://up-a".into(), owner_use), ("http://up-b".into(), 0)],
            at: Instant::now(),
        });
    }

    #[tokio::test(start_paused = true)]
    async fn memory_admission_counts_reservations_not_yet_in_the_reading() {
        let g = Gate::new(vec![memory_lane(Policy::Reject, false)], None, None).unwrap();
        free(&g, 5000, 0);
        let short = AdmitRequest {
            audio_seconds: Some(10.0),
            ..Default::default()
        };
        // 5000 free: the first job needs 2000 + 500 margin; after its reservation 3000 are
        // left, so a second fits and a third does not, though the reading has not moved.
        let a = g.admit(0, short.clone()).await.unwrap();
        let b = g.admit(0, short.clone()).await.unwrap();
        let r = g.admit(0, short.clone()).await.unwrap_err();
        assert_eq!(r.reason.code(), "gpu_memory");
        let m = r.memory.clone().unwrap();
        assert_eq!(
            (m.free_bytes, m.reserved_bytes, m.need_bytes, m.margin_bytes),
            (Some(5000), 4000, 2000, 500)
        );
        // Mean service unknown: the earliest reservation ends one default service time after
        // its admission.
        assert_eq!(r.retry_after, DEFAULT_SERVICE_TIME);
        let s = g.snapshot();
        assert_eq!(
            (s.memory[0].reservations, s.memory[0].reserved_bytes),
            (2, 4000)
        );
        drop((a, b));
        let s = g.snapshot();
        assert_eq!(
            (s.memory[0].reservations, s.memory[0].reserved_bytes),
            (0, 0)
        );
        // Unknown-length audio counts as the longest clip (1000 + 30 s x 100 + 500 > 4000).
        free(&g, 4000, 0);
        let unknown = AdmitRequest {
            audio_unknown: true,
            ..Default::default()
        };
        assert_eq!(
            g.admit(0, unknown).await.unwrap_err().reason,
            RejectReason::GpuMemory
        );
        assert!(g.admit(0, AdmitRequest::default()).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn host_pool_refusals_say_host_memory() {
        let settings = LedgerSettings {
            kind: PoolKind::Host,
            ..LedgerSettings::default()
        };
        let g = Gate::new(
            vec![memory_lane(Policy::Reject, false)],
            None,
            Some(settings),
        )
        .unwrap();
        free(&g, 100, 0);
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(r.reason.code(), "host_memory");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_reading_lanes_follow_fail_open_and_nobody_waits() {
        // No reading at all: a closed lane refuses at once, even under the queue policy.
        let g = Gate::new(vec![memory_lane(Policy::Queue, false)], None, None).unwrap();
        let start = Instant::now();
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(r.reason, RejectReason::GpuMemory);
        assert_eq!(r.memory.unwrap().free_bytes, None);
        assert_eq!(start.elapsed(), Duration::ZERO);
        // A queued waiter is refused as soon as the reading goes away.
        free(&g, 1600, 0);
        let held = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let waiter = tokio::spawn(async move { g2.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(counts(&g, 0), (1, 1));
        g.memory_unreadable(0);
        let refused = waiter.await.unwrap().unwrap_err();
        assert_eq!(refused.reason, RejectReason::GpuMemory);
        assert_eq!(start.elapsed(), Duration::from_millis(5));
        drop(held);
        // A stale reading counts as none.
        free(&g, 100_000, 0);
        tokio::time::sleep(Duration::from_millis(1001)).await;
        assert!(g.admit(0, AdmitRequest::default()).await.is_err());
        // A fail-open lane admits without a reading.
        let g = Gate::new(vec![memory_lane(Policy::Reject, true)], None, None).unwrap();
        assert!(g.admit(0, AdmitRequest::default()).await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_need_no_job_s_end_can_meet_is_refused_at_once_with_its_figures() {
        let g = Gate::new(vec![memory_lane(Policy::Queue, false)], None, None).unwrap();
        // 1400 free and nothing admitted: 1000 + 500 margin can only fit if something outside
        // the lanes gives memory back. Refused now, not after queue_timeout.
        free(&g, 1400, 0);
        let start = Instant::now();
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert_eq!(r.reason, RejectReason::GpuMemory);
        assert_eq!(r.queued_for, None);
        let m = r.memory.unwrap();
        assert_eq!(
            (m.free_bytes, m.need_bytes, m.margin_bytes),
            (Some(1400), 1000, 500)
        );
        assert_eq!(m.ceiling_bytes, Some(1400));
        assert!(m.never_fits());
        assert_eq!(counts(&g, 0), (0, 0));
        // With a job running 700 above its upstream's floor, its end could make room: wait.
        free(&g, 2100, 0);
        let held = g.admit(0, AdmitRequest::default()).await.unwrap();
        free(&g, 1400, 700);
        let g2 = g.clone();
        let waiter = tokio::spawn(async move { g2.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert_eq!(counts(&g, 0), (1, 1));
        let lane = g.snapshot().lanes[0].clone();
        assert_eq!(lane.held_by, Some("gpu_memory"));
        let waiting = lane.memory.unwrap().waiting.unwrap();
        assert_eq!((waiting.free_bytes, waiting.need_bytes), (Some(1400), 1000));
        drop(held);
        free(&g, 2100, 0);
        assert!(waiter.await.unwrap().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_held_for_memory_until_its_wait_runs_out_says_memory() {
        let g = Gate::new(vec![memory_lane(Policy::Queue, false)], None, None).unwrap();
        free(&g, 2000, 0);
        let running = g.admit(0, AdmitRequest::default()).await.unwrap();
        // The running job holds 600 above its floor; 1000 + 500 does not fit the 1400 free,
        // but will once it ends.
        free(&g, 1400, 600);
        let start = Instant::now();
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        assert_eq!(r.reason, RejectReason::GpuMemory, "not queue_timeout");
        assert_eq!(r.queued_for, Some(Duration::from_millis(200)));
        let m = r.memory.unwrap();
        assert_eq!(
            (m.free_bytes, m.need_bytes, m.ceiling_bytes),
            (Some(1400), 1000, Some(2000))
        );
        assert_eq!(g.snapshot().lanes[0].queue_timeouts, 1);
        drop(running);
    }

    #[tokio::test(start_paused = true)]
    async fn text_does_not_yield_to_audio_that_waits_for_memory() {
        // Audio (memory lane, priority 10) and text yielding to it, under a device-wide cap.
        let audio = LaneSpec {
            priority: 10,
            queue_timeout: Duration::from_secs(30),
            ..memory_lane(Policy::Queue, false)
        };
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            max_yield: Duration::from_secs(10),
            queue_timeout: Duration::from_secs(10),
            ..lane("text", 2, 8, Policy::Queue)
        };
        let g = Gate::new(vec![audio, text], Some(3), None).unwrap();
        free(&g, 3000, 0);
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        // Audio running: text yields.
        let g2 = g.clone();
        let t = tokio::spawn(async move { g2.admit(1, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(counts(&g, 1), (0, 1));
        // The running job grew 1000 above its floor; a second audio job waits for memory (its
        // end would make room, so it is not refused). Nothing text holds can help it.
        free(&g, 1200, 1000);
        let g3 = g.clone();
        let queued = tokio::spawn(async move { g3.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(counts(&g, 0), (1, 1));
        drop(a);
        // The first audio job has ended, the second still waits (the reading has not moved):
        // text goes in at once (after the linger of 0), it does not wait out max_yield.
        let t = tokio::time::timeout(Duration::from_millis(100), t).await;
        let t = t
            .expect("text admitted while audio waits for memory")
            .unwrap()
            .unwrap();
        assert_eq!(g.snapshot().lanes[0].held_by, Some("gpu_memory"));
        assert!(!g.snapshot().lanes[1].yielding);
        // A second text request is not held by the device cap for the memory-bound head either.
        let t2 = g.admit(1, AdmitRequest::default()).await.unwrap();
        drop((t, t2));
        free(&g, 3000, 0);
        assert!(queued.await.unwrap().is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn queued_memory_waiters_get_in_when_a_reservation_ends() {
        let g = Gate::new(vec![memory_lane(Policy::Queue, false)], None, None).unwrap();
        free(&g, 2000, 0);
        let a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let waiter = tokio::spawn(async move { g2.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(counts(&g, 0), (1, 1));
        // The snapshot says what holds the queue: the need beside free and reserved.
        let waiting = g.snapshot().lanes[0].waiting_for.clone().unwrap();
        assert_eq!(waiting.reason, "gpu_memory");
        let m = waiting.memory.unwrap();
        assert_eq!(
            (m.need_bytes, m.margin_bytes, m.free_bytes, m.reserved_bytes),
            (1000, 500, Some(2000), 1000)
        );
        drop(a);
        let b = waiter.await.unwrap().unwrap();
        assert_eq!(g.snapshot().lanes[0].waiting_for, None);
        drop(b);
    }

    #[tokio::test(start_paused = true)]
    async fn learned_need_replaces_the_configured_one() {
        let mut spec = memory_lane(Policy::Reject, false);
        spec.gpu.as_mut().unwrap().learn = true;
        spec.gpu.as_mut().unwrap().bytes_per_audio_second = 0;
        spec.upstreams.truncate(1);
        let settings = LedgerSettings {
            learn_min_samples: 3,
            ..LedgerSettings::default()
        };
        let g = Gate::new(vec![spec], None, Some(settings)).unwrap();
        for _ in 0..3 {
            free(&g, 50_000, 100);
            let p = g.admit(0, AdmitRequest::default()).await.unwrap();
            // The job really uses 2000 above the upstream's floor of 100.
            free(&g, 48_000, 2100);
            free(&g, 49_000, 1100);
            drop(p);
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        // The last job's sample waits for the level its upstream keeps after it: back at 100
        // once it has been idle for `settle`.
        free(&g, 50_000, 100);
        assert!(g.learned(0).is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        free(&g, 50_000, 100);
        let learned = g.learned(0).unwrap();
        assert_eq!((learned.bytes_per_job, learned.samples), (2000, 3));
        let lane = g.snapshot().lanes[0].memory.clone().unwrap();
        assert_eq!(
            (lane.configured_bytes_per_job, lane.bytes_per_job),
            (1000, 2000)
        );
        // 2000 + 500 margin no longer fits 2400 free.
        free(&g, 2400, 100);
        assert!(g.admit(0, AdmitRequest::default()).await.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn engine_metrics_hold_admission_and_pick_unsaturated_upstream() {
        let spec = LaneSpec {
            engine: Some(crate::EngineLimits {
                max_waiting: Some(0.0),
                max_kv_cache_usage: Some(0.9),
                stale_after: Duration::from_secs(2),
                fail_open: false,
            }),
            ..lane("text", 4, 0, Policy::Reject)
        };
        let g = gate(vec![spec]);
        // No metrics yet: stale counts as saturated.
        assert_eq!(
            g.admit(0, AdmitRequest::default())
                .await
                .unwrap_err()
                .reason,
            RejectReason::EngineSaturated
        );
        let load = |waiting: f64, kv: f64| EngineLoad {
            waiting: Some(waiting),
            running: Some(1.0),
            kv_cache_usage: Some(kv),
            observed_at: Instant::now(),
        };
        g.set_engine_load("http://up-a", load(3.0, 0.5));
        g.set_engine_load("http://up-b", load(0.0, 0.2));
        let p = g.admit(0, AdmitRequest::default()).await.unwrap();
        assert_eq!(p.upstream(), "http://up-b");
        g.set_engine_load("http://up-b", load(0.0, 0.95));
        assert_eq!(
            g.admit(0, AdmitRequest::default())
                .await
                .unwrap_err()
                .reason,
            RejectReason::EngineSaturated
        );
        drop(p);
    }

    #[tokio::test(start_paused = true)]
    async fn retry_after_follows_measured_service_time_and_queue() {
        let g = gate(vec![lane("audio", 2, 8, Policy::Queue)]);
        // Before any measurement the default service time is used.
        assert_eq!(g.retry_after(0), Duration::from_millis(500));
        for _ in 0..2 {
            let p = g.admit(0, AdmitRequest::default()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(400)).await;
            drop(p);
        }
        // Mean 400 ms, nothing queued, 2 slots: 200 ms.
        assert_eq!(g.retry_after(0), Duration::from_millis(200));
        let _a = g.admit(0, AdmitRequest::default()).await.unwrap();
        let _b = g.admit(0, AdmitRequest::default()).await.unwrap();
        let g2 = g.clone();
        let _w = tokio::spawn(async move { g2.admit(0, AdmitRequest::default()).await });
        tokio::time::sleep(Duration::from_millis(1)).await;
        // One queued ahead: (1 + 1) * 400 ms / 2.
        assert_eq!(g.retry_after(0), Duration::from_millis(400));
    }

    fn preempting_pair(per_job: usize) -> Gate {
        let audio = lane("audio", 4, 0, Policy::Reject);
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            preempt: true,
            preempt_per_job: per_job,
            // Admission of text while audio runs is not what these tests are about.
            max_yield: Duration::ZERO,
            ..lane("text", 8, 0, Policy::Reject)
        };
        gate(vec![audio, text])
    }

    /// Whether `permit`'s preemption has fired (arming its waiter now, as the server does).
    fn told_to_stop(permit: &Permit) -> bool {
        let notify = permit
            .preemption()
            .expect("a preempt lane's permit has a waiter");
        let mut waiter = Box::pin(notify.notified_owned());
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        waiter.as_mut().poll(&mut cx).is_ready()
    }

    #[tokio::test(start_paused = true)]
    async fn one_audio_job_stops_only_the_youngest_text_request() {
        let g = preempting_pair(1);
        let mut text = Vec::new();
        for _ in 0..3 {
            text.push(g.admit(1, AdmitRequest::default()).await.unwrap());
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let _a1 = g.admit(0, AdmitRequest::default()).await.unwrap();
        let told: Vec<bool> = text.iter().map(told_to_stop).collect();
        assert_eq!(
            told,
            vec![false, false, true],
            "youngest first, one per job"
        );
        // The stopped request leaves; the next audio job stops the next youngest.
        text.pop();
        let _a2 = g.admit(0, AdmitRequest::default()).await.unwrap();
        let told: Vec<bool> = text.iter().map(told_to_stop).collect();
        assert_eq!(told, vec![false, true]);

        let g = preempting_pair(2);
        let mut text = Vec::new();
        for _ in 0..3 {
            text.push(g.admit(1, AdmitRequest::default()).await.unwrap());
        }
        let _a = g.admit(0, AdmitRequest::default()).await.unwrap();
        assert_eq!(text.iter().filter(|p| told_to_stop(p)).count(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn preempt_all_stops_every_running_request_and_the_job_knows_which_lane_it_stopped() {
        let g = preempting_pair(crate::PREEMPT_ALL);
        let mut text = Vec::new();
        for _ in 0..3 {
            text.push(g.admit(1, AdmitRequest::default()).await.unwrap());
            tokio::time::advance(Duration::from_millis(10)).await;
        }
        let a1 = g.admit(0, AdmitRequest::default()).await.unwrap();
        let told: Vec<bool> = text.iter().map(told_to_stop).collect();
        assert_eq!(told, vec![true, true, true], "every running request stops");
        assert_eq!(a1.stopped_lanes(), &[1], "the audio job stopped text");
        // Nothing left running: the next job stops nothing, and says so.
        drop(text);
        let a2 = g.admit(0, AdmitRequest::default()).await.unwrap();
        assert!(a2.stopped_lanes().is_empty());
        // Text permits never stop anything themselves.
        drop((a1, a2));
        tokio::time::advance(Duration::from_secs(1)).await;
        let t = g.admit(1, AdmitRequest::default()).await.unwrap();
        assert!(t.stopped_lanes().is_empty());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_preemption_sent_before_the_waiter_is_armed_is_not_lost() {
        // Audio is admitted in the window between a text permit being granted and its waiter
        // being armed, hundreds of times on two threads; every such text request still stops.
        for round in 0..300 {
            let g = preempting_pair(1);
            let (g1, g2) = (g.clone(), g.clone());
            let text = tokio::spawn(async move { g1.admit(1, AdmitRequest::default()).await });
            let audio = tokio::spawn(async move {
                tokio::task::yield_now().await;
                g2.admit(0, AdmitRequest::default()).await
            });
            let text = text.await.unwrap().unwrap();
            let audio = audio.await.unwrap().unwrap();
            // Armed only now, after the audio job was admitted (or not yet: then nothing fired,
            // and the text request, admitted after the audio one, is not the one to stop).
            let notify = text.preemption().unwrap();
            let mut waiter = Box::pin(notify.notified_owned());
            waiter.as_mut().enable();
            let text_first = text.admitted_at() <= audio.admitted_at();
            let fired = tokio::time::timeout(Duration::from_millis(200), waiter)
                .await
                .is_ok();
            assert!(
                !text_first || fired,
                "round {round}: text ran before audio and was never told to stop"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_pausing_lane_is_paused_while_audio_runs_and_its_requests_are_not_stopped() {
        let audio = lane("audio", 4, 0, Policy::Reject);
        let text = LaneSpec {
            yield_to: vec!["audio".into()],
            preempt: true,
            preempt_mode: PreemptMode::Pause,
            max_yield: Duration::ZERO,
            ..lane("text", 8, 0, Policy::Reject)
        };
        let g = gate(vec![audio, text]);
        assert!(g.pause_signal(0).is_none(), "audio does not pause");
        let mut paused = g.pause_signal(1).expect("the text lane pauses");
        assert!(!*paused.borrow_and_update());
        let t = g.admit(1, AdmitRequest::default()).await.unwrap();
        assert!(
            t.preemption().is_none(),
            "a paused request is kept, never told to stop"
        );
        assert!(!paused.has_changed().unwrap(), "text alone pauses nothing");
        let a1 = g.admit(0, AdmitRequest::default()).await.unwrap();
        assert!(paused.has_changed().unwrap() && *paused.borrow_and_update());
        let a2 = g.admit(0, AdmitRequest::default()).await.unwrap();
        drop(a1);
        assert!(!paused.has_changed().unwrap(), "one audio job still runs");
        drop(a2);
        assert!(paused.has_changed().unwrap());
        assert!(
            !*paused.borrow_and_update(),
            "resumed when the last audio job ended"
        );
        drop(t);
    }

    #[tokio::test(start_paused = true)]
    async fn draining_refuses_new_work() {
        let g = gate(vec![lane("text", 2, 2, Policy::Queue)]);
        let p = g.admit(0, AdmitRequest::default()).await.unwrap();
        g.start_draining();
        let r = g.admit(0, AdmitRequest::default()).await.unwrap_err();
        assert_eq!(r.reason, RejectReason::ShuttingDown);
        drop(p);
        g.wait_idle().await;
    }

    #[test]
    fn invalid_specs_are_named() {
        let bad_yield = LaneSpec {
            yield_to: vec!["nope".into()],
            ..LaneSpec::new("text", &["http://x"])
        };
        let err = Gate::new(vec![bad_yield], None, None).err().unwrap();
        assert!(err.to_string().contains("unknown lane `nope`"), "{err}");
        let dup = vec![LaneSpec::new("a", &["u"]), LaneSpec::new("a", &["u"])];
        assert!(Gate::new(dup, None, None).is_err());
        let zero = LaneSpec {
            max_inflight: 0,
            ..LaneSpec::new("a", &["u"])
        };
        assert!(Gate::new(vec![zero], None, None).is_err());
        assert!(Gate::new(vec![], None, None).is_err());
    }
}
