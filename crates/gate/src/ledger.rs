//! The memory ledger: per device (an NVML GPU or the host pool), the last reading pushed in by the
//! sampler task plus the reservations of admitted jobs, the memory check admission asks it, and
//! the per-lane learning of job peaks. Everything here is plain data and arithmetic: readings and
//! times are inputs, nothing here reads a probe or a clock.
//!
//! A job is admitted only when `free − Σ hidden reservations ≥ need + margin`. A reservation is
//! *hidden* while the reading cannot yet show it: its part not yet covered by the growth of the
//! owning upstream's measured use above that upstream's idle floor (reservations of one owner
//! take the growth oldest first). Visible parts are already in the free figure and are not
//! counted twice. A reservation counts as wholly visible once it has *settled*: for an owner whose
//! use is measured, `settle` after its covered part last grew (the job's use stopped growing
//! short of its reservation — a job that has not started allocating never settles, however long
//! it waits upstream); for an owner that cannot be measured, `settle` after admission.
//!
//! A job's learned need is what it adds above the level its upstream keeps *between* jobs: its
//! highest reading less the higher of the idle floor before it and the lowest idle reading after
//! it (up to the next job, or `settle` after it ended). A backend that keeps most of its first
//! job's memory (Whisper's allocator does) would otherwise have that memory counted twice: once
//! in the free figure, once more in the need.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

/// Samples a lane's learner keeps (newest first out).
const LEARN_WINDOW: usize = 256;
/// Ended jobs of one upstream waiting for the level it keeps after them (oldest dropped).
const PENDING_MAX: usize = 64;

/// One reading of one memory pool, as the sampler took it.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryReading {
    /// Device index (the host pool is one device, index 0).
    pub device: u32,
    pub total_bytes: u64,
    pub free_bytes: u64,
    /// Measured use of each upstream (keyed by the upstream as configured in the lanes), for the
    /// upstreams whose processes could be found.
    pub owners: Vec<(String, u64)>,
    /// When the reading was taken.
    pub at: Instant,
}

impl MemoryReading {
    fn owner_use(&self, owner: &str) -> Option<u64> {
        self.owners
            .iter()
            .find(|(o, _)| o == owner)
            .map(|(_, b)| *b)
    }
}

/// Which pool a gate's memory admission reads; it names the rejection code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    Gpu,
    Host,
}

/// How the ledger treats readings and reservations.
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerSettings {
    pub kind: PoolKind,
    /// A reservation counts as wholly visible this long after its covered part last grew (after
    /// admission where the owner's use is not measured).
    pub settle: Duration,
    /// A reading older than this counts as none.
    pub stale_after: Duration,
    /// Quantile of observed peaks a learned need covers (0..=1].
    pub learn_quantile: f64,
    /// Measured jobs needed before a learned need replaces the configured one.
    pub learn_min_samples: usize,
    /// Test-only: ignore reservations and compare the reading alone with the need (the old
    /// comparison), so a test can show that it over-commits.
    #[doc(hidden)]
    pub ignore_reservations: bool,
}

impl Default for LedgerSettings {
    fn default() -> Self {
        LedgerSettings {
            kind: PoolKind::Gpu,
            settle: Duration::from_secs(5),
            stale_after: Duration::from_secs(1),
            learn_quantile: 0.95,
            learn_min_samples: 8,
            ignore_reservations: false,
        }
    }
}

/// The figures behind a memory refusal.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct MemoryShortfall {
    pub device: u32,
    /// Free bytes in the last reading; `None` when there is no usable reading.
    pub free_bytes: Option<u64>,
    /// Reserved bytes of admitted jobs the reading does not show yet.
    pub reserved_bytes: u64,
    /// Bytes the job needs (without the margin).
    pub need_bytes: u64,
    pub margin_bytes: u64,
    /// The most that could be free once every admitted job on the device has ended (free plus
    /// what running jobs hold above their upstreams' idle floors, the best of the recent
    /// readings). `None` without a usable reading.
    pub ceiling_bytes: Option<u64>,
}

