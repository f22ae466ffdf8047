//! `headroom serve` against hostile clients, on real sockets: a client that never reads its
//! response is dropped (its slot freed) at `send_timeout` or at its request's deadline, on both
//! HTTP/1 paths; slowloris and idle connections are closed; near the open-file limit new clients
//! are still answered while idle connections are held; request bodies held in memory stay under
//! `max_body_memory`; the end of `shutdown_grace` answers what is left (503, or a stream's error
//! event); and the smaller edges: the auth scheme in any case, `Host` required, `/readyz` from
//! the background check and quiet without a key, metric labels only from the gateway's own codes.

use std::io::{Read, Write};
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use crate::common::{SERIAL, config_file, rig};
use crate::serve::{base, chat, client, gateway, json_of, metric, text_lane};
use crate::serve_upstream;

/// An upstream whose every chat answer is an endless SSE stream of 64 KiB events, as fast as it
/// is read; `streaming` counts the answers still being sent (one ends when the gateway drops it).
async fn endless_upstream() -> (String, std::sync::Arc<std::sync::atomic::AtomicIsize>) {
    use std::sync::atomic::{AtomicIsize, Ordering};
    struct Counted(std::sync::Arc<AtomicIsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let streaming = std::sync::Arc::new(AtomicIsize::new(0));
    let count = streaming.clone();
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        axum::routing::post(move || {
            let count = count.clone();
            async move {
                count.fetch_add(1, Ordering::SeqCst);
                let guard = Counted(count);
                let event = bytes::Bytes::from(format!("data: {}\n\n", "x".repeat(64 << 10)));
                let events = futures_util::stream::repeat_with(move || {
                    let _ = &guard;
                    Ok::<_, std::io::Error>(event.clone())
                });
                (
                    [("content-type", "text/event-stream")],
                    axum::body::Body::from_stream(events),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (url, streaming)
}

/// Opens a connection with a 4 KiB receive buffer and asks for a streamed chat on `path`; the
/// response is never read.
async fn never_reading_client(addr: std::net::SocketAddr, path: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut tcp = socket.connect(addr).await.unwrap();
    let body = crate::serve::chat_body(true);
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp
}

/// Seconds until the lane shows nothing in flight (polled every 50 ms), or `None` by `within`.
async fn freed_within(c: &reqwest::Client, b: &str, within: Duration) -> Option<f64> {
    let start = Instant::now();
    while start.elapsed() < within {
        let s = crate::serve::admin(c, b).await;
        if crate::serve::lane(&s, "text")["inflight"] == 0 {
            return Some(start.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_never_reads_is_dropped_and_its_slot_freed() {
    let _serial = SERIAL.lock().await;
    let (up, streaming) = endless_upstream().await;
    // (send_timeout, request_timeout, the reason counted): a stalled write ends at whichever
    // comes first. The fast path serves the plain path, hyper the one with a query string.
    let cases = [
        ("", "2s", "deadline"),
        ("send_timeout = \"1s\"\n", "30s", "send_timeout"),
    ];
    for (keys, timeout, reason) in cases {
        for path in ["/v1/chat/completions", "/v1/chat/completions?via=hyper"] {
            let toml = format!(
                "{keys}listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{up}\"]\nmax_inflight = 1\nrequest_timeout = \"{timeout}\"\n"
            );
            let g = gateway(&toml).await;
            let (c, b) = (client(), base(&g));
            let stalled = never_reading_client(g.addr, path).await;
            crate::serve::wait_lane(&c, &b, "text", Duration::from_secs(5), |l| {
                l["inflight"] == 1
            })
            .await;
            let freed = freed_within(&c, &b, Duration::from_secs(12)).await;
            eprintln!("{path}, {reason}: slot freed after {freed:?} s");
            assert!(
                freed.is_some(),
                "{path}: a client that never reads still holds the lane's only slot after 12 s \
                 ({reason} is due within 2 s)"
            );
            let closed = format!("headroom_connections_closed_total{{reason=\"{reason}\"}}");
            assert_eq!(metric(&c, &b, &closed).await, Some(1.0), "{path}");
            // The upstream's answer was dropped with it, and the lane takes work again.
            let until = Instant::now() + Duration::from_secs(5);
            while streaming.load(std::sync::atomic::Ordering::SeqCst) != 0 && Instant::now() < until
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(
                streaming.load(std::sync::atomic::Ordering::SeqCst),
                0,
                "{path}"
            );
            let (first, more) = crate::serve::started_stream(&c, &b, "next", &[]).await;
            assert!(!first.is_empty());
            drop((more, stalled));
            g.shutdown().await.unwrap();
        }
    }
}

/// Sends `head` a byte every `every` and returns when the server closes the connection (the
/// seconds since the connection opened), or `None` after `within`.
fn closed_after(addr: &str, head: &[u8], every: Duration, within: Duration) -> Option<f64> {
    let start = std::time::Instant::now();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let mut sent = 0;
    let mut buf = [0u8; 4096];
    while start.elapsed() < within {
        if sent < head.len() && start.elapsed() >= every * sent as u32 {
            if s.write_all(&head[sent..sent + 1]).is_err() {
                return Some(start.elapsed().as_secs_f64());
            }
            sent += 1;
        }
        match s.read(&mut buf) {
            Ok(0) => return Some(start.elapsed().as_secs_f64()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
            Err(_) => return Some(start.elapsed().as_secs_f64()),
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slowloris_and_idle_connections_are_closed() {
    let (_serial, _up, g, c, b) = rig(|up| {
        format!(
            "client_header_timeout = \"1s\"\nkeepalive_timeout = \"2s\"\n{}",
            text_lane(up, "")
        )
    })
    .await;
    let addr = g.addr.to_string();
    let slow_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
    let within = Duration::from_secs(8);
    let (a, h) = (addr.clone(), slow_head.to_vec());
    let slowloris = tokio::task::spawn_blocking(move || {
        closed_after(&a, &h, Duration::from_millis(100), within)
    });
    let a = addr.clone();
    let silent = tokio::task::spawn_blocking(move || {
        closed_after(&a, b"", Duration::from_millis(100), within)
    });
    // Kept alive after one request, on each path: the fast one, and hyper's (a GET).
    let kept = |request: String| {
        let a = addr.clone();
        tokio::task::spawn_blocking(move || {
            let start = std::time::Instant::now();
            let mut s = std::net::TcpStream::connect(&a).unwrap();
            s.write_all(request.as_bytes()).unwrap();
            s.set_read_timeout(Some(within)).unwrap();
            let mut buf = [0u8; 8192];
            let mut got = Vec::new();
            let mut answered = None;
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        got.extend_from_slice(&buf[..n]);
                        if answered.is_none() && got.windows(4).any(|w| w == b"\r\n\r\n") {
                            answered = Some(start.elapsed().as_secs_f64());
                        }
                    }
                }
            }
            let text = String::from_utf8_lossy(&got).into_owned();
            (answered, start.elapsed().as_secs_f64(), text)
        })
    };
    let body = crate::serve::chat_body(false);
    let fast = kept(format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    ));
    let hyper = kept("GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n".to_string());
    let slowloris = slowloris.await.unwrap();
    let silent = silent.await.unwrap();
    let (fast_answered, fast_closed, fast_text) = fast.await.unwrap();
    let (_, hyper_closed, hyper_text) = hyper.await.unwrap();
    eprintln!(
        "slowloris closed after {slowloris:?} s, silent after {silent:?} s, kept-alive after \
         {fast_closed:.2} s (fast path) and {hyper_closed:.2} s (hyper)"
    );
    // The slowloris was still sending (its head is 100 bytes: 10 s at a byte per 100 ms).
    let slowloris = slowloris.expect("a slowloris connection was still open after 8 s");
    assert!((0.9..6.0).contains(&slowloris), "{slowloris}");
    let silent = silent.expect("a silent connection was still open after 8 s");
    assert!((0.9..6.0).contains(&silent), "{silent}");
    assert!(fast_text.starts_with("HTTP/1.1 200"), "{fast_text}");
    assert!(fast_answered.is_some());
    assert!(
        (1.9..7.0).contains(&fast_closed),
        "kept alive {fast_closed} s"
    );
    assert!(hyper_text.starts_with("HTTP/1.1 200"), "{hyper_text}");
    // hyper times the wait for a next head with the shorter timeout (1 s).
    assert!(
        (0.9..7.0).contains(&hyper_closed),
        "kept alive {hyper_closed} s"
    );
    for reason in ["header_timeout", "idle_timeout"] {
        let series = format!("headroom_connections_closed_total{{reason=\"{reason}\"}}");
        assert!(metric(&c, &b, &series).await >= Some(1.0), "{series}");
    }
    g.shutdown().await.unwrap();
}

/// A gateway process, killed if the test ends before it stopped it (a failed assertion must not
/// leave it running).
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary with its open-file limit (soft and hard) at `limit`.
fn start_limited(config: &std::path::Path, limit: u32) -> (std::process::Child, String) {
    let mut command = std::process::Command::new("sh");
    command
        .arg("-c")
        .arg(format!(
            "ulimit -n {limit} && exec \"$0\" serve --config \"$1\""
        ))
        .arg(env!("CARGO_BIN_EXE_headroom"))
        .arg(config);
    crate::serve::start_serving(command)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn new_clients_are_answered_while_idle_connections_fill_the_descriptor_limit() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let (_dir, config) = config_file(&text_lane(&up, "max_inflight = 4"));
    let (child, addr) = start_limited(&config, 256);
    let mut child = Reaped(child);
    // 600 connections that say nothing, more than the limit: those the gateway does not take
    // wait in the backlog, or time out connecting once it is full.
    let connects = (0..600).map(|_| {
        tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(addr.clone()),
        )
    });
    let held: Vec<_> = futures_util::future::join_all(connects)
        .await
        .into_iter()
        .filter_map(|c| c.ok().and_then(Result::ok))
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New clients, one connection each: health probes and chat requests.
    let mut answered = 0;
    let tries = 20;
    for i in 0..tries {
        let c = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let ok = if i % 2 == 0 {
            c.get(format!("http://{addr}/healthz")).send().await
        } else {
            c.post(format!("http://{addr}/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(crate::serve::chat_body(false))
                .send()
                .await
        };
        if ok.is_ok_and(|r| r.status() == 200) {
            answered += 1;
        }
    }
    let held_count = held.len();
    drop(held);
    crate::serve::sigterm(&child.0);
    crate::serve::wait_exit(&mut child.0, Duration::from_secs(10));
    let mut stderr = String::new();
    child
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    eprintln!(
        "{} connections held; {answered} of {tries} new clients answered; stderr:\n{stderr}",
        held_count
    );
    assert_eq!(answered, tries, "new clients went unanswered at the limit");
    let said = stderr.matches("near the open-file limit").count();
    assert_eq!(said, 1, "said once, not once a second:\n{stderr}");
    assert!(!stderr.contains("accept failed"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bodies_held_in_memory_stay_under_the_cap() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    // max_body_memory is left at its default: 4 x the largest max_body_bytes (192 MiB here).
    let (_dir, config) = config_file(&format!(
        "listen = \"127.0.0.1:0\"\n{}",
        crate::serve::audio_lane(
            &up,
            "max_body_bytes = \"48MiB\"\nmax_inflight = 1\nmax_queue = 16\npolicy = \"queue\"\nqueue_timeout = \"60s\"\nrequest_timeout = \"60s\""
        )
    ));
    let (child, addr) = crate::serve::start_binary(&config, &[]);
    let mut child = Reaped(child);
    let pid = child.0.id();
    // A WAV of 2,900 s at 8 kHz: 44 MiB.
    let (ct, body) = crate::serve::multipart_body(Some(&crate::serve::wav(2900.0)), "whisper-1");
    let body = bytes::Bytes::from(body);
    let before = crate::serve_hardening::rss_bytes(pid);
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(before));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(
                    crate::serve_hardening::rss_bytes(pid),
                    std::sync::atomic::Ordering::Relaxed,
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let c = client();
    let uploads: Vec<_> = (0..12)
        .map(|i| {
            let (c, body, ct) = (c.clone(), body.clone(), ct.clone());
            let url = format!("http://{addr}/v1/audio/transcriptions");
            tokio::spawn(async move {
                c.post(url)
                    .header("content-type", ct)
                    .header("x-test-id", format!("up{i}"))
                    .header("x-test-delay-ms", "200")
                    .body(body)
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            })
        })
        .collect();
    let mut statuses = Vec::new();
    for u in uploads {
        statuses.push(u.await.unwrap());
    }
    sampler.abort();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    crate::serve::sigterm(&child.0);
    crate::serve::wait_exit(&mut child.0, Duration::from_secs(10));
    eprintln!(
        "12 x 44 MiB uploads: RSS {:.0} MiB before, peak {:.0} MiB; statuses {statuses:?}",
        before as f64 / 1048576.0,
        peak as f64 / 1048576.0
    );
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    // 530 MiB of bodies arrived; at most 4 of them (192 MiB) are held at once.
    assert!(
        peak < before + (320 << 20),
        "peak RSS {peak} bytes from {before}: bodies were held past the cap"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_finds_no_room_in_time_gets_503_with_retry_after() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nmax_body_memory = \"8MiB\"\n{}",
        crate::serve::audio_lane(
            &up,
            "max_body_bytes = \"8MiB\"\nmax_inflight = 4\nqueue_timeout = \"300ms\""
        )
    );
    let g = gateway(&toml).await;
    // A WAV of 390 s at 8 kHz: 6 MiB.
    let (ct, body) = crate::serve::multipart_body(Some(&crate::serve::wav(390.0)), "whisper-1");
    let body = bytes::Bytes::from(body);
    let c = client();
    let url = format!("{}/v1/audio/transcriptions", base(&g));
    let sends: Vec<_> = (0..3)
        .map(|i| {
            c.post(&url)
                .header("content-type", ct.clone())
                .header("x-test-id", format!("b{i}"))
                .header("x-test-delay-ms", "1500")
                .body(body.clone())
                .send()
        })
        .collect();
    let replies = futures_util::future::join_all(sends).await;
    let mut served = 0;
    let mut refused = 0;
    for r in replies {
        let r = r.unwrap();
        match r.status().as_u16() {
            200 => served += 1,
            503 => {
                assert_eq!(r.headers()["retry-after"], "1");
                assert_eq!(json_of(r).await["error"]["code"], "body_memory_full");
                refused += 1;
            }
            other => panic!("status {other}"),
        }
    }
    // 6 MiB each under an 8 MiB cap: one at a time, and the others wait no longer than 300 ms.
    assert_eq!((served, refused), (1, 2));
    assert_eq!(g.gate.snapshot().lanes[0].inflight, 0);
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn what_is_left_at_the_end_of_the_grace_gets_503_or_an_error_event() {
    let (_serial, up, g, c, b) = rig(|up| {
        format!(
            "shutdown_grace = \"500ms\"\n{}",
            text_lane(up, "max_inflight = 4\nrequest_timeout = \"60s\"")
        )
    })
    .await;
    // A plain request the upstream answers in 10 s, and a stream of an event every 300 ms.
    let (c1, b1) = (c.clone(), b.clone());
    let plain = tokio::spawn(async move {
        let r = chat(
            &c1,
            &b1,
            "plain",
            &[("x-test-chunks", "1"), ("x-test-interval-ms", "10000")],
            false,
        )
        .await;
        (r.status().as_u16(), r.text().await.unwrap_or_default())
    });
    let (first, mut stream) = crate::serve::started_stream(
        &c,
        &b,
        "stream",
        &[("x-test-chunks", "100"), ("x-test-interval-ms", "300")],
    )
    .await;
    up.log
        .wait_started("plain", Duration::from_secs(5))
        .await
        .unwrap();
    let started = Instant::now();
    let stopping = tokio::spawn(g.shutdown());
    let mut text = String::from_utf8_lossy(&first).into_owned();
    use futures_util::StreamExt;
    while let Some(Ok(chunk)) = stream.next().await {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (status, body) = plain.await.unwrap();
    stopping.await.unwrap().unwrap();
    eprintln!("stopped after {:?}", started.elapsed());
    assert_eq!(status, 503, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["code"], "shutting_down");
    let last = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .last()
        .unwrap();
    assert!(
        last.starts_with("data: {\"error\"") && last.contains("shutting_down"),
        "the stream ended without an error event: {last:?}"
    );
}

/// Sends one raw request and returns the whole answer (read until close or 5 s).
fn raw(addr: &str, request: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_auth_scheme_is_any_case_and_http11_needs_a_host() {
    let (_serial, _up, g, c, b) =
        rig(|up| format!("api_keys = [\"k1\"]\n{}", text_lane(up, ""))).await;
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let r = chat(
            &c,
            &b,
            scheme,
            &[("authorization", &format!("{scheme} k1"))],
            false,
        )
        .await;
        assert_eq!(r.status(), 200, "{scheme}");
    }
    let r = chat(&c, &b, "wrong", &[("authorization", "bearer k2")], false).await;
    assert_eq!(r.status(), 401);
    // No Host: 400 on the fast path (a proxied POST) and on hyper's (any other request).
    let addr = g.addr.to_string();
    let body = crate::serve::chat_body(false);
    for request in [
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer k1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        ),
        "GET /healthz HTTP/1.1\r\n\r\n".to_string(),
    ] {
        let a = addr.clone();
        let answer = tokio::task::spawn_blocking(move || raw(&a, &request))
            .await
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(answer.contains("missing_host"), "{answer}");
    }
    // HTTP/1.0 has no Host requirement.
    let a = addr.clone();
    let answer = tokio::task::spawn_blocking(move || raw(&a, "GET /healthz HTTP/1.0\r\n\r\n"))
        .await
        .unwrap();
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_answers_from_the_background_check_and_says_little_without_a_key() {
    let _serial = SERIAL.lock().await;
    // An upstream that counts its /health calls.
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = calls.clone();
    let app = axum::Router::new().route(
        "/health",
        axum::routing::get(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { "ok" }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let g = gateway(&format!(
        "listen = \"127.0.0.1:0\"\napi_keys = [\"k1\"]\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{up}\"]\n"
    ))
    .await;
    let (c, b) = (client(), base(&g));
    let r = c.get(format!("{b}/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v = json_of(r).await;
    assert_eq!(
        v,
        serde_json::json!({"ready": true}),
        "no key: no upstreams named"
    );
    let start = Instant::now();
    let before = calls.load(std::sync::atomic::Ordering::SeqCst);
    for _ in 0..50 {
        let r = c
            .get(format!("{b}/readyz"))
            .header("authorization", "Bearer k1")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let v = json_of(r).await;
        assert_eq!(v["upstreams"][0]["url"], up.as_str());
    }
    let probes = calls.load(std::sync::atomic::Ordering::SeqCst) - before;
    let rounds = start.elapsed().as_secs_f64() / 0.5;
    eprintln!(
        "50 probes in {:?}: {probes} upstream /health calls",
        start.elapsed()
    );
    assert!(
        (probes as f64) <= rounds + 2.0,
        "{probes} /health calls for 50 probes in {:?}",
        start.elapsed()
    );
    g.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstreams_own_error_codes_do_not_become_metric_labels() {
    let (_serial, _up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 4")).await;
    let lines = |c: reqwest::Client, b: String| async move {
        c.get(format!("{b}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
            .lines()
            .count()
    };
    assert_eq!(chat(&c, &b, "warm", &[], false).await.status(), 200);
    let before = lines(c.clone(), b.clone()).await;
    for i in 0..100 {
        let body = format!(r#"{{"error":{{"message":"no","code":"engine_code_{i}"}}}}"#);
        let r = chat(
            &c,
            &b,
            &format!("e{i}"),
            &[("x-test-status", "400"), ("x-test-error-body", &body)],
            false,
        )
        .await;
        assert_eq!(r.status(), 400);
        assert_eq!(
            json_of(r).await["error"]["code"],
            format!("engine_code_{i}"),
            "the client still reads the upstream's code"
        );
    }
    let after = lines(c.clone(), b.clone()).await;
    eprintln!("/metrics: {before} lines before, {after} after 100 upstream codes");
    assert!(after <= before + 8, "{before} -> {after} lines");
    assert_eq!(
        metric(&c, &b, "headroom_bad_requests_total{code=\"other\"}").await,
        Some(100.0)
    );
    g.shutdown().await.unwrap();
}
