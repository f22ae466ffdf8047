//! The leak verdict: from one idle floor per round (the lowest memory in the quiet gap after a
//! round of an identical workload) and one throughput figure per round, decide
//! `leak | no_leak | inconclusive` and say why in words.
//!
//! Rule: suspect a leak when identical rounds leave an increasing memory floor, or when their
//! throughput keeps falling. Memory that stays high after requests finish is not by itself a leak:
//! caching allocators grow during the first rounds and then plateau, and a cache that is filled
//! once shows up as one step. Floors taken in idle gaps (queue empty) already remove the effect of
//! queue depth and context length, which only move in-round peaks.
//!
//! How the floor series is judged:
//! 1. Mann–Kendall test for a monotonic trend and Theil–Sen slope with its confidence interval.
//! 2. No significant rise: `no_leak` when the interval rules out a rise of
//!    [`LeakConfig::min_leak_bytes_per_round`], otherwise `inconclusive` (more rounds needed).
//! 3. A significant, material rise is still `no_leak` when a single level shift with a flat floor
//!    after it explains the series clearly better than a line (a step), or when the most recent
//!    half of the rounds is flat (warm-up, then plateau). When a level shift fits about as well as
//!    a line, it is a `leak` only if the floor keeps rising after the shift (a leak that set in
//!    part-way), otherwise `inconclusive`. Any other material rise is a `leak`.
//!
//! Throughput is judged with the same two statistics: a significant fall of at least
//! [`LeakConfig::min_degradation_per_round`] of the median per round is a degradation, which also
//! makes the verdict `leak` (a leak of something other than GPU memory, or a slowdown that will
//! end in one), with `degradation` set so callers can tell the two apart.
//!
//! The verdict depends only on differences between floors: adding a constant to every floor
//! never changes it (exactly so for whole byte counts, which are exact in `f64` below 2^53).

use serde::Serialize;

use crate::trend::{MannKendall, TheilSen, mann_kendall, median, theil_sen};

const MIB: f64 = 1024.0 * 1024.0;

/// Thresholds of the verdict.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeakConfig {
    /// Significance level of the trend tests; the slope intervals use confidence 1 − alpha.
    pub alpha: f64,
    /// Rounds needed (after warm-up) before any verdict other than `inconclusive`.
    pub min_rounds: usize,
    /// Leading rounds left out of the analysis.
    pub warmup_rounds: usize,
    /// The smallest floor rise per round that counts as a leak, in bytes.
    pub min_leak_bytes_per_round: f64,
    /// Floors closer than this count as equal in the trend test, in bytes (measurement jitter).
    pub tie_tolerance_bytes: f64,
    /// The smallest throughput fall per round that counts, as a fraction of the median (0.005 =
    /// 0.5 % per round).
    pub min_degradation_per_round: f64,
}

impl Default for LeakConfig {
    fn default() -> Self {
        LeakConfig {
            alpha: 0.05,
            min_rounds: 6,
            warmup_rounds: 0,
            min_leak_bytes_per_round: 2.0 * MIB,
            tie_tolerance_bytes: MIB,
            min_degradation_per_round: 0.005,
        }
    }
}

/// The three answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Leak,
    NoLeak,
    Inconclusive,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Leak => "leak",
            Verdict::NoLeak => "no_leak",
            Verdict::Inconclusive => "inconclusive",
        })
    }
}

/// What the floor series looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FloorShape {
    /// Not enough rounds to say anything.
    TooShort,
    /// No significant trend and a rise of the threshold size is ruled out.
    Flat,
    /// No significant trend, but the data cannot rule out a material rise.
    Noisy,
    /// Significantly falling.
    Falling,
    /// Significant rise, but below the threshold per round.
    SmallRise,
    /// One level shift, flat before and after.
    Step,
    /// Rose early, flat over the recent rounds.
    Plateau,
    /// Looks as much like a level shift as like a trend.
    StepOrTrend,
    /// Rising, and still rising recently.
    Rising,
}

/// The floor analysis.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FloorTrend {
    /// Rounds analysed (after warm-up).
    pub rounds: usize,
    pub shape: FloorShape,
    pub slope_mib_per_round: f64,
    /// Theil–Sen confidence interval of the slope (confidence 1 − alpha), MiB per round.
    pub slope_ci_mib_per_round: [f64; 2],
    /// Mann–Kendall two-sided p-value.
    pub p_value: f64,
    /// Kendall's tau.
    pub tau: f64,
    /// Theil–Sen slope over the most recent half of the rounds, MiB per round.
    pub recent_slope_mib_per_round: f64,
    /// Floor change from the first to the last round analysed (medians of the first and last
    /// three), MiB.
    pub total_rise_mib: f64,
}