impl MemoryShortfall {
    /// Whether waiting cannot help: even with every admitted job ended, the need and the margin
    /// would not fit (only memory the gate does not admit, such as an engine shrinking or a
    /// backend restarting, could change that).
    pub fn never_fits(&self) -> bool {
        self.ceiling_bytes
            .is_some_and(|c| c < self.need_bytes.saturating_add(self.margin_bytes))
    }
}

/// A learned per-lane need.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LearnedNeed {
    pub bytes_per_job: u64,
    pub bytes_per_audio_second: u64,
    /// Measured jobs behind the figures.
    pub samples: u64,
}

#[derive(Debug)]
struct Reservation {
    id: u64,
    lane: usize,
    owner: String,
    bytes: u64,
    admitted_at: Instant,
    audio_seconds: Option<f64>,
    /// Bytes of this reservation the latest reading shows (owner growth attributed to it).
    covered: u64,
    /// The most ever covered, and when the covered part last grew past it.
    max_covered: u64,
    progress_at: Option<Instant>,
    /// A reading has shown the owner's use since admission.
    measured: bool,
    /// Owner's idle floor at admission, when known.
    floor: Option<u64>,
    /// Highest owner use seen by readings during the job.
    max_seen: Option<u64>,
    /// No other job of the same owner overlapped this one.
    alone: bool,
}

impl Reservation {
    /// Whether a reading the probe began at `at` can show this job: only one begun after the
    /// job was admitted (an earlier one shows memory of jobs that may have ended since).
    fn shown_at(&self, at: Instant) -> bool {
        self.admitted_at <= at
    }
}

/// A lone job that ended: its highest reading, waiting for the level its upstream keeps after it.
#[derive(Debug, Clone, Copy)]
struct Pending {
    lane: usize,
    max_seen: u64,
    floor_before: u64,
    audio_seconds: Option<f64>,
}

#[derive(Debug, Default)]
struct Owner {
    name: String,
    /// The owner's use in the latest reading taken while it had no reservation.
    floor: Option<u64>,
    /// When a reservation of this owner last ended: a reading taken before then may still show
    /// that job's memory, so it cannot be the idle floor.
    released_at: Option<Instant>,
    /// The lowest idle reading since a reservation of this owner last ended: the level it
    /// keeps between jobs, so far.
    low_since_release: Option<u64>,
    /// Ended jobs whose sample waits for that level.
    pending: Vec<Pending>,
}

impl Owner {
    /// Turns the pending jobs into samples, each against the higher of its floor before and the
    /// level kept after it (`low_since_release`, which must be known).
    fn finish(&mut self, out: &mut Vec<PeakSample>) {
        let Some(after) = self.low_since_release else {
            return;
        };
        out.extend(self.pending.drain(..).map(|p| PeakSample {
            lane: p.lane,
            peak_bytes: p.max_seen.saturating_sub(p.floor_before.max(after)),
            audio_seconds: p.audio_seconds,
        }));
    }
}

#[derive(Debug)]
struct DeviceLedger {
    device: u32,
    reading: Option<MemoryReading>,
    /// `(taken at, ceiling)` of the readings within `stale_after` of the latest: each one's
    /// free bytes plus what running jobs then held above their upstreams' idle floors.
    recent_ceilings: VecDeque<(Instant, u64)>,
    reservations: Vec<Reservation>,
    owners: Vec<Owner>,
}

impl DeviceLedger {
    /// What running jobs hold above their upstreams' idle floors in the latest reading: memory
    /// that goes back when they end.
    fn releasable(&self) -> u64 {
        let Some(reading) = &self.reading else {
            return 0;
        };
        self.owners
            .iter()
            .filter(|o| self.reservations.iter().any(|r| r.owner == o.name))
            .filter_map(|o| Some(reading.owner_use(&o.name)?.saturating_sub(o.floor?)))
            .sum()
    }
}

/// One job's measured peak, handed back when its reservation ends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakSample {
    pub lane: usize,
    pub peak_bytes: u64,
    pub audio_seconds: Option<f64>,
}

/// Per-device readings and reservations.
#[derive(Debug)]
pub struct Ledger {
    settings: LedgerSettings,
    devices: Vec<DeviceLedger>,
    /// Job samples ready for the lanes' learners (see [`Ledger::take_samples`]).
    samples: Vec<PeakSample>,
}

