//! The start sequence: every audio backend started and measured in order, the text engine's
//! budget, flags and start, the audio room check, and the figures kept in the calibration file.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use headroom_gpu::calibration::{BackendCalibration, Calibration, ContentionFigures};
use headroom_server::admin_box::BackendState;

use crate::UpError;
use crate::beside::text_beside_audio;
use crate::boxfile::BackendConfig;
use crate::budget::{AudioFootprint, Budget, JobRoom, mib};
use crate::ctx::{Ctx, now_ms};
use crate::flags::TextFlags;
use crate::kept::{self, calibration_file};
use crate::lanes::LaneFigures;
use crate::launch::{Started, start};
use crate::measure::{Measured, measure_audio, wait_steady};
use crate::plan_check::checked_against_plan;
use crate::plan_flags::{audio_vllm_flags, text_flags, text_sequences};
use crate::process::Group;
use crate::report::shown_flags;
use crate::versions::versions_seen;

/// Starts and measures every backend; returns the figures the lanes are derived from.
pub(crate) async fn bring_up(
    ctx: &Arc<Ctx>,
    started: &mut Vec<Started>,
) -> Result<Vec<LaneFigures>, UpError> {
    let calibration_path = calibration_file(&ctx.config, &ctx.opts.box_path);
    let previous = previous_figures(ctx, &calibration_path);
    let mut calibration = fresh_calibration(ctx, previous.as_ref());
    let mut audio = AudioLanes::default();
    for b in ctx.config.audio() {
        bring_up_audio_lane(
            ctx,
            b,
            previous.as_ref(),
            started,
            &mut audio,
            &mut calibration,
        )
        .await?;
    }
    let mut lanes = audio.lanes.clone();
    if let Some(t) = ctx.config.text() {
        lanes.push(bring_up_text_lane(ctx, t, started, &mut audio, &mut calibration).await?);
    }
    keep_figures(ctx, &mut calibration, &calibration_path);
    Ok(lanes)
}

/// What the audio backends brought up so far leave for the next steps.
#[derive(Default)]
pub(crate) struct AudioLanes {
    /// Their lanes' figures, in order.
    lanes: Vec<LaneFigures>,
    /// What each holds resident and at its peak.
    footprints: Vec<AudioFootprint>,
    /// The fastest warm-up job of each that ran one now: the job alone.
    alone: BTreeMap<String, Duration>,
    /// Contention figures kept with the audio figures they were measured with (they stand while
    /// those do).
    kept_contention: BTreeMap<String, ContentionFigures>,
}

impl AudioLanes {
    /// Raises the footprint of each backend that settled at a level (`levels`, after its jobs
    /// beside text) above its measured resident by more than the kept figures' tolerance: that
    /// level is what it keeps, and its peak moves up with it (a job still needs what it was
    /// measured to add). Piper's speech server was seen to keep 244 MiB after its jobs beside a
    /// generation, 198 MiB after the same jobs alone. Returns what was raised, in words.
    fn grown(&mut self, levels: &[(String, u64)]) -> Vec<String> {
        let mut said = Vec::new();
        for (name, level) in levels {
            let Some(f) = self.footprints.iter_mut().find(|f| &f.name == name) else {
                continue;
            };
            if *level <= f.resident_bytes + kept::tolerance(f.resident_bytes) {
                continue;
            }
            let growth = level - f.resident_bytes;
            said.push(format!(
                "is started again: [{name}] keeps {} after its jobs beside text, {} above the {} measured; its peak counts as {} (the kept figures stay as measured)",
                mib(*level),
                mib(growth),
                mib(f.resident_bytes),
                mib(f.peak_bytes + growth)
            ));
            f.resident_bytes = *level;
            f.peak_bytes += growth;
        }
        said
    }
}

/// The calibration file's figures, unless `--recalibrate` or it cannot be read (said).
fn previous_figures(ctx: &Ctx, calibration_path: &Path) -> Option<Calibration> {
    let previous = if ctx.opts.recalibrate {
        None
    } else {
        match Calibration::load_if_present(calibration_path) {
            Ok(c) => c,
            Err(e) => {
                ctx.say(&format!("up: ignoring the calibration file: {e}"));
                None
            }
        }
    };
    if let Some(p) = &previous {
        ctx.say(&format!(
            "up: starting from the figures measured {} in {} (--recalibrate measures again)",
            p.date,
            calibration_path.display()
        ));
    }
    previous
}

