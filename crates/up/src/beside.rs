//! Whether text slows an audio lane's jobs: measured beside the started text engine (or kept),
//! said, and turned into the lanes text gives way to.

use std::collections::BTreeMap;
use std::time::Duration;

use headroom_gpu::calibration::{Calibration, ContentionFigures};

use crate::boxfile::{BackendConfig, Engine, Warmup};
use crate::contention::{self, Contention, TextLoad, TextSide};
use crate::ctx::Ctx;
use crate::flags::TextFlags;
use crate::report::shown_flags;
use crate::warmup::{self, Job};

/// Measures whether the text lane's load (as many streams of requests as it runs at once)
/// slows each audio backend's job ([`contention`]): every job is timed alone first, then the
/// text load is started once and each job timed beside it; returns the audio lanes text gives
/// way to with the settle for their jobs, and the audio backends that ran a job here (they may
/// still hold it: see [`crate::bringup`]'s wait for them). A measurement that fails is said and
/// derives nothing (the box file's settings stand).
pub(crate) async fn text_beside_audio(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    alone: &BTreeMap<String, Duration>,
    kept: &BTreeMap<String, ContentionFigures>,
    calibration: &mut Calibration,
) -> (GivesWay, Vec<String>) {
    let mut gives_way = GivesWay::default();
    let mut ran = Vec::new();
    let flags = shown_flags(f);
    let mut lanes = Vec::new();
    for b in ctx.config.audio() {
        let Some(w) = &b.warmup else { continue };
        // Kept with the audio figures and measured beside the same text engine flags and as many
        // generations as its lane runs now.
        if let Some(k) = kept.get(&b.name).filter(|k| kept_applies(k, &flags, f)) {
            let c = Contention::from_kept(&b.name, k);
            ctx.say(&format!(
                "up: [{}] beside [{}] (measured {}, the calibration file):",
                t.name, b.name, k.date
            ));
            say_contention(ctx, t, &c);
            gives_way.count(&b.name, &c);
            calibration.contention.insert(b.name.clone(), k.clone());
            continue;
        }
        ran.push(b.name.clone());
        match LaneJobs::alone(ctx, b, w, alone.get(&b.name).copied()).await {
            Ok(jobs) => lanes.push(jobs),
            Err(e) => cannot_measure(ctx, t, &b.name, &e),
        }
    }
    if !lanes.is_empty() {
        time_beside_text(ctx, t, f, &flags, &lanes, &mut gives_way, calibration).await;
    }
    (gives_way, ran)
}

/// Starts the text load once and times each lane's jobs beside it ([`lane_contention`]),
/// counting the lanes text gives way to and keeping their figures.
async fn time_beside_text(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    flags: &[String],
    lanes: &[LaneJobs],
    gives_way: &mut GivesWay,
    calibration: &mut Calibration,
) {
    let (prompt_tokens, max_tokens) = text_load(f.context_per_sequence);
    let text = t.upstream();
    let side = TextSide {
        base: &text,
        generations: f.sequences,
        prompt_tokens,
        max_tokens,
    };
    ctx.say(&format!(
        "up: [{}] timing the audio jobs beside {} stream(s) of text requests ({prompt_tokens}-token prompts, {max_tokens}-token answers)",
        t.name,
        f.sequences.max(1)
    ));
    let load = match TextLoad::start(&ctx.client, side).await {
        Ok(load) => load,
        Err(e) => {
            for jobs in lanes {
                cannot_measure(ctx, t, &jobs.backend, &e);
            }
            return;
        }
    };
    for jobs in lanes {
        match lane_contention(ctx, t, jobs, &load).await {
            Ok(c) => {
                say_contention(ctx, t, &c);
                gives_way.count(&jobs.backend, &c);
                calibration
                    .contention
                    .insert(jobs.backend.clone(), c.kept(flags));
            }
            Err(e) => cannot_measure(ctx, t, &jobs.backend, &e),
        }
    }
    load.stop();
}