impl Ledger {
    pub fn new(settings: LedgerSettings) -> Ledger {
        Ledger {
            settings,
            devices: Vec::new(),
            samples: Vec::new(),
        }
    }

    /// The measured job peaks that became known since the last call, for the lanes' learners.
    pub fn take_samples(&mut self) -> Vec<PeakSample> {
        std::mem::take(&mut self.samples)
    }

    pub fn settings(&self) -> &LedgerSettings {
        &self.settings
    }

    fn device_mut(&mut self, device: u32) -> &mut DeviceLedger {
        if let Some(i) = self.devices.iter().position(|d| d.device == device) {
            return &mut self.devices[i];
        }
        self.devices.push(DeviceLedger {
            device,
            reading: None,
            recent_ceilings: VecDeque::new(),
            reservations: Vec::new(),
            owners: Vec::new(),
        });
        self.devices.last_mut().expect("just pushed")
    }

    fn device(&self, device: u32) -> Option<&DeviceLedger> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// Takes a new reading: owner floors, the covered part of each reservation, job maxima.
    ///
    /// `reading.at` is when the probe began. The reading says nothing about a job admitted
    /// after that (its memory cannot show yet, and the memory that does show is other jobs'),
    /// and it is an owner's idle floor only if no job of that owner was running or had just
    /// ended when it was taken.
    pub fn push_reading(&mut self, reading: MemoryReading) {
        let at = reading.at;
        let (settle, keep) = (self.settings.settle, self.settings.stale_after);
        let mut samples = std::mem::take(&mut self.samples);
        let d = self.device_mut(reading.device);
        for (name, used) in &reading.owners {
            let shown = |r: &Reservation| &r.owner == name && r.shown_at(at);
            let running = d.reservations.iter().any(shown);
            let owner = match d.owners.iter().position(|o| &o.name == name) {
                Some(i) => &mut d.owners[i],
                None => {
                    d.owners.push(Owner {
                        name: name.clone(),
                        ..Owner::default()
                    });
                    d.owners.last_mut().expect("just pushed")
                }
            };
            if !running && owner.released_at.is_none_or(|t| t < at) {
                owner.floor = Some(*used);
                owner.low_since_release =
                    Some(owner.low_since_release.map_or(*used, |l| l.min(*used)));
                // Idle for `settle` since the last job ended: its level is known.
                if owner
                    .released_at
                    .is_some_and(|t| at.saturating_duration_since(t) >= settle)
                {
                    owner.finish(&mut samples);
                }
            }
            // The owner's growth above its idle floor, shared out oldest reservation first.
            let mut growth = owner.floor.map_or(0, |f| used.saturating_sub(f));
            for r in d.reservations.iter_mut().filter(|r| shown(r)) {
                r.covered = growth.min(r.bytes);
                growth -= r.covered;
                r.measured = true;
                if r.covered > r.max_covered {
                    r.max_covered = r.covered;
                    r.progress_at = Some(reading.at);
                }
                r.max_seen = Some(r.max_seen.map_or(*used, |m| m.max(*used)));
            }
        }
        for r in d.reservations.iter_mut().filter(|r| r.shown_at(at)) {
            if reading.owner_use(&r.owner).is_none() {
                r.covered = 0;
            }
        }
        let free = reading.free_bytes;
        d.reading = Some(reading);
        let ceiling = free.saturating_add(d.releasable());
        d.recent_ceilings.push_back((at, ceiling));
        while d
            .recent_ceilings
            .front()
            .is_some_and(|(t, _)| at.saturating_duration_since(*t) > keep)
        {
            d.recent_ceilings.pop_front();
        }
        self.samples = samples;
    }

    /// Forgets the device's reading (the probe failed): admission follows `fail_open`.
    pub fn clear_reading(&mut self, device: u32) {
        self.device_mut(device).reading = None;
    }

