//! Sends one request of a [`RequestSpec`] and measures it: status, time to first byte, first
//! chunk, first token, every inter-chunk gap, end-to-end time, output tokens. Never panics on
//! what the server sends: anything unexpected becomes an `other_error` outcome with a reason.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::json;

use crate::sse::StreamClock;
use crate::workload::{RequestKind, RequestSpec};

/// How a request ended. 429, 503 and 504 are kept apart from other failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok,
    Http429,
    Http503,
    Http504,
    OtherError,
}

impl Outcome {
    pub fn from_status(status: u16) -> Outcome {
        match status {
            200..=299 => Outcome::Ok,
            429 => Outcome::Http429,
            503 => Outcome::Http503,
            504 => Outcome::Http504,
            _ => Outcome::OtherError,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Http429 => "http_429",
            Outcome::Http503 => "http_503",
            Outcome::Http504 => "http_504",
            Outcome::OtherError => "other_error",
        }
    }
}

/// Everything measured about one request. Times are from the moment the request was handed to
/// the HTTP client.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// Index of the spec in the run's list.
    pub spec: usize,
    /// When the request started, from the start of the run.
    pub started: Duration,
    pub outcome: Outcome,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub first_byte: Option<Duration>,
    pub first_chunk: Option<Duration>,
    pub ttft: Option<Duration>,
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub output_tokens: Option<u64>,
    /// Seconds of audio sent (transcription) for RTFx.
    pub audio_seconds: Option<f64>,
    /// Times the request was sent again on a fresh connection because a pooled one had been
    /// closed by the server before the request reached it (see [`never_reached_server`]).
    pub stale_retries: u32,
}

impl RequestRecord {
    /// TPOT = (E2E − TTFT) / (output tokens − 1), for requests with at least two tokens.
    pub fn tpot(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let tokens = self.output_tokens?;
        if tokens < 2 {
            return None;
        }
        Some(self.e2e.saturating_sub(ttft) / (tokens - 1) as u32)
    }
}

/// Sends request number `seq` of `spec`.
pub async fn execute(
    client: &reqwest::Client,
    spec: &RequestSpec,
    spec_index: usize,
    seq: u64,
    run_start: Instant,
    timeout: Duration,
) -> RequestRecord {
    let mut record = RequestRecord {
        spec: spec_index,
        started: run_start.elapsed(),
        outcome: Outcome::OtherError,
        status: None,
        error: None,
        first_byte: None,
        first_chunk: None,
        ttft: None,
        itl: Vec::new(),
        e2e: Duration::ZERO,
        output_tokens: None,
        audio_seconds: None,
        stale_retries: 0,
    };
    let result =
        tokio::time::timeout(timeout, send(client, spec, seq, run_start, &mut record)).await;
    let sent_at = match result {
        Ok(sent_at) => sent_at,
        Err(_) => {
            record.outcome = Outcome::OtherError;
            record.error = Some(format!("timed out after {}s", timeout.as_secs_f64()));
            run_start + record.started
        }
    };
    if record.e2e.is_zero() {
        // Ended early (connection failure, broken body, timeout): up to now.
        record.e2e = sent_at.elapsed();
    }
    record
}

/// Builds request number `seq` of `spec` on `client`; `Err` says why it cannot be sent.
fn build(
    client: &reqwest::Client,
    spec: &RequestSpec,
    seq: u64,
    record: &mut RequestRecord,
) -> Result<reqwest::RequestBuilder, String> {
    let Some(url) = spec.endpoint_url() else {
        return Err(format!("not a valid URL: {}", spec.endpoint()));
    };
    let mut builder = client.post(url.clone());
    if let Some(key) = &spec.api_key {
        builder = builder.bearer_auth(key);
    }
    Ok(match spec.kind {
        RequestKind::Chat => {
            let mut body = json!({
                "model": spec.model,
                "messages": [{"role": "user", "content": spec.prompts.get(seq)}],
                "max_tokens": spec.max_tokens,
                "stream": spec.stream,
            });
            if spec.stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            json_body(builder, &body)
        }
        RequestKind::Completions => {
            let mut body = json!({
                "model": spec.model,
                "prompt": spec.prompts.get(seq),
                "max_tokens": spec.max_tokens,
                "stream": spec.stream,
            });
            if spec.stream {
                body["stream_options"] = json!({"include_usage": true});
            }
            json_body(builder, &body)
        }
        RequestKind::Speech => json_body(
            builder,
            &json!({
                "model": spec.model,
                "input": spec.prompts.get(seq),
                "voice": spec.voice,
            }),
        ),
        RequestKind::Transcription => {
            if spec.audio.is_empty() {
                return Err("no audio files".into());
            }
            let clip = &spec.audio[(seq % spec.audio.len() as u64) as usize];
            record.audio_seconds = clip.seconds;
            let part = || {
                reqwest::multipart::Part::bytes(clip.bytes.as_ref().clone())
                    .file_name(clip.file_name.clone())
            };
            // The MIME types are fixed strings that always parse; without one the file still goes.
            let part = part().mime_str(clip.mime).unwrap_or_else(|_| part());
            let mut form = reqwest::multipart::Form::new()
                .part("file", part)
                .text("model", spec.model.clone())
                .text("response_format", "json");
            if spec.stream {
                form = form.text("stream", "true");
            }
            builder.multipart(form)
        }
    })
}

