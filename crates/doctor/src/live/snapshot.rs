//! One parsed `/metrics` reading: every sample flattened to (full name, labels, value), read
//! with a maintained Prometheus text-format parser (`prom_text_format_parser`; vLLM's and
//! llama.cpp's names carry colons, which simpler parsers refuse). Sums and maxima over label
//! sets, and histograms (cumulative buckets, sum, count) with their differences and quantiles.

use prom_text_format_parser::{ScrapeParseError, Type, ValueType, parse_scrape};

/// Errors turning a `/metrics` body into samples.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("not Prometheus text format: {0}")]
    NotPrometheus(String),
    #[error("the body has no samples")]
    Empty,
}

#[derive(Debug, Clone, PartialEq)]
struct Sample {
    name: String,
    labels: Vec<(String, String)>,
    value: f64,
}

/// A parsed reading.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    samples: Vec<Sample>,
}

/// Cumulative buckets (upper bound, count ≤ bound), sum and count of one histogram.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
    pub count: f64,
}

/// Go/Prometheus float text (`+Inf`, `NaN`, `1e-3`) as f64.
fn float(text: &str) -> Option<f64> {
    match text {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        t => t.parse::<f64>().ok(),
    }
}

impl Snapshot {
    /// Parses a `/metrics` body. Lines the parser cannot assemble into a metric are dropped;
    /// a body that is not the text format at all is an error.
    pub fn parse(text: &str) -> Result<Snapshot, MetricsError> {
        let (metrics, error) = parse_scrape(text);
        if let Some(ScrapeParseError::Parse(e)) = error {
            let first = e.lines().next().unwrap_or("").chars().take(200).collect();
            return Err(MetricsError::NotPrometheus(first));
        }
        let mut samples = Vec::new();
        for m in metrics {
            for s in m.samples {
                let suffix = match (m.kind, s.value.value_type) {
                    (Type::Histogram, ValueType::Sample) => "_bucket",
                    (Type::Histogram | Type::Summary, ValueType::Sum) => "_sum",
                    (Type::Histogram | Type::Summary, ValueType::Count) => "_count",
                    _ => "",
                };
                let Some(value) = float(s.value.value.as_str()) else {
                    continue;
                };
                samples.push(Sample {
                    name: format!("{}{suffix}", m.name),
                    labels: s
                        .labels
                        .iter()
                        .map(|l| (l.key.clone(), l.value.clone()))
                        .collect(),
                    value,
                });
            }
        }
        if samples.is_empty() {
            return Err(MetricsError::Empty);
        }
        Ok(Snapshot { samples })
    }

    fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && filter
                    .iter()
                    .all(|(k, v)| s.labels.iter().any(|(lk, lv)| lk == k && lv == v))
        })
    }

    /// True when any sample's name starts with `prefix`.
    pub fn has_prefix(&self, prefix: &str) -> bool {
        self.samples.iter().any(|s| s.name.starts_with(prefix))
    }

    /// Sum over every label set of `name` that carries the labels in `filter`.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        let mut acc = None;
        for s in self.matching(name, filter).filter(|s| s.value.is_finite()) {
            acc = Some(acc.unwrap_or(0.0) + s.value);
        }
        acc
    }

    /// Largest value of `name` over the label sets carrying `filter`.
    pub fn max(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        self.matching(name, filter)
            .map(|s| s.value)
            .filter(|v| v.is_finite())
            .reduce(f64::max)
    }

    /// Distinct values of `label` on samples of `name` (first-seen order).
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in self.samples.iter().filter(|s| s.name == name) {
            if let Some((_, v)) = s.labels.iter().find(|(k, _)| k == label)
                && !out.contains(v)
            {
                out.push(v.clone());
            }
        }
        out
    }

    /// The histogram `name` (its `_bucket`/`_sum`/`_count` series), summed over the label sets
    /// carrying `filter`.
    pub fn histogram(&self, name: &str, filter: &[(&str, &str)]) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for s in self.matching(&bucket, filter) {
            let Some(le) = s
                .labels
                .iter()
                .find(|(k, _)| k == "le")
                .and_then(|(_, v)| float(v))
            else {
                continue;
            };
            if !s.value.is_finite() || le.is_nan() {
                continue;
            }
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(slot) => slot.1 += s.value,
                None => buckets.push((le, s.value)),
            }
        }
        let count = self.sum(&format!("{name}_count"), filter);
        if buckets.is_empty() && count.is_none() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram {
            buckets,
            sum: self.sum(&format!("{name}_sum"), filter).unwrap_or(0.0),
            count: count.unwrap_or(0.0),
        })
    }
}

