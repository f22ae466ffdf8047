//! What `headroom serve` puts on the wire, read from a raw TCP socket: a reply the upstream sized
//! keeps its `content-length` (it is not re-chunked) and reaches the client whole when it arrives
//! in parts, a stream stays chunked, the per-lane metric handles count what happened, and one
//! connection carries pipelined requests across the fast path and hyper in order.

use std::time::Duration;

use headroom_server::ServeSettings;

use crate::serve_upstream;

/// Sends one request with `connection: close` and returns the response head (lower-cased) and body.
async fn raw_post(addr: std::net::SocketAddr, path: &str, body: &str) -> (String, Vec<u8>) {
    use std::io::{Read, Write};
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let all = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut all = Vec::new();
        s.read_to_end(&mut all)
            .expect("the gateway answers within 30 s");
        all
    })
    .await
    .unwrap();
    let split = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a complete response head");
    let head = String::from_utf8_lossy(&all[..split]).to_ascii_lowercase();
    (head, all[split + 4..].to_vec())
}

/// A gateway with one chat lane in front of `upstream` (four in flight).
async fn one_lane_gateway(upstream: &str) -> headroom_server::Running {
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{upstream}\"]\nmax_inflight = 4\n"
    );
    headroom_server::spawn(ServeSettings::from_toml(&toml).unwrap(), None)
        .await
        .unwrap()
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_reply_keeps_its_length_and_a_stream_stays_chunked() {
    let up = serve_upstream::start().await;
    let g = one_lane_gateway(&up.url()).await;
    let chat = |stream: bool| {
        format!(
            r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };

    let (head, body) = raw_post(g.addr, "/v1/chat/completions", &chat(false)).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    let len: usize = header(&head, "content-length")
        .unwrap_or_else(|| panic!("the upstream's content-length is kept: {head}"))
        .parse()
        .unwrap();
    assert_eq!(len, body.len());
    assert!(header(&head, "transfer-encoding").is_none(), "{head}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");

    let (head, body) = raw_post(g.addr, "/v1/chat/completions", &chat(true)).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(
        header(&head, "transfer-encoding"),
        Some("chunked"),
        "{head}"
    );
    assert!(header(&head, "content-length").is_none(), "{head}");
    assert!(String::from_utf8_lossy(&body).contains("data: [DONE]"));

    // The per-lane handles count both requests under the lane's name.
    let metrics = reqwest::get(format!("http://{}/metrics", g.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let ok = metrics
        .lines()
        .find(|l| {
            l.starts_with("headroom_requests_total{")
                && l.contains("lane=\"text\"")
                && l.contains("outcome=\"ok\"")
        })
        .unwrap_or_else(|| panic!("no ok series in\n{metrics}"));
    assert!(ok.ends_with(" 2"), "{ok}");
    assert!(
        metrics.contains("headroom_ttft_seconds_count{lane=\"text\"} 2"),
        "{metrics}"
    );
    g.shutdown().await.unwrap();
}

/// An upstream on a raw socket that answers each request with a sized reply written in two
/// parts, `pause` apart, on a keep-alive connection.
async fn split_reply_upstream(body: &'static str, pause: Duration) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // One whole request: its head, then content-length bytes of body.
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = header(&head, "content-length")
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0);
                    while buf.len() < end + 4 + len {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.drain(..end + 4 + len);
                    let (first, rest) = body.split_at(body.len() / 2);
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{first}",
                        body.len()
                    );
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(pause).await;
                    if s.write_all(rest.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_reply_that_arrives_in_parts_reaches_the_client_whole() {
    const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"first half, then the second half"},"finish_reason":"stop"}]}"#;
    let up = split_reply_upstream(ANSWER, Duration::from_millis(100)).await;
    let g = one_lane_gateway(&format!("http://{up}")).await;
    let chat = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
    // Twice: the second request goes out on the pooled connection the first one left.
    for _ in 0..2 {
        let (head, body) = raw_post(g.addr, "/v1/chat/completions", chat).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(
            header(&head, "content-length"),
            Some(ANSWER.len().to_string().as_str()),
            "{head}"
        );
        assert_eq!(String::from_utf8_lossy(&body), ANSWER);
    }
    g.shutdown().await.unwrap();
}

