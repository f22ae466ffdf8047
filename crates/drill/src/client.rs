//! The night's clients: one attempt of a request (sent, answered or not, classified), and a
//! request as the official OpenAI SDK makes it — a refusal (429, 503), a connection that fails
//! before any answer and a stream the server stopped are sent again, up to `max_retries` times,
//! after the answer's Retry-After (`retry-after-ms` first, capped) or an exponential backoff,
//! and never past the request's deadline. Everything is timed from the night's start.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use headroom_bench::arrivals::Rng;
use headroom_bench::client::{describe_reqwest, never_reached_server};
use headroom_bench::sse::StreamClock;
use serde::Serialize;

use crate::payload::Body;
use crate::scenario::{ClientPolicy, StreamKind};

/// Where a stream's requests go.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http://127.0.0.1:PORT` (a gateway, or the engine itself on a box set up by hand).
    pub base: String,
    pub api_key: Option<String>,
}

/// How one attempt ended.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "end", rename_all = "snake_case")]
pub enum End {
    /// A whole, well-formed answer.
    Ok {
        /// Output tokens (text), when the answer says or the stream shows.
        tokens: Option<u64>,
        /// Time to the first event (streams) or first byte (audio answers), seconds.
        first_s: Option<f64>,
    },
    /// 429 or 503: the server declined the request for now.
    Refused {
        status: u16,
        code: Option<String>,
        retry_after_s: Option<f64>,
    },
    /// Any other error answer.
    Failed { status: u16, code: Option<String> },
    /// A stream that ended with an error event (e.g. preempted by audio work).
    Stopped { message: String },
    /// No answer: the connection failed or was reset, the body broke off, or the deadline passed.
    Lost {
        why: String,
        /// Nothing of an answer arrived (safe to send again, as the SDK does).
        before_answer: bool,
    },
}

/// One attempt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Attempt {
    /// When it was sent, seconds from the night's start.
    pub start_s: f64,
    /// How long until it ended, seconds.
    pub secs: f64,
    #[serde(flatten)]
    pub end: End,
}

/// The request's outcome after its retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Final {
    Ok,
    Refused,
    Failed,
    Stopped,
    Lost,
}

/// Everything about one request of the night.
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub stream: usize,
    pub seq: u64,
    /// The round it belongs to; `None` for the idle measurement.
    pub round: Option<u32>,
    pub attempts: Vec<Attempt>,
    #[serde(rename = "final")]
    pub outcome: Final,
}

impl Record {
    pub fn sent_s(&self) -> f64 {
        self.attempts.first().map(|a| a.start_s).unwrap_or(0.0)
    }

    pub fn ended_s(&self) -> f64 {
        self.attempts
            .last()
            .map(|a| a.start_s + a.secs)
            .unwrap_or(0.0)
    }

    /// Latency of the attempt that was served (`None` unless ok).
    pub fn served_secs(&self) -> Option<f64> {
        (self.outcome == Final::Ok).then(|| self.attempts.last().map(|a| a.secs))?
    }

    /// From the first send to the answer, retries and waits included (`None` unless ok).
    pub fn total_secs(&self) -> Option<f64> {
        (self.outcome == Final::Ok).then(|| self.ended_s() - self.sent_s())
    }

    pub fn tokens(&self) -> u64 {
        match self.attempts.last().map(|a| &a.end) {
            Some(End::Ok {
                tokens: Some(t), ..
            }) if self.outcome == Final::Ok => *t,
            _ => 0,
        }
    }

    pub fn refusals(&self) -> impl Iterator<Item = &Attempt> {
        self.attempts
            .iter()
            .filter(|a| matches!(a.end, End::Refused { .. }))
    }
}

/// The statuses a server uses to decline a request for now.
pub fn is_refusal(status: u16) -> bool {
    status == 429 || status == 503
}

/// What to send: the stream's body and how its answer is read.
#[derive(Debug, Clone)]
pub struct Shape {
    pub kind: StreamKind,
    pub model: String,
    pub body: Body,
    /// Read the answer as a stream of events (chat) or as it arrives (speech).
    pub streamed: bool,
}