/// The throughput analysis.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThroughputTrend {
    pub rounds: usize,
    /// Theil–Sen slope in the input's units per round.
    pub slope_per_round: f64,
    /// The slope as a percentage of the median throughput.
    pub percent_per_round: f64,
    pub percent_ci_per_round: [f64; 2],
    pub p_value: f64,
    pub degrading: bool,
}

/// The verdict with its evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LeakReport {
    pub verdict: Verdict,
    /// One or two sentences saying why.
    pub reason: String,
    /// The floor rises like a leak.
    pub memory_leak: bool,
    /// Throughput falls round after round.
    pub degradation: bool,
    pub floor: FloorTrend,
    pub throughput: Option<ThroughputTrend>,
    pub config: LeakConfig,
}

/// Inputs the verdict cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum LeakError {
    #[error("{series} value {index} is not a finite number")]
    NotFinite { series: &'static str, index: usize },
    #[error("{floors} floors but {throughputs} throughput values; give one of each per round")]
    LengthMismatch { floors: usize, throughputs: usize },
    #[error("invalid leak settings: {0}")]
    BadConfig(&'static str),
}

/// The verdict with default thresholds. `floors` are bytes, one per round; `throughputs` are
/// per-round figures in any unit (tokens/s, requests/s), or empty when not measured.
pub fn verdict(floors: &[f64], throughputs: &[f64]) -> Result<LeakReport, LeakError> {
    verdict_with(floors, throughputs, &LeakConfig::default())
}

/// The verdict with explicit thresholds.
pub fn verdict_with(
    floors: &[f64],
    throughputs: &[f64],
    config: &LeakConfig,
) -> Result<LeakReport, LeakError> {
    check_config(config)?;
    check_finite("floor", floors)?;
    check_finite("throughput", throughputs)?;
    if !throughputs.is_empty() && throughputs.len() != floors.len() {
        return Err(LeakError::LengthMismatch {
            floors: floors.len(),
            throughputs: throughputs.len(),
        });
    }
    let skip = config.warmup_rounds.min(floors.len());
    let (floor, floor_reason) = analyse_floor(&floors[skip..], config);
    let throughput = if throughputs.is_empty() {
        None
    } else {
        Some(analyse_throughput(&throughputs[skip..], config))
    };
    let degradation = throughput.as_ref().is_some_and(|t| t.degrading);
    let memory_leak = floor.shape == FloorShape::Rising;
    let verdict = if memory_leak || degradation {
        Verdict::Leak
    } else {
        match floor.shape {
            FloorShape::TooShort | FloorShape::Noisy | FloorShape::StepOrTrend => {
                Verdict::Inconclusive
            }
            _ => Verdict::NoLeak,
        }
    };
    let mut reason = floor_reason;
    if let Some(t) = &throughput {
        if t.degrading {
            reason.push_str(&format!(
                " Throughput falls {:.2} % per round (CI {:.2} to {:.2} %, Mann–Kendall p{}){}.",
                -t.percent_per_round,
                -t.percent_ci_per_round[1],
                -t.percent_ci_per_round[0],
                fmt_p(t.p_value),
                if memory_leak {
                    ""
                } else {
                    ": degradation with a floor that does not rise, so something other than GPU memory accumulates"
                }
            ));
        } else if t.rounds >= config.min_rounds {
            reason.push_str(&format!(
                " Throughput holds ({:+.2} % per round, p{}).",
                t.percent_per_round,
                fmt_p(t.p_value)
            ));
        }
    }
    Ok(LeakReport {
        verdict,
        reason,
        memory_leak,
        degradation,
        floor,
        throughput,
        config: config.clone(),
    })
}

fn check_config(config: &LeakConfig) -> Result<(), LeakError> {
    if !(config.alpha > 0.0 && config.alpha < 0.5) {
        return Err(LeakError::BadConfig("alpha must lie in (0, 0.5)"));
    }
    if config.min_rounds < 3 {
        return Err(LeakError::BadConfig("min_rounds must be at least 3"));
    }
    if !(config.min_leak_bytes_per_round.is_finite() && config.min_leak_bytes_per_round >= 0.0) {
        return Err(LeakError::BadConfig(
            "min_leak_bytes_per_round must be a finite number >= 0",
        ));
    }
    if !(config.tie_tolerance_bytes.is_finite() && config.tie_tolerance_bytes >= 0.0) {
        return Err(LeakError::BadConfig(
            "tie_tolerance_bytes must be a finite number >= 0",
        ));
    }
    if !(config.min_degradation_per_round.is_finite() && config.min_degradation_per_round >= 0.0) {
        return Err(LeakError::BadConfig(
            "min_degradation_per_round must be a finite number >= 0",
        ));
    }
    Ok(())
}

fn check_finite(series: &'static str, values: &[f64]) -> Result<(), LeakError> {
    match values.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(LeakError::NotFinite { series, index }),
        None => Ok(()),
    }
}