/// Says that whether text slows `backend`'s jobs could not be measured, and what stands instead.
fn cannot_measure(ctx: &Ctx, t: &BackendConfig, backend: &str, e: &str) {
    ctx.say(&format!(
        "up: [{}] warning: could not measure whether text slows [{backend}]'s jobs ({e}); the box file's lane settings stand",
        t.name
    ));
}

/// Whether a kept contention figure stands for the text engine started now: measured beside the
/// same flags and as many generations as its lane runs (a figure from beside one generation
/// says little of a lane that runs two), and taken from its rounds the way `up` takes it now.
fn kept_applies(k: &ContentionFigures, flags: &[String], f: &TextFlags) -> bool {
    k.text_flags == flags
        && k.generations == f.sequences.max(1)
        && k.with_text_of_rounds == contention::WITH_TEXT_OF_ROUNDS
}

/// The audio lanes text gives way to, and the settle for their jobs: the longest any needs.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct GivesWay {
    pub(crate) lanes: Vec<String>,
    pub(crate) settle: Option<Duration>,
}

impl GivesWay {
    /// Counts the lane `backend` in when text slows its jobs past the limit (`c`).
    pub(crate) fn count(&mut self, backend: &str, c: &Contention) {
        if c.text_gives_way() {
            self.settle = self.settle.max(Some(c.settle()));
            self.lanes.push(backend.to_string());
        }
    }
}

/// The longest prompt timed beside the audio jobs, in tokens: on the CPU box (SmolLM2 on two
/// threads) it takes 8.8 s to read; 8,000 take 55 s, minutes of bring-up for every lane.
const LONGEST_PROMPT: u64 = 2048;
/// The longest answer written beside the audio jobs, in tokens.
const SHORT_ANSWER: u64 = 8;

/// Each request run beside an audio job, in tokens: a prompt as long as one sequence leaves
/// beside its answer, at most [`LONGEST_PROMPT`], and an answer of at most [`SHORT_ANSWER`]
/// (a quarter of the sequence where that is less), so the engine spends nearly all its time
/// reading prompts, its heaviest work (on the CPU box a 2,048-token prompt takes 9 s to read,
/// eight tokens a third of a second to write), and a request fits its sequence. Long prompts
/// slow an audio job more than short ones: on the CPU box the night's 2.5-minute recording on
/// the one-core Whisper ran 4.6-4.8 s alone, 4.8-5.1 s beside two streams of 512-token prompts
/// answered in 64 tokens (what `up` timed until 2026-12-08: x1.09, so text ran on beside
/// recordings) and 5.9-6.1 s beside two of 1,800-token prompts (x1.25-1.3); on an hour's night
/// the recordings' p99 was 1.53 x their idle figure.
pub(crate) fn text_load(context_per_sequence: u64) -> (u64, u64) {
    let answer = (context_per_sequence / 4).clamp(1, SHORT_ANSWER);
    let prompt = context_per_sequence
        .saturating_sub(answer)
        .clamp(1, LONGEST_PROMPT);
    (prompt, answer)
}

/// An audio lane's jobs, each with its time alone: its warm-up and, where the warm-up is longer
/// than one job, its shortest ([`warmup::prepare_shortest`]).
pub(crate) struct LaneJobs {
    backend: String,
    job: Job,
    job_alone: Duration,
    shortest: Option<(Job, Duration)>,
}

impl LaneJobs {
    /// Prepares `b`'s jobs and times each alone (`known`: the warm-up's fastest run, when
    /// measured already), before any text runs.
    async fn alone(
        ctx: &Ctx,
        b: &BackendConfig,
        w: &Warmup,
        known: Option<Duration>,
    ) -> Result<LaneJobs, String> {
        let job = warmup::prepare(b, w).map_err(|e| e.to_string())?;
        let job_alone = match known {
            Some(d) => d,
            None => contention::alone(&ctx.client, &job).await?,
        };
        let shortest = match warmup::prepare_shortest(b, w).map_err(|e| e.to_string())? {
            Some(short) => {
                let took = contention::alone(&ctx.client, &short).await?;
                Some((short, took))
            }
            None => None,
        };
        Ok(LaneJobs {
            backend: b.name.clone(),
            job,
            job_alone,
            shortest,
        })
    }
}

