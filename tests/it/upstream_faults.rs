//! A lane with two replicas whose engines fail the ways engines fail (close without answering,
//! hang), through a real gateway on 127.0.0.1: a POST reaches the engines at most once unless the
//! lane says its requests may be repeated, and a replica that keeps timing out is ejected so the
//! healthy one serves, then let back in by a probe once it answers again.

use std::time::Duration;

use crate::common::SERIAL;
use crate::fault_upstream::{self, FaultUpstream, Mode};
use crate::serve::{admin, base, chat, client, gateway, lane};

fn two_replicas(a: &FaultUpstream, b: &FaultUpstream, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{}\", \"{}\"]\nmax_inflight = 4\n{extra}\n",
        a.url, b.url
    )
}

/// Two replicas that answer, a first request that leaves a kept-alive connection to `a` in the
/// gateway's pool, then both replicas closing every request without an answer; returns the
/// status the gateway gave the POST and how many times the replicas read it.
async fn post_into_closing_replicas(extra: &str) -> (u16, u64, u64) {
    let (a, b) = (
        fault_upstream::start(Mode::Answer).await,
        fault_upstream::start(Mode::Answer).await,
    );
    let g = gateway(&two_replicas(&a, &b, extra)).await;
    let (c, base) = (client(), base(&g));
    // The tie between two idle replicas goes to the first one: its connection is pooled now.
    let warm = chat(&c, &base, "warm", &[], false).await;
    assert_eq!(warm.status(), 200);
    assert_eq!((a.answered(), b.answered()), (1, 0));
    a.set(Mode::Close);
    b.set(Mode::Close);
    let (a0, b0) = (a.delivered(), b.delivered());
    let r = chat(&c, &base, "once", &[], false).await;
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    eprintln!("status {status}: {body}");
    // Whatever went out has arrived by the time the gateway answered; a moment more for a
    // resend racing the answer (there must be none).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = (status, a.delivered() - a0, b.delivered() - b0);
    g.shutdown().await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_whose_replica_closes_without_answering_reaches_the_engines_once_and_gets_502() {
    let _serial = SERIAL.lock().await;
    let (status, on_a, on_b) = post_into_closing_replicas("").await;
    eprintln!("deliveries of one POST: replica a {on_a}, replica b {on_b}");
    assert_eq!(
        (on_a, on_b),
        (1, 0),
        "the POST was sent again after the engine had read it"
    );
    assert_eq!(status, 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_marked_idempotent_may_send_an_unanswered_request_again_and_reroute_it() {
    let _serial = SERIAL.lock().await;
    let (status, on_a, on_b) = post_into_closing_replicas("idempotent = true").await;
    eprintln!("deliveries on an idempotent lane: replica a {on_a}, replica b {on_b}");
    // Resent once on a fresh connection to a, then tried on b: every replica had its chance.
    assert_eq!((on_a, on_b), (2, 1));
    assert_eq!(status, 502);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_keeps_timing_out_is_ejected_and_the_healthy_one_serves() {
    let _serial = SERIAL.lock().await;
    let (hung, healthy) = (
        fault_upstream::start(Mode::Hang).await,
        fault_upstream::start(Mode::Answer).await,
    );
    // The hung replica is first: every tie between two idle replicas goes to it.
    let g = gateway(&two_replicas(&hung, &healthy, "request_timeout = \"1s\"")).await;
    let (c, base) = (client(), base(&g));
    let mut statuses = Vec::new();
    for i in 0..8 {
        let r = chat(&c, &base, &format!("r{i}"), &[], false).await;
        statuses.push(r.status().as_u16());
    }
    let served = statuses.iter().filter(|&&s| s == 200).count();
    eprintln!(
        "8 sequential requests: {statuses:?}; the hung replica read {}, the healthy one answered {}",
        hung.delivered(),
        healthy.answered()
    );
    assert!(
        served >= 5 && healthy.answered() as usize == served,
        "{statuses:?}: the hung replica kept taking requests"
    );
    assert!(hung.delivered() <= 3, "{}", hung.delivered());
    let snapshot = admin(&c, &base).await;
    let ups = &lane(&snapshot, "text")["upstreams"];
    assert_eq!(ups[0]["healthy"], false, "{ups}");
    assert_eq!(ups[0]["ejections"], 1, "{ups}");
    assert_eq!(ups[1]["healthy"], true, "{ups}");
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ejected_replica_is_probed_back_in_once_it_answers_again() {
    let _serial = SERIAL.lock().await;
    let (flaky, healthy) = (
        fault_upstream::start(Mode::Close).await,
        fault_upstream::start(Mode::Answer).await,
    );
    let g = gateway(&two_replicas(
        &flaky,
        &healthy,
        "eject_after_failures = 2\nbase_ejection_time = \"1s\"",
    ))
    .await;
    let (c, base) = (client(), base(&g));
    // Two 502s (no reroute for a POST the engine read), then ejected: the rest go to the other.
    let mut statuses = Vec::new();
    for i in 0..5 {
        statuses.push(
            chat(&c, &base, &format!("a{i}"), &[], false)
                .await
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [502, 502, 200, 200, 200]);
    assert_eq!(flaky.delivered(), 2);
    flaky.set(Mode::Answer);
    // After the ejection ends, the first idle tie goes to the flaky replica as the probe: it
    // answers, and it is back in the rotation.
    let back = crate::serve::wait_lane(&c, &base, "text", Duration::from_secs(10), |l| {
        l["upstreams"][0]["healthy"] == true
    })
    .await;
    assert_eq!(lane(&back, "text")["upstreams"][0]["healthy"], true);
    let r = chat(&c, &base, "probe", &[], false).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        flaky.answered(),
        1,
        "the probe went to the replica let back"
    );
    let snapshot = admin(&c, &base).await;
    let ups = &lane(&snapshot, "text")["upstreams"];
    assert_eq!(ups[0]["consecutive_failures"], 0, "{ups}");
    assert_eq!(ups[0]["ejections"], 1, "{ups}");
    g.shutdown().await.unwrap();
}
