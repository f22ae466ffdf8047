//! The upstream client against raw HTTP/1 servers on 127.0.0.1 that behave in the ways engines
//! do: keep-alive reuse, a server that closes after each reply, one that closes a kept-alive
//! connection without reading the next request (llama.cpp after a stream), one that reads the
//! next request and closes without an answer (an engine that died on it), `Connection: close`,
//! a redirect, a refused connect.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// How a test server treats a connection after answering one request.
#[derive(Clone, Copy)]
enum After {
    /// Reads the next request on the same connection.
    KeepAlive,
    /// Closes the socket right after the reply (while the reply said keep-alive).
    Close,
    /// Keeps the socket open a while without reading, then closes it (unread data: a reset).
    LingerUnread(Duration),
    /// Reads the next request on the connection and closes it cleanly without an answer (a
    /// keep-alive close that crossed the request on the wire).
    CloseOnNext,
}

struct Server {
    address: String,
    accepted: Arc<AtomicU64>,
    served: Arc<AtomicU64>,
}

/// Reads one request head and its Content-Length body; `false` when the peer closed first.
async fn read_request(reader: &mut BufReader<TcpStream>) -> bool {
    let mut length = 0usize;
    loop {
        let mut line = String::new();
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => return false,
            Ok(_) => {}
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).await.is_ok()
}

/// A server answering every request with `reply`, then doing `after`.
async fn server(reply: &'static str, after: After) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    let accepted = Arc::new(AtomicU64::new(0));
    let served = Arc::new(AtomicU64::new(0));
    let (a, s) = (accepted.clone(), served.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            a.fetch_add(1, Ordering::SeqCst);
            let s = s.clone();
            tokio::spawn(async move {
                let mut reader = BufReader::new(tcp);
                while read_request(&mut reader).await {
                    s.fetch_add(1, Ordering::SeqCst);
                    if reader.get_mut().write_all(reply.as_bytes()).await.is_err() {
                        return;
                    }
                    match after {
                        After::KeepAlive => continue,
                        After::Close => return,
                        After::LingerUnread(d) => {
                            tokio::time::sleep(d).await;
                            return;
                        }
                        After::CloseOnNext => {
                            let _ = read_request(&mut reader).await;
                            let _ = reader.get_mut().shutdown().await;
                            return;
                        }
                    }
                }
            });
        }
    });
    Server {
        address,
        accepted,
        served,
    }
}

const OK: &str =
    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}";
const CHUNKED_SSE: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n6\r\ndata: \r\n8\r\n[DONE]\n\n\r\n0\r\n\r\n";

fn outgoing() -> Outgoing<'static> {
    Outgoing {
        path: "/v1/chat/completions",
        query: None,
        headers: Vec::new(),
        body: Bytes::from_static(b"{\"model\":\"m\"}"),
        idempotent: false,
    }
}

/// Sends one request and reads its body whole.
async fn round_trip(endpoint: &Arc<Endpoint>) -> Result<(u16, Vec<u8>), UpstreamError> {
    exchange_whole(endpoint, &outgoing()).await
}