/// Times the lane's shortest job beside the text load and, when that does not already make
/// text give way, its warm-up job too; the lane's figure is the one text slows most
/// ([`contention::worse`]). The short job first: it takes a second where the warm-up may take a
/// minute.
async fn lane_contention(
    ctx: &Ctx,
    t: &BackendConfig,
    jobs: &LaneJobs,
    load: &TextLoad,
) -> Result<Contention, String> {
    let client = &ctx.client;
    let Some((short, short_alone)) = &jobs.shortest else {
        return load
            .measure(client, &jobs.backend, &jobs.job, jobs.job_alone)
            .await;
    };
    let short = load
        .measure(client, &jobs.backend, short, *short_alone)
        .await?;
    if short.text_gives_way() {
        return Ok(short);
    }
    ctx.say(&format!(
        "up: [{}] beside [{}], its shortest job: {}; and its warm-up job:",
        t.name,
        jobs.backend,
        short.describe()
    ));
    let whole = load
        .measure(client, &jobs.backend, &jobs.job, jobs.job_alone)
        .await?;
    Ok(contention::worse(whole, short))
}

/// Says how much text slows `c`'s jobs and what text does about it ([`verdict`]).
pub(crate) fn say_contention(ctx: &Ctx, t: &BackendConfig, c: &Contention) {
    ctx.say(&format!(
        "up: [{}] beside [{}]: {}; {}",
        t.name,
        c.backend,
        c.describe(),
        verdict(c, t.engine)
    ));
}

