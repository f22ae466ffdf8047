//! A raw HTTP/1.1 upstream on 127.0.0.1 that plays an engine's faults on demand: it answers, or
//! takes a request whole and closes the connection without a word, or takes it and never answers
//! (a hung engine). Every request it read whole is counted as a delivery, so a test can tell how
//! many times one POST reached an engine. The mode can change while the gateway is running.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// What the upstream does with each request it has read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Mode {
    /// A 200 chat completion, the connection kept alive.
    Answer = 0,
    /// Closes the connection (a clean FIN) without answering.
    Close = 1,
    /// Never answers; holds the connection until the gateway drops it.
    Hang = 2,
}

impl Mode {
    fn from_u8(v: u8) -> Mode {
        match v {
            1 => Mode::Close,
            2 => Mode::Hang,
            _ => Mode::Answer,
        }
    }
}

pub struct FaultUpstream {
    pub url: String,
    mode: Arc<AtomicU8>,
    delivered: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
}

impl FaultUpstream {
    pub fn set(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    /// Requests read whole (each one an engine would have run).
    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::SeqCst)
    }

    /// Requests answered 200.
    pub fn answered(&self) -> u64 {
        self.answered.load(Ordering::SeqCst)
    }
}

const ANSWER_BODY: &str = r#"{"id":"c1","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;

/// Reads one request (head and `content-length` body); `false` when the peer closed first.
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

async fn serve_connection(
    tcp: TcpStream,
    mode: Arc<AtomicU8>,
    delivered: Arc<AtomicU64>,
    answered: Arc<AtomicU64>,
) {
    let mut reader = BufReader::new(tcp);
    while read_request(&mut reader).await {
        delivered.fetch_add(1, Ordering::SeqCst);
        match Mode::from_u8(mode.load(Ordering::SeqCst)) {
            Mode::Answer => {
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{ANSWER_BODY}",
                    ANSWER_BODY.len()
                );
                if reader.get_mut().write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
                answered.fetch_add(1, Ordering::SeqCst);
            }
            Mode::Close => {
                let _ = reader.get_mut().shutdown().await;
                return;
            }
            Mode::Hang => {
                // Until the gateway gives up and closes its end.
                let mut sink = [0u8; 1024];
                while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
                return;
            }
        }
    }
}

pub async fn start(mode: Mode) -> FaultUpstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let up = FaultUpstream {
        url,
        mode: Arc::new(AtomicU8::new(mode as u8)),
        delivered: Arc::new(AtomicU64::new(0)),
        answered: Arc::new(AtomicU64::new(0)),
    };
    let (m, d, a) = (up.mode.clone(), up.delivered.clone(), up.answered.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(serve_connection(tcp, m.clone(), d.clone(), a.clone()));
        }
    });
    up
}