/// Sends `outgoing` and reads the body whole.
async fn exchange_whole(
    endpoint: &Arc<Endpoint>,
    outgoing: &Outgoing<'_>,
) -> Result<(u16, Vec<u8>), UpstreamError> {
    let mut response = send(endpoint, outgoing).await?;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        body.extend_from_slice(&chunk);
    }
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keep_alive_connections_are_reused() {
    let s = server(OK, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for _ in 0..20 {
        let (status, body) = round_trip(&endpoint).await.expect("answered");
        assert_eq!((status, body.as_slice()), (200, &b"{\"ok\":true}"[..]));
    }
    assert_eq!(s.served.load(Ordering::SeqCst), 20);
    assert_eq!(
        s.accepted.load(Ordering::SeqCst),
        1,
        "one connection for all"
    );
    assert_eq!(endpoint.connects(), 1);
    assert_eq!(endpoint.idle_count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_stream_gives_its_connection_back_too() {
    let s = server(CHUNKED_SSE, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for _ in 0..5 {
        let (status, body) = round_trip(&endpoint).await.expect("answered");
        assert_eq!((status, body.as_slice()), (200, &b"data: [DONE]\n\n"[..]));
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_dropped_mid_body_is_not_reused() {
    let s = server(CHUNKED_SSE, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let mut first = send(&endpoint, &outgoing()).await.unwrap();
    let _ = first.chunk().await.unwrap();
    drop(first);
    assert_eq!(
        endpoint.idle_count(),
        0,
        "a half-read response closes its connection"
    );
    round_trip(&endpoint)
        .await
        .expect("answered on a new connection");
    assert_eq!(s.accepted.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_after_each_reply_loses_no_request() {
    let s = server(CHUNKED_SSE, After::Close).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for i in 0..30 {
        round_trip(&endpoint)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        // Back to back, and sometimes after the close has surely arrived.
        if i % 3 == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    // Each request reached the server exactly once.
    assert_eq!(s.served.load(Ordering::SeqCst), 30);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_written_into_a_stale_connection_is_sent_again_on_a_fresh_one() {
    let s = server(CHUNKED_SSE, After::LingerUnread(Duration::from_millis(40))).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for i in 0..10 {
        round_trip(&endpoint)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
    }
    assert_eq!(
        s.served.load(Ordering::SeqCst),
        10,
        "none lost, none doubled"
    );
    assert!(
        endpoint.stale_resends() >= 1,
        "the server should have made the client meet a stale pooled connection"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_close_is_honoured() {
    const CLOSE: &str = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
    let s = server(CLOSE, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for _ in 0..3 {
        round_trip(&endpoint).await.expect("answered");
    }
    assert_eq!(s.accepted.load(Ordering::SeqCst), 3);
    assert_eq!(endpoint.stale_resends(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_comes_back_as_it_is() {
    const MOVED: &str = "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:9/elsewhere\r\nContent-Length: 0\r\n\r\n";
    let s = server(MOVED, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let (status, _) = round_trip(&endpoint).await.expect("answered");
    assert_eq!(status, 307);
    assert_eq!(s.served.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connect_never_reached_the_upstream() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let endpoint = Arc::new(Endpoint::parse(&format!("http://127.0.0.1:{port}")).unwrap());
    let e = round_trip(&endpoint).await.expect_err("nothing listens");
    assert!(e.is_connect() && e.unsent() && e.may_reroute(false), "{e}");
}

#[test]
fn addresses_parse_into_host_and_port() {
    let e = Endpoint::parse("http://127.0.0.1:8000").unwrap();
    assert_eq!(e.host_header(), "127.0.0.1:8000");
    let e = Endpoint::parse("http://[::1]:8000").unwrap();
    assert_eq!(e.host_header(), "[::1]:8000");
    assert!(Endpoint::parse("https://a:1").is_err());
    assert!(Endpoint::parse("http://").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_delimited_by_close_is_read_to_the_end_and_its_connection_not_reused() {
    const UNTIL_CLOSE: &str = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it";
    let s = server(UNTIL_CLOSE, After::Close).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for _ in 0..3 {
        let (status, body) = round_trip(&endpoint).await.expect("answered");
        assert_eq!((status, body.as_slice()), (200, &b"all of it"[..]));
    }
    assert_eq!(endpoint.idle_count(), 0);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 3);
    assert_eq!(endpoint.stale_resends(), 0, "no connection was reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interim_response_is_skipped_and_http_1_0_is_not_kept_alive() {
    const INTERIM: &str =
        "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok";
    let s = server(INTERIM, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    for _ in 0..2 {
        let (status, body) = round_trip(&endpoint).await.expect("answered");
        assert_eq!((status, body.as_slice()), (200, &b"ok"[..]));
    }
    assert_eq!(
        s.accepted.load(Ordering::SeqCst),
        2,
        "HTTP/1.0 without keep-alive closes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_response_is_an_error_that_reached_the_upstream() {
    const BAD: &str = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok";
    let s = server(BAD, After::KeepAlive).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let e = round_trip(&endpoint)
        .await
        .expect_err("conflicting lengths");
    assert!(matches!(e, UpstreamError::Malformed(_)), "{e}");
    assert!(
        !e.unanswered() && !e.may_reroute(true),
        "the upstream took the request: no resend"
    );
    assert_eq!(s.served.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_cut_short_by_the_upstream_is_an_error_not_an_end() {
    const SHORT: &str = "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nonly";
    let s = server(SHORT, After::Close).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let mut response = send(&endpoint, &outgoing()).await.expect("head arrived");
    let mut got = Vec::new();
    let end = loop {
        match response.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            other => break other,
        }
    };
    assert_eq!(got, b"only");
    let e = end.expect_err("4 of 10 bytes is not a whole body");
    assert!(!e.unanswered() && !e.may_reroute(true), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_an_upstream_read_and_closed_unanswered_is_not_sent_again() {
    let s = server(OK, After::CloseOnNext).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let (status, _) = round_trip(&endpoint).await.expect("the first is answered");
    assert_eq!(status, 200);
    // The second goes out on the kept-alive connection; the server reads it whole and closes.
    let e = round_trip(&endpoint)
        .await
        .expect_err("closed without an answer");
    assert!(
        matches!(e, UpstreamError::Closed { answered: false }),
        "{e}"
    );
    assert!(e.unanswered() && !e.unsent(), "{e}");
    assert!(
        !e.may_reroute(false),
        "it may have run: answered, not repeated"
    );
    assert_eq!(endpoint.stale_resends(), 0);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 1, "no second connection");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_may_run_twice_is_sent_again_after_a_close_without_an_answer() {
    let s = server(OK, After::CloseOnNext).await;
    let endpoint = Arc::new(Endpoint::parse(&s.address).unwrap());
    let idempotent = Outgoing {
        idempotent: true,
        ..outgoing()
    };
    for i in 0..4 {
        let (status, _) = exchange_whole(&endpoint, &idempotent)
            .await
            .unwrap_or_else(|e| panic!("request {i}: {e}"));
        assert_eq!(status, 200);
    }
    // Requests 2-4 each met a connection that closed without an answer, and were sent again.
    assert_eq!(endpoint.stale_resends(), 3);
    assert_eq!(s.accepted.load(Ordering::SeqCst), 4);
}
