//! Trend statistics over short series (one value per round): the Mann–Kendall test for a
//! monotonic trend and the Theil–Sen slope with Sen's confidence interval. Pure functions.
//!
//! References: Mann (1945) "Nonparametric tests against trend", Econometrica 13:245–259; Kendall
//! (1975) "Rank Correlation Methods"; Sen (1968) "Estimates of the Regression Coefficient Based on
//! Kendall's Tau", JASA 63:1379–1389. Mann–Kendall assumes no serial correlation, which is why the
//! leak verdict feeds it one value per round rather than raw samples.

use serde::Serialize;

/// Result of the Mann–Kendall test.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MannKendall {
    /// Σ sgn(x_j − x_i) over i < j; positive means rising.
    pub s: i64,
    /// Variance of S under "no trend", corrected for ties.
    pub var_s: f64,
    /// Normal score with continuity correction.
    pub z: f64,
    /// Two-sided p-value.
    pub p_value: f64,
    /// Kendall's tau (S over the number of pairs).
    pub tau: f64,
}

/// Mann–Kendall test. Two values closer than `tie_tolerance` count as tied. Fewer than two
/// values give S = 0 and p = 1.
pub fn mann_kendall(values: &[f64], tie_tolerance: f64) -> MannKendall {
    let n = values.len();
    let tol = tie_tolerance.max(0.0);
    let mut s: i64 = 0;
    for i in 0..n {
        for j in (i + 1)..n {
            let d = values[j] - values[i];
            if d > tol {
                s += 1;
            } else if d < -tol {
                s -= 1;
            }
        }
    }
    let var_s = mk_variance(values, tol);
    let z = if var_s <= 0.0 {
        0.0
    } else if s > 0 {
        (s as f64 - 1.0) / var_s.sqrt()
    } else if s < 0 {
        (s as f64 + 1.0) / var_s.sqrt()
    } else {
        0.0
    };
    let p_value = if z == 0.0 {
        1.0
    } else {
        (2.0 * (1.0 - normal_cdf(z.abs()))).clamp(0.0, 1.0)
    };
    let pairs = (n * n.saturating_sub(1) / 2) as f64;
    MannKendall {
        s,
        var_s,
        z,
        p_value,
        tau: if pairs > 0.0 { s as f64 / pairs } else { 0.0 },
    }
}

/// Var(S) = [n(n−1)(2n+5) − Σ t(t−1)(2t+5)] / 18 with t the sizes of tied groups. Values are
/// grouped by sorting and chaining neighbours no further apart than `tol`.
fn mk_variance(values: &[f64], tol: f64) -> f64 {
    let n = values.len() as f64;
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mut ties = 0.0;
    let mut run = 1.0_f64;
    for w in sorted.windows(2) {
        if w[1] - w[0] <= tol {
            run += 1.0;
        } else {
            ties += run * (run - 1.0) * (2.0 * run + 5.0);
            run = 1.0;
        }
    }
    ties += run * (run - 1.0) * (2.0 * run + 5.0);
    ((n * (n - 1.0) * (2.0 * n + 5.0) - ties) / 18.0).max(0.0)
}

/// Theil–Sen line through `(i, values[i])` with Sen's confidence interval for the slope.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct TheilSen {
    /// Median of the pairwise slopes, in value units per step.
    pub slope: f64,
    /// Median of `values[i] − slope·i`.
    pub intercept: f64,
    pub lower: f64,
    pub upper: f64,
    /// The confidence level the interval was computed for, e.g. 0.95.
    pub confidence: f64,
}

/// Theil–Sen estimate over equally spaced points (x = 0, 1, 2, …). The interval follows Sen:
/// with N pairwise slopes sorted and C = z·√Var(S), the bounds are the slopes of rank (N − C)/2
/// and (N + C)/2 + 1. Fewer than two values give a zero slope with an unbounded interval.
pub fn theil_sen(values: &[f64], confidence: f64, tie_tolerance: f64) -> TheilSen {
    let n = values.len();
    if n < 2 {
        return TheilSen {
            slope: 0.0,
            intercept: values.first().copied().unwrap_or(0.0),
            lower: f64::NEG_INFINITY,
            upper: f64::INFINITY,
            confidence,
        };
    }
    let mut slopes = Vec::with_capacity(n * (n - 1) / 2);
    for i in 0..n {
        for j in (i + 1)..n {
            slopes.push((values[j] - values[i]) / (j - i) as f64);
        }
    }
    slopes.sort_by(f64::total_cmp);
    let slope = median_sorted(&slopes);
    let mut residuals: Vec<f64> = values
        .iter()
        .enumerate()
        .map(|(i, v)| v - slope * i as f64)
        .collect();
    residuals.sort_by(f64::total_cmp);
    let intercept = median_sorted(&residuals);

    let count = slopes.len() as f64;
    let z = normal_quantile(0.5 + confidence.clamp(0.0, 0.999_999) / 2.0);
    let c = z * mk_variance(values, tie_tolerance.max(0.0)).sqrt();
    // Ranks are 1-based in Sen's description.
    let rank_low = ((count - c) / 2.0).round();
    let rank_high = ((count + c) / 2.0).round() + 1.0;
    let lower = if rank_low < 1.0 {
        f64::NEG_INFINITY
    } else {
        slopes[(rank_low as usize - 1).min(slopes.len() - 1)]
    };
    let upper = if rank_high > count {
        f64::INFINITY
    } else {
        slopes[(rank_high as usize).max(1) - 1]
    };
    TheilSen {
        slope,
        intercept,
        lower,
        upper,
        confidence,
    }
}

/// Median of an already sorted slice (0 for an empty one).
pub fn median_sorted(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// Median of any slice.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    median_sorted(&sorted)
}

