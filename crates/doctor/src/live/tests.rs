//! Unit tests of the live rules on hand-written readings, and the no-panic properties.

use std::time::Duration;

use proptest::prelude::*;

use super::*;

fn snap(text: &str) -> Snapshot {
    Snapshot::parse(text).expect("test reading parses")
}

const SETTINGS: &str = "# TYPE headroom_lane_max_inflight gauge\n\
headroom_lane_max_inflight{lane=\"text\"} 2\n\
headroom_lane_max_inflight{lane=\"audio\"} 1\n\
# TYPE headroom_lane_queue_timeout_seconds gauge\n\
headroom_lane_queue_timeout_seconds{lane=\"text\"} 5\n\
headroom_lane_queue_timeout_seconds{lane=\"audio\"} 30\n\
# TYPE headroom_lane_policy gauge\n\
headroom_lane_policy{lane=\"text\",policy=\"reject\"} 1\n\
headroom_lane_policy{lane=\"audio\",policy=\"queue\"} 1\n";

fn gateway(ok: u64, rejected: u64, audio_ok: u64, dur_sum: f64) -> Snapshot {
    snap(&format!(
        "{SETTINGS}# TYPE headroom_requests_total counter\n\
headroom_requests_total{{lane=\"text\",outcome=\"ok\"}} {ok}\n\
headroom_requests_total{{lane=\"text\",outcome=\"rejected\"}} {rejected}\n\
headroom_requests_total{{lane=\"audio\",outcome=\"ok\"}} {audio_ok}\n\
# TYPE headroom_lane_inflight gauge\n\
headroom_lane_inflight{{lane=\"text\"}} 2\n\
headroom_lane_inflight{{lane=\"audio\"}} 0\n\
# TYPE headroom_request_duration_seconds histogram\n\
headroom_request_duration_seconds_bucket{{lane=\"text\",le=\"0.5\"}} 0\n\
headroom_request_duration_seconds_bucket{{lane=\"text\",le=\"1\"}} {ok}\n\
headroom_request_duration_seconds_bucket{{lane=\"text\",le=\"+Inf\"}} {ok}\n\
headroom_request_duration_seconds_sum{{lane=\"text\"}} {dur_sum}\n\
headroom_request_duration_seconds_count{{lane=\"text\"}} {ok}\n"
    ))
}

#[test]
fn rejecting_text_while_audio_idles_names_the_policy_with_the_share() {
    let before = gateway(0, 0, 3, 0.0);
    // 20 served in 10 s at 0.8 s each, 30 refused: 50 offered = 5 req/s × 0.8 s = 4 in flight.
    let after = gateway(20, 30, 3, 16.0);
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(10),
        &Thresholds::default(),
    );
    assert_eq!(d.source, MetricsSource::Gateway);
    let f = &d.findings[0];
    assert_eq!(f.cause, LiveCause::RejectingWhileAudioIdle);
    assert_eq!(f.lane.as_deref(), Some("text"));
    assert!((f.numbers["refused_share"] - 0.6).abs() < 1e-9);
    assert_eq!(f.numbers["max_inflight_needed"], 4.0);
    assert!(f.fix.contains("raise `max_inflight` to 4"), "{}", f.fix);
    assert!(f.fix.contains("policy = \"queue\""), "{}", f.fix);
    assert!(f.fix.contains("`max_queue = 2`"), "{}", f.fix);
}

#[test]
fn the_same_refusals_while_audio_works_are_not_a_policy_error() {
    let before = gateway(0, 0, 3, 0.0);
    let after = gateway(20, 30, 9, 16.0);
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(10),
        &Thresholds::default(),
    );
    assert!(
        d.findings
            .iter()
            .all(|f| f.cause != LiveCause::RejectingWhileAudioIdle),
        "{:?}",
        d.findings
    );
}

#[test]
fn a_quiet_gateway_has_no_findings() {
    let before = gateway(10, 0, 3, 8.0);
    let after = gateway(14, 0, 3, 11.2);
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(10),
        &Thresholds::default(),
    );
    assert!(d.findings.is_empty(), "{:?}", d.findings);
    assert_eq!(d.figures["text.requests"], 4.0);
    assert_eq!(d.verdict(), "nothing wrong in this interval");
}

#[test]
fn llamacpp_deferred_requests_are_named_with_the_slot_count() {
    let before = snap("llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n");
    let after = snap("llamacpp:requests_processing 2\nllamacpp:requests_deferred 3\n");
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(2),
        &Thresholds::default(),
    );
    assert_eq!(d.source, MetricsSource::LlamaCpp);
    assert_eq!(d.findings[0].cause, LiveCause::DeferredRequests);
    assert_eq!(d.findings[0].numbers["deferred"], 3.0);
    assert!(
        d.findings[0].fix.contains("`--parallel 5`"),
        "{}",
        d.findings[0].fix
    );
    assert!(d.findings[0].fix.contains("`max_inflight = 2`"));
}