/// What text does beside an audio lane, in words: runs on, stops its generations, or (llama.cpp)
/// is paused.
pub(crate) fn verdict(c: &Contention, text_engine: Engine) -> String {
    if c.text_gives_way() && text_engine == Engine::LlamaCpp {
        "text yields to it and llama.cpp is paused while its jobs run (its process group stopped, then continued)".to_string()
    } else if c.text_gives_way() {
        format!(
            "text yields to it and stops every running generation for its jobs (preempt, all; settle {} ms)",
            c.settle().as_millis()
        )
    } else {
        format!(
            "within {:.1} x: text runs on beside it",
            contention::SLOWDOWN_LIMIT
        )
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use headroom_gpu::calibration::ContentionFigures;

    use super::{GivesWay, kept_applies, text_load, verdict};
    use crate::boxfile::Engine;
    use crate::contention::Contention;
    use crate::flags::TextFlags;

    fn contention(alone: f64, with_text: f64, step: Option<f64>) -> Contention {
        Contention::from_kept(
            "tts",
            &ContentionFigures {
                alone_seconds: alone,
                with_text_seconds: with_text,
                text_step_seconds: step,
                text_flags: Vec::new(),
                generations: 1,
                with_text_of_rounds: "median".into(),
                date: String::new(),
            },
        )
    }

    #[test]
    fn text_gives_way_to_the_lanes_it_slows_with_the_longest_settle() {
        let mut g = GivesWay::default();
        // 1.1 x: within the limit.
        g.count("stt", &contention(1.0, 1.1, Some(0.9)));
        assert_eq!(g, GivesWay::default());
        // 3 x, decode steps of 0.4 s: settle two steps.
        g.count("tts", &contention(1.0, 3.0, Some(0.4)));
        // 2 x, steps of 1.5 s: 3 s, the longer.
        g.count("asr", &contention(2.0, 4.0, Some(1.5)));
        // 4 x, steps of 0.1 s: 0.2 s, raised to the 250 ms floor, shorter than 3 s.
        g.count("vad", &contention(0.5, 2.0, Some(0.1)));
        assert_eq!(g.lanes, ["tts", "asr", "vad"]);
        assert_eq!(g.settle, Some(Duration::from_secs(3)));
    }

    #[test]
    fn a_kept_figure_stands_only_beside_the_same_flags_and_generations_taken_the_same_way() {
        // A calibration file written before generations were counted was measured beside one.
        let old: ContentionFigures = serde_json::from_str(
            r#"{"alone_seconds":0.45,"with_text_seconds":0.53,"text_flags":["-c","16384"]}"#,
        )
        .unwrap();
        assert_eq!(old.generations, 1);
        let flags = |sequences: u64| TextFlags {
            args: Vec::new(),
            env: Vec::new(),
            sequences,
            context_per_sequence: 8192,
            expected: crate::flags::Expected {
                weights_bytes: 0,
                kv_cache_bytes: 0,
                kv_tokens: 0,
                total_bytes: 0,
            },
        };
        let shown = vec!["-c".to_string(), "16384".to_string()];
        // Its figure was the fastest of its rounds: measured again.
        assert_eq!(old.with_text_of_rounds, "fastest");
        assert!(!kept_applies(&old, &shown, &flags(1)));
        // The median beside decode-only generations (before prompts were read beside the job and
        // the slowest round kept): measured again too.
        let decode_only = ContentionFigures {
            with_text_of_rounds: "median".into(),
            ..old.clone()
        };
        assert!(!kept_applies(&decode_only, &shown, &flags(1)));
        // The slowest of three beside prompts of at most 512 tokens, streams started afresh for
        // each round (the recording came out at x1.09 that way): measured again.
        let short_prompts = ContentionFigures {
            with_text_of_rounds: "slowest of three beside prompts read".into(),
            ..old.clone()
        };
        assert!(!kept_applies(&short_prompts, &shown, &flags(1)));
        let old = ContentionFigures {
            with_text_of_rounds: "slowest of three beside streams of long prompts, short answers"
                .into(),
            ..old
        };
        assert!(kept_applies(&old, &shown, &flags(1)));
        // The lane runs two now: measured again.
        assert!(!kept_applies(&old, &shown, &flags(2)));
        assert!(!kept_applies(&old, &["-c".to_string()], &flags(1)));
        let two = ContentionFigures {
            generations: 2,
            ..old
        };
        assert!(kept_applies(&two, &shown, &flags(2)));
    }

    #[test]
    fn each_request_beside_a_job_reads_a_long_prompt_and_fits_one_sequence() {
        // The night box's text lane: sequences of 8,192 tokens. Its recordings were timed beside
        // 512-token prompts (x1.09) and slowed 1.25-1.3 x beside 1,800-token ones.
        // Answers of 64 tokens, streams left running: llama.cpp's decode steps beside the job
        // took 0.37-0.5 s, an answer half a minute, and the recording met decoding (x1.01).
        assert_eq!(text_load(8192), (2048, 8));
        assert_eq!(text_load(2048), (2040, 8));
        assert_eq!(text_load(512), (504, 8));
        assert_eq!(text_load(16), (12, 4));
        assert_eq!(text_load(2), (1, 1));
    }

    #[test]
    fn the_verdict_names_what_text_does() {
        assert_eq!(
            verdict(&contention(1.0, 1.1, None), Engine::Vllm),
            "within 1.2 x: text runs on beside it"
        );
        assert_eq!(
            verdict(&contention(1.0, 2.0, Some(0.3)), Engine::Vllm),
            "text yields to it and stops every running generation for its jobs (preempt, all; settle 600 ms)"
        );
        assert_eq!(
            verdict(&contention(1.0, 2.0, Some(0.3)), Engine::LlamaCpp),
            "text yields to it and llama.cpp is paused while its jobs run (its process group stopped, then continued)"
        );
    }
}