fn analyse_floor(raw: &[f64], config: &LeakConfig) -> (FloorTrend, String) {
    let n = raw.len();
    // Work on differences from the lowest floor: exact for byte counts, and it makes the verdict
    // independent of the absolute level.
    let low = raw.iter().copied().fold(f64::INFINITY, f64::min);
    let values: Vec<f64> = raw.iter().map(|v| v - low).collect();
    let confidence = 1.0 - config.alpha;
    let tol = config.tie_tolerance_bytes;
    let mk = mann_kendall(&values, tol);
    let ts = theil_sen(&values, confidence, tol);
    let recent = &values[n - recent_len(n)..];
    let recent_ts = theil_sen(recent, confidence, tol);
    let head = median(&values[..n.min(3)]);
    let tail = median(&values[n - n.min(3)..]);
    let mut trend = FloorTrend {
        rounds: n,
        shape: FloorShape::TooShort,
        slope_mib_per_round: ts.slope / MIB,
        slope_ci_mib_per_round: [ts.lower / MIB, ts.upper / MIB],
        p_value: mk.p_value,
        tau: mk.tau,
        recent_slope_mib_per_round: recent_ts.slope / MIB,
        total_rise_mib: (tail - head) / MIB,
    };
    let pct = (confidence * 100.0).round();
    let stats = format!(
        "slope {:+.2} MiB/round ({pct} % CI {} to {}), Mann–Kendall p{}",
        trend.slope_mib_per_round,
        fmt_mib(ts.lower),
        fmt_mib(ts.upper),
        fmt_p(mk.p_value)
    );
    let threshold = config.min_leak_bytes_per_round;
    let threshold_text = format!("{:.2} MiB/round", threshold / MIB);

    if n < config.min_rounds {
        trend.shape = FloorShape::TooShort;
        let reason = format!(
            "Only {n} rounds{}; at least {} are needed for a verdict.",
            if config.warmup_rounds > 0 {
                " after warm-up"
            } else {
                ""
            },
            config.min_rounds
        );
        return (trend, reason);
    }

    let rising = mk.p_value < config.alpha && mk.s > 0;
    if !rising {
        let falling = mk.p_value < config.alpha && mk.s < 0;
        if falling {
            trend.shape = FloorShape::Falling;
            return (trend, format!("The idle floor falls: {stats}."));
        }
        if ts.upper < threshold {
            trend.shape = FloorShape::Flat;
            return (
                trend,
                format!(
                    "The idle floor is flat: {stats}; a rise of {threshold_text} is ruled out."
                ),
            );
        }
        trend.shape = FloorShape::Noisy;
        return (
            trend,
            format!(
                "No significant trend in the idle floor, but the interval still allows a rise of {threshold_text} or more: {stats}. Run more rounds."
            ),
        );
    }

    let line_error = line_abs_error(&values, &ts);
    let step = best_step(&values);
    let after_step = &values[step.at..];
    let after_flat = after_step.len() < 2
        || theil_sen(after_step, confidence, tol).slope < threshold
            && !(mann_kendall(after_step, tol).p_value < config.alpha
                && mann_kendall(after_step, tol).s > 0);
    if step.abs_error <= 0.5 * line_error && step.after > step.before && after_flat {
        trend.shape = FloorShape::Step;
        return (
            trend,
            format!(
                "One step of {:+.1} MiB at round {} with a flat floor before and after: a one-time allocation (a cache or pool grew), not a leak. Over all rounds: {stats}.",
                (step.after - step.before) / MIB,
                step.at + 1 + config.warmup_rounds
            ),
        );
    }
    let recent_mk = mann_kendall(recent, tol);
    let recent_rising = recent_mk.p_value < config.alpha && recent_mk.s > 0;
    if recent_ts.slope < threshold && !recent_rising {
        trend.shape = FloorShape::Plateau;
        let reason = format!(
            "The idle floor rose by {:.1} MiB early on, then stayed flat over the last {} rounds ({:+.2} MiB/round): allocator warm-up reaching a plateau, not a leak. Over all rounds: {stats}.",
            trend.total_rise_mib,
            recent.len(),
            trend.recent_slope_mib_per_round
        );
        return (trend, reason);
    }
    if ts.slope < threshold {
        trend.shape = FloorShape::SmallRise;
        return (
            trend,
            format!("The idle floor creeps up, but by less than {threshold_text}: {stats}."),
        );
    }
    if step.abs_error < line_error || ts.lower <= 0.0 {
        // A leak that set in part-way looks like a level shift to the whole series; what decides
        // is whether the floor keeps rising after the shift.
        let after = &values[step.at..];
        if after.len() >= config.min_rounds {
            let after_mk = mann_kendall(after, tol);
            let after_ts = theil_sen(after, confidence, tol);
            if after_mk.p_value < config.alpha
                && after_mk.s > 0
                && after_ts.slope >= threshold
                && after_ts.lower > 0.0
            {
                trend.shape = FloorShape::Rising;
                let reason = format!(
                    "The idle floor rises round after round since round {}: slope {:+.2} MiB/round over the last {} rounds ({pct} % CI {} to {}, Mann–Kendall p{}). Over all rounds: {stats}.",
                    step.at + 1 + config.warmup_rounds,
                    after_ts.slope / MIB,
                    after.len(),
                    fmt_mib(after_ts.lower),
                    fmt_mib(after_ts.upper),
                    fmt_p(after_mk.p_value)
                );
                return (trend, reason);
            }
        }
        trend.shape = FloorShape::StepOrTrend;
        return (
            trend,
            format!(
                "The idle floor rises ({stats}), but one level shift at round {} fits about as well as a steady trend. Run more rounds.",
                step.at + 1 + config.warmup_rounds
            ),
        );
    }
    trend.shape = FloorShape::Rising;
    let reason = format!(
        "The idle floor rises round after round: {stats}; still {:+.2} MiB/round over the last {} rounds.",
        trend.recent_slope_mib_per_round,
        recent.len()
    );
    (trend, reason)
}

