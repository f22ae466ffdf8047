//! The memory concern of admission: the check a lane with a [`crate::GpuNeed`] makes against the
//! ledger, taking and giving back reservations, feeding measured peaks to the lane's learner,
//! and the Retry-After of a memory refusal (the expected end of the earliest reservation).

use std::time::Duration;

use tokio::time::Instant;

use super::{AdmitRequest, DEFAULT_SERVICE_TIME, Inner, MAX_RETRY_AFTER, PoolSnapshot, State};
use crate::lane::RejectReason;
use crate::ledger::{MemoryShortfall, PeakSample, PoolKind};

/// Shortest Retry-After of a memory refusal (about one sampler period).
const MIN_MEMORY_RETRY: Duration = Duration::from_millis(50);

impl Inner {
    /// Bytes one job of `lane` needs now (learned or configured; no margin).
    fn job_bytes(&self, st: &State, lane: usize, request: &AdmitRequest) -> u64 {
        match &self.specs[lane].gpu {
            None => 0,
            Some(need) => need.job_bytes(
                request.audio_seconds,
                request.audio_unknown,
                st.learners[lane].learned(),
            ),
        }
    }

    fn memory_reason(st: &State) -> RejectReason {
        match st.ledger.as_ref().map(|l| l.settings().kind) {
            Some(PoolKind::Host) => RejectReason::HostMemory,
            _ => RejectReason::GpuMemory,
        }
    }

    /// Admits a job only when `free − hidden reservations ≥ need + margin`; without a usable
    /// reading the lane's `fail_open` decides.
    pub(super) fn check_memory(
        &self,
        st: &mut State,
        lane: usize,
        now: Instant,
        request: &AdmitRequest,
    ) -> Result<(), RejectReason> {
        let Some(need) = &self.specs[lane].gpu else {
            return Ok(());
        };
        let bytes = self.job_bytes(st, lane, request);
        let Some(ledger) = st.ledger.as_ref() else {
            return Ok(());
        };
        match ledger.check(need.device, bytes, need.margin_bytes, now) {
            Ok(()) => Ok(()),
            Err(short) if short.free_bytes.is_none() && need.fail_open => Ok(()),
            Err(short) => {
                st.shortfall = Some(short);
                Err(Self::memory_reason(st))
            }
        }
    }

    /// Records the reservation of a job just admitted on `lane` (owned by `upstream`).
    pub(super) fn reserve_memory(
        &self,
        st: &mut State,
        lane: usize,
        upstream: usize,
        now: Instant,
        id: u64,
        request: &AdmitRequest,
    ) -> Option<(u32, u64)> {
        let spec = &self.specs[lane];
        let need = spec.gpu.as_ref()?;
        let bytes = self.job_bytes(st, lane, request);
        let ledger = st.ledger.as_mut()?;
        ledger.reserve(
            id,
            lane,
            need.device,
            &spec.upstreams[upstream],
            bytes,
            request.audio_seconds,
            now,
        );
        self.learn_from_ledger(st);
        Some((need.device, id))
    }

    /// Gives a reservation back (its measured peak reaches the lane's learner once the level its
    /// upstream keeps after it is known).
    pub(super) fn release_memory(&self, st: &mut State, device: u32, id: u64, now: Instant) {
        if let Some(ledger) = st.ledger.as_mut() {
            ledger.release(device, id, now);
        }
    }

    /// Hands the job peaks the ledger has finished measuring to their lanes' learners.
    pub(super) fn learn_from_ledger(&self, st: &mut State) {
        let Some(ledger) = st.ledger.as_mut() else {
            return;
        };
        let (quantile, min) = (
            ledger.settings().learn_quantile,
            ledger.settings().learn_min_samples,
        );
        for PeakSample {
            lane,
            peak_bytes,
            audio_seconds,
        } in ledger.take_samples()
        {
            if let Some(need) = &self.specs[lane].gpu {
                st.learners[lane].add(
                    peak_bytes,
                    audio_seconds,
                    need.bytes_per_audio_second,
                    quantile,
                    min,
                );
            }
        }
    }

    /// Retry-After of a memory refusal with figures `short`: until the earliest reservation on
    /// its device is expected to end (admitted + its lane's mean service time), or until a
    /// reading may come.
    pub(super) fn memory_retry_after(
        &self,
        st: &State,
        short: &MemoryShortfall,
        now: Instant,
    ) -> Option<Duration> {
        let ledger = st.ledger.as_ref()?;
        if short.free_bytes.is_none() {
            return Some(ledger.settings().stale_after.max(MIN_MEMORY_RETRY));
        }
        let hold = |lane: usize| st.lanes[lane].mean_service.unwrap_or(DEFAULT_SERVICE_TIME);
        let release = ledger.earliest_release(short.device, hold)?;
        Some(
            release
                .saturating_duration_since(now)
                .clamp(MIN_MEMORY_RETRY, MAX_RETRY_AFTER),
        )
    }

    /// Every device the lanes admit on, with its ledger figures.
    pub(super) fn pool_snapshots(&self, st: &State, now: Instant) -> Vec<PoolSnapshot> {
        let Some(ledger) = st.ledger.as_ref() else {
            return Vec::new();
        };
        let mut devices: Vec<u32> = self
            .specs
            .iter()
            .filter_map(|s| s.gpu.as_ref().map(|g| g.device))
            .collect();
        devices.sort_unstable();
        devices.dedup();
        devices
            .into_iter()
            .map(|device| {
                let reading = ledger.reading(device, now);
                PoolSnapshot {
                    device,
                    kind: ledger.settings().kind,
                    total_bytes: reading.map(|r| r.total_bytes),
                    free_bytes: reading.map(|r| r.free_bytes),
                    reading_age_seconds: reading
                        .map(|r| now.saturating_duration_since(r.at).as_secs_f64()),
                    reservations: ledger.reservation_count(device),
                    reserved_bytes: ledger.reserved_bytes(device),
                    hidden_bytes: ledger.hidden_bytes(device, now),
                }
            })
            .collect()
    }
}
