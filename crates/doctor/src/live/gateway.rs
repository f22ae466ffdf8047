//! Findings for a headroom gateway's `/metrics`: the overload policy judged against the load it
//! met — text refused while audio is idle, queue waits near `queue_timeout`, the fallback's
//! share, text preempted per audio job, audio waiting behind a text lane that does not yield,
//! and clients that come back before their Retry-After. Lane settings come from the gauges the
//! gateway publishes at start (`headroom_lane_max_inflight`, `…_queue_timeout_seconds`, …).

use super::{LiveCause, LiveDiagnosis, LiveFinding, Window, pct, secs};

const REQUESTS: &str = "headroom_requests_total";
const QUEUE_WAIT: &str = "headroom_queue_wait_seconds";
const DURATION: &str = "headroom_request_duration_seconds";
const INFLIGHT: &str = "headroom_lane_inflight";
const QUEUED: &str = "headroom_lane_queue_depth";
const FALLBACKS: &str = "headroom_fallbacks_total";
const EARLY_RETRIES: &str = "headroom_early_retries_total";
const MAX_INFLIGHT: &str = "headroom_lane_max_inflight";
const MAX_QUEUE: &str = "headroom_lane_max_queue";
const QUEUE_TIMEOUT: &str = "headroom_lane_queue_timeout_seconds";
const POLICY: &str = "headroom_lane_policy";
const YIELDS_TO: &str = "headroom_lane_yields_to";
const PREEMPT: &str = "headroom_lane_preempt";

/// Outcomes that reached the client as 429/503 from the gateway itself.
const REFUSED: [&str; 2] = ["rejected", "queue_timeout"];
/// Words that mark a lane as an audio lane.
const AUDIO_WORDS: [&str; 8] = [
    "audio", "stt", "tts", "speech", "asr", "whisper", "transcri", "voice",
];

/// One lane's settings and what it did over the interval.
struct Lane {
    name: String,
    audio: bool,
    total: f64,
    ok: f64,
    refused: f64,
    queue_timeouts: f64,
    fallbacks: f64,
    preempted: f64,
    inflight: f64,
    queued: f64,
    max_inflight: Option<f64>,
    max_queue: Option<f64>,
    queue_timeout: Option<f64>,
    policy: Option<String>,
    yields_to: Vec<String>,
    preempt: bool,
    wait: Option<super::Histogram>,
    duration: Option<super::Histogram>,
}

fn lane_names(w: &Window) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for metric in [MAX_INFLIGHT, REQUESTS, INFLIGHT] {
        for n in w.after.label_values(metric, "lane") {
            if !names.contains(&n) {
                names.push(n);
            }
        }
    }
    names
}

fn read_lane(w: &Window, name: &str, yielded_to: &[String]) -> Lane {
    let l = [("lane", name)];
    let outcome = |o: &str| w.delta(REQUESTS, &[("lane", name), ("outcome", o)]);
    let lower = name.to_ascii_lowercase();
    let policy = w
        .after
        .label_values(POLICY, "policy")
        .into_iter()
        .find(|p| {
            w.after
                .max(POLICY, &[("lane", name), ("policy", p)])
                .is_some()
        });
    let yields_to = w
        .after
        .label_values(YIELDS_TO, "to")
        .into_iter()
        .filter(|to| {
            w.after
                .max(YIELDS_TO, &[("lane", name), ("to", to)])
                .is_some()
        })
        .collect();
    Lane {
        name: name.to_owned(),
        audio: AUDIO_WORDS.iter().any(|a| lower.contains(a))
            || yielded_to.iter().any(|y| y == name),
        total: w.delta(REQUESTS, &l),
        ok: outcome("ok"),
        refused: REFUSED.iter().map(|o| outcome(o)).sum(),
        queue_timeouts: outcome("queue_timeout"),
        fallbacks: w.delta(FALLBACKS, &l).max(outcome("fallback")),
        preempted: outcome("preempted"),
        inflight: w.gauge_max(INFLIGHT, &l).unwrap_or(0.0),
        queued: w.gauge_max(QUEUED, &l).unwrap_or(0.0),
        max_inflight: w.after.max(MAX_INFLIGHT, &l),
        max_queue: w.after.max(MAX_QUEUE, &l),
        queue_timeout: w.after.max(QUEUE_TIMEOUT, &l),
        policy,
        yields_to,
        preempt: w.after.max(PREEMPT, &l).is_some_and(|v| v > 0.0),
        wait: w.histogram(QUEUE_WAIT, &l),
        duration: w.histogram(DURATION, &l),
    }
}

