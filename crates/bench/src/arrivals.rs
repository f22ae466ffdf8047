//! Open-loop arrival times: Poisson (burstiness 1) or gamma-distributed gaps (burstiness < 1 is
//! burstier, > 1 smoother), from a small seeded generator so runs are repeatable.

use std::time::Duration;

/// SplitMix64: tiny, fast, good enough for inter-arrival times and picking prompts.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.unit();
        let u2 = self.unit();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// Gamma(shape, scale) by Marsaglia–Tsang; shapes below 1 use the `U^(1/shape)` boost.
    pub fn gamma(&mut self, shape: f64, scale: f64) -> f64 {
        if shape < 1.0 {
            let boost = self.unit().powf(1.0 / shape);
            return self.gamma(shape + 1.0, scale) * boost;
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = self.unit();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v * scale;
            }
        }
    }
}

/// Gap before the next arrival at `rate` per second: exponential when `burstiness` is 1, gamma
/// with shape `burstiness` otherwise (mean always `1/rate`).
pub fn next_gap(rng: &mut Rng, rate: f64, burstiness: f64) -> f64 {
    if (burstiness - 1.0).abs() < f64::EPSILON {
        -rng.unit().ln() / rate
    } else {
        rng.gamma(burstiness, 1.0 / (rate * burstiness))
    }
}

/// `n` arrival offsets (the first at 0) whose gaps are drawn as in [`next_gap`] and then scaled so
/// the `n` gaps add up to exactly `n / rate`: the run sends `n` requests in `n / rate` seconds
/// whatever the draw, while keeping the burst pattern.
pub fn schedule(n: u64, rate: f64, burstiness: f64, seed: u64) -> Vec<Duration> {
    let mut rng = Rng::new(seed);
    let gaps: Vec<f64> = (0..n)
        .map(|_| next_gap(&mut rng, rate, burstiness))
        .collect();
    let total: f64 = gaps.iter().sum();
    let target = n as f64 / rate;
    let scale = if total > 0.0 { target / total } else { 1.0 };
    let mut at = 0.0;
    gaps.iter()
        .map(|g| {
            let this = at;
            at += g * scale;
            Duration::try_from_secs_f64(this).unwrap_or(Duration::MAX)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mean_and_cv(xs: &[f64]) -> (f64, f64) {
        let n = xs.len() as f64;
        let mean = xs.iter().sum::<f64>() / n;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt() / mean)
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate_and_cv_one() {
        let mut rng = Rng::new(7);
        let gaps: Vec<f64> = (0..20_000).map(|_| next_gap(&mut rng, 50.0, 1.0)).collect();
        let (mean, cv) = mean_and_cv(&gaps);
        assert!((mean - 0.02).abs() < 0.0006, "mean {mean}");
        assert!((cv - 1.0).abs() < 0.05, "cv {cv}");
    }

    #[test]
    fn gamma_burstiness_sets_the_spread() {
        // Gamma with shape k has coefficient of variation 1/sqrt(k).
        for k in [0.25, 4.0] {
            let mut rng = Rng::new(11);
            let gaps: Vec<f64> = (0..40_000).map(|_| next_gap(&mut rng, 10.0, k)).collect();
            let (mean, cv) = mean_and_cv(&gaps);
            assert!((mean - 0.1).abs() < 0.005, "k {k} mean {mean}");
            assert!((cv - 1.0 / f64::sqrt(k)).abs() < 0.08, "k {k} cv {cv}");
        }
    }

    #[test]
    fn schedule_spans_n_over_rate() {
        let s = schedule(500, 50.0, 1.0, 3);
        assert_eq!(s.len(), 500);
        assert_eq!(s[0], Duration::ZERO);
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        let last = s.last().unwrap().as_secs_f64();
        assert!(last < 10.0 && last > 9.5, "last arrival {last}");
    }
}