/// Reads `n` content-length-framed responses from `s`; each is (head lower-cased, body).
fn read_responses(s: &mut std::net::TcpStream, n: usize) -> Vec<(String, String)> {
    use std::io::Read;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let mut out = Vec::new();
    while out.len() < n {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let len: usize = header(&head, "content-length")
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("a sized response: {head}"));
            if buf.len() >= end + 4 + len {
                let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).into_owned();
                buf.drain(..end + 4 + len);
                out.push((head, body));
                continue;
            }
        }
        let got = s
            .read(&mut chunk)
            .unwrap_or_else(|e| panic!("response {} of {n} did not come: {e}", out.len() + 1));
        assert!(
            got > 0,
            "the gateway closed after {} of {n} responses",
            out.len()
        );
        buf.extend_from_slice(&chunk[..got]);
    }
    assert!(buf.is_empty(), "nothing more than {n} responses");
    out
}

/// One connection carries requests the fast path serves (two pipelined in one write), then one
/// it hands to hyper (a `GET` in the same write), and the answers come back in order; a body
/// sent after its head (it is hyper's, read with its timeout) is answered too, and so is a whole
/// request after it on the same connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_and_a_handover_to_hyper_share_one_connection() {
    use std::io::Write;
    let up = serve_upstream::start().await;
    let g = one_lane_gateway(&up.url()).await;
    let addr = g.addr;
    let post = |content: &str| {
        let body =
            format!(r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}}]}}"#);
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let (one, two) = (post("one"), post("two"));
    let split = post("three");
    let after = post("four");
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let all = format!("{one}{two}GET /healthz HTTP/1.1\r\nhost: gw\r\n\r\n");
        s.write_all(all.as_bytes()).unwrap();
        let answers = read_responses(&mut s, 3);
        for (head, body) in &answers[..2] {
            assert!(head.starts_with("http/1.1 200"), "{head}");
            assert!(body.contains("chat.completion"), "{body}");
        }
        let (head, body) = &answers[2];
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert_eq!(body, r#"{"status":"ok"}"#);

        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let at = split.find("\r\n\r\n").unwrap() + 4;
        s.write_all(&split.as_bytes()[..at]).unwrap();
        std::thread::sleep(Duration::from_millis(150));
        s.write_all(&split.as_bytes()[at..]).unwrap();
        let (head, body) = read_responses(&mut s, 1).remove(0);
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(body.contains("chat.completion"), "{body}");
        s.write_all(after.as_bytes()).unwrap();
        let (head, _) = read_responses(&mut s, 1).remove(0);
        assert!(head.starts_with("http/1.1 200"), "{head}");
    })
    .await
    .unwrap();
    g.shutdown().await.unwrap();
}

/// The connection's deadline timer is re-armed for every request it carries: on one keep-alive
/// connection a request that outlives its deadline is cut at that deadline (504) whether the
/// deadline before it was longer, shorter or already spent, and a fast request between them is
/// answered in full (its deadline, long past by the next one, fires on nothing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_on_a_connection_gets_its_own_deadline() {
    use std::io::Write;
    let up = serve_upstream::start().await;
    let g = one_lane_gateway(&up.url()).await;
    let addr = g.addr;
    let post = |timeout_ms: u64, delay_ms: u64| {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n\
             x-headroom-timeout-ms: {timeout_ms}\r\nx-test-delay-ms: {delay_ms}\r\n\
             content-length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    // (deadline, upstream delay, expected status); timings are generous for a loaded box: a
    // cut request must end well before its upstream would have answered.
    let steps = [
        (60_000, 0, "200"),
        (400, 8_000, "504"),
        (400, 8_000, "504"),
        (60_000, 0, "200"),
        (300, 8_000, "504"),
        (20_000, 900, "200"),
        (500, 8_000, "504"),
    ];
    tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        for (i, (timeout, delay, status)) in steps.into_iter().enumerate() {
            let started = std::time::Instant::now();
            s.write_all(post(timeout, delay).as_bytes()).unwrap();
            let (head, body) = read_responses(&mut s, 1).remove(0);
            let took = started.elapsed();
            assert!(
                head.starts_with(&format!("http/1.1 {status}")),
                "request {i}: {head}\n{body}"
            );
            if status == "504" {
                assert!(body.contains("\"deadline\""), "request {i}: {body}");
                assert!(
                    took >= Duration::from_millis(timeout) && took < Duration::from_millis(6_000),
                    "request {i} was cut after {took:?}, its deadline {timeout} ms"
                );
            }
        }
    })
    .await
    .unwrap();
    g.shutdown().await.unwrap();
}