impl Histogram {
    /// What happened between `earlier` and `self` (counters only grow; a reset gives `self`).
    pub fn since(&self, earlier: Option<&Histogram>) -> Histogram {
        let Some(e) = earlier else {
            return self.clone();
        };
        if self.count < e.count {
            return self.clone();
        }
        let buckets = self
            .buckets
            .iter()
            .map(|(le, c)| {
                let before = e.buckets.iter().find(|(b, _)| b == le).map_or(0.0, |x| x.1);
                (*le, (c - before).max(0.0))
            })
            .collect();
        Histogram {
            buckets,
            sum: (self.sum - e.sum).max(0.0),
            count: self.count - e.count,
        }
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }

    /// The `q` quantile, interpolated linearly inside the bucket that holds it (as
    /// Prometheus's `histogram_quantile` does); the highest finite bound when it falls in +Inf.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.buckets.last().map(|b| b.1).filter(|t| *t > 0.0)?;
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower = 0.0;
        let mut below = 0.0;
        for (le, cum) in &self.buckets {
            if *cum >= rank {
                if le.is_infinite() {
                    return Some(lower);
                }
                let inside = cum - below;
                let frac = if inside > 0.0 {
                    (rank - below) / inside
                } else {
                    1.0
                };
                return Some(lower + (le - lower) * frac.clamp(0.0, 1.0));
            }
            lower = if le.is_finite() { *le } else { lower };
            below = *cum;
        }
        Some(lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP vllm:num_requests_waiting Waiting.\n\
# TYPE vllm:num_requests_waiting gauge\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"a\"} 3.0\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"b\"} 1.0\n\
# TYPE headroom_queue_wait_seconds histogram\n\
headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"0.1\"} 2\n\
headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"1\"} 6\n\
headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"+Inf\"} 8\n\
headroom_queue_wait_seconds_sum{lane=\"text\"} 9.5\n\
headroom_queue_wait_seconds_count{lane=\"text\"} 8\n";

    #[test]
    fn sums_labels_and_histograms() {
        let s = Snapshot::parse(TEXT).unwrap();
        assert_eq!(s.sum("vllm:num_requests_waiting", &[]), Some(4.0));
        assert_eq!(
            s.sum("vllm:num_requests_waiting", &[("model_name", "b")]),
            Some(1.0)
        );
        assert_eq!(s.max("vllm:num_requests_waiting", &[]), Some(3.0));
        let h = s
            .histogram("headroom_queue_wait_seconds", &[("lane", "text")])
            .unwrap();
        assert_eq!(h.count, 8.0);
        assert_eq!(h.buckets.len(), 3);
        // rank 4 of 8 lies in (0.1, 1]: 0.1 + 0.9 × (4 − 2) / 4 = 0.55
        assert!((h.quantile(0.5).unwrap() - 0.55).abs() < 1e-9);
        // rank 7.2 lies in (1, +Inf]: the highest finite bound
        assert_eq!(h.quantile(0.9), Some(1.0));
        let earlier = Histogram {
            buckets: vec![(0.1, 2.0), (1.0, 2.0), (f64::INFINITY, 2.0)],
            sum: 0.1,
            count: 2.0,
        };
        let d = h.since(Some(&earlier));
        assert_eq!(d.count, 6.0);
        assert_eq!(d.buckets[0].1, 0.0);
        assert!((d.mean().unwrap() - 9.4 / 6.0).abs() < 1e-9);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(Snapshot::parse("<html>nope</html>").is_err());
        assert!(matches!(
            Snapshot::parse(""),
            Err(MetricsError::Empty) | Err(MetricsError::NotPrometheus(_))
        ));
    }
}