/// Standard normal CDF, through the complementary error function (Chebyshev fit, fractional error
/// below 1.2e-7, Numerical Recipes §6.2).
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * erfc(-z / std::f64::consts::SQRT_2)
}

fn erfc(x: f64) -> f64 {
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let r = t * poly.exp();
    if x >= 0.0 { r } else { 2.0 - r }
}

/// Inverse of the standard normal CDF (Acklam's rational approximation, relative error below
/// 1.2e-9). `p` is clamped into (0, 1).
pub fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969_683_028_665_376e1,
        2.209_460_984_245_205e2,
        -2.759_285_104_469_687e2,
        1.383_577_518_672_69e2,
        -3.066_479_806_614_716e1,
        2.506_628_277_459_239,
    ];
    const B: [f64; 5] = [
        -5.447_609_879_822_406e1,
        1.615_858_368_580_409e2,
        -1.556_989_798_598_866e2,
        6.680_131_188_771_972e1,
        -1.328_068_155_288_572e1,
    ];
    const C: [f64; 6] = [
        -7.784_894_002_430_293e-3,
        -3.223_964_580_411_365e-1,
        -2.400_758_277_161_838,
        -2.549_732_539_343_734,
        4.374_664_141_464_968,
        2.938_163_982_698_783,
    ];
    const D: [f64; 4] = [
        7.784_695_709_041_462e-3,
        3.224_671_290_700_398e-1,
        2.445_134_137_142_996,
        3.754_408_661_907_416,
    ];
    const P_LOW: f64 = 0.024_25;
    let p = p.clamp(1e-300, 1.0 - 1e-16);
    if p < P_LOW {
        let q = (-2.0 * p.ln()).sqrt();
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    } else if p <= 1.0 - P_LOW {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_functions_match_table_values() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_964) - 0.975).abs() < 1e-6);
        assert!((normal_cdf(-1.0) - 0.158_655_25).abs() < 1e-6);
        assert!((normal_quantile(0.975) - 1.959_964).abs() < 1e-5);
        assert!((normal_quantile(0.01) + 2.326_348).abs() < 1e-5);
        for p in [0.001, 0.02, 0.3, 0.5, 0.8, 0.99] {
            assert!((normal_cdf(normal_quantile(p)) - p).abs() < 1e-6, "{p}");
        }
    }

    #[test]
    fn mann_kendall_on_a_strictly_rising_series() {
        let values: Vec<f64> = (0..10).map(f64::from).collect();
        let mk = mann_kendall(&values, 0.0);
        assert_eq!(mk.s, 45);
        // n = 10 without ties: Var(S) = 10·9·25/18 = 125.
        assert!((mk.var_s - 125.0).abs() < 1e-9);
        assert!((mk.z - 44.0 / 125f64.sqrt()).abs() < 1e-9);
        assert!(mk.p_value < 1e-4);
        assert!((mk.tau - 1.0).abs() < 1e-12);
    }

    #[test]
    fn mann_kendall_ties_reduce_the_variance_and_tolerance_makes_ties() {
        let values = [1.0, 1.0, 2.0, 2.0, 2.0, 3.0];
        let mk = mann_kendall(&values, 0.0);
        // Ties: one group of 2, one of 3 → Σ = 2·1·9 + 3·2·11 = 84; (6·5·17 − 84)/18 = 23.667.
        assert!((mk.var_s - (510.0 - 84.0) / 18.0).abs() < 1e-9);
        let jitter = [10.0, 10.2, 9.9, 10.1, 10.3];
        assert_eq!(mann_kendall(&jitter, 0.5).s, 0);
        assert_ne!(mann_kendall(&jitter, 0.0).s, 0);
    }

    #[test]
    fn mann_kendall_sees_no_trend_in_alternation() {
        let values = [5.0, 1.0, 5.0, 1.0, 5.0, 1.0, 5.0, 1.0];
        let mk = mann_kendall(&values, 0.0);
        assert!(mk.p_value > 0.5, "{mk:?}");
    }

    #[test]
    fn theil_sen_ignores_one_outlier_and_brackets_the_slope() {
        let mut values: Vec<f64> = (0..12).map(|i| 100.0 + 3.0 * i as f64).collect();
        values[5] = 10_000.0;
        let ts = theil_sen(&values, 0.95, 0.0);
        assert!((ts.slope - 3.0).abs() < 1e-9, "{ts:?}");
        assert!((ts.intercept - 100.0).abs() < 1e-9);
        assert!(ts.lower <= 3.0 && ts.upper >= 3.0, "{ts:?}");
        assert!(ts.lower > 0.0);
    }

    #[test]
    fn theil_sen_interval_widens_with_confidence() {
        let values = [3.0, 7.0, 4.0, 9.0, 6.0, 11.0, 8.0, 12.0, 10.0, 15.0];
        let narrow = theil_sen(&values, 0.80, 0.0);
        let wide = theil_sen(&values, 0.99, 0.0);
        assert!(wide.lower <= narrow.lower && wide.upper >= narrow.upper);
        assert!(wide.upper - wide.lower > narrow.upper - narrow.lower);
    }

    #[test]
    fn short_series_do_not_panic() {
        assert_eq!(mann_kendall(&[], 0.0).p_value, 1.0);
        assert_eq!(mann_kendall(&[1.0], 0.0).s, 0);
        let ts = theil_sen(&[4.0], 0.95, 0.0);
        assert_eq!(ts.slope, 0.0);
        assert!(ts.lower.is_infinite() && ts.upper.is_infinite());
        let two = theil_sen(&[1.0, 2.0], 0.95, 0.0);
        assert_eq!(two.slope, 1.0);
    }
}