pub fn diagnose(w: &Window, d: &mut LiveDiagnosis) {
    let yielded_to: Vec<String> = w.after.label_values(YIELDS_TO, "to");
    let lanes: Vec<Lane> = lane_names(w)
        .iter()
        .map(|n| read_lane(w, n, &yielded_to))
        .collect();
    if lanes.iter().all(|l| l.max_inflight.is_none()) {
        d.not_judged.push(
            "the gateway publishes no lane settings (headroom_lane_max_inflight …): an older headroom; findings that need max_inflight or queue_timeout are skipped"
                .to_owned(),
        );
    }
    for l in &lanes {
        let p = |k: &str| format!("{}.{k}", l.name);
        d.figures
            .insert(p("requests_per_second"), l.total / w.seconds);
        d.figures.insert(p("refused"), l.refused);
        d.figures.insert(p("requests"), l.total);
        if l.total > 0.0 {
            d.figures.insert(p("refused_share"), l.refused / l.total);
        }
        if let Some(q) = l.wait.as_ref().and_then(|h| h.quantile(0.9)) {
            d.figures.insert(p("queue_wait_p90_seconds"), q);
        }
    }
    let audio: Vec<&Lane> = lanes.iter().filter(|l| l.audio).collect();
    let audio_idle = !audio.is_empty()
        && audio
            .iter()
            .all(|a| a.total == 0.0 && a.inflight == 0.0 && a.queued == 0.0);
    let audio_jobs: f64 = audio.iter().map(|a| a.ok).sum();
    for l in lanes.iter().filter(|l| !l.audio) {
        rejecting_while_audio_idle(w, d, l, audio_idle, audio.is_empty());
        fallback_share(w, d, l);
        preemptions(w, d, l, audio_jobs);
    }
    for l in &lanes {
        queue_near_timeout(w, d, l);
        early_retries(w, d, l);
    }
    for a in &audio {
        audio_waits_behind_text(w, d, a, &lanes);
    }
}

/// Concurrency the offered load needs (Little's law: arrivals per second × mean duration).
fn needed_inflight(w: &Window, l: &Lane) -> Option<(f64, f64, f64)> {
    let rate = l.total / w.seconds;
    let mean = l.duration.as_ref().and_then(|h| h.mean())?;
    Some(((rate * mean).ceil().max(1.0), rate, mean))
}

fn rejecting_while_audio_idle(
    w: &Window,
    d: &mut LiveDiagnosis,
    l: &Lane,
    audio_idle: bool,
    no_audio_lane: bool,
) {
    if l.total < w.t.min_requests || l.refused == 0.0 {
        return;
    }
    let share = l.refused / l.total;
    if share < w.t.reject_share || !(audio_idle || no_audio_lane) {
        return;
    }
    let m = l.max_inflight;
    let need = needed_inflight(w, l);
    let p90 = l.duration.as_ref().and_then(|h| h.quantile(0.9));
    let mut fix = format!(
        "lane `{}`{} refused {:.0} of {:.0} requests ({}) with 429/503 in {} while {}: the overload policy is rejecting during normal operation, not protecting audio",
        l.name,
        l.policy
            .as_deref()
            .map(|p| format!(" (policy = \"{p}\")"))
            .unwrap_or_default(),
        l.refused,
        l.total,
        pct(share),
        secs(w.seconds),
        if no_audio_lane {
            "no audio lane exists"
        } else {
            "audio was idle"
        },
    );
    match (need, m) {
        (Some((n, rate, mean)), Some(m)) if n > m => {
            let extra = (n - m).max(1.0);
            let timeout = (p90.unwrap_or(mean) * (extra / m).ceil().max(1.0)).ceil().max(1.0);
            fix.push_str(&format!(
                ": it was offered {rate:.2} req/s of {} mean duration, which needs {n:.0} in flight (rate × duration) against `max_inflight = {m:.0}`; \
                 raise `max_inflight` to {n:.0} if the engine has room, or move to `policy = \"queue\"` with `max_queue = {extra:.0}` and \
                 `queue_timeout = \"{timeout:.0}s\"` (⌈queue / slots⌉ × p90 duration {}) so bursts wait instead of failing",
                secs(mean),
                secs(p90.unwrap_or(mean)),
            ));
        }
        (_, Some(m)) => fix.push_str(&format!(
            ": `max_inflight = {m:.0}` refuses bursts even though the average load fits; move to `policy = \"queue\"` with `max_queue = {m:.0}` \
             so a burst waits for a slot instead of failing"
        )),
        _ => fix.push_str(
            ": raise the lane's `max_inflight`, or move to `policy = \"queue\"` with a bounded `max_queue`",
        ),
    }
    d.findings.push(
        LiveFinding::new(LiveCause::RejectingWhileAudioIdle, Some(&l.name))
            .num("refused_share", Some(share))
            .num("refused", Some(l.refused))
            .num("requests", Some(l.total))
            .num("offered_per_second", Some(l.total / w.seconds))
            .num("mean_duration_seconds", need.map(|n| n.2))
            .num("p90_duration_seconds", p90)
            .num("max_inflight", m)
            .num("max_inflight_needed", need.map(|n| n.0))
            .fix(fix),
    );
}