/// Whether a send error proves the request never reached the server: the connection was closed
/// or reset under it before any byte of a response came back, and it was not a failure to
/// connect (a server that is down is an error, not a stale connection). This is what a pooled
/// keep-alive connection looks like when the server closed it right after its last response
/// (llama.cpp does so after a stream, while advertising keep-alive): the request goes out on the
/// dead socket within microseconds, the kernel answers with a reset, and the server's
/// application never reads a byte of it. hyper reports this as "connection closed before
/// message completed" (or the reset itself) with no response head.
pub fn never_reached_server(e: &reqwest::Error) -> bool {
    if e.is_connect() || e.is_timeout() || e.status().is_some() {
        return false;
    }
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
            )
        {
            return true;
        }
        if s.to_string()
            .contains("connection closed before message completed")
        {
            return true;
        }
        source = s.source();
    }
    false
}

/// A client that never reuses a connection, for the one resend after a stale pooled connection.
fn fresh_connection_client() -> Option<reqwest::Client> {
    reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()
        .ok()
}

async fn send(
    client: &reqwest::Client,
    spec: &RequestSpec,
    seq: u64,
    run_start: Instant,
    record: &mut RequestRecord,
) -> Instant {
    let builder = match build(client, spec, seq, record) {
        Ok(b) => b,
        Err(why) => {
            record.error = Some(why);
            return Instant::now();
        }
    };
    // The clock starts when the request is handed to the connection, not while it is built.
    let start = Instant::now();
    record.started = start.saturating_duration_since(run_start);
    let response = match builder.send().await {
        Ok(r) => Ok(r),
        Err(e) if never_reached_server(&e) => {
            // Sent again, once, on a connection of its own; the lost microseconds stay in the
            // measured time.
            record.stale_retries += 1;
            match fresh_connection_client() {
                Some(fresh) => match build(&fresh, spec, seq, record) {
                    Ok(b) => b.send().await,
                    Err(_) => Err(e),
                },
                None => Err(e),
            }
        }
        Err(e) => Err(e),
    };
    let response = match response {
        Ok(r) => r,
        Err(e) => {
            record.error = Some(describe_reqwest(&e));
            return start;
        }
    };
    let status = response.status().as_u16();
    record.status = Some(status);
    record.outcome = Outcome::from_status(status);
    let streamed = spec.stream && record.outcome == Outcome::Ok;
    let mut clock = StreamClock::new(start);
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(next) = stream.next().await {
        match next {
            Ok(bytes) => {
                let now = Instant::now();
                record.first_byte.get_or_insert(now - start);
                if streamed {
                    clock.feed(&bytes, now);
                } else if body.len() < 64 << 20 {
                    body.extend_from_slice(&bytes);
                }
            }
            Err(e) => {
                record.outcome = Outcome::OtherError;
                record.error = Some(format!("body: {}", describe_reqwest(&e)));
                return start;
            }
        }
    }
    let end = Instant::now();
    record.e2e = end - start;
    if record.outcome != Outcome::Ok {
        record.error = Some(format!("HTTP {status}{}", error_message(&body)));
        return start;
    }
    if streamed {
        clock.finish(end);
        record.first_chunk = clock.first_chunk;
        record.ttft = clock.first_content;
        record.itl = std::mem::take(&mut clock.gaps);
        record.output_tokens = Some(clock.output_tokens());
        if let Some(err) = clock.error {
            record.outcome = Outcome::OtherError;
            record.error = Some(err);
        } else if clock.first_chunk.is_none() {
            record.outcome = Outcome::OtherError;
            record.error = Some("stream ended without a single chunk".into());
        }
        return start;
    }
    match check_body(spec.kind, &body) {
        Ok(tokens) => record.output_tokens = tokens,
        Err(why) => {
            record.outcome = Outcome::OtherError;
            record.error = Some(why);
        }
    }
    start
}