#[test]
fn vllm_kv_pressure_preemptions_and_queueing() {
    let before = snap(
        "vllm:num_preemptions_total{model_name=\"m\"} 4\nvllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 10\n\
vllm:time_to_first_token_seconds_bucket{le=\"1\",model_name=\"m\"} 0\nvllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 0\n\
vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 0\nvllm:time_to_first_token_seconds_count{model_name=\"m\"} 0\n\
vllm:request_queue_time_seconds_sum{model_name=\"m\"} 0\nvllm:request_queue_time_seconds_count{model_name=\"m\"} 0\n",
    );
    let after = snap(
        "vllm:num_requests_waiting{model_name=\"m\"} 5\nvllm:num_requests_running{model_name=\"m\"} 8\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.97\n\
vllm:num_preemptions_total{model_name=\"m\"} 10\nvllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 22\n\
vllm:time_to_first_token_seconds_bucket{le=\"1\",model_name=\"m\"} 1\nvllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 4\n\
vllm:time_to_first_token_seconds_sum{model_name=\"m\"} 8\nvllm:time_to_first_token_seconds_count{model_name=\"m\"} 4\n\
vllm:request_queue_time_seconds_sum{model_name=\"m\"} 6\nvllm:request_queue_time_seconds_count{model_name=\"m\"} 4\n",
    );
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(10),
        &Thresholds::default(),
    );
    let causes: Vec<LiveCause> = d.findings.iter().map(|f| f.cause).collect();
    assert_eq!(
        causes,
        vec![
            LiveCause::KvPressureWithWaiting,
            LiveCause::EnginePreemptions,
            LiveCause::TtftDominatedByQueueing
        ]
    );
    assert_eq!(d.findings[1].numbers["preemptions"], 6.0);
    assert_eq!(
        d.findings[1].numbers["preemptions_per_finished_request"],
        0.5
    );
    assert_eq!(d.findings[2].numbers["queue_share_of_ttft"], 0.75);
}

fn check(d: &LiveDiagnosis) {
    for f in &d.findings {
        assert!(!f.fix.is_empty());
        assert!(f.numbers.values().all(|v| v.is_finite()));
    }
    assert!(d.figures.values().all(|v| v.is_finite()));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_bytes_never_panic_the_metrics_reader(input in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let text = String::from_utf8_lossy(&input);
        if let Ok(s) = Snapshot::parse(&text) {
            check(&diagnose_live(&s, &s, Duration::from_secs(1), &Thresholds::default()));
        }
    }

    #[test]
    fn metric_like_text_never_panics(
        lines in proptest::collection::vec(
            prop_oneof![
                "(headroom_requests_total|headroom_lane_max_inflight|headroom_queue_wait_seconds_bucket|headroom_request_duration_seconds_sum|vllm:num_requests_waiting|vllm:kv_cache_usage_perc|vllm:time_to_first_token_seconds_count|llamacpp:requests_deferred)(\\{(lane|outcome|le|model_name)=\"(text|audio|ok|rejected|0.5|\\+Inf|m)\"\\})? (-?[0-9]{1,6}(\\.[0-9]{1,3})?|NaN|\\+Inf|-Inf)",
                "# (TYPE|HELP) [a-z_:]{1,30} (counter|gauge|histogram|summary|x)",
                "[ -~]{0,60}",
            ],
            0..40,
        ),
        later in proptest::collection::vec("(-?[0-9]{1,6}|NaN)", 0..8),
        secs in 0u64..100,
    ) {
        let text = lines.join("\n");
        let mut changed = text.clone();
        for v in &later {
            changed.push_str(&format!("\nheadroom_requests_total{{lane=\"text\",outcome=\"rejected\"}} {v}"));
        }
        if let (Ok(a), Ok(b)) = (Snapshot::parse(&text), Snapshot::parse(&changed)) {
            check(&diagnose_live(&a, &b, Duration::from_secs(secs), &Thresholds::default()));
            check(&diagnose_live(&b, &a, Duration::from_millis(secs), &Thresholds::default()));
        }
    }
}