fn queue_near_timeout(w: &Window, d: &mut LiveDiagnosis, l: &Lane) {
    let Some(timeout) = l.queue_timeout.filter(|t| *t > 0.0) else {
        return;
    };
    let wait = l.wait.as_ref();
    let p90 = wait.and_then(|h| h.quantile(0.9));
    let near = p90.is_some_and(|q| q >= w.t.queue_near_timeout * timeout);
    if !(near || l.queue_timeouts > 0.0) {
        return;
    }
    let served_per_s = l
        .max_inflight
        .zip(l.duration.as_ref().and_then(|h| h.mean()));
    let mut fix = format!(
        "lane `{}` queue waits reach {} (p90) against `queue_timeout = {}`, and {:.0} requests gave up in the queue (503 after waiting): \
         timeouts masquerading as queueing",
        l.name,
        p90.map(secs).unwrap_or_else(|| "?".into()),
        secs(timeout),
        l.queue_timeouts
    );
    match served_per_s {
        Some((m, mean)) if mean > 0.0 => {
            let rate = m / mean;
            let drains = (rate * timeout * w.t.queue_near_timeout).floor().max(0.0);
            fix.push_str(&format!(
                "; at `max_inflight = {m:.0}` and {} per request the lane serves {rate:.2} req/s, so a queue drains only {drains:.0} requests within the timeout: \
                 `max_queue = {drains:.0}` turns the excess into an immediate 429 with Retry-After, or raise `max_inflight` to serve it",
                secs(mean)
            ));
        }
        _ => fix.push_str(
            "; shorten `max_queue` to what the lane drains within the timeout, or raise `max_inflight`",
        ),
    }
    d.findings.push(
        LiveFinding::new(LiveCause::QueueWaitNearTimeout, Some(&l.name))
            .num("queue_wait_p90_seconds", p90)
            .num("queue_wait_p50_seconds", wait.and_then(|h| h.quantile(0.5)))
            .num("queue_timeout_seconds", Some(timeout))
            .num("queue_timeouts", Some(l.queue_timeouts))
            .num("max_queue", l.max_queue)
            .fix(fix),
    );
}

fn fallback_share(w: &Window, d: &mut LiveDiagnosis, l: &Lane) {
    if l.total < w.t.min_requests || l.fallbacks == 0.0 {
        return;
    }
    let share = l.fallbacks / l.total;
    if share < w.t.fallback_share {
        return;
    }
    let need = needed_inflight(w, l);
    let mut fix = format!(
        "lane `{}` answered {:.0} of {:.0} requests ({}) with its fallback",
        l.name,
        l.fallbacks,
        l.total,
        pct(share)
    );
    match (need, l.max_inflight) {
        (Some((n, rate, _)), Some(m)) if n > m => fix.push_str(&format!(
            "; {rate:.2} req/s needs {n:.0} in flight against `max_inflight = {m:.0}`: the degraded answer has become the normal one — raise `max_inflight` to {n:.0} or add `max_queue` so short bursts wait for the model"
        )),
        _ => fix.push_str(
            "; if that is more degradation than intended, give bursts a `max_queue` (with `queue_timeout` below the client's patience) before the fallback answers",
        ),
    }
    d.findings.push(
        LiveFinding::new(LiveCause::FallbackShareHigh, Some(&l.name))
            .num("fallback_share", Some(share))
            .num("fallbacks", Some(l.fallbacks))
            .num("requests", Some(l.total))
            .num("max_inflight_needed", need.map(|n| n.0))
            .fix(fix),
    );
}