/// Builds request `seq` of `shape` for `target`.
pub fn build(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    seq: u64,
) -> reqwest::RequestBuilder {
    let url = format!("{}{}", target.base.trim_end_matches('/'), shape.kind.path());
    let mut b = client.post(url);
    if let Some(key) = &target.api_key {
        b = b.bearer_auth(key);
    }
    match &shape.body {
        Body::Audio { wav, .. } => {
            let part = reqwest::multipart::Part::bytes(wav.as_ref().clone())
                .file_name(format!("clip-{seq}.wav"));
            let part = match part.mime_str("audio/wav") {
                Ok(p) => p,
                Err(_) => reqwest::multipart::Part::bytes(wav.as_ref().clone())
                    .file_name(format!("clip-{seq}.wav")),
            };
            let form = reqwest::multipart::Form::new()
                .part("file", part)
                .text("model", shape.model.clone())
                .text("response_format", "json");
            b.multipart(form)
        }
        Body::Json { template } => b
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(template.body(seq).to_string()),
    }
}

/// The seconds a refusal asks the client to wait: `retry-after-ms`, else `retry-after` (seconds
/// or an HTTP date, which we do not read).
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<f64> {
    if let Some(ms) = headers
        .get("retry-after-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
    {
        return Some(ms / 1000.0);
    }
    headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|v| v.is_finite() && *v >= 0.0)
}

/// The `code` of an OpenAI-shaped error body (also inside FastAPI's `detail`), for the report.
pub fn error_code(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let err = v
        .get("error")
        .or_else(|| v.get("detail").and_then(|d| d.get("error")))?;
    match err.get("code") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Number(n)) => Some(n.to_string()),
        _ => err.get("type").and_then(|t| t.as_str()).map(str::to_string),
    }
}

/// Whether a body is an OpenAI-shaped error (`{"error": {"message": ...}}`).
pub fn is_openai_error(body: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.get("message")?.as_str().map(|_| ()))
        .is_some()
}

/// Sends one attempt, giving up after `limit`.
pub async fn attempt(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    seq: u64,
    night_start: Instant,
    limit: Duration,
) -> Attempt {
    let start = Instant::now();
    let start_s = start.saturating_duration_since(night_start).as_secs_f64();
    let end = match tokio::time::timeout(limit, send(client, target, shape, seq, start)).await {
        Ok(end) => end,
        Err(_) => End::Lost {
            why: format!(
                "no answer within {:.0} s (its deadline)",
                limit.as_secs_f64()
            ),
            before_answer: false,
        },
    };
    Attempt {
        start_s,
        secs: start.elapsed().as_secs_f64(),
        end,
    }
}

async fn send(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    seq: u64,
    start: Instant,
) -> End {
    let response = match build(client, target, shape, seq).send().await {
        Ok(r) => r,
        Err(e) => {
            return End::Lost {
                before_answer: e.is_connect() || never_reached_server(&e),
                why: describe_reqwest(&e),
            };
        }
    };
    let status = response.status().as_u16();
    if !response.status().is_success() {
        let ra = retry_after(response.headers());
        let body = read_capped(response, 1 << 20).await.unwrap_or_default();
        let code = error_code(&body);
        return if is_refusal(status) {
            End::Refused {
                status,
                code,
                retry_after_s: ra,
            }
        } else {
            End::Failed { status, code }
        };
    }
    if shape.kind == StreamKind::Chat && shape.streamed {
        return read_events(response, start).await;
    }
    let mut first = None;
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(next) = chunks.next().await {
        match next {
            Ok(b) => {
                first.get_or_insert_with(|| start.elapsed().as_secs_f64());
                if body.len() < (64 << 20) {
                    body.extend_from_slice(&b);
                }
            }
            Err(e) => {
                return End::Lost {
                    why: format!("answer broke off: {}", describe_reqwest(&e)),
                    before_answer: false,
                };
            }
        }
    }
    match check_whole(shape.kind, &body) {
        Ok(tokens) => End::Ok {
            tokens,
            first_s: first,
        },
        Err(why) => End::Failed {
            status,
            code: Some(why),
        },
    }
}

async fn read_capped(response: reqwest::Response, cap: usize) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(next) = chunks.next().await {
        let b = next.ok()?;
        if body.len() < cap {
            body.extend_from_slice(&b);
        }
    }
    Some(body)
}