fn analyse_throughput(values: &[f64], config: &LeakConfig) -> ThroughputTrend {
    let n = values.len();
    let confidence = 1.0 - config.alpha;
    let mk: MannKendall = mann_kendall(values, 0.0);
    let ts: TheilSen = theil_sen(values, confidence, 0.0);
    let mid = median(values).abs();
    let percent = |v: f64| {
        if mid > 0.0 { 100.0 * v / mid } else { 0.0 }
    };
    let degrading = n >= config.min_rounds
        && mid > 0.0
        && mk.p_value < config.alpha
        && mk.s < 0
        && ts.upper < 0.0
        && -ts.slope >= config.min_degradation_per_round * mid;
    ThroughputTrend {
        rounds: n,
        slope_per_round: ts.slope,
        percent_per_round: percent(ts.slope),
        percent_ci_per_round: [percent(ts.lower), percent(ts.upper)],
        p_value: mk.p_value,
        degrading,
    }
}

/// How many of the most recent rounds count as "recent": half, at least four.
fn recent_len(n: usize) -> usize {
    n.div_ceil(2).max(4).min(n)
}

fn line_abs_error(values: &[f64], ts: &TheilSen) -> f64 {
    values
        .iter()
        .enumerate()
        .map(|(i, v)| (v - (ts.intercept + ts.slope * i as f64)).abs())
        .sum()
}

struct Step {
    /// First round of the upper level.
    at: usize,
    before: f64,
    after: f64,
    abs_error: f64,
}

