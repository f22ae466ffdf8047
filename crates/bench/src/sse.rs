//! Server-sent events as OpenAI-compatible servers stream them, and the clock that turns one
//! streamed response into timings.
//!
//! Definitions (printed in every report):
//! - time to first byte: request sent → first body byte;
//! - time to first chunk: request sent → first `data:` event carrying `choices` (a role-only chunk
//!   counts here);
//! - TTFT: request sent → first event whose delta has non-empty `content` (or `reasoning_content`,
//!   `reasoning`, or completions `text`);
//! - ITL: every gap between two consecutive content-bearing events;
//! - E2E: request sent → end of the response body.

use std::time::{Duration, Instant};

/// Splits a byte stream into SSE events and returns each event's `data` payload.
#[derive(Debug, Default, Clone)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<String>,
    has_data: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                self.handle_line(&line, &mut events);
            } else {
                self.line.push(b);
            }
        }
        events
    }

    /// Ends the stream: an event not followed by a blank line still counts.
    pub fn finish(&mut self) -> Vec<String> {
        let mut events = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.handle_line(&line, &mut events);
        }
        self.dispatch(&mut events);
        events
    }

    fn handle_line(&mut self, line: &[u8], events: &mut Vec<String>) {
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line.first() == Some(&b':') {
            return; // comment / keep-alive ping
        }
        let (field, value) = match line.iter().position(|&c| c == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            self.data.push(String::from_utf8_lossy(value).into_owned());
            self.has_data = true;
        }
    }

    fn dispatch(&mut self, events: &mut Vec<String>) {
        if self.has_data {
            events.push(self.data.join("\n"));
        }
        self.data.clear();
        self.has_data = false;
    }
}

/// What one SSE data payload says.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk {
    /// `[DONE]`.
    Done,
    /// A JSON event. `choices` tells whether it carried a `choices` entry, `content_chars` how
    /// much generated text it carried, `completion_tokens` the usage count if present.
    Event {
        choices: bool,
        content_chars: usize,
        completion_tokens: Option<u64>,
    },
    /// An `{"error": ...}` event sent mid-stream.
    Error(String),
    /// Not JSON.
    Malformed,
}

/// Classifies one data payload.
pub fn classify(data: &str) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk::Done;
    }
    let value: serde_json::Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(_) => return Chunk::Malformed,
    };
    let Some(obj) = value.as_object() else {
        return Chunk::Malformed;
    };
    if let Some(err) = obj.get("error") {
        let message = err
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("error event in stream");
        return Chunk::Error(message.to_string());
    }
    let completion_tokens = obj
        .get("usage")
        .and_then(|u| u.get("completion_tokens"))
        .and_then(|t| t.as_u64());
    let choices = obj.get("choices").and_then(|c| c.as_array());
    let mut content_chars = 0;
    if let Some(choices) = choices {
        for choice in choices {
            let delta = choice.get("delta");
            for text in [
                delta.and_then(|d| d.get("content")),
                delta.and_then(|d| d.get("reasoning_content")),
                delta.and_then(|d| d.get("reasoning")),
                choice.get("text"),
            ]
            .into_iter()
            .flatten()
            {
                if let Some(s) = text.as_str() {
                    content_chars += s.len();
                }
            }
        }
    } else if let Some(text) = obj.get("delta").and_then(|d| d.as_str()) {
        // Streamed transcription events (`transcript.text.delta`).
        content_chars += text.len();
    }
    Chunk::Event {
        choices: choices.is_some_and(|c| !c.is_empty()),
        content_chars,
        completion_tokens,
    }
}

/// Timings of one streamed response, measured from `start`.
#[derive(Debug, Clone)]
pub struct StreamClock {
    start: Instant,
    pub first_byte: Option<Duration>,
    pub first_chunk: Option<Duration>,
    pub first_content: Option<Duration>,
    last_content: Option<Duration>,
    pub gaps: Vec<Duration>,
    pub content_chunks: u64,
    pub usage_tokens: Option<u64>,
    pub done: bool,
    /// The first problem seen (malformed event or error event).
    pub error: Option<String>,
    parser: SseParser,
}

impl StreamClock {
    pub fn new(start: Instant) -> Self {
        StreamClock {
            start,
            first_byte: None,
            first_chunk: None,
            first_content: None,
            last_content: None,
            gaps: Vec::new(),
            content_chunks: 0,
            usage_tokens: None,
            done: false,
            error: None,
            parser: SseParser::new(),
        }
    }

    /// Feeds bytes that arrived at `at`.
    pub fn feed(&mut self, bytes: &[u8], at: Instant) {
        if bytes.is_empty() {
            return;
        }
        let t = at.saturating_duration_since(self.start);
        self.first_byte.get_or_insert(t);
        for data in self.parser.push(bytes) {
            self.event(&data, t);
        }
    }