/// A streamed chat: ok only when it ends with `[DONE]` and no error event.
async fn read_events(response: reqwest::Response, start: Instant) -> End {
    let mut clock = StreamClock::new(start);
    let mut chunks = response.bytes_stream();
    while let Some(next) = chunks.next().await {
        match next {
            Ok(b) => clock.feed(&b, Instant::now()),
            Err(e) => {
                clock.finish(Instant::now());
                if let Some(message) = clock.error.take() {
                    return End::Stopped { message };
                }
                return End::Lost {
                    why: format!("stream broke off: {}", describe_reqwest(&e)),
                    before_answer: false,
                };
            }
        }
    }
    clock.finish(Instant::now());
    if let Some(message) = clock.error.take() {
        return End::Stopped { message };
    }
    if !clock.done {
        return End::Lost {
            why: "stream ended without [DONE]".into(),
            before_answer: false,
        };
    }
    End::Ok {
        tokens: Some(clock.output_tokens()),
        first_s: clock.first_content.map(|d| d.as_secs_f64()),
    }
}

/// Checks a whole answer's shape; returns output tokens where the answer gives them.
fn check_whole(kind: StreamKind, body: &[u8]) -> Result<Option<u64>, String> {
    if kind == StreamKind::Speech {
        return if body.is_empty() {
            Err("empty audio".into())
        } else {
            Ok(None)
        };
    }
    let v: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| "answer is not JSON".to_string())?;
    match kind {
        StreamKind::Transcription if v.get("text").is_some_and(|t| t.is_string()) => Ok(None),
        StreamKind::Chat if v.pointer("/choices/0/message").is_some() => Ok(v
            .pointer("/usage/completion_tokens")
            .and_then(|t| t.as_u64())),
        _ => Err(format!("unexpected {} answer", kind.as_str())),
    }
}

/// The SDK's backoff before retry `n` (0-based): 0.5 s doubling up to 8 s, less up to 25 % jitter.
pub fn backoff(n: u32, rng: &mut Rng) -> Duration {
    let base = (0.5 * 2f64.powi(n.min(10) as i32)).min(8.0);
    Duration::from_secs_f64(base * (1.0 - 0.25 * rng.unit()))
}

/// What to do after an attempt: stop with a final outcome, or wait and send again.
pub fn next_step(
    end: &End,
    retries_done: u32,
    policy: &ClientPolicy,
    rng: &mut Rng,
) -> Result<Duration, Final> {
    let again = retries_done < policy.max_retries;
    match end {
        End::Ok { .. } => Err(Final::Ok),
        End::Failed { .. } => Err(Final::Failed),
        End::Lost {
            before_answer: false,
            ..
        } => Err(Final::Lost),
        End::Lost { .. } if !again => Err(Final::Lost),
        End::Lost { .. } => Ok(backoff(retries_done, rng)),
        End::Refused { .. } if !again => Err(Final::Refused),
        End::Refused { retry_after_s, .. } => Ok(match retry_after_s {
            Some(s) if *s > 0.0 && Duration::from_secs_f64(*s) <= policy.retry_after_cap => {
                Duration::from_secs_f64(*s)
            }
            _ => backoff(retries_done, rng),
        }),
        End::Stopped { .. } if !again => Err(Final::Stopped),
        End::Stopped { .. } => Ok(backoff(retries_done, rng)),
    }
}