/// The figures this start keeps: none measured yet, the learned needs of `previous` that are
/// still valid.
fn fresh_calibration(ctx: &Ctx, previous: Option<&Calibration>) -> Calibration {
    let mut calibration = Calibration::new(ctx.meter.kind.as_str(), ctx.meter.capacity);
    if let Some(p) = previous {
        // Needs learned above the level before each job (older versions) are learned again.
        calibration.learned = p
            .learned
            .iter()
            .filter(|(_, l)| l.between_jobs)
            .map(|(k, l)| (k.clone(), l.clone()))
            .collect();
    }
    calibration
}

/// Plans (an audio vLLM), starts and measures one audio backend, then adds its lane, footprint
/// and figures to `audio` and `calibration`.
async fn bring_up_audio_lane(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    previous: Option<&Calibration>,
    started: &mut Vec<Started>,
    audio: &mut AudioLanes,
    calibration: &mut Calibration,
) -> Result<(), UpError> {
    let saved = previous.and_then(|p| {
        let kept = p.backends.get(&b.name)?;
        Some((kept, p.versions.get(&b.name).map(String::as_str)))
    });
    // An audio vLLM pre-allocates: its flags are planned from what the pool has left now.
    let planned = match &b.audio_vllm {
        Some(_) => Some(audio_vllm_flags(ctx, b, started, &audio.footprints)?),
        None => None,
    };
    let (args, env) = planned
        .as_ref()
        .map(|f| (f.args.clone(), f.env.clone()))
        .unwrap_or_default();
    let (group, m) = bring_up_audio(ctx, b, saved, &args, &env)
        .await
        .map_err(|e| e.0)?;
    if let Some(f) = &planned {
        let check = checked_against_plan(ctx, b, f, &group, m.resident, m.peak);
        ctx.status.update(&b.name, |r| {
            r.flags = shown_flags(f);
            r.plan_check = Some(check);
        });
    }
    started.push(Started {
        backend: b.clone(),
        group,
        args,
        env,
    });
    if let Some(fastest) = m.fastest_job {
        audio.alone.insert(b.name.clone(), fastest);
    }
    if let (Some(_), Some(c)) = (&m.kept, previous.and_then(|p| p.contention.get(&b.name))) {
        audio.kept_contention.insert(b.name.clone(), c.clone());
    }
    audio.lanes.push(LaneFigures {
        speech_seconds_per_char: m.speech_seconds_per_char,
        ..LaneFigures::new(
            &b.name,
            m.peak.saturating_sub(m.resident),
            // An audio vLLM runs as many jobs at once as it has whole sequences.
            planned.as_ref().map_or(1, |f| f.sequences),
        )
    });
    audio.footprints.push(AudioFootprint {
        name: b.name.clone(),
        resident_bytes: m.resident,
        peak_bytes: m.peak,
    });
    match &m.kept {
        // Kept as they are: only figures measured the same way (a warm-up) replace them.
        Some(kept) => {
            calibration.backends.insert(b.name.clone(), kept.clone());
        }
        None => calibration.set_backend(&b.name, m.audio_calibration(b.engine)),
    }
    calibration
        .versions
        .insert(b.name.clone(), versions_seen(b));
    Ok(())
}

