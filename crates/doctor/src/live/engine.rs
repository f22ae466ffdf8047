//! Findings for an engine's own `/metrics`: vLLM (KV pressure while requests wait, preemptions,
//! time to first token spent queued) and llama.cpp's server (requests deferred for want of a
//! slot). Metric names from vLLM's metrics design doc and llama.cpp's server README, with the
//! older vLLM names still read.

use super::{LiveCause, LiveDiagnosis, LiveFinding, Window, pct, secs};

pub fn vllm(w: &Window, d: &mut LiveDiagnosis) {
    let waiting = w.gauge_max("vllm:num_requests_waiting", &[]);
    let running = w.gauge_max("vllm:num_requests_running", &[]);
    let kv = w
        .gauge_max("vllm:kv_cache_usage_perc", &[])
        .or_else(|| w.gauge_max("vllm:gpu_cache_usage_perc", &[]));
    let preempted = w.delta("vllm:num_preemptions_total", &[]);
    let finished = w.delta("vllm:request_success_total", &[]);
    let ttft = w.histogram("vllm:time_to_first_token_seconds", &[]);
    let queue = w.histogram("vllm:request_queue_time_seconds", &[]);
    for (k, v) in [
        ("waiting_max", waiting),
        ("running_max", running),
        ("kv_cache_usage_max", kv),
        ("preemptions", Some(preempted)),
        ("finished", Some(finished)),
        ("ttft_mean_seconds", ttft.as_ref().and_then(|h| h.mean())),
        (
            "queue_time_mean_seconds",
            queue.as_ref().and_then(|h| h.mean()),
        ),
    ] {
        if let Some(v) = v {
            d.figures.insert(k.to_owned(), v);
        }
    }
    if kv.is_none() {
        d.not_judged
            .push("no KV-cache usage gauge (vllm:kv_cache_usage_perc)".to_owned());
    }
    if let (Some(kv), Some(wait)) = (kv, waiting)
        && kv >= w.t.kv_full
        && wait > 0.0
    {
        let run = running.unwrap_or(0.0);
        d.findings.push(
            LiveFinding::new(LiveCause::KvPressureWithWaiting, None)
                .num("kv_cache_usage", Some(kv))
                .num("waiting", Some(wait))
                .num("running", running)
                .fix(format!(
                    "the KV cache is {} full with {wait:.0} requests waiting and {run:.0} running: the engine holds no room for more sequences; \
                     give it more KV (`--gpu-memory-utilization` up, `--kv-cache-dtype fp8`, a shorter `--max-model-len`), or stop sending more than it holds: \
                     in front of it, a gateway text lane with `max_inflight = {:.0}` and `engine_max_kv_cache_usage = {:.2}`",
                    pct(kv),
                    run.max(1.0),
                    (w.t.kv_full - 0.05).max(0.5)
                )),
        );
    }
    if preempted > 0.0 {
        let per = (finished > 0.0).then(|| preempted / finished);
        let run = running.unwrap_or(0.0);
        d.findings.push(
            LiveFinding::new(LiveCause::EnginePreemptions, None)
                .num("preemptions", Some(preempted))
                .num("preemptions_per_second", Some(preempted / w.seconds))
                .num("preemptions_per_finished_request", per)
                .num("running", running)
                .fix(format!(
                    "vLLM preempted {preempted:.0} running sequences in {} ({}): it ran out of KV mid-generation and recomputes their work later; \
                     lower `--max-num-seqs` to about the {run:.0} that were running, or give the KV pool more memory",
                    secs(w.seconds),
                    per.map(|p| format!("{p:.2} per finished request"))
                        .unwrap_or_else(|| "no request finished".into())
                )),
        );
    }
    if let (Some(t), Some(q)) = (&ttft, &queue)
        && t.count >= 3.0
        && let (Some(tm), Some(qm)) = (t.mean(), q.mean())
        && tm > 0.0
        && qm / tm >= w.t.queue_share_of_ttft
    {
        let share = (qm / tm).min(1.0);
        d.findings.push(
            LiveFinding::new(LiveCause::TtftDominatedByQueueing, None)
                .num("ttft_mean_seconds", Some(tm))
                .num("queue_time_mean_seconds", Some(qm))
                .num("queue_share_of_ttft", Some(share))
                .num("ttft_p90_seconds", t.quantile(0.9))
                .fix(format!(
                    "{} of the time to first token ({} mean) is spent in vLLM's own queue ({} mean): the engine is saturated and its queue is unbounded; \
                     bound concurrency before it (a gateway text lane with `max_inflight = {:.0}` and `policy = \"queue\"` or `engine_max_waiting`), or add capacity",
                    pct(share),
                    secs(tm),
                    secs(qm),
                    running.unwrap_or(1.0).max(1.0)
                )),
        );
    }
}

pub fn llamacpp(w: &Window, d: &mut LiveDiagnosis) {
    let deferred = w.gauge_max("llamacpp:requests_deferred", &[]);
    let processing = w.gauge_max("llamacpp:requests_processing", &[]);
    let busy = w.gauge_max("llamacpp:n_busy_slots_per_decode", &[]);
    let decodes = w.delta("llamacpp:n_decode_total", &[]);
    let tokens = w.delta("llamacpp:tokens_predicted_total", &[]);
    for (k, v) in [
        ("deferred_max", deferred),
        ("processing_max", processing),
        ("busy_slots_per_decode", busy),
        ("decodes_per_second", Some(decodes / w.seconds)),
        ("tokens_predicted_per_second", Some(tokens / w.seconds)),
    ] {
        if let Some(v) = v {
            d.figures.insert(k.to_owned(), v);
        }
    }
    let Some(def) = deferred.filter(|v| *v > 0.0) else {
        return;
    };
    let slots = processing.unwrap_or(0.0).max(1.0);
    d.findings.push(
        LiveFinding::new(LiveCause::DeferredRequests, None)
            .num("deferred", Some(def))
            .num("processing", processing)
            .num("slots_busy", Some(slots))
            .num("busy_slots_per_decode", busy)
            .fix(format!(
                "llama.cpp deferred {def:.0} requests while {slots:.0} were processing: every slot was busy, so the extra streams wait inside the server, unbounded \
                 and with no Retry-After; either give it more slots (`--parallel {:.0}`, with `--ctx-size` scaled by the same factor since the context is split across slots), \
                 or cap the gateway lane in front at `max_inflight = {slots:.0}` with `policy = \"queue\"` so the wait is bounded and answered with Retry-After",
                slots + def
            )),
    );
}
