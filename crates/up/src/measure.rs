//! Measuring an audio backend: steady levels, its warm-up jobs and their peaks, or the kept
//! figures that stand for them after one job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_gpu::calibration::BackendCalibration;
use headroom_server::admin_box::BackendState;

use crate::UpError;
use crate::boxfile::{BackendConfig, Engine, Warmup};
use crate::budget::mib;
use crate::ctx::{Ctx, now_ms};
use crate::kept::{kept_figures_apply, one_job_agrees};
use crate::launch::last_line;
use crate::process::Group;
use crate::steady::{SteadyRule, judge};
use crate::versions::versions_seen;
use crate::warmup;

/// What was measured for one backend.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Measured {
    /// Steady before its first job (now).
    pub(crate) idle: u64,
    /// The level it keeps between jobs.
    pub(crate) resident: u64,
    pub(crate) peak: u64,
    pub(crate) peak_per_audio_second: Option<f64>,
    /// A speech backend's seconds of speech per input character (its warm-up's answer).
    pub(crate) speech_seconds_per_char: Option<f64>,
    pub(crate) runs: u32,
    /// The figures (all but `idle`) are the calibration file's, unchanged.
    pub(crate) kept: Option<BackendCalibration>,
    /// The fastest warm-up job, when one ran now: the job alone.
    pub(crate) fastest_job: Option<Duration>,
}

/// Waits until the backend's memory is steady; returns `(level, steady)`. On timeout the
impl Measured {
    /// A backend measured at rest only (no warm-up job): steady at `level`, with its `peak`.
    pub(crate) fn at_rest(level: u64, peak: u64) -> Measured {
        Measured {
            idle: level,
            resident: level,
            peak,
            peak_per_audio_second: None,
            speech_seconds_per_char: None,
            runs: 0,
            kept: None,
            fastest_job: None,
        }
    }

    /// The calibration file's figures standing for the warm-up, with the `idle` level read now.
    pub(crate) fn from_kept(
        idle: u64,
        kept: &BackendCalibration,
        fastest_job: Option<Duration>,
    ) -> Measured {
        Measured {
            idle,
            resident: kept.resident_bytes,
            peak: kept.peak_bytes,
            peak_per_audio_second: kept.peak_per_audio_second_bytes,
            speech_seconds_per_char: kept.speech_seconds_per_char,
            runs: kept.warmup_runs,
            kept: Some(kept.clone()),
            fastest_job,
        }
    }

    /// The figures a text engine's calibration entry keeps (its date set when saved).
    pub(crate) fn text_calibration(&self, engine: Engine) -> BackendCalibration {
        BackendCalibration {
            role: "text".into(),
            engine: engine.as_str().into(),
            idle_bytes: None,
            resident_bytes: self.resident,
            peak_bytes: self.peak,
            peak_per_audio_second_bytes: None,
            speech_seconds_per_char: None,
            warmup_runs: 0,
            date: String::new(),
        }
    }

    /// The figures an audio backend's calibration entry keeps (its date set when saved).
    pub(crate) fn audio_calibration(&self, engine: Engine) -> BackendCalibration {
        BackendCalibration {
            role: "audio".into(),
            engine: engine.as_str().into(),
            idle_bytes: Some(self.idle),
            resident_bytes: self.resident,
            peak_bytes: self.peak,
            peak_per_audio_second_bytes: self.peak_per_audio_second,
            speech_seconds_per_char: self.speech_seconds_per_char,
            warmup_runs: self.runs,
            date: String::new(),
        }
    }
}

/// Bytes per second of audio a job needs above `idle`: the warm-up's `peak` above it over the
/// clip's seconds (none without a clip length).
pub(crate) fn per_audio_second(peak: u64, idle: u64, audio_seconds: Option<f64>) -> Option<f64> {
    audio_seconds
        .filter(|s| *s > 0.0)
        .map(|secs| peak.saturating_sub(idle) as f64 / secs)
}