/// One request with its retries, within `deadline` of its first send.
#[allow(clippy::too_many_arguments)]
pub async fn request(
    client: &reqwest::Client,
    target: &Target,
    shape: &Shape,
    stream: usize,
    seq: u64,
    round: Option<u32>,
    night_start: Instant,
    deadline: Duration,
    policy: &ClientPolicy,
    rng: &mut Rng,
) -> Record {
    let first = Instant::now();
    let mut attempts = Vec::new();
    let outcome = loop {
        let left = deadline.saturating_sub(first.elapsed());
        if left.is_zero() {
            break Final::Lost;
        }
        let a = attempt(client, target, shape, seq, night_start, left).await;
        let step = next_step(&a.end, attempts.len() as u32, policy, rng);
        attempts.push(a);
        match step {
            Err(f) => break f,
            Ok(wait) => {
                if first.elapsed() + wait >= deadline {
                    // The wait would pass the deadline: the answer it has is the last one.
                    break match attempts.last().map(|a| &a.end) {
                        Some(End::Refused { .. }) => Final::Refused,
                        Some(End::Stopped { .. }) => Final::Stopped,
                        _ => Final::Lost,
                    };
                }
                tokio::time::sleep(wait).await;
            }
        }
    };
    Record {
        stream,
        seq,
        round,
        attempts,
        outcome,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> ClientPolicy {
        ClientPolicy {
            max_retries: 2,
            retry_after_cap: Duration::from_secs(60),
        }
    }

    #[test]
    fn refusals_wait_their_retry_after_and_give_up_after_the_retries() {
        let mut rng = Rng::new(1);
        let refused = End::Refused {
            status: 503,
            code: Some("backend_unavailable".into()),
            retry_after_s: Some(2.5),
        };
        assert_eq!(
            next_step(&refused, 0, &policy(), &mut rng),
            Ok(Duration::from_millis(2500))
        );
        assert_eq!(
            next_step(&refused, 2, &policy(), &mut rng),
            Err(Final::Refused)
        );
        // Without a Retry-After (or one past the cap): the SDK's backoff.
        let bare = End::Refused {
            status: 429,
            code: None,
            retry_after_s: None,
        };
        let w = next_step(&bare, 1, &policy(), &mut rng).unwrap();
        assert!(
            w >= Duration::from_millis(750) && w <= Duration::from_secs(1),
            "{w:?}"
        );
        let far = End::Refused {
            status: 429,
            code: None,
            retry_after_s: Some(600.0),
        };
        assert!(next_step(&far, 0, &policy(), &mut rng).unwrap() <= Duration::from_millis(500));
    }

    #[test]
    fn only_losses_before_an_answer_are_sent_again() {
        let mut rng = Rng::new(1);
        let reset = End::Lost {
            why: "connection failed".into(),
            before_answer: true,
        };
        assert!(next_step(&reset, 0, &policy(), &mut rng).is_ok());
        assert_eq!(next_step(&reset, 2, &policy(), &mut rng), Err(Final::Lost));
        let cut = End::Lost {
            why: "stream broke off".into(),
            before_answer: false,
        };
        assert_eq!(next_step(&cut, 0, &policy(), &mut rng), Err(Final::Lost));
        let failed = End::Failed {
            status: 400,
            code: None,
        };
        assert_eq!(
            next_step(&failed, 0, &policy(), &mut rng),
            Err(Final::Failed)
        );
    }

    #[test]
    fn retry_after_ms_wins_over_seconds() {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("retry-after", "3".parse().unwrap());
        assert_eq!(retry_after(&h), Some(3.0));
        h.insert("retry-after-ms", "2500".parse().unwrap());
        assert_eq!(retry_after(&h), Some(2.5));
        let mut d = reqwest::header::HeaderMap::new();
        d.insert(
            "retry-after",
            "Wed, 21 Oct 2015 07:28:00 GMT".parse().unwrap(),
        );
        assert_eq!(retry_after(&d), None);
    }

    #[test]
    fn error_codes_come_from_openai_and_fastapi_shapes() {
        assert_eq!(
            error_code(
                br#"{"error":{"message":"m","type":"t","param":null,"code":"host_memory"}}"#
            ),
            Some("host_memory".into())
        );
        assert_eq!(
            error_code(br#"{"detail":{"error":{"message":"m","type":"invalid_request_error"}}}"#),
            Some("invalid_request_error".into())
        );
        assert_eq!(error_code(b"Internal Server Error"), None);
        assert!(is_openai_error(br#"{"error":{"message":"m"}}"#));
        assert!(!is_openai_error(br#"{"detail":"Not Found"}"#));
    }

    #[test]
    fn backoff_doubles_to_eight_seconds() {
        let mut rng = Rng::new(3);
        for (n, top) in [(0, 0.5), (1, 1.0), (3, 4.0), (4, 8.0), (9, 8.0)] {
            let b = backoff(n, &mut rng).as_secs_f64();
            assert!(b <= top && b >= 0.75 * top, "{n}: {b}");
        }
    }
}