/// Gives the text engine what the audio backends and co-tenants leave (its budget and flags),
/// starts it, checks that every audio lane can still admit a job beside it, measures whether it
/// slows the audio jobs; returns its lane. An audio backend that keeps more after its jobs beside
/// text than its measured figures say ([`AudioLanes::grown`]) leaves the text engine less: it
/// is started again with the budget that leaves.
async fn bring_up_text_lane(
    ctx: &Arc<Ctx>,
    t: &BackendConfig,
    started: &mut Vec<Started>,
    audio: &mut AudioLanes,
    calibration: &mut Calibration,
) -> Result<LaneFigures, UpError> {
    // Seen before the text engine starts: once it has run, its memory is the box's own.
    let cotenants = ctx
        .meter
        .cotenants(started.iter().map(|s| s.group.pid), ctx.started_ms)
        .max_bytes();
    let (mut text_flags, mut m) =
        start_text(ctx, t, started, audio, cotenants, calibration).await?;
    let (gives_way, ran) = text_beside_audio(
        ctx,
        t,
        &text_flags,
        &audio.alone,
        &audio.kept_contention,
        calibration,
    )
    .await;
    let levels = back_at_rest(ctx, started, &ran).await?;
    let grown = audio.grown(&levels);
    if !grown.is_empty() {
        for g in &grown {
            ctx.say(&format!("up: [{}] {g}", t.name));
        }
        for f in &audio.footprints {
            ctx.status.update(&f.name, |r| {
                r.resident_bytes = f.resident_bytes;
                r.peak_bytes = f.peak_bytes;
            });
        }
        stop_text(ctx, started).await;
        (text_flags, m) = start_text(ctx, t, started, audio, cotenants, calibration).await?;
    }
    calibration.set_backend(&t.name, m.text_calibration(t.engine));
    calibration
        .versions
        .insert(t.name.clone(), versions_seen(t));
    Ok(LaneFigures {
        gives_way_to: gives_way.lanes,
        preempt_settle: gives_way.settle,
        ..LaneFigures::new(&t.name, 0, text_flags.sequences)
    })
}

/// The text engine's budget and flags from what the audio backends and co-tenants (`cotenants`
/// bytes) hold (said), the engine started with them and measured, and the check that every
/// audio lane can still admit a job beside it.
async fn start_text(
    ctx: &Arc<Ctx>,
    t: &BackendConfig,
    started: &mut Vec<Started>,
    audio: &AudioLanes,
    cotenants: u64,
    calibration: &mut Calibration,
) -> Result<(TextFlags, Measured), UpError> {
    let budget = Budget::new(
        ctx.meter.capacity,
        &audio.footprints,
        cotenants,
        ctx.config.memory.margin,
    );
    ctx.say(&format!("up: [{}] budget: {}", t.name, budget.describe()));
    ctx.status.lock().text_budget_bytes = budget.text_bytes;
    let slots = text_sequences(ctx, t, &audio.lanes);
    let mut text_flags = text_flags(ctx, t, &budget, &audio.footprints, slots)?;
    ctx.say(&format!(
        "up: [{}] flags: {}",
        t.name,
        text_flags.describe()
    ));
    if let Some(hand) = &ctx.opts.text_sized_by_hand {
        text_flags = text_flags.sized_by_hand(hand);
        ctx.say(&format!(
            "up: [{}] sizing switched off (--text-sized-by-hand): started with {} instead",
            t.name,
            text_flags.describe_given()
        ));
    }
    let (group, m) = bring_up_text(ctx, t, &text_flags).await?;
    ctx.status
        .update(&t.name, |r| r.flags = shown_flags(&text_flags));
    started.push(Started {
        backend: t.clone(),
        group,
        args: text_flags.args.clone(),
        env: text_flags.env.clone(),
    });
    // The text engine fills its pages as its cache is used: count it at its plan.
    let text_held = m.resident.max(text_flags.expected.total_bytes);
    let room = JobRoom::new(ctx.meter.capacity, &audio.footprints, text_held, cotenants);
    match check_audio_room(ctx, &room, &audio.lanes, calibration) {
        Err(e) if ctx.opts.text_sized_by_hand.is_some() => {
            ctx.say(&format!("up: warning (sizing switched off): {e}"))
        }
        other => other?,
    }
    Ok((text_flags, m))
}

/// Stops the text engine, the backend started last, before it is started again.
async fn stop_text(ctx: &Ctx, started: &mut Vec<Started>) {
    if let Some(mut s) = started.pop() {
        s.group.stop(s.backend.stop_grace).await;
        ctx.status.update(&s.backend.name, |r| {
            r.state = BackendState::Starting;
            r.pid = None;
        });
    }
}