fn preemptions(w: &Window, d: &mut LiveDiagnosis, l: &Lane, audio_jobs: f64) {
    if l.preempted < 2.0 {
        return;
    }
    let per_job = if audio_jobs > 0.0 {
        l.preempted / audio_jobs
    } else {
        l.preempted
    };
    if per_job < w.t.preemptions_per_audio_job {
        return;
    }
    d.findings.push(
        LiveFinding::new(LiveCause::PreemptionsPerAudioJob, Some(&l.name))
            .num("preempted", Some(l.preempted))
            .num("audio_jobs", Some(audio_jobs))
            .num("preempted_per_audio_job", Some(per_job))
            .fix(format!(
                "lane `{}` had {:.0} streams stopped by audio work over {:.0} audio jobs ({per_job:.2} per job): each restart wastes the text already generated; \
                 raise `yield_linger` (text stays out between audio jobs instead of starting and being stopped), or set `preempt = false` and let `yield_to` hold only new text",
                l.name, l.preempted, audio_jobs
            )),
    );
}

fn audio_waits_behind_text(w: &Window, d: &mut LiveDiagnosis, a: &Lane, lanes: &[Lane]) {
    let Some(p90) = a
        .wait
        .as_ref()
        .filter(|h| h.count > 0.0)
        .and_then(|h| h.quantile(0.9))
    else {
        return;
    };
    if p90 < w.t.audio_wait_seconds {
        return;
    }
    for t in lanes
        .iter()
        .filter(|t| !t.audio && (t.total > 0.0 || t.inflight > 0.0))
    {
        let yields = t.yields_to.contains(&a.name);
        let fix = if !yields {
            format!(
                "audio lane `{}` waited {} (p90) in its queue while text lane `{}` kept running ({:.0} requests, up to {:.0} in flight) and does not yield to it: \
                 add `yield_to = [\"{}\"]` to lane `{}` (with `max_yield` bounding how long text holds back)",
                a.name,
                secs(p90),
                t.name,
                t.total,
                t.inflight,
                a.name,
                t.name
            )
        } else if !t.preempt {
            format!(
                "audio lane `{}` waited {} (p90) although lane `{}` yields to it: yielding only holds new text, so running streams finish first; \
                 set `preempt = true` on lane `{}` to stop them when audio arrives, or lower its `max_inflight`",
                a.name,
                secs(p90),
                t.name,
                t.name
            )
        } else {
            continue;
        };
        d.findings.push(
            LiveFinding::new(LiveCause::AudioWaitsBehindText, Some(&a.name))
                .num("audio_queue_wait_p90_seconds", Some(p90))
                .num("text_requests", Some(t.total))
                .num("text_inflight_max", Some(t.inflight))
                .fix(fix),
        );
    }
}

fn early_retries(w: &Window, d: &mut LiveDiagnosis, l: &Lane) {
    if w.after.sum(EARLY_RETRIES, &[("lane", &l.name)]).is_none() {
        return;
    }
    let early = w.delta(EARLY_RETRIES, &[("lane", &l.name)]);
    if l.refused == 0.0 || early == 0.0 || l.total == 0.0 {
        return;
    }
    let share = (early / l.total).min(1.0);
    if share < w.t.early_retry_share {
        return;
    }
    d.findings.push(
        LiveFinding::new(LiveCause::RetryAfterIgnored, Some(&l.name))
            .num("early_retries", Some(early))
            .num("requests", Some(l.total))
            .num("refused", Some(l.refused))
            .num("early_retry_share", Some(share))
            .fix(format!(
                "{early:.0} of the {:.0} requests to lane `{}` ({}) came from a client refused less than its Retry-After earlier: those clients retry on their own \
                 schedule, so each refusal only adds load ({:.0} refused); use a client that honours Retry-After/retry-after-ms (the official OpenAI client does, up to 120 s), \
                 or `policy = \"queue\"` so they wait inside the gateway",
                l.total,
                l.name,
                pct(share),
                l.refused
            )),
    );
}