    /// Ends the stream.
    pub fn finish(&mut self, at: Instant) {
        let t = at.saturating_duration_since(self.start);
        for data in self.parser.finish() {
            self.event(&data, t);
        }
    }

    fn event(&mut self, data: &str, t: Duration) {
        match classify(data) {
            Chunk::Done => self.done = true,
            Chunk::Malformed => {
                self.error
                    .get_or_insert_with(|| "malformed event in stream".to_string());
            }
            Chunk::Error(message) => {
                self.error.get_or_insert(message);
            }
            Chunk::Event {
                choices,
                content_chars,
                completion_tokens,
            } => {
                if let Some(n) = completion_tokens {
                    self.usage_tokens = Some(n);
                }
                if choices || content_chars > 0 {
                    self.first_chunk.get_or_insert(t);
                }
                if content_chars > 0 {
                    self.first_content.get_or_insert(t);
                    if let Some(prev) = self.last_content {
                        self.gaps.push(t.saturating_sub(prev));
                    }
                    self.last_content = Some(t);
                    self.content_chunks += 1;
                }
            }
        }
    }

    /// Output tokens: the server's usage count when it sent one, else one per content chunk.
    pub fn output_tokens(&self) -> u64 {
        self.usage_tokens.unwrap_or(self.content_chunks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_pushes_and_crlf() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(
            p.push(b":1}\r\n\r\n: ping\n\ndata: [DONE]\n\n"),
            vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]
        );
        assert!(p.finish().is_empty());
    }

    #[test]
    fn multi_line_data_is_joined_and_unterminated_event_flushes() {
        let mut p = SseParser::new();
        assert!(p.push(b"event: x\ndata: a\ndata: b").is_empty());
        assert_eq!(p.finish(), vec!["a\nb".to_string()]);
    }

    #[test]
    fn role_only_chunk_is_a_chunk_but_not_content() {
        let c = classify(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#);
        assert_eq!(
            c,
            Chunk::Event {
                choices: true,
                content_chars: 0,
                completion_tokens: None
            }
        );
        let c = classify(r#"{"choices":[{"delta":{"content":"Hi"}}]}"#);
        assert!(matches!(
            c,
            Chunk::Event {
                content_chars: 2,
                ..
            }
        ));
        let c = classify(r#"{"choices":[{"text":"abc"}],"usage":{"completion_tokens":7}}"#);
        assert_eq!(
            c,
            Chunk::Event {
                choices: true,
                content_chars: 3,
                completion_tokens: Some(7)
            }
        );
        assert_eq!(classify("not json"), Chunk::Malformed);
        assert_eq!(
            classify(r#"{"error":{"message":"boom"}}"#),
            Chunk::Error("boom".into())
        );
    }

    #[test]
    fn clock_measures_ttft_from_first_content_and_every_gap() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut clock = StreamClock::new(start);
        clock.feed(
            b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            at(50),
        );
        for i in 0..3u64 {
            clock.feed(
                b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\n",
                at(60 + 10 * i),
            );
        }
        clock.feed(b"data: [DONE]\n\n", at(81));
        clock.finish(at(81));
        assert_eq!(clock.first_byte, Some(Duration::from_millis(50)));
        assert_eq!(clock.first_chunk, Some(Duration::from_millis(50)));
        assert_eq!(clock.first_content, Some(Duration::from_millis(60)));
        assert_eq!(clock.gaps, vec![Duration::from_millis(10); 2]);
        assert_eq!(clock.output_tokens(), 3);
        assert!(clock.done && clock.error.is_none());
    }

    #[test]
    fn garbage_in_stream_is_an_error_not_a_panic() {
        let start = Instant::now();
        let mut clock = StreamClock::new(start);
        clock.feed(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: \xff\xfe garbage\n\n",
            start,
        );
        clock.finish(start);
        assert_eq!(clock.error.as_deref(), Some("malformed event in stream"));
    }

    proptest::proptest! {
        /// However the bytes are cut into network reads, the same events come out.
        #[test]
        fn events_do_not_depend_on_read_boundaries(
            payloads in proptest::collection::vec("[a-z{}\":, 0-9]{0,30}", 1..8),
            cuts in proptest::collection::vec(0usize..400, 0..12),
            crlf in proptest::bool::ANY,
        ) {
            let nl = if crlf { "\r\n" } else { "\n" };
            let mut text = String::new();
            for p in &payloads {
                text.push_str(&format!(": ping{nl}data: {p}{nl}{nl}"));
            }
            let bytes = text.as_bytes();
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut parser = SseParser::new();
            let mut got = Vec::new();
            let mut from = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                got.extend(parser.push(&bytes[from..c]));
                from = c;
            }
            got.extend(parser.finish());
            proptest::prop_assert_eq!(got, payloads);
        }
    }
}