/// Waits until each audio backend in `ran` (it just ran a job beside text) is steady again and
/// returns the levels of those that are. A
/// backend still near its job's peak when the gateway opens leaves the pool short of the lanes'
/// needs, and the gateway refuses an audio job at once where it could never fit: seen as a
/// first transcription refused with 174 MiB free, where the box at rest had about 230 MiB.
async fn back_at_rest(
    ctx: &Ctx,
    started: &mut [Started],
    ran: &[String],
) -> Result<Vec<(String, u64)>, UpError> {
    let mut levels = Vec::new();
    for s in started.iter_mut().filter(|s| ran.contains(&s.backend.name)) {
        let (level, steady) = wait_steady(ctx, &s.backend, &mut s.group).await?;
        if steady {
            ctx.say(&format!(
                "up: [{}] at rest again after its jobs beside text: {}",
                s.backend.name,
                mib(level)
            ));
            levels.push((s.backend.name.clone(), level));
        }
    }
    Ok(levels)
}

/// Keeps this start's figures in the calibration file (said; a failure is a warning).
fn keep_figures(ctx: &Ctx, calibration: &mut Calibration, calibration_path: &Path) {
    calibration
        .versions
        .insert("headroom".into(), env!("CARGO_PKG_VERSION").into());
    match calibration.save(calibration_path) {
        Ok(()) => ctx.say(&format!(
            "up: figures kept in {}",
            calibration_path.display()
        )),
        Err(e) => ctx.say(&format!("up: warning: could not keep the figures: {e}")),
    }
}

/// Refuses a box in which an audio lane could never admit a job: its need (learned, where a
/// learned figure is kept, else measured) and the margin above what the pool can ever have free
/// for it ([`JobRoom`]). A learned need that does not fit where the measured one does is dropped
/// (learned again from real jobs) and said so.
pub(crate) fn check_audio_room(
    ctx: &Ctx,
    room: &JobRoom,
    lanes: &[LaneFigures],
    calibration: &mut Calibration,
) -> Result<(), UpError> {
    let margin = ctx.config.memory.margin;
    for f in lanes.iter().filter(|f| f.per_job_bytes > 0) {
        if let Some(l) = calibration.learned.get(&f.backend)
            && !room.admits(l.bytes_per_job, margin)
        {
            ctx.say(&format!(
                "up: [{}] the learned need {} and the margin {} cannot fit the room an audio job can ever find ({}); it is learned again from the measured {}",
                f.backend,
                mib(l.bytes_per_job),
                mib(margin),
                room.describe(),
                mib(f.per_job_bytes)
            ));
            calibration.learned.remove(&f.backend);
        }
        if !room.admits(f.per_job_bytes, margin) {
            return Err(never_admits(f, room, margin));
        }
        ctx.say(&format!(
            "up: [{}] a job needs {} + margin {}; the most an audio job can find free: {}",
            f.backend,
            mib(f.per_job_bytes),
            mib(margin),
            room.describe()
        ));
    }
    Ok(())
}

/// Why a box whose audio lane `f` could never admit a job does not fit: its need and the
/// `margin` above the most the pool can ever have free for it, and what would make room.
pub(crate) fn never_admits(f: &LaneFigures, room: &JobRoom, margin: u64) -> UpError {
    UpError::DoesNotFit(format!(
        "backend `{}`: its lane could never admit a job: a job needs {} and the margin {}, and at most {} can ever be free for it ({}); options: raise [memory] capacity by {}, lower [memory] margin, a smaller text `max_parallel` or `context`",
        f.backend,
        mib(f.per_job_bytes),
        mib(margin),
        mib(room.room_bytes),
        room.describe(),
        mib((f.per_job_bytes + margin).saturating_sub(room.room_bytes))
    ))
}

/// An audio backend's start-up failure, with its group (already stopped) out of the way.
pub(crate) struct StartFailure(UpError);

/// Starts an audio backend with its planned `args` and `env` and measures it ([`measure_audio`]);
/// a backend that fails while measured is stopped.
pub(crate) async fn bring_up_audio(
    ctx: &Arc<Ctx>,
    b: &BackendConfig,
    saved: Option<(&BackendCalibration, Option<&str>)>,
    args: &[String],
    env: &[(String, String)],
) -> Result<(Group, Measured), StartFailure> {
    let mut group = start(ctx, b, args, env).await.map_err(StartFailure)?;
    let result = measure_audio(ctx, b, &mut group, saved).await;
    match result {
        Ok(m) => Ok((group, m)),
        Err(e) => {
            group.stop(b.stop_grace).await;
            Err(StartFailure(e))
        }
    }
}