/// The single level shift (two medians) that fits best in absolute error.
fn best_step(values: &[f64]) -> Step {
    let mut best = Step {
        at: 0,
        before: 0.0,
        after: median(values),
        abs_error: f64::INFINITY,
    };
    for at in 1..values.len() {
        let (left, right) = values.split_at(at);
        let (before, after) = (median(left), median(right));
        let error: f64 = left.iter().map(|v| (v - before).abs()).sum::<f64>()
            + right.iter().map(|v| (v - after).abs()).sum::<f64>();
        if error < best.abs_error {
            best = Step {
                at,
                before,
                after,
                abs_error: error,
            };
        }
    }
    best
}

fn fmt_mib(bytes: f64) -> String {
    if bytes.is_infinite() {
        if bytes > 0.0 {
            "+inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{:+.2}", bytes / MIB)
    }
}

fn fmt_p(p: f64) -> String {
    if p < 0.0001 {
        "<0.0001".into()
    } else {
        format!("={p:.4}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: f64 = 1024.0 * MIB;

    /// Deterministic noise in [-1, 1) from a small LCG, so tests do not depend on a seed crate.
    fn noise(n: usize, seed: u64) -> Vec<f64> {
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..n)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
            })
            .collect()
    }

    fn whole_bytes(values: Vec<f64>) -> Vec<f64> {
        values.into_iter().map(f64::round).collect()
    }

    #[test]
    fn warm_up_then_plateau_is_no_leak() {
        let mut floors = vec![6.0 * GIB, 6.4 * GIB, 6.6 * GIB, 6.65 * GIB];
        floors.extend(std::iter::repeat_n(6.68 * GIB, 12));
        let jitter = noise(floors.len(), 3);
        let floors = whole_bytes(
            floors
                .iter()
                .zip(&jitter)
                .map(|(f, j)| f + 0.3 * MIB * j)
                .collect(),
        );
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::NoLeak, "{}", report.reason);
        assert!(
            matches!(report.floor.shape, FloorShape::Plateau | FloorShape::Step),
            "{report:?}"
        );
        assert!(
            report.floor.p_value < 0.05,
            "the early rise itself is significant"
        );
    }

    #[test]
    fn steady_eight_mib_per_round_is_a_leak() {
        let floors: Vec<f64> = (0..12).map(|i| 5.0 * GIB + 8.0 * MIB * i as f64).collect();
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Leak, "{}", report.reason);
        assert!(report.memory_leak && !report.degradation);
        assert!((report.floor.slope_mib_per_round - 8.0).abs() < 1e-9);
        let [low, high] = report.floor.slope_ci_mib_per_round;
        assert!(low > 0.0 && low <= 8.0 && high >= 8.0);
        assert!(report.floor.p_value < 0.001);
        assert!(
            report.reason.contains("+8.00 MiB/round"),
            "{}",
            report.reason
        );
    }

    #[test]
    fn eight_mib_per_round_under_noise_is_still_a_leak() {
        let jitter = noise(20, 11);
        let floors = whole_bytes(
            (0..20)
                .map(|i| 5.0 * GIB + 8.0 * MIB * i as f64 + 12.0 * MIB * jitter[i])
                .collect(),
        );
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Leak, "{}", report.reason);
        assert!((report.floor.slope_mib_per_round - 8.0).abs() < 3.0);
    }

    #[test]
    fn a_leak_that_sets_in_half_way_is_a_leak() {
        let floors: Vec<f64> = (0..20)
            .map(|i| {
                4.0 * GIB
                    + if i < 10 {
                        0.0
                    } else {
                        8.0 * MIB * (i - 9) as f64
                    }
            })
            .collect();
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Leak, "{}", report.reason);
        assert!(
            report.reason.contains("+8.00 MiB/round"),
            "{}",
            report.reason
        );
    }

    #[test]
    fn a_staircase_of_level_shifts_is_a_leak() {
        let floors: Vec<f64> = (0..20)
            .map(|i| 4.0 * GIB + 200.0 * MIB * (i / 7) as f64)
            .collect();
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Leak, "{}", report.reason);
    }

    #[test]
    fn noisy_flat_is_no_leak() {
        let jitter = noise(24, 5);
        let floors = whole_bytes(jitter.iter().map(|j| 7.0 * GIB + 16.0 * MIB * j).collect());
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::NoLeak, "{}", report.reason);
        assert_eq!(report.floor.shape, FloorShape::Flat);
        assert!(report.floor.p_value > 0.05);
    }

    #[test]
    fn one_step_up_then_flat_is_no_leak() {
        let floors: Vec<f64> = (0..14)
            .map(|i| {
                if i < 9 {
                    4.0 * GIB
                } else {
                    4.0 * GIB + 512.0 * MIB
                }
            })
            .collect();
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::NoLeak, "{}", report.reason);
        assert_eq!(report.floor.shape, FloorShape::Step);
        assert!(report.reason.contains("round 10"), "{}", report.reason);
        assert!(report.reason.contains("+512.0 MiB"), "{}", report.reason);
    }

    #[test]
    fn throughput_falling_two_percent_per_round_with_a_flat_floor_is_degradation() {
        let floors = vec![6.0 * GIB; 12];
        let throughputs: Vec<f64> = (0..12).map(|i| 1000.0 * 0.98f64.powi(i)).collect();
        let report = verdict(&floors, &throughputs).expect("verdict");
        assert!(report.degradation, "{}", report.reason);
        assert!(!report.memory_leak);
        assert_eq!(report.floor.shape, FloorShape::Flat);
        assert_eq!(report.verdict, Verdict::Leak);
        let t = report.throughput.expect("throughput trend");
        assert!((t.percent_per_round + 2.0).abs() < 0.3, "{t:?}");
        assert!(report.reason.contains("degradation"), "{}", report.reason);
    }

    #[test]
    fn steady_throughput_with_a_flat_floor_is_no_leak() {
        let jitter = noise(12, 8);
        let floors = vec![6.0 * GIB; 12];
        let throughputs: Vec<f64> = jitter.iter().map(|j| 1000.0 + 15.0 * j).collect();
        let report = verdict(&floors, &throughputs).expect("verdict");
        assert_eq!(report.verdict, Verdict::NoLeak, "{}", report.reason);
        assert!(!report.degradation);
    }

    #[test]
    fn flat_noisy_floors_are_rarely_called_a_leak() {
        // 400 fixed noise series per length (so the test is deterministic). A false leak needs a
        // significant rising trend (2.5 % of flat series at alpha = 0.05) that is also material;
        // 12 rounds often cannot rule a 2 MiB/round leak out (inconclusive), 24 rounds can.
        for (rounds, min_no_leaks) in [(12, 150), (24, 360)] {
            let mut leaks = 0;
            let mut no_leaks = 0;
            for seed in 0..400u64 {
                let jitter = noise(rounds, seed);
                let floors =
                    whole_bytes(jitter.iter().map(|j| 4.0 * GIB + 16.0 * MIB * j).collect());
                match verdict(&floors, &[]).expect("verdict").verdict {
                    Verdict::Leak => leaks += 1,
                    Verdict::NoLeak => no_leaks += 1,
                    Verdict::Inconclusive => {}
                }
            }
            assert!(
                leaks <= 10,
                "{rounds} rounds: {leaks} of 400 flat series called a leak"
            );
            assert!(
                no_leaks >= min_no_leaks,
                "{rounds} rounds: only {no_leaks} of 400 flat series called no_leak"
            );
        }
    }

    #[test]
    fn noisy_eight_mib_leaks_are_found_nearly_always() {
        // 8 MiB per round under ±16 MiB of noise, 20 rounds, 400 fixed noise series.
        let mut leaks = 0;
        let mut no_leaks = 0;
        for seed in 0..400u64 {
            let jitter = noise(20, seed + 10_000);
            let floors = whole_bytes(
                (0..20)
                    .map(|i| 4.0 * GIB + 8.0 * MIB * i as f64 + 16.0 * MIB * jitter[i])
                    .collect(),
            );
            match verdict(&floors, &[]).expect("verdict").verdict {
                Verdict::Leak => leaks += 1,
                Verdict::NoLeak => no_leaks += 1,
                Verdict::Inconclusive => {}
            }
        }
        assert!(leaks >= 380, "only {leaks} of 400 leaking series found");
        assert_eq!(no_leaks, 0, "a leaking series called no_leak");
    }

    #[test]
    fn too_few_rounds_is_inconclusive() {
        let floors: Vec<f64> = (0..4).map(|i| GIB + 50.0 * MIB * i as f64).collect();
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Inconclusive);
        assert_eq!(report.floor.shape, FloorShape::TooShort);
        assert!(report.reason.contains("Only 4 rounds"), "{}", report.reason);
    }

    #[test]
    fn very_noisy_short_series_is_inconclusive() {
        let jitter = noise(7, 21);
        let floors = whole_bytes(jitter.iter().map(|j| 3.0 * GIB + 400.0 * MIB * j).collect());
        let report = verdict(&floors, &[]).expect("verdict");
        assert_eq!(report.verdict, Verdict::Inconclusive, "{}", report.reason);
        assert_eq!(report.floor.shape, FloorShape::Noisy);
    }

    #[test]
    fn warm_up_rounds_are_left_out() {
        // With five warm-up rounds left out only five remain, fewer than `min_rounds`: the
        // verdict says so instead of judging what is left.
        let floors: Vec<f64> = (0..10).map(|i| GIB + 8.0 * MIB * i as f64).collect();
        let config = LeakConfig {
            warmup_rounds: 5,
            ..LeakConfig::default()
        };
        let report = verdict_with(&floors, &[], &config).expect("verdict");
        assert_eq!(report.floor.rounds, 5);
        assert_eq!(report.verdict, Verdict::Inconclusive);
        assert!(report.reason.contains("after warm-up"));
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert_eq!(
            verdict(&[1.0, f64::NAN], &[]).unwrap_err(),
            LeakError::NotFinite {
                series: "floor",
                index: 1
            }
        );
        assert!(matches!(
            verdict(&[1.0, 2.0], &[3.0]),
            Err(LeakError::LengthMismatch { .. })
        ));
        let bad = LeakConfig {
            alpha: 0.0,
            ..LeakConfig::default()
        };
        assert!(verdict_with(&[1.0; 8], &[], &bad).is_err());
        assert_eq!(
            verdict(&[], &[]).expect("empty").verdict,
            Verdict::Inconclusive
        );
    }

    #[test]
    fn report_serializes_with_snake_case_verdicts() {
        let floors: Vec<f64> = (0..8).map(|i| GIB + 8.0 * MIB * i as f64).collect();
        let json = serde_json::to_value(verdict(&floors, &[]).expect("verdict")).expect("json");
        assert_eq!(json["verdict"], "leak");
        assert_eq!(json["floor"]["shape"], "rising");
        assert!(json["floor"]["slope_ci_mib_per_round"].is_array());
    }

    /// Floor series of every kind the verdict distinguishes, as whole byte counts.
    fn floor_series() -> impl Strategy<Value = Vec<f64>> {
        (
            3usize..40,
            0u32..5,
            0.0f64..32.0,
            0.0f64..64.0,
            any::<u64>(),
            0usize..40,
        )
            .prop_map(|(n, kind, slope_mib, noise_mib, seed, at)| {
                let jitter = noise(n, seed);
                (0..n)
                    .map(|i| {
                        let base = match kind {
                            0 => 0.0,
                            1 => slope_mib * MIB * i as f64,
                            2 if i >= at % n => 300.0 * MIB,
                            3 => 800.0 * MIB * (1.0 - (-(i as f64) / 2.0).exp()),
                            _ => 0.0,
                        };
                        (4.0 * GIB + base + noise_mib * MIB * jitter[i]).round()
                    })
                    .collect()
            })
    }

    proptest! {
        #[test]
        fn a_steady_rise_of_eight_mib_or_more_under_small_noise_is_always_a_leak(
            n in 8usize..40,
            slope_mib in 8.0f64..64.0,
            noise_mib in 0.0f64..2.0,
            seed in any::<u64>(),
        ) {
            let jitter = noise(n, seed);
            let floors: Vec<f64> = (0..n)
                .map(|i| (4.0 * GIB + slope_mib * MIB * i as f64 + noise_mib * MIB * jitter[i]).round())
                .collect();
            let report = verdict(&floors, &[]).expect("verdict");
            prop_assert_eq!(report.verdict, Verdict::Leak, "{}", report.reason);
        }

        #[test]
        fn adding_a_constant_to_every_floor_never_changes_the_verdict(
            floors in floor_series(),
            shift in -(1i64 << 42)..(1i64 << 42),
        ) {
            let shifted: Vec<f64> = floors.iter().map(|f| f + shift as f64).collect();
            let a = verdict(&floors, &[]).expect("verdict");
            let b = verdict(&shifted, &[]).expect("verdict");
            prop_assert_eq!(a.verdict, b.verdict);
            prop_assert_eq!(a.floor.shape, b.floor.shape);
            prop_assert_eq!(a.floor.slope_mib_per_round, b.floor.slope_mib_per_round);
            prop_assert_eq!(a.floor.p_value, b.floor.p_value);
        }
    }
}