    /// The reading admission may use now, if any.
    pub fn reading(&self, device: u32, now: Instant) -> Option<&MemoryReading> {
        self.device(device)?
            .reading
            .as_ref()
            .filter(|r| now.saturating_duration_since(r.at) <= self.settings.stale_after)
    }

    /// Reserved bytes the reading does not show yet.
    pub fn hidden_bytes(&self, device: u32, now: Instant) -> u64 {
        if self.settings.ignore_reservations {
            return 0;
        }
        let Some(d) = self.device(device) else {
            return 0;
        };
        let settle = self.settings.settle;
        d.reservations
            .iter()
            .filter(|r| {
                let since = if r.measured {
                    r.progress_at
                } else {
                    Some(r.admitted_at)
                };
                since.is_none_or(|t| now.saturating_duration_since(t) < settle)
            })
            .map(|r| r.bytes - r.covered)
            .sum()
    }

    /// Every outstanding reservation's bytes on a device.
    pub fn reserved_bytes(&self, device: u32) -> u64 {
        self.device(device)
            .map_or(0, |d| d.reservations.iter().map(|r| r.bytes).sum())
    }

    pub fn reservation_count(&self, device: u32) -> usize {
        self.device(device).map_or(0, |d| d.reservations.len())
    }

    /// Whether a job needing `need` bytes (plus `margin`) fits on `device` now. `Ok(false)`
    /// when there is no usable reading, so the caller applies `fail_open`.
    pub fn check(
        &self,
        device: u32,
        need: u64,
        margin: u64,
        now: Instant,
    ) -> Result<(), MemoryShortfall> {
        let hidden = self.hidden_bytes(device, now);
        let shortfall = |free, ceiling| MemoryShortfall {
            device,
            free_bytes: free,
            reserved_bytes: hidden,
            need_bytes: need,
            margin_bytes: margin,
            ceiling_bytes: ceiling,
        };
        let Some(reading) = self.reading(device, now) else {
            return Err(shortfall(None, None));
        };
        let available = reading.free_bytes.saturating_sub(hidden);
        if available >= need.saturating_add(margin) {
            Ok(())
        } else {
            Err(shortfall(Some(reading.free_bytes), self.ceiling(device)))
        }
    }

    /// The most that could be free on `device` once every admitted job has ended: each recent
    /// reading's free figure plus what running jobs then held above their upstreams' idle
    /// floors, the best of the readings within `stale_after` (one low reading is no verdict).
    pub fn ceiling(&self, device: u32) -> Option<u64> {
        self.device(device)?
            .recent_ceilings
            .iter()
            .map(|(_, c)| *c)
            .max()
    }

    /// Records an admitted job's reservation.
    #[allow(clippy::too_many_arguments)]
    pub fn reserve(
        &mut self,
        id: u64,
        lane: usize,
        device: u32,
        owner: &str,
        bytes: u64,
        audio_seconds: Option<f64>,
        now: Instant,
    ) {
        let mut samples = std::mem::take(&mut self.samples);
        let d = self.device_mut(device);
        let mut alone = true;
        for r in d.reservations.iter_mut().filter(|r| r.owner == owner) {
            r.alone = false;
            alone = false;
        }
        let o = d.owners.iter_mut().find(|o| o.name == owner);
        // The idle stretch since the owner's last job ends here: its lowest reading is the
        // level kept after the jobs that wait for it.
        let floor = o.and_then(|o| {
            o.finish(&mut samples);
            o.floor
        });
        self.samples = samples;
        let d = self.device_mut(device);
        d.reservations.push(Reservation {
            id,
            lane,
            owner: owner.to_string(),
            bytes,
            admitted_at: now,
            audio_seconds,
            covered: 0,
            max_covered: 0,
            progress_at: None,
            measured: false,
            floor,
            // Only readings taken after admission count: the latest one may show jobs that
            // ended just before this one was admitted.
            max_seen: None,
            alone,
        });
    }

