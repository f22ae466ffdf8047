//! What `headroom serve` puts on the wire, read from a raw TCP socket: a reply the upstream sized
//! keeps its `content-length` (it is not re-chunked), a stream stays chunked, and the per-lane
//! metric handles count what happened.

use std::time::Duration;

use headroom_server::ServeConfig;

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

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sized_reply_keeps_its_length_and_a_stream_stays_chunked() {
    let up = serve_upstream::start().await;
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[[lanes]]\nname = \"text\"\npaths = [\"/v1/chat/completions\"]\nupstreams = [\"{}\"]\nmax_inflight = 4\n",
        up.url()
    );
    let g = headroom_server::spawn(ServeConfig::from_toml(&toml).unwrap(), None)
        .await
        .unwrap();
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