/// Starts the text engine with its flags `f`, waits for its steady level, measures its peak and
/// checks it against the plan ([`checked_against_plan`]).
pub(crate) async fn bring_up_text(
    ctx: &Arc<Ctx>,
    t: &BackendConfig,
    f: &TextFlags,
) -> Result<(Group, Measured), UpError> {
    let t0 = now_ms();
    let mut group = start(ctx, t, &f.args, &f.env).await?;
    ctx.status
        .update(&t.name, |r| r.state = BackendState::Measuring);
    let steady = wait_steady(ctx, t, &mut group).await;
    let (resident, _) = match steady {
        Ok(s) => s,
        Err(e) => {
            group.stop(t.stop_grace).await;
            return Err(e);
        }
    };
    let peak = ctx.meter.peak_since(group.pid, t0, resident);
    let check = checked_against_plan(ctx, t, f, &group, resident, peak);
    ctx.status.update(&t.name, |r| {
        r.resident_bytes = resident;
        r.peak_bytes = peak;
        r.current_bytes = resident;
        r.plan_check = Some(check);
        r.state = BackendState::Ready;
    });
    Ok((group, Measured::at_rest(resident, peak)))
}

#[cfg(test)]
mod tests {
    use super::{AudioLanes, never_admits};
    use crate::budget::{AudioFootprint, JobRoom};
    use crate::lanes::LaneFigures;

    const MIB: u64 = 1024 * 1024;

    fn footprint(name: &str, resident: u64, peak: u64) -> AudioFootprint {
        AudioFootprint {
            name: name.into(),
            resident_bytes: resident * MIB,
            peak_bytes: peak * MIB,
        }
    }

    #[test]
    fn a_backend_that_keeps_more_after_its_jobs_beside_text_counts_at_that_level() {
        let mut audio = AudioLanes {
            footprints: vec![footprint("stt", 227, 278), footprint("tts", 198, 198)],
            ..AudioLanes::default()
        };
        // Whisper a little below its figure, piper 46 MiB above (the tolerance is 19.8 MiB).
        let said = audio.grown(&[("stt".into(), 224 * MIB), ("tts".into(), 244 * MIB)]);
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(said[0].contains("[tts] keeps 244"), "{said:?}");
        assert_eq!(audio.footprints[0], footprint("stt", 227, 278));
        assert_eq!(audio.footprints[1], footprint("tts", 244, 244));
        // Within the tolerance: the measured figures stand.
        let mut audio = AudioLanes {
            footprints: vec![footprint("stt", 227, 278)],
            ..AudioLanes::default()
        };
        assert!(audio.grown(&[("stt".into(), 245 * MIB)]).is_empty());
        assert_eq!(audio.footprints[0], footprint("stt", 227, 278));
        // Growth moves the peak by as much: a job still adds what it was measured to add.
        assert_eq!(audio.grown(&[("stt".into(), 260 * MIB)]).len(), 1);
        assert_eq!(audio.footprints[0], footprint("stt", 260, 311));
    }

    #[test]
    fn a_lane_that_could_never_admit_a_job_says_by_how_much_the_box_is_short() {
        let audio = [AudioFootprint {
            name: "stt".into(),
            resident_bytes: 1024 * MIB,
            peak_bytes: 1600 * MIB,
        }];
        // 4096 − 1024 − 2048 − 512 = 512 MiB at most free for a job.
        let room = JobRoom::new(4096 * MIB, &audio, 2048 * MIB, 512 * MIB);
        let e = never_admits(&LaneFigures::new("stt", 600 * MIB, 1), &room, 64 * MIB);
        assert_eq!(e.exit_code(), 3);
        assert_eq!(
            e.to_string(),
            "backend `stt`: its lane could never admit a job: a job needs 600.0 MiB and the margin 64.0 MiB, \
             and at most 512.0 MiB can ever be free for it (capacity 4096.0 MiB − audio between jobs \
             1024.0 MiB − text engine 2048.0 MiB − co-tenants 512.0 MiB = 512.0 MiB); options: raise \
             [memory] capacity by 152.0 MiB, lower [memory] margin, a smaller text `max_parallel` or \
             `context`"
        );
    }
}
