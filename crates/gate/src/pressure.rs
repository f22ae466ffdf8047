//! Pressure signals as plain inputs: what a job needs from GPU memory, and the engine's own load
//! figures (scraped elsewhere) with the thresholds a lane holds admission at.

use std::time::Duration;

use tokio::time::Instant;

/// GPU memory one job of a lane needs before it may start.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuNeed {
    /// Device index as the probe reports it.
    pub device: u32,
    /// Bytes every job needs.
    pub bytes_per_job: u64,
    /// Extra bytes per second of input audio.
    pub bytes_per_audio_second: u64,
    /// Free memory that must remain after the job.
    pub margin_bytes: u64,
    /// Admit when the probe fails instead of treating the device as full.
    pub fail_open: bool,
    /// Learn the need from measured job peaks (replacing the figures above once enough jobs
    /// were measured).
    pub learn: bool,
    /// The lane's longest allowed clip: audio of unknown length counts as this long.
    pub longest_clip_seconds: Option<f64>,
}

impl GpuNeed {
    /// Bytes that must be free for a job with this much audio (the margin included).
    pub fn required_bytes(&self, audio_seconds: Option<f64>) -> u64 {
        self.job_bytes(audio_seconds, false, None)
            .saturating_add(self.margin_bytes)
    }

    /// Bytes one job needs, from the learned figures when given, else the configured ones.
    /// `audio_unknown` marks audio whose length could not be read: it counts as the longest
    /// allowed clip, not as none.
    pub fn job_bytes(
        &self,
        audio_seconds: Option<f64>,
        audio_unknown: bool,
        learned: Option<crate::ledger::LearnedNeed>,
    ) -> u64 {
        let (per_job, per_second) = match learned {
            Some(l) if self.learn => (l.bytes_per_job, l.bytes_per_audio_second),
            _ => (self.bytes_per_job, self.bytes_per_audio_second),
        };
        let seconds = match audio_seconds {
            Some(s) => s.max(0.0),
            None if audio_unknown => self.longest_clip_seconds.unwrap_or(0.0),
            None => 0.0,
        };
        let per_audio = (seconds * per_second as f64).ceil() as u64;
        per_job.saturating_add(per_audio)
    }
}

/// Thresholds on an engine's own metrics above which the lane stops admitting.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLimits {
    /// Hold while the engine's waiting queue is longer than this.
    pub max_waiting: Option<f64>,
    /// Hold while KV-cache usage (0..1) is above this.
    pub max_kv_cache_usage: Option<f64>,
    /// Metrics older than this count as saturated unless `fail_open`.
    pub stale_after: Duration,
    pub fail_open: bool,
}

/// One scrape of an engine's load.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineLoad {
    pub waiting: Option<f64>,
    pub running: Option<f64>,
    /// KV-cache usage as a fraction 0..1, when the engine reports it.
    pub kv_cache_usage: Option<f64>,
    pub observed_at: Instant,
}

impl EngineLimits {
    /// Whether an upstream with this (possibly missing) load may take new work now.
    pub fn admits(&self, load: Option<&EngineLoad>, now: Instant) -> bool {
        let Some(load) = load else {
            return self.fail_open;
        };
        if now.saturating_duration_since(load.observed_at) > self.stale_after {
            return self.fail_open;
        }
        if let (Some(max), Some(w)) = (self.max_waiting, load.waiting)
            && w > max
        {
            return false;
        }
        if let (Some(max), Some(kv)) = (self.max_kv_cache_usage, load.kv_cache_usage)
            && kv > max
        {
            return false;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(fail_open: bool) -> EngineLimits {
        EngineLimits {
            max_waiting: Some(2.0),
            max_kv_cache_usage: Some(0.9),
            stale_after: Duration::from_secs(5),
            fail_open,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn engine_limits_hold_on_queue_kv_and_staleness() {
        let now = Instant::now();
        let load = |w: f64, kv: f64| EngineLoad {
            waiting: Some(w),
            running: Some(1.0),
            kv_cache_usage: Some(kv),
            observed_at: now,
        };
        assert!(limits(false).admits(Some(&load(2.0, 0.5)), now));
        assert!(!limits(false).admits(Some(&load(3.0, 0.5)), now));
        assert!(!limits(false).admits(Some(&load(0.0, 0.95)), now));
        assert!(!limits(false).admits(None, now));
        assert!(limits(true).admits(None, now));
        let later = now + Duration::from_secs(6);
        assert!(!limits(false).admits(Some(&load(0.0, 0.1)), later));
        assert!(limits(true).admits(Some(&load(0.0, 0.1)), later));
    }

    #[test]
    fn gpu_need_scales_with_audio_seconds() {
        let need = GpuNeed {
            device: 0,
            bytes_per_job: 1000,
            bytes_per_audio_second: 10,
            margin_bytes: 100,
            fail_open: false,
            learn: false,
            longest_clip_seconds: Some(60.0),
        };
        assert_eq!(need.required_bytes(None), 1100);
        assert_eq!(need.required_bytes(Some(30.0)), 1400);
        assert_eq!(need.required_bytes(Some(-5.0)), 1100);
        // Audio of unknown length counts as the longest clip, not as none.
        assert_eq!(need.job_bytes(None, true, None), 1600);
        let learned = crate::ledger::LearnedNeed {
            bytes_per_job: 2000,
            bytes_per_audio_second: 20,
            samples: 9,
        };
        assert_eq!(need.job_bytes(Some(10.0), false, Some(learned)), 1100);
        let learning = GpuNeed {
            learn: true,
            ..need
        };
        assert_eq!(learning.job_bytes(Some(10.0), false, Some(learned)), 2200);
    }
}
