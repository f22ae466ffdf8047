//! The text engine's budget: pool capacity − Σ audio peaks − co-tenants − margin. The audio
//! backends' *peaks* are charged, not their residents, because the peaks are what will coexist
//! with a full text engine. Co-tenants (memory in the pool that is none of the box's backends:
//! another process on the GPU, a watched process on the host) are charged at the most they were
//! seen holding during the whole measurement, so one that grows between warm-up rounds is
//! charged at its grown size. Once the text engine runs, [`JobRoom`] says whether an audio
//! lane can ever admit a job: what the pool can have free for it with every backend at the level
//! it keeps between jobs and the text engine at the most it will hold. Pure arithmetic over
//! values handed in.

use headroom_gpu::Sample;
use serde::Serialize;

/// One audio backend's measured footprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AudioFootprint {
    pub name: String,
    pub resident_bytes: u64,
    pub peak_bytes: u64,
}

/// How the text budget was reached, line by line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub capacity_bytes: u64,
    pub audio_peak_bytes: u64,
    pub cotenant_bytes: u64,
    pub margin_bytes: u64,
    /// What is left for the text engine (0 when nothing is).
    pub text_bytes: u64,
    /// How much is missing when the audio side, co-tenants and margin exceed the capacity.
    pub overcommitted_bytes: u64,
}

impl Budget {
    pub fn new(capacity: u64, audio: &[AudioFootprint], cotenant: u64, margin: u64) -> Budget {
        let audio_peak_bytes: u64 = audio.iter().map(|a| a.peak_bytes).sum();
        let taken = audio_peak_bytes as u128 + cotenant as u128 + margin as u128;
        let capacity128 = capacity as u128;
        Budget {
            capacity_bytes: capacity,
            audio_peak_bytes,
            cotenant_bytes: cotenant,
            margin_bytes: margin,
            text_bytes: capacity128.saturating_sub(taken) as u64,
            overcommitted_bytes: taken.saturating_sub(capacity128) as u64,
        }
    }

    /// One line for the progress log.
    pub fn describe(&self) -> String {
        format!(
            "capacity {} − audio peaks {} − co-tenants {} − margin {} = {} for the text engine",
            mib(self.capacity_bytes),
            mib(self.audio_peak_bytes),
            mib(self.cotenant_bytes),
            mib(self.margin_bytes),
            mib(self.text_bytes)
        )
    }
}

/// The most the pool can have free for one audio job once the box is up: capacity − every audio
/// backend at the level it keeps between jobs − the text engine at the most it will hold (its
/// plan, or what it holds now if more: an engine's pages fill as its cache is used) −
/// co-tenants. An audio lane whose need and margin exceed it could never admit a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobRoom {
    pub capacity_bytes: u64,
    pub audio_kept_bytes: u64,
    pub text_bytes: u64,
    pub cotenant_bytes: u64,
    pub room_bytes: u64,
}

impl JobRoom {
    pub fn new(capacity: u64, audio: &[AudioFootprint], text: u64, cotenant: u64) -> JobRoom {
        let audio_kept_bytes: u64 = audio.iter().map(|a| a.resident_bytes).sum();
        JobRoom {
            capacity_bytes: capacity,
            audio_kept_bytes,
            text_bytes: text,
            cotenant_bytes: cotenant,
            room_bytes: capacity
                .saturating_sub(audio_kept_bytes)
                .saturating_sub(text)
                .saturating_sub(cotenant),
        }
    }

    /// Whether a job needing `need` (plus `margin` kept free) can ever be admitted.
    pub fn admits(&self, need: u64, margin: u64) -> bool {
        need.saturating_add(margin) <= self.room_bytes
    }

    /// One line: the terms and the room.
    pub fn describe(&self) -> String {
        format!(
            "capacity {} − audio between jobs {} − text engine {} − co-tenants {} = {}",
            mib(self.capacity_bytes),
            mib(self.audio_kept_bytes),
            mib(self.text_bytes),
            mib(self.cotenant_bytes),
            mib(self.room_bytes)
        )
    }
}

/// Keeps the largest co-tenant use seen across every sample of the measurement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoTenants {
    max_bytes: u64,
    samples: u64,
}

impl CoTenants {
    /// Counts one sample: what the pool holds beyond `ours` (the box's own backends then).
    pub fn observe(&mut self, pool_used: u64, ours: u64) {
        self.max_bytes = self.max_bytes.max(pool_used.saturating_sub(ours));
        self.samples += 1;
    }

    /// Counts sampler samples, with `ours` giving the box's own bytes in each.
    pub fn observe_samples(&mut self, samples: &[Sample], ours: impl Fn(&Sample) -> u64) {
        for s in samples {
            self.observe(s.used_without_reserved(), ours(s));
        }
    }

    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
    }

    /// Samples counted (read by the tests).
    #[cfg(test)]
    pub fn samples(&self) -> u64 {
        self.samples
    }
}