fn json_body(
    builder: reqwest::RequestBuilder,
    body: &serde_json::Value,
) -> reqwest::RequestBuilder {
    builder
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string())
}

/// Checks a non-streamed answer has the expected shape; returns its output token count if given.
fn check_body(kind: RequestKind, body: &[u8]) -> Result<Option<u64>, String> {
    if kind == RequestKind::Speech {
        return if body.is_empty() {
            Err("empty audio body".into())
        } else {
            Ok(None)
        };
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|_| "malformed JSON body".to_string())?;
    let ok = match kind {
        RequestKind::Chat => value
            .pointer("/choices/0/message")
            .is_some_and(|m| m.is_object()),
        RequestKind::Completions => value
            .pointer("/choices/0/text")
            .is_some_and(|t| t.is_string()),
        RequestKind::Transcription => value.get("text").is_some_and(|t| t.is_string()),
        RequestKind::Speech => true,
    };
    if !ok {
        return Err(format!("unexpected {} response shape", kind.as_str()));
    }
    Ok(value
        .pointer("/usage/completion_tokens")
        .and_then(|t| t.as_u64()))
}

/// `": message"` from an OpenAI-shaped error body, or nothing. Never echoes other content.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/message")?.as_str().map(str::to_string))
        .map(|m| format!(": {}", m.chars().take(200).collect::<String>()))
        .unwrap_or_default()
}

/// A short, one-line description of a client error.
pub fn describe_reqwest(e: &reqwest::Error) -> String {
    let kind = if e.is_connect() {
        "connection failed"
    } else if e.is_timeout() {
        "timed out"
    } else if e.is_body() || e.is_decode() {
        "broken body"
    } else if e.is_request() {
        "request failed"
    } else {
        "error"
    };
    let mut text = kind.to_string();
    let mut source: Option<&dyn std::error::Error> = std::error::Error::source(e);
    let mut depth = 0;
    while let Some(s) = source {
        let piece = s.to_string();
        if !text.contains(&piece) && depth < 3 {
            text.push_str(": ");
            text.push_str(&piece);
        }
        source = s.source();
        depth += 1;
    }
    text.replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_outcomes() {
        assert_eq!(Outcome::from_status(200), Outcome::Ok);
        assert_eq!(Outcome::from_status(429), Outcome::Http429);
        assert_eq!(Outcome::from_status(503), Outcome::Http503);
        assert_eq!(Outcome::from_status(504), Outcome::Http504);
        assert_eq!(Outcome::from_status(500), Outcome::OtherError);
        assert_eq!(Outcome::from_status(401), Outcome::OtherError);
    }

    #[test]
    fn bodies_are_checked_by_kind() {
        assert_eq!(
            check_body(
                RequestKind::Chat,
                br#"{"choices":[{"message":{"content":"x"}}],"usage":{"completion_tokens":4}}"#
            ),
            Ok(Some(4))
        );
        assert!(check_body(RequestKind::Chat, b"<html>").is_err());
        assert!(check_body(RequestKind::Completions, br#"{"choices":[]}"#).is_err());
        assert_eq!(
            check_body(RequestKind::Transcription, br#"{"text":"hi"}"#),
            Ok(None)
        );
        assert!(check_body(RequestKind::Speech, b"").is_err());
    }

    #[test]
    fn tpot_uses_tokens_after_the_first() {
        let r = RequestRecord {
            spec: 0,
            started: Duration::ZERO,
            outcome: Outcome::Ok,
            status: Some(200),
            error: None,
            first_byte: None,
            first_chunk: None,
            ttft: Some(Duration::from_millis(100)),
            itl: vec![],
            e2e: Duration::from_millis(1100),
            output_tokens: Some(11),
            audio_seconds: None,
            stale_retries: 0,
        };
        assert_eq!(r.tpot(), Some(Duration::from_millis(100)));
    }
}