    /// Ends a reservation at `now`. A job that ran alone on its upstream, with a reading taken
    /// during it and the upstream's idle floor known, yields a sample once the level the
    /// upstream keeps after it is known ([`Ledger::take_samples`]).
    pub fn release(&mut self, device: u32, id: u64, now: Instant) {
        let d = self.device_mut(device);
        let Some(pos) = d.reservations.iter().position(|r| r.id == id) else {
            return;
        };
        let r = d.reservations.remove(pos);
        let Some(o) = d.owners.iter_mut().find(|o| o.name == r.owner) else {
            return;
        };
        o.released_at = Some(now);
        o.low_since_release = None;
        if let (true, Some(floor_before), Some(max_seen)) = (r.alone, r.floor, r.max_seen) {
            if o.pending.len() == PENDING_MAX {
                o.pending.remove(0);
            }
            o.pending.push(Pending {
                lane: r.lane,
                max_seen,
                floor_before,
                audio_seconds: r.audio_seconds,
            });
        }
    }

    /// When the earliest reservation on `device` is expected to end, given each lane's expected
    /// hold time.
    pub fn earliest_release(
        &self,
        device: u32,
        hold: impl Fn(usize) -> Duration,
    ) -> Option<Instant> {
        self.device(device)?
            .reservations
            .iter()
            .map(|r| r.admitted_at + hold(r.lane))
            .min()
    }
}

/// A lane's measured job peaks and the need learned from them.
#[derive(Debug, Default)]
pub struct Learner {
    samples: VecDeque<(f64, u64)>,
    /// Jobs measured since start (the window keeps the newest).
    seen: u64,
    /// Loaded from the calibration file; replaced once enough new samples exist.
    loaded: Option<LearnedNeed>,
    current: Option<LearnedNeed>,
}

impl Learner {
    pub fn with_loaded(loaded: LearnedNeed) -> Learner {
        Learner {
            loaded: Some(loaded),
            ..Learner::default()
        }
    }

    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Adds one job's peak. `per_second` is the configured bytes per audio second (a slope is
    /// fitted only where clips of different lengths were measured).
    pub fn add(
        &mut self,
        peak: u64,
        audio_seconds: Option<f64>,
        per_second: u64,
        quantile: f64,
        min: usize,
    ) {
        let seconds = match audio_seconds {
            Some(s) if s.is_finite() && s >= 0.0 => s,
            // A per-second need cannot be split off a job of unknown length.
            _ if per_second > 0 => return,
            _ => 0.0,
        };
        if self.samples.len() == LEARN_WINDOW {
            self.samples.pop_front();
        }
        self.samples.push_back((seconds, peak));
        self.seen += 1;
        if self.samples.len() >= min {
            self.current = Some(fit(&self.samples, per_second, quantile));
        }
    }

    /// The learned need in force, if any.
    pub fn learned(&self) -> Option<LearnedNeed> {
        self.current.or(self.loaded)
    }
}

