//! Whether text slows an audio lane's jobs: measured beside the started text engine (or kept),
//! said, and turned into the lanes text gives way to.

use std::collections::BTreeMap;
use std::time::Duration;

use headroom_gpu::calibration::{Calibration, ContentionFigures};

use crate::boxfile::{BackendConfig, Engine, Warmup};
use crate::contention::{self, Contention};
use crate::ctx::Ctx;
use crate::flags::TextFlags;
use crate::report::shown_flags;
use crate::warmup;

/// Measures whether one generation of the text engine slows each audio backend's job
/// ([`contention`]); returns the audio lanes text gives way to and the settle for their jobs.
/// A measurement that fails is said and derives nothing (the box file's settings stand).
pub(crate) async fn text_beside_audio(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    alone: &BTreeMap<String, Duration>,
    kept: &BTreeMap<String, ContentionFigures>,
    calibration: &mut Calibration,
) -> (Vec<String>, Option<Duration>) {
    let mut gives_way_to = Vec::new();
    let mut settle: Option<Duration> = None;
    // Long enough to outlast an audio job, short enough for the context of one sequence.
    let max_tokens = f.context_per_sequence.saturating_sub(128).clamp(16, 1024);
    let flags = shown_flags(f);
    for b in ctx.config.audio() {
        let Some(w) = &b.warmup else { continue };
        // Kept with the audio figures and measured beside the same text engine flags.
        if let Some(k) = kept.get(&b.name).filter(|k| k.text_flags == flags) {
            let c = Contention::from_kept(&b.name, k);
            ctx.say(&format!(
                "up: [{}] beside [{}] (measured {}, the calibration file):",
                t.name, b.name, k.date
            ));
            say_contention(ctx, t, &c);
            if c.text_gives_way() {
                settle = settle.max(Some(c.settle()));
                gives_way_to.push(b.name.clone());
            }
            calibration.contention.insert(b.name.clone(), k.clone());
            continue;
        }
        let known = alone.get(&b.name).copied();
        let measured = lane_contention(ctx, t, b, w, known, max_tokens).await;
        match measured {
            Ok(c) => {
                say_contention(ctx, t, &c);
                if c.text_gives_way() {
                    settle = settle.max(Some(c.settle()));
                    gives_way_to.push(b.name.clone());
                }
                calibration.contention.insert(b.name.clone(), c.kept(&flags));
            }
            Err(e) => ctx.say(&format!(
                "up: [{}] warning: could not measure whether text slows [{}]'s jobs ({e}); the box file's lane settings stand",
                t.name, b.name
            )),
        }
    }
    (gives_way_to, settle)
}

/// Times `b`'s warm-up job beside the text engine and, when that job does not already make text
/// give way and the lane has a shorter one ([`warmup::prepare_shortest`]), its shortest job too;
/// the lane's figure is the one text slows most ([`contention::worse`]).
pub(crate) async fn lane_contention(
    ctx: &Ctx,
    t: &BackendConfig,
    b: &BackendConfig,
    w: &Warmup,
    known: Option<Duration>,
    max_tokens: u64,
) -> Result<Contention, String> {
    let job = warmup::prepare(b, w).map_err(|e| e.to_string())?;
    let shortest = warmup::prepare_shortest(b, w).map_err(|e| e.to_string())?;
    let text = t.upstream();
    let whole = contention::measure(&ctx.client, &b.name, &job, known, &text, max_tokens).await?;
    let Some(short) = shortest.filter(|_| !whole.text_gives_way()) else {
        return Ok(whole);
    };
    ctx.say(&format!(
        "up: [{}] beside [{}], its warm-up job: {}; and its shortest job:",
        t.name,
        b.name,
        whole.describe()
    ));
    let short = contention::measure(&ctx.client, &b.name, &short, None, &text, max_tokens).await?;
    Ok(contention::worse(whole, short))
}

pub(crate) fn say_contention(ctx: &Ctx, t: &BackendConfig, c: &Contention) {
    let verdict = if c.text_gives_way() && t.engine == Engine::LlamaCpp {
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
    };
    ctx.say(&format!(
        "up: [{}] beside [{}]: {}; {verdict}",
        t.name,
        c.backend,
        c.describe()
    ));
}
