//! The night's client against real HTTP servers on 127.0.0.1 (axum, in process): a refusal with
//! Retry-After is waited out and served, one without is retried on the SDK's backoff, a
//! connection that closes before any answer is lost, a stream stopped by an error event is
//! stopped, an answer past the deadline is lost, and a whole stream counts its tokens.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use headroom_bench::arrivals::Rng;
use headroom_drill::client::{End, Final, Shape, Target, request};
use headroom_drill::payload::{Body, JsonTemplate};
use headroom_drill::scenario::{ClientPolicy, StreamKind};

async fn serve(router: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    format!("http://{addr}")
}

fn speech() -> Shape {
    Shape {
        kind: StreamKind::Speech,
        model: "tts-1".into(),
        body: Body::Json {
            template: JsonTemplate::Speech {
                model: "tts-1".into(),
                text: Arc::new("Hello there.".into()),
                voice: "alloy".into(),
                format: "wav".into(),
            },
        },
        streamed: false,
    }
}

fn chat() -> Shape {
    Shape {
        kind: StreamKind::Chat,
        model: "m".into(),
        body: Body::Json {
            template: JsonTemplate::Chat {
                model: "m".into(),
                instruction: "Clean up:".into(),
                prompts: Arc::new(headroom_bench::workload::Prompts::Generated {
                    input_tokens: 10,
                }),
                max_tokens: 8,
                stream: true,
            },
        },
        streamed: true,
    }
}

const POLICY: ClientPolicy = ClientPolicy {
    max_retries: 2,
    retry_after_cap: Duration::from_secs(60),
};

async fn one(base: &str, shape: &Shape, deadline: Duration) -> headroom_drill::client::Record {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let target = Target {
        base: base.into(),
        api_key: None,
    };
    let mut rng = Rng::new(7);
    request(
        &client,
        &target,
        shape,
        0,
        1,
        Some(0),
        Instant::now(),
        deadline,
        &POLICY,
        &mut rng,
    )
    .await
}

#[tokio::test]
async fn a_refusal_with_retry_after_is_waited_out_and_served() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let base = serve(Router::new().route(
        "/v1/audio/speech",
        post(move || {
            let c = Arc::clone(&c);
            async move {
                if c.fetch_add(1, Ordering::SeqCst) == 0 {
                    let mut h = HeaderMap::new();
                    h.insert("retry-after", "1".parse().unwrap());
                    h.insert("retry-after-ms", "400".parse().unwrap());
                    (StatusCode::SERVICE_UNAVAILABLE, h, r#"{"error":{"message":"busy","type":"x","param":null,"code":"host_memory"}}"#).into_response()
                } else {
                    (StatusCode::OK, vec![1u8; 100]).into_response()
                }
            }
        }),
    ))
    .await;
    let r = one(&base, &speech(), Duration::from_secs(10)).await;
    assert_eq!(r.outcome, Final::Ok, "{r:?}");
    assert_eq!(r.attempts.len(), 2);
    match &r.attempts[0].end {
        End::Refused {
            status,
            code,
            retry_after_s,
        } => {
            assert_eq!(*status, 503);
            assert_eq!(code.as_deref(), Some("host_memory"));
            assert_eq!(*retry_after_s, Some(0.4));
        }
        other => panic!("{other:?}"),
    }
    // The second attempt went after the 400 ms the answer asked for.
    let waited = r.attempts[1].start_s - r.attempts[0].start_s - r.attempts[0].secs;
    assert!(waited >= 0.39, "waited {waited}");
    assert!(r.total_secs().unwrap() > r.served_secs().unwrap());
}

#[tokio::test]
async fn refusals_without_retry_after_give_up_after_the_retries() {
    let base = serve(Router::new().route(
        "/v1/audio/speech",
        post(|| async { (StatusCode::TOO_MANY_REQUESTS, "slow down") }),
    ))
    .await;
    let r = one(&base, &speech(), Duration::from_secs(10)).await;
    assert_eq!(r.outcome, Final::Refused);
    assert_eq!(r.attempts.len(), 3, "the first try and two retries");
    assert!(r.refusals().all(|a| matches!(
        a.end,
        End::Refused {
            retry_after_s: None,
            ..
        }
    )));
}

#[tokio::test]
async fn a_connection_closed_before_any_answer_is_retried_then_lost() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU32::new(0));
    let a = Arc::clone(&accepted);
    tokio::spawn(async move {
        loop {
            let (sock, _) = listener.accept().await.unwrap();
            a.fetch_add(1, Ordering::SeqCst);
            drop(sock);
        }
    });
    let r = one(
        &format!("http://{addr}"),
        &speech(),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(r.outcome, Final::Lost, "{r:?}");
    assert_eq!(r.attempts.len(), 3);
    assert!(r.attempts.iter().all(|a| matches!(
        a.end,
        End::Lost {
            before_answer: true,
            ..
        }
    )));
    assert!(accepted.load(Ordering::SeqCst) >= 3);
}

#[tokio::test]
async fn no_answer_by_the_deadline_is_lost() {
    let base = serve(Router::new().route(
        "/v1/audio/speech",
        post(|| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            "late"
        }),
    ))
    .await;
    let t = Instant::now();
    let r = one(&base, &speech(), Duration::from_millis(400)).await;
    assert_eq!(r.outcome, Final::Lost);
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(
        matches!(&r.attempts[0].end, End::Lost { why, before_answer: false } if why.contains("deadline"))
    );
}

const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":null}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n\
data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n\
data: {\"choices\":[],\"usage\":{\"completion_tokens\":7}}\n\n\
data: [DONE]\n\n";

#[tokio::test]
async fn streams_count_tokens_and_an_error_event_stops_them() {
    let calls = Arc::new(AtomicU32::new(0));
    let c = Arc::clone(&calls);
    let base = serve(Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let c = Arc::clone(&c);
            async move {
                let body = match c.fetch_add(1, Ordering::SeqCst) {
                    0 => STREAM.to_string(),
                    1 => "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"error\":{\"message\":\"preempted by audio\",\"code\":\"preempted\"}}\n\n".to_string(),
                    // Cut: no [DONE].
                    _ => "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n".to_string(),
                };
                ([("content-type", "text/event-stream")], body)
            }
        }),
    ))
    .await;
    let ok = one(&base, &chat(), Duration::from_secs(10)).await;
    assert_eq!(ok.outcome, Final::Ok);
    assert_eq!(ok.tokens(), 7, "usage wins over counted chunks");
    let r = one(&base, &chat(), Duration::from_secs(10)).await;
    // Stopped, sent again, and the retry is cut off without [DONE]: lost.
    assert!(
        matches!(&r.attempts[0].end, End::Stopped { message } if message.contains("preempted")),
        "{r:?}"
    );
    assert_eq!(r.outcome, Final::Lost);
    assert!(matches!(&r.attempts[1].end, End::Lost { why, .. } if why.contains("[DONE]")));
}