/// `peak ≈ a + b × seconds`: the slope by least squares where clip lengths vary (else the
/// configured one), and `a` the `quantile` of the residuals, so the need covers that share of
/// the measured jobs.
fn fit(samples: &VecDeque<(f64, u64)>, per_second: u64, quantile: f64) -> LearnedNeed {
    let n = samples.len() as f64;
    let mean_s = samples.iter().map(|(s, _)| s).sum::<f64>() / n;
    let mean_p = samples.iter().map(|(_, p)| *p as f64).sum::<f64>() / n;
    let var_s = samples
        .iter()
        .map(|(s, _)| (s - mean_s).powi(2))
        .sum::<f64>();
    let spread = samples
        .iter()
        .map(|(s, _)| *s)
        .fold(f64::NEG_INFINITY, f64::max)
        - samples
            .iter()
            .map(|(s, _)| *s)
            .fold(f64::INFINITY, f64::min);
    let slope = if per_second > 0 && spread >= 1.0 && var_s > 0.0 {
        let cov = samples
            .iter()
            .map(|(s, p)| (s - mean_s) * (*p as f64 - mean_p))
            .sum::<f64>();
        (cov / var_s).max(0.0)
    } else {
        per_second as f64
    };
    let mut residuals: Vec<f64> = samples.iter().map(|(s, p)| *p as f64 - slope * s).collect();
    residuals.sort_by(f64::total_cmp);
    // Nearest rank: the smallest residual at or above the quantile's share.
    let rank = ((quantile * n).ceil() as usize).clamp(1, residuals.len());
    LearnedNeed {
        bytes_per_job: residuals[rank - 1].max(0.0).round() as u64,
        bytes_per_audio_second: slope.round() as u64,
        samples: samples.len() as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn reading(free: u64, owner_use: u64, at: Instant) -> MemoryReading {
        MemoryReading {
            device: 0,
            total_bytes: 10_000 * MIB,
            free_bytes: free,
            owners: vec![("up".into(), owner_use)],
            at,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn reservations_count_until_the_reading_shows_them() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        // Three jobs of 300 MiB fit 1000 MiB free with 50 MiB margin; the fourth does not.
        for id in 0..3 {
            assert!(l.check(0, 300 * MIB, 50 * MIB, t0).is_ok(), "job {id}");
            l.reserve(id, 0, 0, "up", 300 * MIB, None, t0);
        }
        let short = l.check(0, 300 * MIB, 50 * MIB, t0).unwrap_err();
        assert_eq!(short.reserved_bytes, 900 * MIB);
        assert_eq!(short.free_bytes, Some(1000 * MIB));
        // Two jobs have allocated: the reading shows 600 MiB more use and less free.
        let t1 = t0 + Duration::from_millis(50);
        l.push_reading(reading(400 * MIB, 700 * MIB, t1));
        assert_eq!(l.hidden_bytes(0, t1), 300 * MIB);
        assert!(l.check(0, 100 * MIB, 0, t1).is_ok());
        assert!(l.check(0, 101 * MIB, 0, t1).is_err());
        // Memory dipped again mid-job: the uncovered part is hidden again.
        l.push_reading(reading(700 * MIB, 400 * MIB, t1));
        assert_eq!(l.hidden_bytes(0, t1), 600 * MIB);
        // Settle time after their use last grew, the two that allocated count as visible; the
        // one that never started allocating stays hidden however long it waits.
        let later = t1 + Duration::from_secs(5);
        assert_eq!(
            l.hidden_bytes(0, later - Duration::from_millis(1)),
            600 * MIB
        );
        assert_eq!(l.hidden_bytes(0, later), 300 * MIB);
        assert_eq!(
            l.hidden_bytes(0, later + Duration::from_secs(60)),
            300 * MIB
        );
        for id in 0..3 {
            l.release(0, id, later);
        }
        assert_eq!(l.reserved_bytes(0), 0);
        assert_eq!(l.reservation_count(0), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unmeasured_owner_settles_from_admission() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        l.reserve(1, 0, 0, "elsewhere", 300 * MIB, None, t0);
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        assert_eq!(
            l.hidden_bytes(0, t0 + Duration::from_millis(4999)),
            300 * MIB
        );
        assert_eq!(l.hidden_bytes(0, t0 + Duration::from_secs(5)), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn no_reading_or_a_stale_one_is_reported_as_none() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        assert_eq!(l.check(0, 1, 0, t0).unwrap_err().free_bytes, None);
        l.push_reading(reading(1000, 0, t0));
        assert!(l.check(0, 1, 0, t0 + Duration::from_secs(1)).is_ok());
        let late = l.check(0, 1, 0, t0 + Duration::from_millis(1001));
        assert_eq!(late.unwrap_err().free_bytes, None);
        l.push_reading(reading(1000, 0, t0));
        l.clear_reading(0);
        assert!(l.check(0, 1, 0, t0).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn the_old_comparison_ignores_reservations() {
        let mut l = Ledger::new(LedgerSettings {
            ignore_reservations: true,
            ..LedgerSettings::default()
        });
        let t0 = Instant::now();
        l.push_reading(reading(1000 * MIB, 0, t0));
        for id in 0..10 {
            assert!(l.check(0, 300 * MIB, 0, t0).is_ok());
            l.reserve(id, 0, 0, "up", 300 * MIB, None, t0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_job_reports_its_peak_above_the_idle_floor() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        l.reserve(1, 2, 0, "up", 300 * MIB, Some(4.0), t0);
        for used in [150, 520, 480] {
            l.push_reading(reading(1000 * MIB, used * MIB, t0 + ms(10)));
        }
        l.release(0, 1, t0 + ms(20));
        // Not known until the level the upstream keeps after the job is.
        assert!(l.take_samples().is_empty());
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0 + ms(30)));
        assert!(l.take_samples().is_empty(), "the idle stretch goes on");
        // The next job ends the idle stretch: back to 100 MiB, so the job added 420 MiB.
        l.reserve(2, 0, 0, "up", 300 * MIB, None, t0 + ms(40));
        let s = l.take_samples();
        assert_eq!(s.len(), 1, "{s:?}");
        assert_eq!((s[0].lane, s[0].peak_bytes), (2, 420 * MIB));
        assert_eq!(s[0].audio_seconds, Some(4.0));
        // Overlapping jobs on one upstream cannot be told apart: no sample.
        l.reserve(3, 0, 0, "up", 300 * MIB, None, t0 + ms(40));
        l.push_reading(reading(1000 * MIB, 700 * MIB, t0 + ms(50)));
        l.release(0, 2, t0 + ms(60));
        l.release(0, 3, t0 + ms(60));
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0 + ms(70)));
        l.reserve(4, 0, 0, "up", 300 * MIB, None, t0 + ms(80));
        assert!(l.take_samples().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn memory_a_job_leaves_behind_is_not_part_of_its_need() {
        // A backend at 100 MiB before its first job peaks at 520 MiB and keeps 400 MiB after it
        // (its allocator keeps the buffers): the job adds 120 MiB above the level kept between
        // jobs, not 420 MiB. The second job, from 400 MiB, peaks at 515 MiB.
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        l.reserve(1, 0, 0, "up", 300 * MIB, None, t0);
        l.push_reading(reading(600 * MIB, 520 * MIB, t0 + ms(10)));
        l.release(0, 1, t0 + ms(20));
        // It gives back a little later than it answers: the lowest idle reading counts.
        l.push_reading(reading(580 * MIB, 450 * MIB, t0 + ms(30)));
        l.push_reading(reading(600 * MIB, 400 * MIB, t0 + ms(40)));
        l.reserve(2, 0, 0, "up", 300 * MIB, None, t0 + ms(50));
        l.push_reading(reading(600 * MIB, 515 * MIB, t0 + ms(60)));
        l.release(0, 2, t0 + ms(70));
        let first = l.take_samples();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].peak_bytes, 120 * MIB);
        // With no next job, the level is known `settle` after the job ended.
        l.push_reading(reading(600 * MIB, 400 * MIB, t0 + ms(80)));
        assert!(l.take_samples().is_empty());
        l.push_reading(reading(
            600 * MIB,
            400 * MIB,
            t0 + ms(70) + Duration::from_secs(5),
        ));
        let second = l.take_samples();
        assert_eq!(second.len(), 1);
        assert_eq!(second[0].peak_bytes, 115 * MIB);
    }

    #[tokio::test(start_paused = true)]
    async fn a_job_admitted_after_overlapping_ones_counts_only_readings_taken_after_it() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0));
        // Two 300 MiB jobs overlap on one upstream; the last reading before they end shows both.
        l.reserve(1, 0, 0, "up", 300 * MIB, None, t0);
        l.reserve(2, 0, 0, "up", 300 * MIB, None, t0);
        l.push_reading(reading(400 * MIB, 700 * MIB, t0 + ms(50)));
        l.release(0, 1, t0 + ms(100));
        l.release(0, 2, t0 + ms(100));
        // The next job is admitted alone before any new reading.
        l.reserve(3, 0, 0, "up", 300 * MIB, None, t0 + ms(101));
        // A probe that began before it (and before the two ended) reports late: it is neither
        // the upstream's floor nor this job's use.
        l.push_reading(reading(400 * MIB, 700 * MIB, t0 + ms(99)));
        assert_eq!(l.hidden_bytes(0, t0 + ms(110)), 300 * MIB);
        l.push_reading(reading(700 * MIB, 400 * MIB, t0 + ms(150)));
        l.release(0, 3, t0 + ms(200));
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0 + ms(210)));
        // A job with no reading taken during it gives no sample.
        l.reserve(4, 0, 0, "up", 300 * MIB, None, t0 + ms(300));
        let s = l.take_samples();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].peak_bytes, 300 * MIB);
        l.push_reading(reading(700 * MIB, 400 * MIB, t0 + ms(250)));
        l.release(0, 4, t0 + ms(320));
        l.push_reading(reading(1000 * MIB, 100 * MIB, t0 + ms(330)));
        l.reserve(5, 0, 0, "up", 300 * MIB, None, t0 + ms(340));
        assert!(l.take_samples().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn the_ceiling_is_the_best_recent_free_plus_what_running_jobs_hold() {
        let mut l = Ledger::new(LedgerSettings::default());
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        l.push_reading(reading(300 * MIB, 100 * MIB, t0));
        // Nothing running: 300 MiB is all there will be; a need of 250 + 100 margin never fits.
        let short = l.check(0, 250 * MIB, 100 * MIB, t0).unwrap_err();
        assert_eq!(short.ceiling_bytes, Some(300 * MIB));
        assert!(short.never_fits());
        // A dip below the best reading of the last `stale_after` is no verdict.
        l.push_reading(reading(200 * MIB, 100 * MIB, t0 + ms(100)));
        assert_eq!(l.ceiling(0), Some(300 * MIB));
        // A running job 150 MiB above its upstream's floor gives that back when it ends: long
        // after the readings before it have left the window, the ceiling still counts it.
        l.reserve(1, 0, 0, "up", 200 * MIB, None, t0 + ms(100));
        l.push_reading(reading(150 * MIB, 250 * MIB, t0 + ms(1500)));
        assert_eq!(l.ceiling(0), Some(300 * MIB));
        let wait = l.check(0, 150 * MIB, 100 * MIB, t0 + ms(1500)).unwrap_err();
        assert!(!wait.never_fits(), "{wait:?}");
        l.release(0, 1, t0 + ms(1600));
        l.push_reading(reading(290 * MIB, 110 * MIB, t0 + ms(2700)));
        assert_eq!(l.ceiling(0), Some(290 * MIB));
    }

    #[test]
    fn learner_takes_the_high_quantile_after_min_samples() {
        let mut learner = Learner::default();
        for (i, peak) in [600u64, 590, 610, 605, 595, 600, 620, 598]
            .iter()
            .enumerate()
        {
            assert_eq!(learner.learned().is_some(), i >= 8, "after {i} samples");
            learner.add(peak * MIB, None, 0, 0.9, 8);
        }
        let need = learner.learned().unwrap();
        assert_eq!(need.bytes_per_job, 620 * MIB);
        assert_eq!((need.bytes_per_audio_second, need.samples), (0, 8));
    }

    #[test]
    fn learner_fits_a_slope_when_clip_lengths_vary() {
        let mut learner = Learner::default();
        // 200 MiB per job plus 10 MiB per second, exactly.
        for s in [1.0, 5.0, 10.0, 20.0, 30.0] {
            learner.add(
                ((200.0 + 10.0 * s) * MIB as f64) as u64,
                Some(s),
                MIB,
                0.95,
                5,
            );
        }
        let need = learner.learned().unwrap();
        assert_eq!(need.bytes_per_audio_second, 10 * MIB);
        assert!(need.bytes_per_job.abs_diff(200 * MIB) < MIB, "{need:?}");
        // A job of unknown length cannot be split when there is a per-second part.
        learner.add(900 * MIB, None, MIB, 0.95, 5);
        assert_eq!(learner.seen(), 5);
    }

    #[test]
    fn a_loaded_figure_holds_until_enough_new_samples() {
        let loaded = LearnedNeed {
            bytes_per_job: 7,
            bytes_per_audio_second: 0,
            samples: 40,
        };
        let mut learner = Learner::with_loaded(loaded);
        assert_eq!(learner.learned(), Some(loaded));
        learner.add(100, None, 0, 0.95, 2);
        assert_eq!(learner.learned(), Some(loaded));
        learner.add(100, None, 0, 0.95, 2);
        assert_eq!(learner.learned().unwrap().bytes_per_job, 100);
    }
}
