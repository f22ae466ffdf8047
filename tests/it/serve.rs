//! `headroom serve` end to end: the gateway in-process (and as the real binary) in front of an
//! in-process upstream on 127.0.0.1 that streams timed SSE chunks and records cancellations.

use std::time::Duration;

use futures_util::StreamExt;
use headroom_server::{Running, ServeSettings};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::common::{SERIAL, config_file, rig};
use crate::serve_upstream::{self, Upstream};

pub(crate) async fn gateway(toml: &str) -> Running {
    let config = ServeSettings::from_toml(toml).expect("test config is valid");
    headroom_server::spawn(config, None)
        .await
        .expect("gateway starts")
}

pub(crate) fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

pub(crate) fn base(g: &Running) -> String {
    format!("http://{}", g.addr)
}

pub(crate) fn chat_body(stream: bool) -> String {
    json!({"model": "test-model", "stream": stream,
           "messages": [{"role": "user", "content": "um so i think the the plan works"}]})
    .to_string()
}

pub(crate) async fn chat(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    headers: &[(&str, &str)],
    stream: bool,
) -> reqwest::Response {
    let mut rb = c
        .post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-test-id", id)
        .body(chat_body(stream));
    for (k, v) in headers {
        rb = rb.header(*k, *v);
    }
    rb.send().await.expect("request reaches the gateway")
}

/// A streamed chat that the gateway answered 200 and whose first chunk (an SSE `data:` event) has
/// arrived: that chunk and the rest of its body, for the test to read or to drop.
pub(crate) async fn started_stream(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    headers: &[(&str, &str)],
) -> (
    bytes::Bytes,
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
) {
    let r = chat(c, base, id, headers, true).await;
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("data: "));
    (first, body)
}

pub(crate) fn wav(seconds: f64) -> Vec<u8> {
    headroom_server::audio::fixtures::wav(seconds, 8000, 1)
}

pub(crate) fn multipart_body(file: Option<&[u8]>, model: &str) -> (String, Vec<u8>) {
    let boundary = "headroomtestboundary";
    let mut b = Vec::new();
    b.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n"
        )
        .as_bytes(),
    );
    if let Some(f) = file {
        b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
        b.extend_from_slice(f);
        b.extend_from_slice(b"\r\n");
    }
    b.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), b)
}

pub(crate) async fn transcribe(
    c: &reqwest::Client,
    base: &str,
    id: &str,
    delay_ms: u64,
) -> reqwest::Response {
    let (ct, body) = multipart_body(Some(&wav(1.0)), "whisper-1");
    c.post(format!("{base}/v1/audio/transcriptions"))
        .header("content-type", ct)
        .header("x-test-id", id)
        .header("x-test-delay-ms", delay_ms.to_string())
        .body(body)
        .send()
        .await
        .expect("request reaches the gateway")
}

pub(crate) async fn json_of(r: reqwest::Response) -> Value {
    let bytes = r.bytes().await.unwrap();
    serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&bytes)))
}

pub(crate) async fn admin(c: &reqwest::Client, base: &str) -> Value {
    json_of(c.get(format!("{base}/admin/lanes")).send().await.unwrap()).await
}

pub(crate) fn lane<'a>(snapshot: &'a Value, name: &str) -> &'a Value {
    snapshot["lanes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no lane {name} in {snapshot}"))
}

/// The least time a wait for an event gets. A loaded 2-core machine can stall a test for a second
/// or more, and a wait returns as soon as its event happens, so a long bound costs nothing when the
/// gateway behaves and still fails when the event never comes.
pub(crate) const SETTLE: Duration = Duration::from_secs(10);

/// Polls /admin/lanes until `pred` holds for `name` (bounded by `within`, at least [`SETTLE`]),
/// returning the last snapshot.
pub(crate) async fn wait_lane(
    c: &reqwest::Client,
    base: &str,
    name: &str,
    within: Duration,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let until = Instant::now() + within.max(SETTLE);
    loop {
        let s = admin(c, base).await;
        if pred(lane(&s, name)) || Instant::now() >= until {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Value of one sample line of /metrics, e.g. `headroom_lane_inflight{lane="text"}`.
pub(crate) async fn metric(c: &reqwest::Client, base: &str, series: &str) -> Option<f64> {
    let text = c
        .get(format!("{base}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

pub(crate) fn text_lane(up: &Upstream, extra: &str) -> String {
    format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\", \"/v1/completions\"]\nupstreams = [\"{}\"]\n{extra}\n",
        up.url()
    )
}

pub(crate) fn audio_lane(up: &Upstream, extra: &str) -> String {
    format!(
        "[[lanes]]\nname = \"audio\"\npaths = [\"/v1/audio/transcriptions\", \"/v1/audio/translations\", \"/v1/audio/speech\"]\nupstreams = [\"{}\"]\n{extra}\n",
        up.url()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_concurrent_requests_on_a_two_slot_lane_give_two_served_and_eight_429() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2\nmax_queue = 0\nqueue_timeout = \"5s\"\nrequest_timeout = \"60s\"\npolicy = \"reject\"")).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(10));
    let mut tasks = Vec::new();
    for i in 0..10 {
        let (c, b, barrier) = (c.clone(), b.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            // The upstream holds each stream for about one second.
            let r = chat(
                &c,
                &b,
                &format!("r{i}"),
                &[("x-test-chunks", "10"), ("x-test-interval-ms", "100")],
                true,
            )
            .await;
            let status = r.status().as_u16();
            let retry_after = r
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let retry_after_ms = r
                .headers()
                .get("retry-after-ms")
                .map(|v| v.to_str().unwrap().to_string());
            let body = r.bytes().await.unwrap();
            (status, retry_after, retry_after_ms, body)
        }));
    }
    let mut served = 0;
    let mut rejected = 0;
    for t in tasks {
        let (status, retry_after, retry_after_ms, body) = t.await.unwrap();
        match status {
            200 => {
                served += 1;
                let text = String::from_utf8(body.to_vec()).unwrap();
                assert!(
                    text.ends_with("data: [DONE]\n\n"),
                    "stream incomplete: {text}"
                );
                assert_eq!(text.matches("chat.completion.chunk").count(), 10);
            }
            429 => {
                rejected += 1;
                let secs: u64 = retry_after.expect("Retry-After").parse().unwrap();
                let ms: u64 = retry_after_ms.expect("retry-after-ms").parse().unwrap();
                assert!(
                    secs >= 1 && ms >= 1 && secs * 1000 >= ms,
                    "{secs} s vs {ms} ms"
                );
                let v: Value = serde_json::from_slice(&body).unwrap();
                let e = &v["error"];
                assert_eq!(e["code"], "lane_saturated");
                assert_eq!(e["type"], "rate_limit_error");
                assert!(e["param"].is_null());
                assert!(e["message"].as_str().unwrap().contains("text"));
            }
            other => panic!("unexpected status {other}"),
        }
    }
    assert_eq!((served, rejected), (2, 8));
    assert_eq!(
        metric(&c, &b, "headroom_lane_inflight{lane=\"text\"}").await,
        Some(0.0)
    );
    assert_eq!(
        metric(&c, &b, "headroom_lane_queue_depth{lane=\"text\"}").await,
        Some(0.0)
    );
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_rejections_total{lane=\"text\",reason=\"lane_saturated\"}"
        )
        .await,
        Some(8.0)
    );
    // TTFT, duration and queue wait were measured for the two served streams.
    for series in [
        "headroom_ttft_seconds_count{lane=\"text\"}",
        "headroom_request_duration_seconds_count{lane=\"text\"}",
        "headroom_queue_wait_seconds_count{lane=\"text\"}",
        "headroom_requests_total{lane=\"text\",outcome=\"ok\"}",
    ] {
        assert_eq!(metric(&c, &b, series).await, Some(2.0), "{series}");
    }
    let s = admin(&c, &b).await;
    let t = lane(&s, "text");
    assert_eq!(
        (
            t["inflight"].as_u64(),
            t["queued"].as_u64(),
            t["rejected"].as_u64()
        ),
        (Some(0), Some(0), Some(8))
    );
    assert_eq!(
        (t["max_inflight"].as_u64(), t["max_queue"].as_u64()),
        (Some(2), Some(0))
    );
    g.shutdown().await.unwrap();
}

fn p99(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    let rank = ((samples.len() as f64) * 0.99).ceil() as usize;
    samples[rank.saturating_sub(1)]
}