/// latest level is used and `steady` is false (logged as a warning by the caller).
pub(crate) async fn wait_steady(
    ctx: &Ctx,
    b: &BackendConfig,
    group: &mut Group,
) -> Result<(u64, bool), UpError> {
    let rule = SteadyRule::new(b.steady_window);
    let begin = Instant::now();
    let from = now_ms();
    loop {
        if let Some(status) = group.reap() {
            return Err(UpError::Backend {
                backend: b.name.clone(),
                what: format!(
                    "{} while being measured; last log line: {}",
                    ctx.how_it_ended(status),
                    last_line(group)
                ),
            });
        }
        let points = ctx.meter.series(group.pid, from);
        if let Some(v) = judge(&points, &rule) {
            if v.steady {
                return Ok((v.level, true));
            }
            if begin.elapsed() > b.steady_timeout {
                ctx.say(&format!(
                    "up: [{}] warning: memory not steady after {} s (moved {} over the last {} s); using the latest level",
                    b.name,
                    b.steady_timeout.as_secs(),
                    mib(v.drift.abs() as u64),
                    b.steady_window.as_secs_f64()
                ));
                return Ok((v.level, false));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Measures an audio backend just started: its idle level, then its warm-up (or the kept figures
/// standing for it); says the figures and puts them in the report.
pub(crate) async fn measure_audio(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    saved: Option<(&BackendCalibration, Option<&str>)>,
) -> Result<Measured, UpError> {
    ctx.status
        .update(&b.name, |r| r.state = BackendState::Measuring);
    let t0 = now_ms();
    let (idle, _) = wait_steady(ctx, b, group).await?;
    ctx.say(&format!("up: [{}] steady at {} idle", b.name, mib(idle)));
    let measured = match &b.warmup {
        None => Measured::at_rest(idle, ctx.meter.peak_since(group.pid, t0, idle)),
        Some(w) => match kept_after_one_job(ctx, b, group, w, saved, idle).await? {
            (Some(kept), fastest_job) => {
                ctx.say(&format!(
                    "up: [{}] warm-up skipped: peak {}, {} between jobs, {} before the first job, measured {} (the calibration file; --recalibrate measures again)",
                    b.name,
                    mib(kept.peak_bytes),
                    mib(kept.resident_bytes),
                    mib(kept.idle_bytes.unwrap_or(idle)),
                    kept.date
                ));
                Measured::from_kept(idle, kept, fastest_job)
            }
            (None, _) => warm_up(ctx, b, group, w, idle, t0).await?,
        },
    };
    ctx.say(&format!(
        "up: [{}] resident {}, peak {}{}",
        b.name,
        mib(measured.resident),
        mib(measured.peak),
        measured
            .peak_per_audio_second
            .map(|p| format!(", {} per audio second above idle", mib(p as u64)))
            .unwrap_or_default()
    ));
    ctx.status.update(&b.name, |r| {
        r.resident_bytes = measured.resident;
        r.peak_bytes = measured.peak;
        r.current_bytes = measured.idle;
        r.state = BackendState::Ready;
    });
    Ok(measured)
}

/// Whether the calibration file's figures (`saved`, with the packages they were measured with)
/// still stand for the warm-up of `b`, steady at `idle` now: they do while they describe the
/// backend as it starts now and as it runs one job (run here). Returns them where they stand,
/// and the time that one job took.
async fn kept_after_one_job<'a>(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    w: &Warmup,
    saved: Option<(&'a BackendCalibration, Option<&str>)>,
    idle: u64,
) -> Result<(Option<&'a BackendCalibration>, Option<Duration>), UpError> {
    let Some((kept, kept_version)) = saved else {
        return Ok((None, None));
    };
    let mut fastest_job = None;
    let agrees = match kept_figures_apply(kept, kept_version, &versions_seen(b), idle) {
        Ok(()) => one_job(ctx, b, group, w)
            .await?
            .and_then(|(took, after, peak)| {
                fastest_job = Some(took);
                one_job_agrees(kept, after, peak)
            }),
        Err(why) => Err(why),
    };
    match agrees {
        Ok(()) => Ok((Some(kept), fastest_job)),
        Err(why) => {
            ctx.say(&format!(
                "up: [{}] measuring again (the calibration file's figures are not used): {why}",
                b.name
            ));
            Ok((None, fastest_job))
        }
    }
}

/// Runs `b`'s warm-up job `w.runs` times (each said with the peak so far), waits for its level
/// between jobs and measures its peak since `t0` (before its idle level `idle` was read).
async fn warm_up(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    w: &Warmup,
    idle: u64,
    t0: u64,
) -> Result<Measured, UpError> {
    let job = warmup::prepare(b, w)?;
    let begin = now_ms();
    let mut runs = 0;
    let mut fastest = Duration::MAX;
    let mut speech_rate = None;
    for i in 1..=w.runs {
        let answer = warmup::run(&ctx.client, &job)
            .await
            .map_err(|e| UpError::Backend {
                backend: b.name.clone(),
                what: format!("failed its warm-up job {i}/{} ({}): {e}", w.runs, job.url),
            })?;
        runs += 1;
        fastest = fastest.min(answer.took);
        let rate = job
            .speech
            .zip(answer.audio_seconds)
            .and_then(|(input, secs)| input.seconds_per_char(secs));
        speech_rate = rate.or(speech_rate);
        let peak = ctx.meter.peak_since(group.pid, begin, 0);
        ctx.say(&format!(
            "up: [{}] warm-up {i}/{}: {}done in {:.2} s, peak so far {}",
            b.name,
            w.runs,
            warmup_audio(&job, answer.audio_seconds, rate),
            answer.took.as_secs_f64(),
            mib(peak)
        ));
    }
    if let (Some(input), None) = (job.speech, speech_rate) {
        ctx.say(&format!(
            "up: [{}] the speech warm-up ({} characters) answered with no audio of a readable length: the speech lane estimates {} s per character (serve's default)",
            b.name,
            input.chars,
            headroom_server::config::DEFAULT_SPEECH_SECONDS_PER_CHAR
        ));
    }
    let (resident, _) = wait_steady(ctx, b, group).await?;
    let peak = ctx.meter.peak_since(group.pid, t0, resident);
    let per_second = per_audio_second(peak, idle, job.audio_seconds);
    Ok(Measured {
        idle,
        resident,
        peak,
        peak_per_audio_second: per_second,
        speech_seconds_per_char: speech_rate,
        runs,
        kept: None,
        fastest_job: (runs > 0).then_some(fastest),
    })
}

/// What a warm-up job's log line says of its audio: the clip's length, or the speech it made and
/// the rate that gives.
pub(crate) fn warmup_audio(job: &warmup::Job, answered: Option<f64>, rate: Option<f64>) -> String {
    match (job.speech, answered, rate) {
        (Some(input), Some(secs), Some(rate)) => format!(
            "{} characters to {secs:.1} s of speech ({rate:.4} s per character), ",
            input.chars
        ),
        _ => job
            .audio_seconds
            .map(|s| format!("{s:.1} s of audio "))
            .unwrap_or_default(),
    }
}

/// Runs the warm-up job once on a backend started from kept figures, then waits for steady
/// memory: `Ok(Ok((time taken, level after, highest reading)))`, or `Ok(Err(why))` when the job
/// failed (the full warm-up will say so again).
pub(crate) async fn one_job(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    group: &mut Group,
    w: &crate::boxfile::Warmup,
) -> Result<Result<(Duration, u64, u64), String>, UpError> {
    let job = warmup::prepare(b, w)?;
    let begin = now_ms();
    let took = match warmup::run(&ctx.client, &job).await {
        Ok(a) => a.took,
        Err(e) => return Ok(Err(format!("its warm-up job failed ({e})"))),
    };
    let (after, _) = wait_steady(ctx, b, group).await?;
    let peak = ctx.meter.highest(group.pid, begin).unwrap_or(after);
    ctx.say(&format!(
        "up: [{}] one warm-up job: {:.2} s, peak {}, {} after it",
        b.name,
        took.as_secs_f64(),
        mib(peak),
        mib(after)
    ));
    Ok(Ok((took, after, peak)))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use headroom_gpu::calibration::BackendCalibration;

    use super::{Measured, per_audio_second, warmup_audio};
    use crate::boxfile::Engine;
    use crate::warmup::{Job, SpeechInput};

    const MIB: u64 = 1024 * 1024;

    fn kept() -> BackendCalibration {
        BackendCalibration {
            role: "audio".into(),
            engine: "whisper".into(),
            idle_bytes: Some(300 * MIB),
            resident_bytes: 320 * MIB,
            peak_bytes: 700 * MIB,
            peak_per_audio_second_bytes: Some(1.5e6),
            speech_seconds_per_char: None,
            warmup_runs: 3,
            date: "2026-12-01".into(),
        }
    }

    #[test]
    fn a_jobs_need_per_audio_second_is_its_peak_above_idle_over_the_clip() {
        // 500 MiB peak, 100 MiB idle, a 4 s clip: 100 MiB per second.
        assert_eq!(
            per_audio_second(500 * MIB, 100 * MIB, Some(4.0)),
            Some(104_857_600.0)
        );
        assert_eq!(per_audio_second(500 * MIB, 100 * MIB, Some(0.0)), None);
        assert_eq!(per_audio_second(500 * MIB, 100 * MIB, None), None);
        assert_eq!(per_audio_second(90, 100, Some(2.0)), Some(0.0));
    }

    #[test]
    fn kept_figures_stand_for_the_warm_up_with_the_idle_level_read_now() {
        let m = Measured::from_kept(310 * MIB, &kept(), Some(Duration::from_millis(800)));
        assert_eq!(m.idle, 310 * MIB);
        assert_eq!(m.resident, 320 * MIB);
        assert_eq!(m.peak, 700 * MIB);
        assert_eq!(m.peak_per_audio_second, Some(1.5e6));
        assert_eq!(m.runs, 3);
        assert_eq!(m.fastest_job, Some(Duration::from_millis(800)));
        assert_eq!(m.kept.as_ref().map(|k| k.date.as_str()), Some("2026-12-01"));
    }

    #[test]
    fn a_backend_at_rest_is_resident_at_its_level_and_ran_no_job() {
        let m = Measured::at_rest(200 * MIB, 260 * MIB);
        assert_eq!(
            (m.idle, m.resident, m.peak),
            (200 * MIB, 200 * MIB, 260 * MIB)
        );
        assert_eq!((m.runs, m.kept, m.fastest_job), (0, None, None));
    }

    #[test]
    fn an_audio_calibration_entry_keeps_what_was_measured() {
        let m = Measured {
            speech_seconds_per_char: Some(0.07),
            runs: 2,
            ..Measured::at_rest(100 * MIB, 400 * MIB)
        };
        let c = m.audio_calibration(Engine::Whisper);
        assert_eq!(c.role, "audio");
        assert_eq!(c.engine, "whisper");
        assert_eq!(c.idle_bytes, Some(100 * MIB));
        assert_eq!((c.resident_bytes, c.peak_bytes), (100 * MIB, 400 * MIB));
        assert_eq!(c.speech_seconds_per_char, Some(0.07));
        assert_eq!(c.warmup_runs, 2);
        assert_eq!(c.date, "");
    }

    #[test]
    fn a_text_calibration_entry_keeps_its_levels_and_no_audio_figures() {
        let c = Measured::at_rest(3000 * MIB, 3100 * MIB).text_calibration(Engine::LlamaCpp);
        assert_eq!((c.role.as_str(), c.engine.as_str()), ("text", "llamacpp"));
        assert_eq!(c.idle_bytes, None);
        assert_eq!((c.resident_bytes, c.peak_bytes), (3000 * MIB, 3100 * MIB));
        assert_eq!(c.peak_per_audio_second_bytes, None);
        assert_eq!(c.warmup_runs, 0);
    }

    #[test]
    fn a_warm_up_line_says_the_clip_or_the_speech_made() {
        let job = |speech: Option<SpeechInput>, audio_seconds: Option<f64>| Job {
            url: "http://127.0.0.1:1/v1".into(),
            body: Default::default(),
            content_type: "application/json".into(),
            audio_seconds,
            speech,
            timeout: Duration::from_secs(1),
        };
        let speech = Some(SpeechInput {
            chars: 100,
            speed: 1.0,
        });
        assert_eq!(
            warmup_audio(&job(speech, None), Some(6.5), Some(0.065)),
            "100 characters to 6.5 s of speech (0.0650 s per character), "
        );
        assert_eq!(warmup_audio(&job(speech, None), None, None), "");
        assert_eq!(
            warmup_audio(&job(None, Some(3.0)), None, None),
            "3.0 s of audio "
        );
        assert_eq!(warmup_audio(&job(None, None), None, None), "");
    }
}
