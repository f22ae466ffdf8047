//! The steady-state detector: a backend's memory counts as steady when, over the last `window`
//! of samples, the Theil–Sen slope (robust to the odd spike of one sample) moves it by less than
//! a tolerance across the window. Pure: it looks at `(ts_ms, bytes)` points handed in.

use std::time::Duration;

use headroom_gpu::trend::theil_sen;

/// How flat is flat.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SteadyRule {
    pub window: Duration,
    /// Drift across the window allowed in absolute bytes ...
    pub abs_tolerance: u64,
    /// ... or as a fraction of the level, whichever is larger.
    pub rel_tolerance: f64,
    /// Fewest samples a window must hold to judge it.
    pub min_samples: usize,
}

impl SteadyRule {
    pub fn new(window: Duration) -> SteadyRule {
        SteadyRule {
            window,
            abs_tolerance: 4 * 1024 * 1024,
            rel_tolerance: 0.01,
            min_samples: 10,
        }
    }
}

/// The verdict over one window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SteadyVerdict {
    pub steady: bool,
    /// Median level over the window.
    pub level: u64,
    /// Slope × window length, in bytes (signed).
    pub drift: f64,
    pub tolerance: f64,
    pub samples: usize,
}

/// Judges the newest `rule.window` of `points` (`(ts_ms, bytes)`, oldest first). `None` while
/// the points do not yet span a whole window or hold too few samples.
pub fn judge(points: &[(u64, u64)], rule: &SteadyRule) -> Option<SteadyVerdict> {
    let (last_ts, _) = *points.last()?;
    let window_ms = rule.window.as_millis() as u64;
    if points[0].0 + window_ms > last_ts {
        return None;
    }
    let from = last_ts - window_ms;
    let start = points.partition_point(|(ts, _)| *ts < from);
    let recent = &points[start..];
    if recent.len() < rule.min_samples.max(2) {
        return None;
    }
    // Theil–Sen is quadratic in the points: thin long windows to about 120 points.
    let step = recent.len().div_ceil(120);
    let values: Vec<f64> = recent
        .iter()
        .step_by(step)
        .map(|(_, b)| *b as f64)
        .collect();
    let mut sorted = values.clone();
    sorted.sort_by(f64::total_cmp);
    let level = headroom_gpu::trend::median_sorted(&sorted);
    // The slope per sample index; samples are close to evenly spaced at the sampler's interval.
    let slope = theil_sen(&values, 0.95, 0.0).slope;
    let drift = slope * (values.len() - 1) as f64;
    let tolerance = (rule.abs_tolerance as f64).max(level * rule.rel_tolerance);
    Some(SteadyVerdict {
        steady: drift.abs() <= tolerance,
        level: level as u64,
        drift,
        tolerance,
        samples: recent.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    fn series(n: u64, every_ms: u64, f: impl Fn(u64) -> u64) -> Vec<(u64, u64)> {
        (0..n).map(|i| (1_000_000 + i * every_ms, f(i))).collect()
    }

    fn rule() -> SteadyRule {
        SteadyRule::new(Duration::from_secs(2))
    }

    #[test]
    fn a_flat_series_is_steady_at_its_level() {
        let v = judge(&series(100, 25, |_| 300 * MIB), &rule()).unwrap();
        assert!(v.steady);
        assert_eq!(v.level, 300 * MIB);
        assert_eq!(v.samples, 81); // 2 s at 25 ms, both ends included
    }

    #[test]
    fn a_ramp_is_not_steady() {
        // 1 MiB per sample: 80 MiB across the window, far above 1 % of ~400 MiB.
        let v = judge(&series(100, 25, |i| 300 * MIB + i * MIB), &rule()).unwrap();
        assert!(!v.steady, "{v:?}");
        assert!((v.drift - 80.0 * MIB as f64).abs() < MIB as f64, "{v:?}");
    }

    #[test]
    fn a_slow_creep_within_tolerance_is_steady() {
        // 2 MiB over the window at 300 MiB: under the 4 MiB floor.
        let v = judge(&series(100, 25, |i| 300 * MIB + i * MIB / 40), &rule()).unwrap();
        assert!(v.steady, "{v:?}");
    }

    #[test]
    fn single_spikes_do_not_break_steadiness() {
        let v = judge(
            &series(100, 25, |i| if i % 17 == 0 { 900 * MIB } else { 300 * MIB }),
            &rule(),
        )
        .unwrap();
        assert!(v.steady, "{v:?}");
        assert_eq!(v.level, 300 * MIB);
    }

    #[test]
    fn a_ramp_that_has_levelled_off_becomes_steady() {
        // Rises for 2 s, then flat for 2.5 s: only the flat part is in the window.
        let pts = series(180, 25, |i| 300 * MIB + i.min(80) * 2 * MIB);
        let v = judge(&pts, &rule()).unwrap();
        assert!(v.steady, "{v:?}");
        assert_eq!(v.level, 460 * MIB);
    }

    #[test]
    fn too_short_a_history_gives_no_verdict() {
        assert!(judge(&series(40, 25, |_| MIB), &rule()).is_none()); // 1 s of a 2 s window
        assert!(judge(&[], &rule()).is_none());
        // A whole window but only 3 samples in it.
        assert!(judge(&series(3, 1000, |_| MIB), &rule()).is_none());
    }
}