fn queueing_gateway(
    ok: u64,
    timeouts: u64,
    wait_over_4s: u64,
    audio: u64,
    audio_slow: u64,
) -> Snapshot {
    snap(&format!(
        "{SETTINGS}headroom_lane_yields_to{{lane=\"text\",to=\"audio\"}} 1\n\
headroom_lane_preempt{{lane=\"text\"}} 0\n\
# TYPE headroom_requests_total counter\n\
headroom_requests_total{{lane=\"text\",outcome=\"ok\"}} {ok}\n\
headroom_requests_total{{lane=\"text\",outcome=\"queue_timeout\"}} {timeouts}\n\
headroom_requests_total{{lane=\"text\",outcome=\"fallback\"}} {timeouts}\n\
headroom_requests_total{{lane=\"text\",outcome=\"preempted\"}} {timeouts}\n\
headroom_requests_total{{lane=\"audio\",outcome=\"ok\"}} {audio}\n\
headroom_fallbacks_total{{lane=\"text\"}} {timeouts}\n\
# TYPE headroom_queue_wait_seconds histogram\n\
headroom_queue_wait_seconds_bucket{{lane=\"text\",le=\"1\"}} 0\n\
headroom_queue_wait_seconds_bucket{{lane=\"text\",le=\"5\"}} {ok}\n\
headroom_queue_wait_seconds_bucket{{lane=\"text\",le=\"+Inf\"}} {ok}\n\
headroom_queue_wait_seconds_sum{{lane=\"text\"}} {}\n\
headroom_queue_wait_seconds_count{{lane=\"text\"}} {ok}\n\
headroom_queue_wait_seconds_bucket{{lane=\"audio\",le=\"0.1\"}} {}\n\
headroom_queue_wait_seconds_bucket{{lane=\"audio\",le=\"2\"}} {audio}\n\
headroom_queue_wait_seconds_bucket{{lane=\"audio\",le=\"+Inf\"}} {audio}\n\
headroom_queue_wait_seconds_sum{{lane=\"audio\"}} 1\n\
headroom_queue_wait_seconds_count{{lane=\"audio\"}} {audio}\n\
# TYPE headroom_request_duration_seconds histogram\n\
headroom_request_duration_seconds_bucket{{lane=\"text\",le=\"+Inf\"}} {ok}\n\
headroom_request_duration_seconds_sum{{lane=\"text\"}} {}\n\
headroom_request_duration_seconds_count{{lane=\"text\"}} {ok}\n",
        wait_over_4s as f64 * 4.5,
        audio - audio_slow,
        ok as f64 * 2.0,
    ))
}

#[test]
fn queue_waits_near_the_timeout_fallbacks_preemptions_and_audio_waiting_are_named() {
    let before = queueing_gateway(0, 0, 0, 0, 0);
    // 10 s: 10 text served after ~4.5 s waits (timeout 5 s), 10 timed out in the queue, were
    // answered by the fallback and preempted; 10 audio jobs, 6 of which waited up to 2 s.
    let after = queueing_gateway(10, 10, 10, 10, 6);
    let d = diagnose_live(
        &before,
        &after,
        Duration::from_secs(10),
        &Thresholds::default(),
    );
    let causes: Vec<LiveCause> = d.findings.iter().map(|f| f.cause).collect();
    for want in [
        LiveCause::QueueWaitNearTimeout,
        LiveCause::FallbackShareHigh,
        LiveCause::PreemptionsPerAudioJob,
        LiveCause::AudioWaitsBehindText,
    ] {
        assert!(
            causes.contains(&want),
            "{want:?} missing: {:#?}",
            d.findings
        );
    }
    let q = d
        .findings
        .iter()
        .find(|f| f.cause == LiveCause::QueueWaitNearTimeout)
        .unwrap();
    assert_eq!(q.numbers["queue_timeouts"], 10.0);
    assert!(q.numbers["queue_wait_p90_seconds"] >= 4.0, "{q:?}");
    // max_inflight 2 at 2 s each serves 1 req/s: 1 × 5 s × 0.8 = 4 drain within the timeout.
    assert!(q.fix.contains("`max_queue = 4`"), "{}", q.fix);
    let p = d
        .findings
        .iter()
        .find(|f| f.cause == LiveCause::PreemptionsPerAudioJob)
        .unwrap();
    assert_eq!(p.numbers["preempted_per_audio_job"], 1.0);
    let a = d
        .findings
        .iter()
        .find(|f| f.cause == LiveCause::AudioWaitsBehindText)
        .unwrap();
    // The text lane yields but does not preempt: the fix is preemption, not yield_to.
    assert!(a.fix.contains("`preempt = true`"), "{}", a.fix);
    assert!(a.numbers["audio_queue_wait_p90_seconds"] > 0.25);
}