/// Bytes as MiB with one decimal, for log lines.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_gpu::{DeviceSnapshot, ProcessMemory};

    const MIB: u64 = 1024 * 1024;
    const GIB: u64 = 1024 * MIB;

    fn audio(name: &str, resident: u64, peak: u64) -> AudioFootprint {
        AudioFootprint {
            name: name.into(),
            resident_bytes: resident,
            peak_bytes: peak,
        }
    }

    #[test]
    fn peaks_not_residents_are_charged() {
        let b = Budget::new(
            8 * GIB,
            &[
                audio("stt", 300 * MIB, 700 * MIB),
                audio("tts", 200 * MIB, 500 * MIB),
            ],
            0,
            256 * MIB,
        );
        assert_eq!(b.audio_peak_bytes, 1200 * MIB);
        // 8192 − 1200 − 256 = 6736 MiB, worked out by hand.
        assert_eq!(b.text_bytes, 6736 * MIB);
        assert_eq!(b.overcommitted_bytes, 0);
    }

    #[test]
    fn an_overcommitted_pool_leaves_nothing_and_says_by_how_much() {
        let b = Budget::new(
            GIB,
            &[audio("stt", 600 * MIB, 900 * MIB)],
            100 * MIB,
            256 * MIB,
        );
        assert_eq!(b.text_bytes, 0);
        assert_eq!(b.overcommitted_bytes, 232 * MIB);
    }

    fn sample(ts: u64, used: u64, ours: &[(u32, u64)]) -> Sample {
        let mut d = DeviceSnapshot::with_memory(0, 24 * GIB, used);
        d.processes = ours
            .iter()
            .map(|&(pid, b)| ProcessMemory {
                pid,
                name: String::new(),
                used_bytes: b,
            })
            .collect();
        Sample::from_device(ts, &d)
    }

    #[test]
    fn a_co_tenant_that_grows_between_warmup_rounds_is_charged_at_its_largest() {
        // Our speech server (pid 10) holds 2 GiB idle and 3 GiB while a job runs; another
        // process on the card holds 1 GiB in round one and 2.5 GiB by round three.
        let ours = |s: &Sample| s.process_used_bytes(10);
        let rounds = [
            vec![
                sample(1, 3 * GIB, &[(10, 2 * GIB)]),
                sample(2, 4 * GIB, &[(10, 3 * GIB)]),
            ],
            vec![
                sample(3, 3 * GIB + GIB / 2, &[(10, 2 * GIB)]),
                sample(4, 4 * GIB + GIB / 2, &[(10, 3 * GIB)]),
            ],
            vec![
                sample(5, 4 * GIB + GIB / 2, &[(10, 2 * GIB)]),
                sample(6, 5 * GIB + GIB / 2, &[(10, 3 * GIB)]),
            ],
        ];
        let mut co = CoTenants::default();
        co.observe_samples(&rounds[0], ours);
        assert_eq!(co.max_bytes(), GIB);
        co.observe_samples(&rounds[1], ours);
        co.observe_samples(&rounds[2], ours);
        assert_eq!(co.max_bytes(), 2 * GIB + GIB / 2);
        assert_eq!(co.samples(), 6);
        let b = Budget::new(
            24 * GIB,
            &[audio("stt", 2 * GIB, 3 * GIB)],
            co.max_bytes(),
            GIB / 2,
        );
        // 24 − 3 − 2.5 − 0.5 = 18 GiB; with the round-one reading it would have been 19.5.
        assert_eq!(b.text_bytes, 18 * GIB);
    }

    #[test]
    fn a_co_tenant_that_shrinks_keeps_its_high_mark() {
        let mut co = CoTenants::default();
        co.observe(5 * GIB, 2 * GIB);
        co.observe(3 * GIB, 2 * GIB);
        assert_eq!(co.max_bytes(), 3 * GIB);
        // Our own use above the pool's (a reading race) never counts negative.
        co.observe(GIB, 2 * GIB);
        assert_eq!(co.max_bytes(), 3 * GIB);
    }

    #[test]
    fn an_audio_job_finds_room_when_the_text_engine_stays_inside_its_budget() {
        // Whisper: 193 MiB between jobs, 269 MiB at the peak; 1 GiB pool, 128 MiB margin.
        let stt = [audio("stt", 193 * MIB, 269 * MIB)];
        let budget = Budget::new(GIB, &stt, 0, 128 * MIB);
        assert_eq!(budget.text_bytes, 627 * MIB);
        // The text engine at its whole budget: the job (76 MiB) and the margin still fit.
        let room = JobRoom::new(GIB, &stt, budget.text_bytes, 0);
        assert_eq!(room.room_bytes, 204 * MIB);
        assert!(room.admits(76 * MIB, 128 * MIB));
        assert!(!room.admits(77 * MIB, 128 * MIB));
        // An engine that holds 20 MiB more than its budget leaves the lane no room, ever.
        let over = JobRoom::new(GIB, &stt, budget.text_bytes + 20 * MIB, 0);
        assert!(!over.admits(76 * MIB, 128 * MIB));
        assert_eq!(
            over.describe(),
            "capacity 1024.0 MiB − audio between jobs 193.0 MiB − text engine 647.0 MiB − co-tenants 0.0 MiB = 184.0 MiB"
        );
    }

    #[test]
    fn the_description_names_every_term() {
        let b = Budget::new(4 * GIB, &[audio("stt", MIB, 512 * MIB)], 0, 256 * MIB);
        assert_eq!(
            b.describe(),
            "capacity 4096.0 MiB − audio peaks 512.0 MiB − co-tenants 0.0 MiB − margin 256.0 MiB = 3328.0 MiB for the text engine"
        );
    }
}
