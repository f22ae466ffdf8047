//! A follower stream (`after`) against a real HTTP server on 127.0.0.1 (axum, in process): the
//! leader's client sends it right after the leader's request is answered and before its own next
//! request, so the two never overlap (one person at a workstation: an utterance, then the
//! assistant's spoken answer to it); a request that was not served gets no follower.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use headroom_drill::client::{Shape, Target};
use headroom_drill::night::{Lane, Traffic};
use headroom_drill::payload::{Body, JsonTemplate};
use headroom_drill::scenario::{Arrivals, ClientPolicy, StreamKind, Think};

/// `(model, received, answered)` of every request the server saw, in seconds since `t0`.
type Log = Arc<Mutex<Vec<(String, f64, f64)>>>;

async fn serve(log: Log, lead_status: StatusCode) -> String {
    let t0 = Instant::now();
    let router = Router::new().route(
        "/v1/audio/speech",
        post(move |body: String| {
            let log = Arc::clone(&log);
            async move {
                let got = t0.elapsed().as_secs_f64();
                let v: serde_json::Value = serde_json::from_str(&body).unwrap();
                let model = v["model"].as_str().unwrap().to_string();
                let lead = model == "lead";
                tokio::time::sleep(Duration::from_millis(if lead { 150 } else { 60 })).await;
                log.lock()
                    .unwrap()
                    .push((model, got, t0.elapsed().as_secs_f64()));
                let status = if lead { lead_status } else { StatusCode::OK };
                (status, vec![1u8; 100]).into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

fn speech(model: &str) -> Shape {
    Shape {
        kind: StreamKind::Speech,
        model: model.into(),
        body: Body::Json {
            template: JsonTemplate::Speech {
                model: model.into(),
                text: Arc::new("Hello there.".into()),
                voice: "alloy".into(),
                format: "wav".into(),
            },
        },
        streamed: false,
    }
}

fn lane(index: usize, base: &str, model: &str, arrivals: Arrivals) -> Lane {
    Lane {
        index,
        target: Target {
            base: base.into(),
            api_key: None,
        },
        shape: speech(model),
        arrivals,
        deadline: Duration::from_secs(10),
        seq: Arc::new(AtomicU64::new(0)),
        sent: Arc::new(AtomicU64::new(0)),
        due: Arc::new(Mutex::new(match arrivals {
            Arrivals::Workers { workers, .. } => vec![None; workers as usize],
            _ => Vec::new(),
        })),
    }
}

/// One round of 1.5 s: a one-client leader thinking 100 ms, and a follower sent after every one
/// of its answers. Returns the server's log and the drill's records per stream.
async fn one_round(lead_status: StatusCode) -> (Vec<(String, f64, f64)>, [usize; 2]) {
    let log: Log = Arc::default();
    let base = serve(Arc::clone(&log), lead_status).await;
    let lanes = vec![
        lane(
            0,
            &base,
            "lead",
            Arrivals::Workers {
                workers: 1,
                think: Think::fixed(Duration::from_millis(100)),
            },
        ),
        lane(
            1,
            &base,
            "follow",
            Arrivals::After {
                stream: 0,
                share: 1.0,
            },
        ),
    ];
    let traffic = Traffic {
        client: reqwest::Client::builder().no_proxy().build().unwrap(),
        clock: Instant::now(),
        policy: ClientPolicy {
            max_retries: 0,
            retry_after_cap: Duration::from_secs(1),
        },
        records: Arc::default(),
        seed: 29,
    };
    traffic
        .round(&lanes, 0, Duration::from_millis(1500), false)
        .await;
    let records = traffic.records.lock().unwrap();
    let per = [0, 1].map(|s| records.iter().filter(|r| r.stream == s).count());
    let mut seen = log.lock().unwrap().clone();
    seen.sort_by(|a, b| a.1.total_cmp(&b.1));
    (seen, per)
}

#[tokio::test]
async fn a_follower_is_sent_right_after_its_leader_is_answered_never_beside_it() {
    let (seen, per) = one_round(StatusCode::OK).await;
    let models: Vec<&str> = seen.iter().map(|(m, _, _)| m.as_str()).collect();
    // 1.5 s of turns of 150 + 60 + 100 ms: about 5, alternating.
    assert!(models.len() >= 6, "{models:?}");
    for (i, pair) in models.chunks(2).enumerate() {
        assert_eq!(pair[0], "lead", "turn {i}: {models:?}");
        if pair.len() == 2 {
            assert_eq!(pair[1], "follow", "turn {i}: {models:?}");
        }
    }
    // Never two at once: each request arrives after the one before was answered.
    for w in seen.windows(2) {
        assert!(
            w[1].1 >= w[0].2,
            "{} arrived at {:.3} s while {} ran until {:.3} s",
            w[1].0,
            w[1].1,
            w[0].0,
            w[0].2
        );
    }
    assert_eq!(per[0], models.iter().filter(|m| **m == "lead").count());
    assert_eq!(
        per[1],
        models.iter().filter(|m| **m == "follow").count(),
        "every follower is recorded on its own lane"
    );
}

#[tokio::test]
async fn a_request_that_was_not_served_gets_no_follower() {
    let (seen, per) = one_round(StatusCode::INTERNAL_SERVER_ERROR).await;
    assert!(per[0] >= 3, "the leader kept sending: {seen:?}");
    assert_eq!(per[1], 0, "{seen:?}");
    assert!(seen.iter().all(|(m, _, _)| m == "lead"), "{seen:?}");
}
