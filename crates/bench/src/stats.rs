//! Latency distributions: HDR histograms recorded in microseconds, and the summary shape every
//! latency field of the report uses (`mean`, `p50`, `p90`, `p95`, `p99`, `max`, in milliseconds).

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// One latency distribution. Values are kept in microseconds with three significant digits.
#[derive(Debug, Clone)]
pub struct LatencyHistogram {
    hist: Histogram<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl LatencyHistogram {
    pub fn new() -> Self {
        // Auto-resizing histogram: no upper bound to get wrong.
        let hist = Histogram::new(3).expect("3 significant digits is within hdrhistogram's range");
        LatencyHistogram { hist }
    }

    /// Records one latency (sub-microsecond values count as 1 µs).
    pub fn record(&mut self, value: Duration) {
        let us = value.as_micros().clamp(1, u64::MAX as u128) as u64;
        if self.hist.record(us).is_err() {
            self.hist.saturating_record(us);
        }
    }

    pub fn len(&self) -> u64 {
        self.hist.len()
    }

    pub fn is_empty(&self) -> bool {
        self.hist.is_empty()
    }

    /// Mean, percentiles and maximum in milliseconds; all `None` when nothing was recorded.
    pub fn summary(&self) -> LatencySummary {
        if self.hist.is_empty() {
            return LatencySummary::default();
        }
        let ms = |us: u64| us as f64 / 1000.0;
        let q = |p: f64| Some(ms(self.hist.value_at_quantile(p)));
        LatencySummary {
            count: self.hist.len(),
            mean: Some(self.hist.mean() / 1000.0),
            p50: q(0.50),
            p90: q(0.90),
            p95: q(0.95),
            p99: q(0.99),
            max: Some(ms(self.hist.max())),
        }
    }

    /// The empirical CDF as `(value_ms, fraction_at_or_below)` points, one per distinct bucket.
    pub fn cdf(&self) -> Vec<(f64, f64)> {
        let total = self.hist.len();
        if total == 0 {
            return Vec::new();
        }
        let mut seen = 0u64;
        let mut points = Vec::new();
        for v in self.hist.iter_recorded() {
            seen += v.count_at_value();
            points.push((
                self.hist.highest_equivalent(v.value_iterated_to()) as f64 / 1000.0,
                seen as f64 / total as f64,
            ));
        }
        points
    }
}

/// The summary of one latency distribution, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Values recorded.
    pub count: u64,
    pub mean: Option<f64>,
    pub p50: Option<f64>,
    pub p90: Option<f64>,
    pub p95: Option<f64>,
    pub p99: Option<f64>,
    pub max: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_one_to_hundred_ms() {
        let mut h = LatencyHistogram::new();
        for ms in 1..=100u64 {
            h.record(Duration::from_millis(ms));
        }
        let s = h.summary();
        assert_eq!(s.count, 100);
        let close = |a: Option<f64>, b: f64| (a.unwrap() - b).abs() <= b * 0.002 + 0.001;
        assert!(close(s.p50, 50.0), "{s:?}");
        assert!(close(s.p90, 90.0), "{s:?}");
        assert!(close(s.p99, 99.0), "{s:?}");
        assert!(close(s.max, 100.0), "{s:?}");
        assert!(close(s.mean, 50.5), "{s:?}");
    }

    #[test]
    fn empty_histogram_has_no_numbers() {
        let s = LatencyHistogram::new().summary();
        assert_eq!(s.count, 0);
        assert!(s.p50.is_none() && s.max.is_none() && s.mean.is_none());
    }

    #[test]
    fn cdf_ends_at_one_and_rises() {
        let mut h = LatencyHistogram::new();
        for ms in [5u64, 5, 10, 20] {
            h.record(Duration::from_millis(ms));
        }
        let cdf = h.cdf();
        assert_eq!(cdf.len(), 3);
        assert!((cdf[0].1 - 0.5).abs() < 1e-9);
        assert!((cdf.last().unwrap().1 - 1.0).abs() < 1e-9);
        assert!(cdf.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 < w[1].1));
    }
}