/// One request per client, started 8 ms apart; returns each request's latency.
async fn audio_round(
    c: &reqwest::Client,
    b: &str,
    clients: usize,
    body: &std::sync::Arc<(String, Vec<u8>)>,
) -> Vec<Duration> {
    let mut tasks = Vec::new();
    for w in 0..clients {
        let (c, b, body) = (c.clone(), b.to_string(), body.clone());
        tasks.push(tokio::spawn(async move {
            // Spread arrivals so the measurement is not a thundering herd.
            tokio::time::sleep(Duration::from_millis(8 * w as u64)).await;
            let start = Instant::now();
            let r = c
                .post(format!("{b}/v1/audio/transcriptions"))
                .header("content-type", &body.0)
                .header("x-test-id", format!("a{w}"))
                .header("x-test-delay-ms", "1000")
                .body(body.1.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await.unwrap();
            start.elapsed()
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.push(t.await.unwrap());
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audio_p99_holds_while_text_is_flooded_tenfold() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    let (_serial, _up, g, c, b) = rig(|up| {
        format!(
            "{}{}",
            text_lane(up, "max_inflight = 2\nmax_queue = 0\npolicy = \"reject\""),
            audio_lane(up, "max_inflight = 50\nmax_queue = 8\npolicy = \"queue\"")
        )
    })
    .await;
    let body = Arc::new(multipart_body(Some(&wav(1.0)), "whisper-1"));

    // Twenty text clients against two slots (ten times the lane's capacity), active on demand.
    let flooding = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let mut flood = Vec::new();
    for w in 0..20 {
        let (c, b) = (c.clone(), b.clone());
        let (flooding, stop, served, refused) = (
            flooding.clone(),
            stop.clone(),
            served.clone(),
            refused.clone(),
        );
        flood.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Relaxed) {
                if !flooding.load(Relaxed) {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                i += 1;
                // Long rewrites: each holds a text slot for about half a second.
                let r = chat(
                    &c,
                    &b,
                    &format!("t{w}-{i}"),
                    &[("x-test-chunks", "10"), ("x-test-interval-ms", "50")],
                    true,
                )
                .await;
                let status = r.status().as_u16();
                // Back off as the official client does (retry-after-ms).
                let backoff: u64 = r
                    .headers()
                    .get("retry-after-ms")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                let _ = r.bytes().await;
                if status == 200 {
                    served.fetch_add(1, Relaxed);
                } else {
                    assert_eq!(status, 429);
                    refused.fetch_add(1, Relaxed);
                    tokio::time::sleep(Duration::from_millis(backoff.clamp(5, 2000))).await;
                }
            }
        }));
    }
    // Warm the connections, then alternate unloaded and flooded rounds so that changes in the
    // machine's background load hit both sides alike. Upstream latency is a fixed 1 s sleep.
    // A comparison spoiled by a burst of outside load (this machine is shared) is measured
    // again, up to three times; a gateway that really slows audio under a text flood fails all.
    let _ = audio_round(&c, &b, 50, &body).await;
    let mut verdicts = Vec::new();
    let mut held = false;
    for _attempt in 0..3 {
        let mut unloaded = Vec::new();
        let mut loaded = Vec::new();
        for _ in 0..4 {
            unloaded.extend(audio_round(&c, &b, 50, &body).await);
            flooding.store(true, Relaxed);
            tokio::time::sleep(Duration::from_millis(150)).await;
            let text_busy = lane(&admin(&c, &b).await, "text")["inflight"].as_u64();
            assert!(text_busy > Some(0), "the flood is not running");
            loaded.extend(audio_round(&c, &b, 50, &body).await);
            flooding.store(false, Relaxed);
            wait_lane(&c, &b, "text", Duration::from_secs(2), |l| {
                l["inflight"] == 0
            })
            .await;
        }
        assert_eq!((unloaded.len(), loaded.len()), (200, 200));
        let (u, l) = (p99(unloaded), p99(loaded));
        eprintln!("audio p99 unloaded {u:?}, flooded {l:?} (200 samples each)");
        // Audio waiting behind text (a shared queue or cap) would wait for text holds of half a
        // second each and more than double p99. The bound is what survives a loaded 2-core box,
        // where the flood's own work (its clients and their 429s run in this process) costs the
        // audio path CPU (measured there: 1.30-1.66x); the strict figure (1.2x idle, real engines)
        // is bench/protection.sh's.
        let holds = l.as_secs_f64() <= u.as_secs_f64() * 1.5;
        verdicts.push(format!("{l:?} flooded vs {u:?} unloaded"));
        if holds {
            held = true;
            break;
        }
    }
    stop.store(true, Relaxed);
    for f in flood {
        f.await.unwrap();
    }
    let (served, refused) = (served.load(Relaxed), refused.load(Relaxed));
    eprintln!("text served {served}, refused {refused}");
    assert!(
        served >= 10 && refused >= 40,
        "the text lane was not flooded: {served} served, {refused} refused"
    );
    assert!(
        held,
        "audio p99 grew more than 50 % under the text flood: {verdicts:?}"
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_yielding_text_lane_waits_for_audio_to_end_or_for_max_yield() {
    let (_serial, up, g, c, b) = rig(|up| format!(
        "{}{}",
        text_lane(
            up,
            "max_inflight = 2\nmax_queue = 4\nqueue_timeout = \"5s\"\npolicy = \"queue\"\nyield_to = [\"audio\"]\nmax_yield = \"700ms\""
        ),
        audio_lane(
            up,
            "max_inflight = 1\nmax_queue = 4\npolicy = \"queue\"\npriority = 10"
        )
    )).await;

    // Half one: audio work (400 ms) ends before max_yield; text starts only after it ends.
    let (c1, b1) = (c.clone(), b.clone());
    let audio =
        tokio::spawn(async move { transcribe(&c1, &b1, "audio-short", 400).await.status() });
    wait_lane(&c, &b, "audio", Duration::from_secs(2), |l| {
        l["inflight"] == 1
    })
    .await;
    let sent = Instant::now();
    let (c2, b2) = (c.clone(), b.clone());
    let text = tokio::spawn(async move {
        chat(&c2, &b2, "text-1", &[("x-test-chunks", "1")], false)
            .await
            .status()
    });
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| l["queued"] == 1).await;
    assert_eq!(lane(&s, "text")["yielding"], true);
    assert_eq!(lane(&s, "text")["inflight"], 0);
    assert_eq!(audio.await.unwrap(), 200);
    assert_eq!(text.await.unwrap(), 200);
    let a = up.log.get("audio-short").unwrap();
    let t = up.log.get("text-1").unwrap();
    let audio_end = a.ended.unwrap();
    assert!(
        t.started >= audio_end,
        "text started before the audio work ended"
    );
    assert!(
        t.started - sent < Duration::from_millis(700),
        "text waited {:?}",
        t.started - sent
    );

    // Half two: audio stays busy (2 s); text is admitted once max_yield (700 ms) has passed.
    let (c1, b1) = (c.clone(), b.clone());
    let audio =
        tokio::spawn(async move { transcribe(&c1, &b1, "audio-long", 2000).await.status() });
    wait_lane(&c, &b, "audio", Duration::from_secs(2), |l| {
        l["inflight"] == 1
    })
    .await;
    let sent = Instant::now();
    let r = chat(&c, &b, "text-2", &[("x-test-chunks", "1")], false).await;
    assert_eq!(r.status(), 200);
    let t = up.log.get("text-2").unwrap();
    let waited = t.started - sent;
    assert!(
        waited >= Duration::from_millis(690),
        "text admitted after only {waited:?}"
    );
    assert!(
        up.log.get("audio-long").unwrap().ended.is_none(),
        "audio had already ended"
    );
    assert_eq!(audio.await.unwrap(), 200);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bounded_queue_serves_in_order_or_answers_503_at_queue_timeout() {
    let (_serial, up, g, c, b) = rig(|up| {
        text_lane(
            up,
            "max_inflight = 1\nmax_queue = 4\nqueue_timeout = \"800ms\"\npolicy = \"queue\"",
        )
    })
    .await;
    // Each request holds the only slot for 600 ms: long beside a loaded machine's stalls, so the
    // second request is served after one hold and the third times out in the queue.
    let hold = [("x-test-chunks", "1"), ("x-test-interval-ms", "600")];
    let mut tasks = Vec::new();
    for i in 0..5 {
        let (c2, b2) = (c.clone(), b.clone());
        tasks.push(tokio::spawn(async move {
            let sent = Instant::now();
            let r = chat(&c2, &b2, &format!("q{i}"), &hold, false).await;
            let status = r.status().as_u16();
            let wait_ms: Option<u64> = r
                .headers()
                .get("x-headroom-queue-wait-ms")
                .map(|v| v.to_str().unwrap().parse().unwrap());
            (i, status, sent.elapsed(), wait_ms, json_of(r).await)
        }));
        // Enter the queue in order.
        wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
            l["inflight"].as_u64().unwrap() + l["queued"].as_u64().unwrap() == i + 1
        })
        .await;
    }
    let full = chat(&c, &b, "q5", &hold, false).await;
    assert_eq!(full.status(), 429);
    assert_eq!(json_of(full).await["error"]["code"], "lane_queue_full");
    let mut served = Vec::new();
    let mut timed_out = 0;
    for t in tasks {
        let (i, status, elapsed, wait_ms, body) = t.await.unwrap();
        match status {
            200 => {
                served.push(i);
                assert!(wait_ms.unwrap() < 800, "q{i} waited {wait_ms:?} ms");
            }
            503 => {
                timed_out += 1;
                assert_eq!(body["error"]["code"], "queue_timeout");
                // At the queue timeout: not before it, and well before a second hold ends.
                assert!(
                    elapsed >= Duration::from_millis(795) && elapsed < Duration::from_millis(1800),
                    "q{i} answered 503 after {elapsed:?}"
                );
            }
            other => panic!("q{i}: status {other}"),
        }
    }
    let order: Vec<String> = up
        .log
        .all()
        .into_iter()
        .filter(|s| s.id.starts_with('q'))
        .map(|s| s.id)
        .collect();
    let expected: Vec<String> = served.iter().map(|i| format!("q{i}")).collect();
    assert_eq!(order, expected, "upstream saw requests out of order");
    assert!(
        served.len() >= 2 && timed_out >= 1,
        "served {served:?}, timed out {timed_out}"
    );
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 0
    })
    .await;
    assert_eq!(lane(&s, "text")["queued"], 0);
    assert_eq!(lane(&s, "text")["queue_timeouts"].as_u64(), Some(timed_out));
    // The queue-wait histogram counts the requests that timed out in the queue too, with their
    // whole wait: no p99 of a few ms while requests give up at the timeout.
    let waits = metric(&c, &b, "headroom_queue_wait_seconds_count{lane=\"text\"}").await;
    assert_eq!(waits, Some(served.len() as f64 + timed_out as f64));
    let over = metric(
        &c,
        &b,
        "headroom_queue_wait_seconds_bucket{lane=\"text\",le=\"0.5\"}",
    )
    .await
    .unwrap();
    assert!(
        waits.unwrap() - over >= timed_out as f64,
        "{timed_out} waits of 0.8 s above the 0.5 s bucket; {over} of {waits:?} at or below it"
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_the_queue_is_removed_at_once() {
    let (_serial, up, g, c, b) = rig(|up| {
        text_lane(
            up,
            "max_inflight = 1\nmax_queue = 4\nqueue_timeout = \"10s\"\npolicy = \"queue\"",
        )
    })
    .await;
    let (c1, b1) = (c.clone(), b.clone());
    let holder = tokio::spawn(async move {
        chat(
            &c1,
            &b1,
            "hold",
            &[("x-test-chunks", "1"), ("x-test-interval-ms", "1500")],
            false,
        )
        .await
        .status()
    });
    wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 1
    })
    .await;
    let (c2, b2) = (c.clone(), b.clone());
    let waiter = tokio::spawn(async move { chat(&c2, &b2, "leaver", &[], false).await });
    wait_lane(&c, &b, "text", Duration::from_secs(1), |l| l["queued"] == 1).await;
    waiter.abort();
    let s = wait_lane(&c, &b, "text", Duration::from_millis(500), |l| {
        l["queued"] == 0
    })
    .await;
    assert_eq!(
        lane(&s, "text")["queued"],
        0,
        "the queued client was not removed"
    );
    assert_eq!(lane(&s, "text")["cancelled_in_queue"], 1);
    assert_eq!(holder.await.unwrap(), 200);
    assert!(
        up.log.get("leaver").is_none(),
        "a request whose client left reached the upstream"
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_disconnect_mid_stream_cancels_the_upstream_at_once() {
    let (_serial, up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2")).await;
    let r = chat(
        &c,
        &b,
        "leave",
        &[("x-test-chunks", "500"), ("x-test-interval-ms", "10")],
        true,
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut seen = 0;
    while seen < 2 {
        let chunk = body.next().await.unwrap().unwrap();
        seen += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    drop(body);
    let left = Instant::now();
    let s = up
        .log
        .wait_ended("leave", Duration::from_secs(2))
        .await
        .unwrap();
    assert!(s.cancelled, "upstream finished instead of being cancelled");
    // Promptly: the stream had about 5 s left. Typically a few ms; the bound is what a loaded
    // 2-core box survives (a scheduling stall of several hundred ms is common there).
    let after = s.ended.unwrap() - left;
    assert!(
        after < Duration::from_secs(1),
        "upstream saw the cancel {after:?} after the client left"
    );
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 0
    })
    .await;
    assert_eq!(lane(&s, "text")["inflight"], 0);
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_requests_total{lane=\"text\",outcome=\"client_disconnected\"}"
        )
        .await,
        Some(1.0)
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_dying_mid_stream_ends_the_stream_with_an_error_event() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 1")).await;
    let r = chat(
        &c,
        &b,
        "dies",
        &[("x-test-chunks", "10"), ("x-test-die-after", "3")],
        true,
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r
        .text()
        .await
        .expect("the client sees a clean end of stream");
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{text}");
    let last: Value = serde_json::from_str(events[3].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "upstream_stream_error");
    assert_eq!(last["error"]["type"], "server_error");
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 0
    })
    .await;
    assert_eq!(lane(&s, "text")["inflight"], 0);
    // The one slot is free again and the gateway still serves.
    assert_eq!(chat(&c, &b, "after", &[], true).await.status(), 200);
    g.shutdown().await.unwrap();
}

/// Small deterministic generator for the fault mix.
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_rounds_of_mixed_faults_leave_every_gauge_at_zero() {
    let (_serial, _up, g, c, b) = rig(|up| format!(
        "{}{}",
        text_lane(
            up,
            "max_inflight = 4\nmax_queue = 4\nqueue_timeout = \"50ms\"\nrequest_timeout = \"150ms\"\npolicy = \"queue\"\nmax_body_bytes = \"32KiB\""
        ),
        audio_lane(
            up,
            "max_inflight = 2\nmax_queue = 2\nqueue_timeout = \"50ms\"\nrequest_timeout = \"150ms\"\npolicy = \"queue\""
        )
    )).await;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..16 {
        let (c, b, next) = (c.clone(), b.clone(), next.clone());
        workers.push(tokio::spawn(async move {
            let mut kinds = [0u32; 8];
            loop {
                let round = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if round >= 1000 {
                    return kinds;
                }
                let mut rng = round.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                let kind = (xorshift(&mut rng) % 8) as usize;
                kinds[kind] += 1;
                let id = format!("f{round}");
                match kind {
                    0 => {
                        // Normal short stream, read to the end.
                        let r = chat(
                            &c,
                            &b,
                            &id,
                            &[("x-test-chunks", "3"), ("x-test-interval-ms", "2")],
                            true,
                        )
                        .await;
                        let _ = r.bytes().await;
                    }
                    1 => {
                        // Client leaves after the first chunk.
                        let r = chat(
                            &c,
                            &b,
                            &id,
                            &[("x-test-chunks", "50"), ("x-test-interval-ms", "5")],
                            true,
                        )
                        .await;
                        let mut s = r.bytes_stream();
                        let _ = s.next().await;
                    }
                    2 => {
                        // Upstream resets mid-stream.
                        let r = chat(
                            &c,
                            &b,
                            &id,
                            &[("x-test-chunks", "5"), ("x-test-die-after", "1")],
                            true,
                        )
                        .await;
                        let _ = r.bytes().await;
                    }
                    3 => {
                        // Deadline passes mid-stream.
                        let r = chat(
                            &c,
                            &b,
                            &id,
                            &[("x-test-chunks", "20"), ("x-test-interval-ms", "20")],
                            true,
                        )
                        .await;
                        let _ = r.bytes().await;
                    }
                    4 => {
                        // Oversize body.
                        let big = "x".repeat(40 * 1024);
                        let body =
                            json!({"model": "m", "messages": [{"role": "user", "content": big}]})
                                .to_string();
                        let r = c
                            .post(format!("{b}/v1/chat/completions"))
                            .header("content-type", "application/json")
                            .body(body)
                            .send()
                            .await
                            .unwrap();
                        assert_eq!(r.status(), 413);
                    }
                    5 => {
                        // Client gives up while queued or waiting for the upstream.
                        let fut = chat(
                            &c,
                            &b,
                            &id,
                            &[("x-test-chunks", "1"), ("x-test-interval-ms", "100")],
                            false,
                        );
                        let _ = tokio::time::timeout(Duration::from_millis(5), fut).await;
                    }
                    6 => {
                        // Upstream deadline before headers (non-streaming, slow).
                        let r = chat(&c, &b, &id, &[("x-test-delay-ms", "300")], false).await;
                        let _ = r.bytes().await;
                    }
                    _ => {
                        // Audio that the client abandons or that completes.
                        let fut = transcribe(&c, &b, &id, 20);
                        if round % 2 == 0 {
                            let _ = tokio::time::timeout(Duration::from_millis(5), fut).await;
                        } else {
                            let _ = fut.await.bytes().await;
                        }
                    }
                }
            }
        }));
    }
    let mut kinds = [0u32; 8];
    for w in workers {
        for (k, n) in w.await.unwrap().iter().enumerate() {
            kinds[k] += n;
        }
    }
    let took = started.elapsed();
    eprintln!("1000 fault rounds in {took:?}: {kinds:?}");
    assert_eq!(kinds.iter().sum::<u32>(), 1000);
    assert!(
        kinds.iter().all(|&n| n > 50),
        "every fault kind ran: {kinds:?}"
    );
    for name in ["text", "audio"] {
        let s = wait_lane(&c, &b, name, Duration::from_secs(3), |l| {
            l["inflight"] == 0 && l["queued"] == 0
        })
        .await;
        let l = lane(&s, name);
        assert_eq!(
            (l["inflight"].as_u64(), l["queued"].as_u64()),
            (Some(0), Some(0)),
            "{name}: {l}"
        );
        assert_eq!(
            l["admitted"], l["completed"],
            "{name}: a permit was not released exactly once"
        );
        assert_eq!(
            metric(
                &c,
                &b,
                &format!("headroom_lane_inflight{{lane=\"{name}\"}}")
            )
            .await,
            Some(0.0)
        );
        assert_eq!(
            metric(
                &c,
                &b,
                &format!("headroom_lane_queue_depth{{lane=\"{name}\"}}")
            )
            .await,
            Some(0.0)
        );
    }
    assert_eq!(admin(&c, &b).await["total_inflight"], 0);
    // The gateway still serves afterwards.
    assert_eq!(chat(&c, &b, "final", &[], true).await.status(), 200);
    g.shutdown().await.unwrap();
}

/// (name, method, url, content type, body, status, code, param)
type BadInput<'a> = (
    &'a str,
    &'a str,
    String,
    &'a str,
    Vec<u8>,
    u16,
    &'a str,
    Option<&'a str>,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_its_documented_status_and_code_and_the_server_keeps_serving() {
    let (_serial, _up, g, c, b) = rig(|up| format!(
        "{}{}",
        text_lane(
            up,
            "max_inflight = 2\nmax_body_bytes = \"64KiB\"\nmax_output_tokens = 100\noutput_tokens_mode = \"reject\""
        ),
        audio_lane(up, "max_inflight = 1\nmax_audio_seconds = 5.0")
    )).await;
    let chat_url = format!("{b}/v1/chat/completions");
    let audio_url = format!("{b}/v1/audio/transcriptions");
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let nested = format!(
        "{{\"model\":\"m\",\"messages\":{}1{}}}",
        "[".repeat(100),
        "]".repeat(100)
    );
    let (mp_ct, long_audio) = multipart_body(Some(&wav(10.0)), "whisper-1");
    let (_, not_audio) = multipart_body(Some(b"this is a text file, not audio"), "whisper-1");
    let (_, no_file) = multipart_body(None, "whisper-1");
    let (_, good_audio) = multipart_body(Some(&wav(1.0)), "whisper-1");
    let broken = good_audio[..good_audio.len() - 30].to_vec();
    let speech_url = format!("{b}/v1/audio/speech");
    let (_, empty_file) = multipart_body(Some(b""), "whisper-1");
    let unterminated = String::from_utf8_lossy(&good_audio)
        .replacen("filename=\"a.wav\"", "filename=\"a.wav", 1)
        .into_bytes();
    let json_ct = "application/json";
    // (name, method, url, content type, body, status, code, param)
    let cases: Vec<BadInput> = vec![
        (
            "malformed JSON",
            "POST",
            chat_url.clone(),
            json_ct,
            b"{\"model\": \"m\", ".to_vec(),
            400,
            "invalid_json",
            None,
        ),
        (
            "wrong content type",
            "POST",
            chat_url.clone(),
            "text/plain",
            json!({"model": "m", "messages": msgs})
                .to_string()
                .into_bytes(),
            415,
            "unsupported_media_type",
            None,
        ),
        (
            "missing model",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"messages": msgs}).to_string().into_bytes(),
            400,
            "missing_model",
            Some("model"),
        ),
        (
            "negative max_tokens",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": msgs, "max_tokens": -5})
                .to_string()
                .into_bytes(),
            400,
            "invalid_value",
            Some("max_tokens"),
        ),
        (
            "huge max_tokens",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": msgs, "max_tokens": 1_000_000_000u64})
                .to_string()
                .into_bytes(),
            400,
            "max_tokens_too_large",
            Some("max_tokens"),
        ),
        (
            "messages not an array",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": "hi"})
                .to_string()
                .into_bytes(),
            422,
            "invalid_type",
            Some("messages"),
        ),
        (
            "oversize body",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(70_000)}]})
                .to_string()
                .into_bytes(),
            413,
            "body_too_large",
            None,
        ),
        (
            "deeply nested JSON",
            "POST",
            chat_url.clone(),
            json_ct,
            nested.into_bytes(),
            400,
            "json_too_deep",
            None,
        ),
        (
            "audio over the duration cap",
            "POST",
            audio_url.clone(),
            &mp_ct,
            long_audio,
            413,
            "audio_too_long",
            Some("file"),
        ),
        (
            "a file that is not audio",
            "POST",
            audio_url.clone(),
            &mp_ct,
            not_audio,
            415,
            "unsupported_audio",
            Some("file"),
        ),
        (
            "broken multipart",
            "POST",
            audio_url.clone(),
            &mp_ct,
            broken,
            400,
            "invalid_multipart",
            None,
        ),
        (
            "form without its file",
            "POST",
            audio_url.clone(),
            &mp_ct,
            no_file,
            400,
            "missing_file",
            Some("file"),
        ),
        (
            "audio as JSON",
            "POST",
            audio_url.clone(),
            json_ct,
            b"{}".to_vec(),
            415,
            "unsupported_media_type",
            None,
        ),
        (
            "unknown route",
            "POST",
            format!("{b}/v1/embeddings"),
            json_ct,
            b"{}".to_vec(),
            404,
            "unknown_route",
            None,
        ),
        (
            "wrong method",
            "GET",
            chat_url.clone(),
            json_ct,
            Vec::new(),
            405,
            "method_not_allowed",
            None,
        ),
        (
            "content is a number",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "user", "content": 42}]}).to_string().into_bytes(),
            400,
            "invalid_type",
            Some("messages[0].content"),
        ),
        (
            "content is an object",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "user", "content": {"text": "hi"}}]}).to_string().into_bytes(),
            400,
            "invalid_type",
            Some("messages[0].content"),
        ),
        (
            "a role that does not exist",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}).to_string().into_bytes(),
            400,
            "invalid_value",
            Some("messages[0].role"),
        ),
        (
            "a message without a role",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"content": "hi"}]}).to_string().into_bytes(),
            400,
            "missing_field",
            Some("messages[0].role"),
        ),
        (
            "no messages",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": []}).to_string().into_bytes(),
            400,
            "invalid_value",
            Some("messages"),
        ),
        (
            "a content part without a type",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "user", "content": [{"text": "hi"}]}]}).to_string().into_bytes(),
            400,
            "invalid_type",
            Some("messages[0].content[0]"),
        ),
        (
            "stream is not a boolean",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": msgs, "stream": "yes"}).to_string().into_bytes(),
            422,
            "invalid_type",
            Some("stream"),
        ),
        (
            "model is not a string",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": 7, "messages": msgs}).to_string().into_bytes(),
            422,
            "invalid_type",
            Some("model"),
        ),
        (
            "body is not an object",
            "POST",
            chat_url.clone(),
            json_ct,
            b"[1, 2]".to_vec(),
            400,
            "invalid_json",
            None,
        ),
        (
            "zero max_completion_tokens",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": msgs, "max_completion_tokens": 0}).to_string().into_bytes(),
            400,
            "invalid_value",
            Some("max_completion_tokens"),
        ),
        (
            "chat audio that is not base64",
            "POST",
            chat_url.clone(),
            json_ct,
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "**not base64**", "format": "wav"}}]}]}).to_string().into_bytes(),
            400,
            "invalid_audio_encoding",
            Some("messages"),
        ),
        (
            "multipart without a boundary",
            "POST",
            audio_url.clone(),
            "multipart/form-data",
            good_audio.clone(),
            400,
            "invalid_multipart",
            None,
        ),
        (
            "unterminated quoted filename",
            "POST",
            audio_url.clone(),
            &mp_ct,
            unterminated.clone(),
            400,
            "invalid_multipart",
            None,
        ),
        (
            "an empty file part",
            "POST",
            audio_url.clone(),
            &mp_ct,
            empty_file.clone(),
            400,
            "missing_file",
            Some("file"),
        ),
        (
            "speech without input",
            "POST",
            speech_url.clone(),
            json_ct,
            json!({"model": "tts-1", "voice": "a"}).to_string().into_bytes(),
            400,
            "missing_field",
            Some("input"),
        ),
    ];
    for (name, method, url, ct, body, status, code, param) in cases {
        let r = c
            .request(method.parse().unwrap(), &url)
            .header("content-type", ct)
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(r.status().as_u16(), status, "{name}");
        let v = json_of(r).await;
        let e = &v["error"];
        assert_eq!(e["code"], code, "{name}: {v}");
        assert_eq!(e["param"].as_str(), param, "{name}: {v}");
        assert!(!e["message"].as_str().unwrap_or("").is_empty(), "{name}");
        assert!(e["type"].is_string(), "{name}");
        // The server keeps serving after every case.
        assert_eq!(
            chat(&c, &b, "ok", &[], false).await.status(),
            200,
            "after {name}"
        );
    }
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_bad_requests_total{code=\"audio_too_long\"}"
        )
        .await,
        Some(1.0)
    );
    let huge = "h".repeat(20_000);
    let r = chat(&c, &b, "big-header", &[("x-big", huge.as_str())], false).await;
    assert_eq!(r.status(), 431);
    assert_eq!(json_of(r).await["error"]["code"], "headers_too_large");
    let r = chat(&c, &b, "lane", &[("x-headroom-lane", "nope")], false).await;
    assert_eq!(r.status(), 400);
    assert_eq!(json_of(r).await["error"]["param"], "x-headroom-lane");
    let r = transcribe(&c, &b, "good-audio", 5).await;
    assert_eq!(r.status(), 200);
    assert_eq!(json_of(r).await["text"], "hello from the gateway test");
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fallback_policy_answers_overload_with_a_rule_based_cleanup() {
    let (_serial, up, g, c, b) = rig(|up| text_lane(
        up,
        "max_inflight = 1\nmax_queue = 0\npolicy = \"fallback\"\nfallback = \"rule-based-cleanup\"",
    )).await;
    let (c1, b1) = (c.clone(), b.clone());
    let holder = tokio::spawn(async move {
        chat(
            &c1,
            &b1,
            "hold",
            &[("x-test-chunks", "1"), ("x-test-interval-ms", "800")],
            false,
        )
        .await
        .status()
    });
    wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 1
    })
    .await;
    let r = chat(&c, &b, "fb", &[], false).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-headroom-fallback"], "rule-based-cleanup");
    let v = json_of(r).await;
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "So I think the plan works."
    );
    let r = chat(&c, &b, "fb-stream", &[], true).await;
    assert_eq!(r.headers()["x-headroom-fallback"], "rule-based-cleanup");
    let text = r.text().await.unwrap();
    assert!(text.contains("So I think the plan works."), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert!(up.log.get("fb").is_none() && up.log.get("fb-stream").is_none());
    assert_eq!(holder.await.unwrap(), 200);
    assert_eq!(
        metric(&c, &b, "headroom_fallbacks_total{lane=\"text\"}").await,
        Some(2.0)
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn upstream_errors_in_other_shapes_reach_the_client_in_openai_shape() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2")).await;
    let r = chat(
        &c,
        &b,
        "e1",
        &[
            ("x-test-status", "422"),
            ("x-test-error-body", "{\"detail\":\"bad field\"}"),
        ],
        false,
    )
    .await;
    assert_eq!(r.status(), 422);
    let v = json_of(r).await;
    assert_eq!(v["error"]["message"], "bad field");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let r = chat(
        &c,
        &b,
        "e2",
        &[
            ("x-test-status", "500"),
            ("x-test-error-body", "Internal Server Error"),
        ],
        false,
    )
    .await;
    assert_eq!(r.status(), 500);
    let v = json_of(r).await;
    assert_eq!(v["error"]["message"], "Internal Server Error");
    assert_eq!(v["error"]["code"], "upstream_error");
    assert_eq!(admin(&c, &b).await["lanes"][0]["inflight"], 0);
    g.shutdown().await.unwrap();
}

/// Found by the drill's hour: llama.cpp restarted after a kill answered two requests 503
/// "Loading model" without a Retry-After, and the gateway passed them on so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_refusal_reaches_the_client_with_a_retry_after() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2")).await;
    let loading = r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#;
    let r = chat(
        &c,
        &b,
        "loading",
        &[("x-test-status", "503"), ("x-test-error-body", loading)],
        false,
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(json_of(r).await["error"]["message"], "Loading model");
    let r = chat(
        &c,
        &b,
        "busy",
        &[
            ("x-test-status", "429"),
            ("x-test-error-body", "slow down"),
            ("x-test-retry-after", "7"),
        ],
        false,
    )
    .await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    assert_eq!(r.headers()["retry-after-ms"], "7000");
    let r = chat(
        &c,
        &b,
        "broken",
        &[("x-test-status", "500"), ("x-test-error-body", "boom")],
        false,
    )
    .await;
    assert_eq!(r.status(), 500);
    assert!(r.headers().get("retry-after").is_none());
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn output_tokens_are_capped_and_speech_streams_back_binary() {
    let (_serial, up, g, c, b) = rig(|up| {
        format!(
            "{}{}",
            text_lane(up, "max_inflight = 2\nmax_output_tokens = 64"),
            audio_lane(up, "max_inflight = 1")
        )
    })
    .await;
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000})
            .to_string();
    let r = c
        .post(format!("{b}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-test-id", "cap")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(up.log.get("cap").unwrap().max_tokens, Some(64));
    let r = c
        .post(format!("{b}/v1/audio/speech"))
        .header("content-type", "application/json")
        .body(json!({"model": "tts", "input": "hello", "voice": "a"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "audio/wav");
    let audio = r.bytes().await.unwrap();
    assert_eq!(audio.len(), 4000);
    assert!(audio[3000..].iter().all(|b| *b == 3));
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engine_metrics_hold_admission_while_the_engine_queue_is_long() {
    let (_serial, up, g, c, b) = rig(|up| {
        *up.metrics_text.lock().unwrap() = "vllm:num_requests_waiting{model_name=\"m\"} 5\nvllm:num_requests_running{model_name=\"m\"} 8\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.97\n".into();
        text_lane(up, "max_inflight = 4\nengine = \"vllm\"\nengine_max_waiting = 2\nengine_metrics_stale_after = \"2s\"")
            .replace("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:0\"\nscrape_interval = \"50ms\"")
    })
    .await;
    let s = wait_lane(&c, &b, "text", Duration::from_secs(2), |l| {
        l["upstreams"][0]["waiting"] == 5.0
    })
    .await;
    assert_eq!(lane(&s, "text")["upstreams"][0]["kv_cache_usage"], 0.97);
    let r = chat(&c, &b, "held", &[], false).await;
    assert_eq!(r.status(), 429);
    assert_eq!(json_of(r).await["error"]["code"], "engine_saturated");
    let kv = metric(
        &c,
        &b,
        &format!(
            "headroom_upstream_kv_cache_usage{{upstream=\"{}\"}}",
            up.url()
        ),
    )
    .await;
    assert_eq!(kv, Some(0.97));
    *up.metrics_text.lock().unwrap() = "vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n".into();
    wait_lane(&c, &b, "text", Duration::from_secs(2), |l| {
        l["upstreams"][0]["waiting"] == 0.0
    })
    .await;
    assert_eq!(chat(&c, &b, "free", &[], false).await.status(), 200);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_are_required_when_configured_and_not_forwarded() {
    let (_serial, up, g, c, b) = rig(|up| {
        text_lane(up, "max_inflight = 2").replace(
            "listen = \"127.0.0.1:0\"",
            "listen = \"127.0.0.1:0\"\napi_keys = [\"sekrit-key\"]",
        )
    })
    .await;
    let r = chat(&c, &b, "none", &[], false).await;
    assert_eq!(r.status(), 401);
    assert_eq!(json_of(r).await["error"]["code"], "invalid_api_key");
    assert_eq!(
        chat(
            &c,
            &b,
            "wrong",
            &[("authorization", "Bearer sekrit-kez")],
            false
        )
        .await
        .status(),
        401
    );
    assert_eq!(
        c.get(format!("{b}/admin/lanes"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        c.get(format!("{b}/healthz")).send().await.unwrap().status(),
        200
    );
    assert_eq!(
        chat(
            &c,
            &b,
            "right",
            &[("authorization", "Bearer sekrit-key")],
            false
        )
        .await
        .status(),
        200
    );
    assert_eq!(up.log.get("right").unwrap().authorization, None);
    assert!(up.log.get("wrong").is_none());
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn models_are_merged_and_readiness_follows_upstreams() {
    let (_serial, _up, g, c, b) = rig(|up| {
        format!(
            "{}{}",
            text_lane(up, ""),
            audio_lane(up, "").replace(&up.url(), "http://127.0.0.1:9")
        )
    })
    .await;
    let v = json_of(c.get(format!("{b}/v1/models")).send().await.unwrap()).await;
    assert_eq!(v["data"][0]["id"], "test-model");
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
    let r = c.get(format!("{b}/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let v = json_of(r).await;
    assert_eq!(v["upstreams"][0]["reachable"], true);
    assert_eq!(v["upstreams"][1]["reachable"], false);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chat_requests_carrying_audio_go_to_the_chat_audio_lane_with_its_duration_cap() {
    let (_serial, _up, g, c, b) = rig(|up| format!(
        "{}[[lanes]]\nname = \"voice-chat\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{}\"]\nchat_audio = true\nmax_audio_seconds = 5.0\n",
        text_lane(up, "max_inflight = 2"),
        up.url()
    )).await;
    let b64 = |d: &[u8]| {
        const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in d.chunks(3) {
            let n = chunk.iter().fold(0u32, |a, x| (a << 8) | *x as u32) << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
            for _ in chunk.len()..3 {
                out.push('=');
            }
        }
        out
    };
    let with_audio = |secs: f64| {
        json!({"model": "vibevoice", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "transcribe"},
            {"type": "input_audio", "input_audio": {"data": b64(&wav(secs)), "format": "wav"}}]}]})
        .to_string()
    };
    let r = c
        .post(format!("{b}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(with_audio(2.0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-headroom-lane"], "voice-chat");
    let r = c
        .post(format!("{b}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(with_audio(9.0))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert_eq!(json_of(r).await["error"]["code"], "audio_too_long");
    let r = chat(&c, &b, "plain", &[], false).await;
    assert_eq!(r.headers()["x-headroom-lane"], "text");
    g.shutdown().await.unwrap();
}

const MINIMAL_CONFIG: &str = r#"listen = "127.0.0.1:8080"
[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["http://127.0.0.1:8000"]
max_inflight = 2
max_queue = 0
queue_timeout = "5s"
request_timeout = "60s"
policy = "reject"
[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech"]
upstreams = ["http://127.0.0.1:8001"]
max_inflight = 1
max_queue = 8
queue_timeout = "30s"
request_timeout = "120s"
policy = "queue"
"#;

/// Starts the real binary; returns the child and the address it printed.
pub(crate) fn start_binary(
    config: &std::path::Path,
    extra: &[&str],
) -> (std::process::Child, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"));
    command.arg("serve").arg("--config").arg(config).args(extra);
    start_serving(command)
}

/// Starts `command` (a `headroom serve`) and reads the address it listens on.
pub(crate) fn start_serving(mut command: std::process::Command) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (child, addr)
}

pub(crate) fn sigterm(child: &std::process::Child) {
    let ok = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(ok.success());
}

pub(crate) fn wait_exit(
    child: &mut std::process::Child,
    within: Duration,
) -> std::process::ExitStatus {
    let until = std::time::Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            panic!("headroom serve did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_binary_serves_the_minimal_config_and_exits_on_sigterm() {
    let _serial = SERIAL.lock().await;
    let (_dir, path) = config_file(MINIMAL_CONFIG);
    let check = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let (mut child, addr) = start_binary(&path, &["--listen", "127.0.0.1:0"]);
    let c = client();
    let b = format!("http://{addr}");
    let v = admin(&c, &b).await;
    let lanes = v["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 2);
    for (l, (name, max_inflight, max_queue)) in lanes.iter().zip([("text", 2, 0), ("audio", 1, 8)])
    {
        assert_eq!(l["name"], name);
        assert_eq!(l["inflight"], 0);
        assert_eq!(l["queued"], 0);
        assert_eq!(l["rejected"], 0);
        assert_eq!(l["max_inflight"], max_inflight);
        assert_eq!(l["max_queue"], max_queue);
    }
    assert_eq!(
        c.get(format!("{b}/healthz")).send().await.unwrap().status(),
        200
    );
    sigterm(&child);
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_lets_an_inflight_stream_finish_then_stops_accepting() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let (_dir, path) = config_file(&text_lane(&up, "max_inflight = 2").replace(
        "listen = \"127.0.0.1:0\"",
        "listen = \"127.0.0.1:0\"\nshutdown_grace = \"5s\"",
    ));
    let (mut child, addr) = start_binary(&path, &[]);
    let c = client();
    let b = format!("http://{addr}");
    let r = chat(
        &c,
        &b,
        "drain",
        &[("x-test-chunks", "10"), ("x-test-interval-ms", "60")],
        true,
    )
    .await;
    assert_eq!(r.status(), 200);
    tokio::time::sleep(Duration::from_millis(150)).await;
    sigterm(&child);
    let text = r.text().await.unwrap();
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "stream cut short by shutdown: {text}"
    );
    assert_eq!(text.matches("chat.completion.chunk").count(), 10);
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(
        c.get(format!("{b}/healthz")).send().await.is_err(),
        "still accepting after drain"
    );
}

#[test]
fn serve_refuses_bad_configs_with_one_line_and_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "listen = \"0.0.0.0:8080\"\n[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://127.0.0.1:1\"]\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("api_keys"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--print-example-config"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let example = String::from_utf8(out.stdout).unwrap();
    std::fs::write(&path, &example).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(["serve", "--check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the printed example does not validate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_official_openai_python_client_streams_and_transcribes_through_the_gateway() {
    let _serial = SERIAL.lock().await;
    // scripts/test.sh points this at the venv scripts/backends.sh installs.
    let python = std::env::var("HEADROOM_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let has_openai = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_openai {
        assert!(
            std::env::var_os("HEADROOM_REQUIRE_PY").is_none(),
            "HEADROOM_REQUIRE_PY is set but the `openai` Python package is missing"
        );
        eprintln!(
            "SKIPPED: the `openai` Python package is not installed (scripts/test.sh installs it)"
        );
        return;
    }
    let up = serve_upstream::start().await;
    let toml = format!(
        "{}{}",
        text_lane(&up, "max_inflight = 2"),
        audio_lane(&up, "max_inflight = 1\nmax_audio_seconds = 30.0")
    );
    let g = gateway(&toml).await;
    let dir = tempfile::tempdir().unwrap();
    let audio = dir.path().join("hello.wav");
    std::fs::write(&audio, wav(1.5)).unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/py/openai_client.py");
    let out = tokio::process::Command::new(&python)
        .arg(script)
        .arg(format!("{}/v1", base(&g)))
        .arg(&audio)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(v["chunks"], 3);
    assert_eq!(v["content"], "tok0 tok1 tok2 ");
    assert_eq!(v["transcript"], "hello from the gateway test");
    assert_eq!(v["rate_limited_status"], 429);
    let seen = up.log.all();
    let t = seen
        .iter()
        .find(|s| s.path == "/v1/audio/transcriptions")
        .expect("transcription reached the upstream");
    assert!(
        t.body_len > 24_000,
        "audio upload was not forwarded whole: {} bytes",
        t.body_len
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_a_non_streaming_request_aborts_the_upstream() {
    let (_serial, up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 1")).await;
    let request = chat(&c, &b, "slow", &[("x-test-delay-ms", "3000")], false);
    assert!(
        tokio::time::timeout(Duration::from_millis(300), request)
            .await
            .is_err()
    );
    let left = Instant::now();
    let s = up
        .log
        .wait_ended("slow", Duration::from_secs(2))
        .await
        .unwrap();
    assert!(s.cancelled, "the upstream finished the abandoned request");
    // Promptly: the upstream had 2.7 s left; the bound survives a loaded 2-core box.
    let after = s.ended.unwrap() - left;
    assert!(
        after < Duration::from_secs(1),
        "upstream saw the abort {after:?} after the client left"
    );
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 0
    })
    .await;
    assert_eq!(lane(&s, "text")["inflight"], 0);
    g.shutdown().await.unwrap();
}

/// A GPU whose free memory the test sets.
struct TestGpu(std::sync::atomic::AtomicU64);

impl headroom_gpu::GpuProbe for TestGpu {
    fn snapshot(&self) -> Result<Vec<headroom_gpu::DeviceSnapshot>, headroom_gpu::ProbeError> {
        let free = self.0.load(std::sync::atomic::Ordering::Relaxed);
        let total = 24u64 << 30;
        Ok(vec![headroom_gpu::DeviceSnapshot {
            index: 0,
            name: "test gpu".into(),
            uuid: "GPU-test".into(),
            total_bytes: total,
            used_bytes: total - free,
            free_bytes: free,
            reserved_bytes: 0,
            utilization_percent: None,
            mig_enabled: None,
            processes: vec![],
        }])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audio_admission_follows_free_gpu_memory_per_audio_second() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nscrape_interval = \"50ms\"\n{}",
        audio_lane(
            &up,
            "max_inflight = 4\nmax_audio_seconds = 60.0\ngpu_memory_per_job = \"1GiB\"\ngpu_memory_per_audio_second = \"100MiB\"\ngpu_memory_margin = \"512MiB\""
        )
    );
    let gpu = std::sync::Arc::new(TestGpu(std::sync::atomic::AtomicU64::new(2 << 30)));
    let config = ServeSettings::from_toml(&toml).unwrap();
    let g = headroom_server::spawn(config, Some(gpu.clone()))
        .await
        .unwrap();
    let (c, b) = (client(), base(&g));
    let send = |secs: f64| {
        let (ct, body) = multipart_body(Some(&wav(secs)), "whisper-1");
        c.post(format!("{b}/v1/audio/transcriptions"))
            .header("content-type", ct)
            .body(body)
            .send()
    };
    // 2 GiB free: 1 GiB + 5 s x 100 MiB + 512 MiB fits; 1 GiB + 6 s x 100 MiB + 512 MiB does not,
    // and with no job running none can make room: 503 at once (only memory outside the lanes'
    // jobs coming back could change it).
    assert_eq!(send(5.0).await.unwrap().status(), 200);
    let r = send(6.0).await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let e = json_of(r).await;
    assert_eq!(e["error"]["code"], "gpu_memory");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 2048 MiB would be free once every admitted job has ended"),
        "{e}"
    );
    gpu.0.store(4 << 30, std::sync::atomic::Ordering::Relaxed);
    // Readings reach the gate from the memory feed's next tick, not from the request.
    let until = Instant::now() + Duration::from_secs(5);
    while g.gate.snapshot().memory[0].free_bytes != Some(4 << 30) {
        assert!(Instant::now() < until, "the new reading never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(send(6.0).await.unwrap().status(), 200);
    // An M4A's length cannot be read: it counts as the longest allowed clip (60 s), so
    // 1 GiB + 60 s x 100 MiB + 512 MiB does not fit 4 GiB (counted as zero seconds it would).
    let (ct, body) = multipart_body(Some(b"\0\0\0\x20ftypM4A \0\0\0\0\0\0"), "whisper-1");
    let r = c
        .post(format!("{b}/v1/audio/transcriptions"))
        .header("content-type", ct)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let e = json_of(r).await;
    assert_eq!(e["error"]["code"], "gpu_memory", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("need_bytes={}", (1u64 << 30) + 6000 * (1 << 20))),
        "{e}"
    );
    // The sampler publishes memory in use.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        metric(&c, &b, "headroom_gpu_memory_used_bytes{gpu=\"0\"}").await,
        Some((20u64 << 30) as f64)
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_input_tokens_counts_with_the_configured_tokenizer() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let tok = dir.path().join("tokenizer.json");
    std::fs::write(&tok, headroom_server::tokens::TEST_TOKENIZER_JSON).unwrap();
    // "a b c d e f g h" is 15 characters: about 4 tokens by the estimate, 8 by the tokenizer.
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "a b c d e f g h"}]})
        .to_string();
    let post = |c: &reqwest::Client, b: &str| {
        c.post(format!("{b}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
    };
    let estimated = gateway(&text_lane(&up, "max_inflight = 1\nmax_input_tokens = 6")).await;
    let (c, b) = (client(), base(&estimated));
    assert_eq!(post(&c, &b).await.unwrap().status(), 200);
    estimated.shutdown().await.unwrap();
    let counted = gateway(&text_lane(
        &up,
        &format!(
            "max_inflight = 1\nmax_input_tokens = 6\ntokenizer = \"{}\"",
            tok.display()
        ),
    ))
    .await;
    let b = base(&counted);
    let r = post(&c, &b).await.unwrap();
    assert_eq!(r.status(), 400);
    let v = json_of(r).await;
    assert_eq!(v["error"]["code"], "input_too_long");
    assert_eq!(v["error"]["param"], "messages");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("8 tokens"),
        "{v}"
    );
    counted.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deadlines_end_requests_with_504_or_a_final_error_event() {
    let (_serial, up, g, c, b) =
        rig(|up| text_lane(up, "max_inflight = 2\nrequest_timeout = \"1500ms\"")).await;
    // Before the response starts: 504 at the lane's deadline, long before the upstream's 10 s.
    // The time scale (1.5 s deadline, 100 ms client deadline, 10 s upstream) keeps the three
    // apart by more than a loaded 2-core box stalls.
    let started = Instant::now();
    let r = chat(
        &c,
        &b,
        "slow-headers",
        &[("x-test-delay-ms", "10000")],
        false,
    )
    .await;
    assert_eq!(r.status(), 504);
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1450) && took < Duration::from_secs(5),
        "504 after {took:?} with a 1.5 s deadline"
    );
    assert_eq!(json_of(r).await["error"]["code"], "deadline");
    // The client's own shorter deadline header wins.
    let started = Instant::now();
    let r = chat(
        &c,
        &b,
        "client-deadline",
        &[
            ("x-test-delay-ms", "10000"),
            ("x-headroom-timeout-ms", "100"),
        ],
        false,
    )
    .await;
    assert_eq!(r.status(), 504);
    assert!(
        started.elapsed() < Duration::from_millis(1000),
        "{:?} with a 100 ms client deadline under a 1.5 s lane deadline",
        started.elapsed()
    );
    // Mid-stream: a final error event, and the upstream is cancelled.
    let r = chat(
        &c,
        &b,
        "slow-stream",
        &[("x-test-chunks", "200"), ("x-test-interval-ms", "50")],
        true,
    )
    .await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], "deadline", "{text}");
    let s = up
        .log
        .wait_ended("slow-stream", Duration::from_secs(1))
        .await
        .unwrap();
    assert!(s.cancelled);
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_requests_total{lane=\"text\",outcome=\"deadline\"}"
        )
        .await,
        Some(3.0)
    );
    let s = wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 0
    })
    .await;
    assert_eq!(lane(&s, "text")["inflight"], 0);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_inflight_total_caps_all_lanes_on_the_device_together() {
    let (_serial, up, g, c, b) = rig(|up| format!(
        "{}{}",
        text_lane(up, "max_inflight = 2\npolicy = \"reject\"").replace(
            "listen = \"127.0.0.1:0\"",
            "listen = \"127.0.0.1:0\"\nmax_inflight_total = 2"
        ),
        audio_lane(
            up,
            "max_inflight = 2\nmax_queue = 2\npolicy = \"queue\"\nqueue_timeout = \"3s\"\npriority = 10"
        )
    )).await;
    let mut holders = Vec::new();
    for i in 0..2 {
        let (c, b) = (c.clone(), b.clone());
        holders.push(tokio::spawn(async move {
            chat(
                &c,
                &b,
                &format!("h{i}"),
                &[("x-test-chunks", "1"), ("x-test-interval-ms", "400")],
                false,
            )
            .await
            .status()
        }));
    }
    wait_lane(&c, &b, "text", Duration::from_secs(1), |l| {
        l["inflight"] == 2
    })
    .await;
    // The device is full: audio waits in its queue (its own lane has room).
    let (c2, b2) = (c.clone(), b.clone());
    let sent = Instant::now();
    let audio =
        tokio::spawn(async move { transcribe(&c2, &b2, "audio-capped", 10).await.status() });
    let s = wait_lane(&c, &b, "audio", Duration::from_secs(1), |l| {
        l["queued"] == 1
    })
    .await;
    assert_eq!(s["total_inflight"], 2);
    assert_eq!(s["max_inflight_total"], 2);
    // When a text request ends, the waiting audio request takes the freed device slot.
    for h in holders {
        assert_eq!(h.await.unwrap(), 200);
    }
    assert_eq!(audio.await.unwrap(), 200);
    let a = up.log.get("audio-capped").unwrap();
    assert!(
        a.started - sent >= Duration::from_millis(300),
        "audio ran before a device slot freed"
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_stops_waiting_for_inflight_work_after_the_grace_period() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let (_dir, path) = config_file(&text_lane(&up, "max_inflight = 2").replace(
        "listen = \"127.0.0.1:0\"",
        "listen = \"127.0.0.1:0\"\nshutdown_grace = \"300ms\"",
    ));
    let (mut child, addr) = start_binary(&path, &[]);
    let c = client();
    let b = format!("http://{addr}");
    // A stream that would take 10 s.
    let r = chat(
        &c,
        &b,
        "too-long",
        &[("x-test-chunks", "200"), ("x-test-interval-ms", "50")],
        true,
    )
    .await;
    assert_eq!(r.status(), 200);
    let signalled = std::time::Instant::now();
    sigterm(&child);
    let status = wait_exit(&mut child, Duration::from_secs(10));
    let took = signalled.elapsed();
    assert!(status.success(), "{status:?}");
    // After the grace, well before the stream's end (the bound survives a loaded 2-core box).
    assert!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM with a 300 ms grace"
    );
    assert!(
        !r.text()
            .await
            .unwrap_or_default()
            .ends_with("data: [DONE]\n\n")
    );
    let s = up
        .log
        .wait_ended("too-long", Duration::from_secs(2))
        .await
        .unwrap();
    assert!(
        s.cancelled,
        "the upstream kept generating after the gateway exited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audio_work_preempts_running_text_on_a_preemptible_lane() {
    let (_serial, up, g, c, b) = rig(|up| format!(
        "{}{}",
        text_lane(
            up,
            "max_inflight = 2\nyield_to = [\"audio\"]\nmax_yield = \"5s\"\npreempt = true\npreempt_per_job = 2"
        ),
        audio_lane(up, "max_inflight = 1")
    )).await;
    // A long text stream and a non-streaming text request wait on the upstream...
    let (_, mut body) = started_stream(
        &c,
        &b,
        "long",
        &[("x-test-chunks", "500"), ("x-test-interval-ms", "10")],
    )
    .await;
    let waiting = tokio::spawn({
        let (c, b) = (c.clone(), b.clone());
        async move { chat(&c, &b, "slow", &[("x-test-delay-ms", "5000")], false).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // ...until audio work is admitted: both stop, and the engine sees both cancelled.
    let audio = transcribe(&c, &b, "asr", 50).await;
    assert_eq!(audio.status(), 200);
    let mut rest = String::new();
    while let Some(chunk) = body.next().await {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    let last = rest
        .trim_end()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    assert!(
        last.contains("\"code\":\"preempted\""),
        "stream ended with {last}"
    );
    let slow = waiting.await.unwrap();
    assert_eq!(slow.status(), 503);
    assert!(slow.headers().contains_key("retry-after"));
    let err = json_of(slow).await;
    assert_eq!(err["error"]["code"], "preempted");
    for id in ["long", "slow"] {
        let s = up.log.wait_ended(id, Duration::from_secs(2)).await.unwrap();
        assert!(s.cancelled, "{id} ran on upstream after preemption");
    }
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_requests_total{lane=\"text\",outcome=\"preempted\"}"
        )
        .await,
        Some(2.0)
    );
    // Without `preempt`, the same audio request leaves running text alone (see the yield tests).
    g.shutdown().await.unwrap();
}

/// A text lane in front of a llama.cpp stand-in whose `/metrics` the test sets: `preempt_per_job
/// = "all"` and `preempt_settle`.
fn settling_box(up: &Upstream, text_up: &Upstream, settle: &str) -> String {
    format!(
        "scrape_interval = \"100ms\"\n{}{}",
        text_lane(
            text_up,
            &format!(
                "max_inflight = 2\nyield_to = [\"audio\"]\nmax_yield = \"5s\"\npreempt = true\n\
                 preempt_per_job = \"all\"\npreempt_settle = \"{settle}\"\nengine = \"llamacpp\"\n\
                 engine_fail_open = true"
            )
        ),
        audio_lane(up, "max_inflight = 1")
    )
}

/// Reads a stream to its end and returns its last line.
async fn last_line(
    mut body: impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
) -> String {
    let mut rest = String::new();
    while let Some(chunk) = body.next().await {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    rest.trim_end()
        .lines()
        .last()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_audio_job_that_preempts_waits_for_the_engine_to_report_the_stopped_requests_gone() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let text_up = serve_upstream::start().await;
    const BUSY: &str = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 0\n";
    *text_up.metrics_text.lock().unwrap() = BUSY.into();
    let g = gateway(&settling_box(&up, &text_up, "5s")).await;
    let (c, b) = (client(), base(&g));
    let long = [("x-test-chunks", "500"), ("x-test-interval-ms", "10")];
    let (_, first) = started_stream(&c, &b, "first", &long).await;
    let (_, second) = started_stream(&c, &b, "second", &long).await;
    // The engine goes on reporting both slots busy (as llama.cpp does until the decode step it
    // is in ends and it reads the cancels) for 700 ms after the audio job arrives.
    let flip = tokio::spawn({
        let metrics = text_up.metrics_text.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            let at = Instant::now();
            *metrics.lock().unwrap() = "llamacpp:requests_processing 0\n".into();
            at
        }
    });
    let audio = transcribe(&c, &b, "asr", 20).await;
    assert_eq!(audio.status(), 200);
    let flipped = flip.await.unwrap();
    // preempt_per_job = "all": both streams stopped, not just the youngest.
    for body in [first, second] {
        let last = last_line(body).await;
        assert!(
            last.contains("\"code\":\"preempted\""),
            "stream ended with {last}"
        );
    }
    let asr = up
        .log
        .get("asr")
        .expect("the audio job reached its upstream");
    assert!(
        asr.started >= flipped,
        "the audio job was forwarded {:?} before the engine reported its stopped requests gone",
        flipped - asr.started
    );
    let waited: u64 = audio.headers()["x-headroom-preempt-settle-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(waited >= 500, "settle header says {waited} ms");
    g.shutdown().await.unwrap();

    // An engine that never reports idle holds the job for preempt_settle, no longer.
    let up = serve_upstream::start().await;
    *text_up.metrics_text.lock().unwrap() = BUSY.into();
    let g = gateway(&settling_box(&up, &text_up, "1s")).await;
    let b = base(&g);
    let (_, stream) = started_stream(&c, &b, "third", &long).await;
    let sent = Instant::now();
    let audio = transcribe(&c, &b, "asr2", 20).await;
    assert_eq!(audio.status(), 200);
    let waited: u64 = audio.headers()["x-headroom-preempt-settle-ms"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (1000..3000).contains(&waited),
        "settle header says {waited} ms"
    );
    assert!(sent.elapsed() < Duration::from_secs(8));
    assert!(last_line(stream).await.contains("\"code\":\"preempted\""));
    // A job that stopped nothing does not wait (and says nothing).
    let audio = transcribe(&c, &b, "asr3", 20).await;
    assert_eq!(audio.status(), 200);
    assert!(!audio.headers().contains_key("x-headroom-preempt-settle-ms"));
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pausing_lane_pauses_its_engine_while_audio_runs_and_keeps_its_requests() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let text_up = serve_upstream::start().await;
    let toml = format!(
        "{}{}",
        text_lane(
            &text_up,
            "max_inflight = 2\nyield_to = [\"audio\"]\nmax_yield = \"5s\"\npreempt = true\npreempt_mode = \"pause\""
        ),
        audio_lane(&up, "max_inflight = 2")
    );
    let g = gateway(&toml).await;
    let (c, b) = (client(), base(&g));
    const PAUSE: &str = "/sleep?level=0&mode=keep";
    const RESUME: &str = "/wake_up?tags=scheduling";
    let calls = |log: &serve_upstream::Log| -> Vec<String> {
        log.all()
            .into_iter()
            .filter(|s| s.path == "/sleep" || s.path == "/wake_up")
            .map(|s| s.id)
            .collect()
    };
    // A pause left behind by an earlier gateway is undone at the start.
    text_up
        .log
        .wait_started(RESUME, SETTLE)
        .await
        .expect("resumed at start");
    // A text stream runs...
    let (first, mut body) = started_stream(
        &c,
        &b,
        "long",
        &[("x-test-chunks", "40"), ("x-test-interval-ms", "50")],
    )
    .await;
    // ...audio is admitted: the text engine is paused (not the audio one), the stream kept.
    let a1 = tokio::spawn({
        let (c, b) = (c.clone(), b.clone());
        async move { transcribe(&c, &b, "asr1", 1500).await.status() }
    });
    up.log
        .wait_started("asr1", SETTLE)
        .await
        .expect("audio ran");
    text_up
        .log
        .wait_started(PAUSE, SETTLE)
        .await
        .expect("paused while audio runs");
    // A second clip overlapping the first: still one pause, no resume in between.
    let a2 = transcribe(&c, &b, "asr2", 100).await;
    assert_eq!(a2.status(), 200);
    assert_eq!(
        calls(&text_up.log),
        vec![RESUME, PAUSE],
        "one audio job still runs"
    );
    assert_eq!(a1.await.unwrap(), 200);
    // The last audio job ended: resumed.
    let until = Instant::now() + SETTLE;
    while calls(&text_up.log).len() < 3 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(calls(&text_up.log), vec![RESUME, PAUSE, RESUME]);
    assert!(
        calls(&up.log).is_empty(),
        "the audio engine is never paused"
    );
    let mut rest = String::from_utf8_lossy(&first).to_string();
    while let Some(chunk) = body.next().await {
        rest.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(
        rest.trim_end().ends_with("data: [DONE]"),
        "the text stream was cut: {}",
        rest.lines().last().unwrap_or_default()
    );
    assert!(text_up.log.get("long").unwrap().completed);
    assert_eq!(
        metric(
            &c,
            &b,
            "headroom_requests_total{lane=\"text\",outcome=\"preempted\"}"
        )
        .await
        .unwrap_or(0.0),
        0.0
    );
    g.shutdown().await.unwrap();
}
