//! The night file (`examples/night.toml`): which requests arrive, how often and how large, and the
//! faults that happen during the night. Times are written as a share of the night (`"30%"`) or as
//! a fixed duration (`"90s"`), so one file runs as a 4-minute night in CI and as a full hour; rates
//! are per minute and do not scale. [`Night::parse`] validates everything once: a bad file is one
//! readable line naming the key, never a surprise half-way through the night.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use headroom_plan::units::{BareNumber, parse_duration, parse_size};
use serde::Deserialize;

/// A night file that cannot be used; the message names the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0}")]
pub struct ScenarioError(pub String);

fn bad(key: &str, why: impl std::fmt::Display) -> ScenarioError {
    ScenarioError(format!("`{key}`: {why}"))
}

/// A point or a length in the night: a share of the whole night, or a fixed duration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Span {
    Share(f64),
    Fixed(Duration),
}

impl Span {
    /// Reads `"30%"` or a duration (`"90s"`, `"2m"`).
    pub fn parse(key: &str, text: &str) -> Result<Span, ScenarioError> {
        let t = text.trim();
        if let Some(number) = t.strip_suffix('%') {
            let share: f64 = number
                .trim()
                .parse()
                .map_err(|_| bad(key, format!("`{text}` is not a percentage")))?;
            if !(0.0..=100.0).contains(&share) {
                return Err(bad(key, format!("{text} is outside 0–100 %")));
            }
            return Ok(Span::Share(share / 100.0));
        }
        parse_duration(t, BareNumber::Seconds)
            .map(Span::Fixed)
            .ok_or_else(|| {
                bad(
                    key,
                    format!("`{text}` is neither a share (\"30%\") nor a duration (\"90s\")"),
                )
            })
    }

    /// The span in a night of length `night`.
    pub fn of(&self, night: Duration) -> Duration {
        match *self {
            Span::Share(s) => night.mul_f64(s),
            Span::Fixed(d) => d,
        }
    }
}

/// How much memory a co-tenant holds: a share of the pool's capacity or a size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Amount {
    ShareOfCapacity(f64),
    Bytes(u64),
}

impl Amount {
    fn parse(key: &str, text: &str) -> Result<Amount, ScenarioError> {
        let t = text.trim();
        if let Some(number) = t.strip_suffix('%') {
            let share: f64 = number
                .trim()
                .parse()
                .map_err(|_| bad(key, format!("`{text}` is not a percentage")))?;
            if !(0.0..=100.0).contains(&share) || share == 0.0 {
                return Err(bad(
                    key,
                    format!("{text} must be above 0 and at most 100 %"),
                ));
            }
            return Ok(Amount::ShareOfCapacity(share / 100.0));
        }
        parse_size(t).map(Amount::Bytes).map_err(|e| bad(key, e))
    }

    /// Bytes in a pool of `capacity` bytes.
    pub fn bytes(&self, capacity: u64) -> u64 {
        match *self {
            Amount::ShareOfCapacity(s) => (capacity as f64 * s) as u64,
            Amount::Bytes(b) => b,
        }
    }
}

/// What a stream sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamKind {
    Transcription,
    Speech,
    Chat,
}

impl StreamKind {
    pub fn as_str(self) -> &'static str {
        match self {
            StreamKind::Transcription => "transcription",
            StreamKind::Speech => "speech",
            StreamKind::Chat => "chat",
        }
    }

    /// The OpenAI route.
    pub fn path(self) -> &'static str {
        match self {
            StreamKind::Transcription => "/v1/audio/transcriptions",
            StreamKind::Speech => "/v1/audio/speech",
            StreamKind::Chat => "/v1/chat/completions",
        }
    }

    /// Audio work: the lanes the page is about.
    pub fn is_audio(self) -> bool {
        !matches!(self, StreamKind::Chat)
    }
}

/// When a stream's requests start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arrivals {
    /// Open loop: exponential gaps with this mean rate.
    Poisson { per_minute: f64 },
    /// Closed loop: `workers` clients, each sending the next request `think` after its last
    /// answer (an overnight batch job).
    Workers { workers: u32, think: Duration },
}

/// The body of a stream's requests.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// A WAV clip, played `repeat` times in a row as one file (long audio from a short clip).
    Audio { clip: PathBuf, repeat: u32 },
    /// Text to speak: `chars` characters of plain sentences.
    Speech {
        chars: u32,
        voice: String,
        format: String,
        stream: bool,
    },
    /// A chat request: `instruction` followed by about `input_tokens` words of transcript.
    Chat {
        instruction: String,
        input_tokens: u32,
        max_tokens: u32,
        stream: bool,
    },
}

impl Payload {
    /// Whether its answer comes as a stream of events (what a client can leave half-way).
    pub fn streams(&self) -> bool {
        match self {
            Payload::Audio { .. } => false,
            Payload::Speech { stream, .. } | Payload::Chat { stream, .. } => *stream,
        }
    }
}

/// One kind of request of the night; its name is its lane in the report.
#[derive(Debug, Clone, PartialEq)]
pub struct Stream {
    pub name: String,
    pub kind: StreamKind,
    /// The box backend that serves it (by name); default: the one whose route fits the kind.
    pub backend: Option<String>,
    pub model: String,
    pub arrivals: Arrivals,
    /// A request with no answer this long after it was first sent is lost.
    pub deadline: Duration,
    /// The verdict on this lane: night p99 at most this many times the idle p50 (audio lanes).
    pub p99_vs_idle: Option<f64>,
    pub payload: Payload,
}

/// What goes wrong during the night.
#[derive(Debug, Clone, PartialEq)]
pub enum FaultAction {
    /// `kill -9` of a backend's main process.
    Kill9 { backend: String },
    /// Clients that read a few events of a streamed answer, then close the connection.
    LeaveMidStream {
        stream: String,
        after_events: u32,
        count: u32,
    },
    /// A body of `bytes` on the stream's route (a valid request, just far too large).
    Oversize { stream: String, bytes: u64 },
    /// Broken bodies on the stream's route: truncated JSON, wrong types, no file, not audio.
    Malformed { stream: String },
    /// Clients that send the stream's request body at `bytes_per_second`.
    SlowClient {
        stream: String,
        bytes_per_second: u64,
        count: u32,
    },
    /// A process that appears inside the memory pool, holds `amount` for `hold`, then exits.
    CoTenant { amount: Amount, hold: Span },
}

impl FaultAction {
    pub fn name(&self) -> &'static str {
        match self {
            FaultAction::Kill9 { .. } => "kill9",
            FaultAction::LeaveMidStream { .. } => "leave_mid_stream",
            FaultAction::Oversize { .. } => "oversize",
            FaultAction::Malformed { .. } => "malformed",
            FaultAction::SlowClient { .. } => "slow_client",
            FaultAction::CoTenant { .. } => "co_tenant",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    pub at: Span,
    pub action: FaultAction,
}

/// How the night's clients retry, like the official OpenAI SDK: a refusal (429, 503), a
/// connection that fails before an answer and a stopped stream are sent again up to
/// `max_retries` times, after the Retry-After the answer gave (capped) or a backoff.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClientPolicy {
    pub max_retries: u32,
    pub retry_after_cap: Duration,
}

/// A validated night.
#[derive(Debug, Clone, PartialEq)]
pub struct Night {
    pub name: String,
    /// The file's folder: clip paths are relative to it.
    pub dir: PathBuf,
    pub seed: u64,
    /// The night is cut into this many rounds, each ending in a quiet gap whose memory floor
    /// feeds the leak verdict (it needs at least 6).
    pub rounds: u32,
    pub gap: Span,
    /// Requests per stream sent one at a time on the quiet box before the night.
    pub idle_requests: u32,
    pub client: ClientPolicy,
    pub streams: Vec<Stream>,
    pub faults: Vec<Fault>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNight {
    name: String,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    rounds: Option<u32>,
    #[serde(default)]
    gap: Option<String>,
    #[serde(default)]
    idle: Option<RawIdle>,
    #[serde(default)]
    client: Option<RawClient>,
    #[serde(default)]
    stream: Vec<RawStream>,
    #[serde(default)]
    fault: Vec<RawFault>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawIdle {
    requests: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawClient {
    #[serde(default)]
    max_retries: Option<u32>,
    #[serde(default)]
    retry_after_cap: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStream {
    name: String,
    kind: String,
    #[serde(default)]
    backend: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    per_minute: Option<f64>,
    #[serde(default)]
    workers: Option<u32>,
    #[serde(default)]
    think: Option<String>,
    #[serde(default)]
    deadline: Option<String>,
    #[serde(default)]
    p99_vs_idle: Option<f64>,
    // transcription
    #[serde(default)]
    clip: Option<String>,
    #[serde(default)]
    repeat: Option<u32>,
    // speech
    #[serde(default)]
    chars: Option<u32>,
    #[serde(default)]
    voice: Option<String>,
    #[serde(default)]
    format: Option<String>,
    // chat (and speech: stream)
    #[serde(default)]
    instruction: Option<String>,
    #[serde(default)]
    input_tokens: Option<u32>,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFault {
    at: String,
    kind: String,
    #[serde(default)]
    backend: Option<String>,
    #[serde(default)]
    stream: Option<String>,
    #[serde(default)]
    count: Option<u32>,
    #[serde(default)]
    after_events: Option<u32>,
    #[serde(default)]
    bytes: Option<String>,
    #[serde(default)]
    bytes_per_second: Option<u64>,
    #[serde(default)]
    hold: Option<String>,
}

const DEFAULT_ROUNDS: u32 = 8;

impl Night {
    /// Reads and validates the night file at `path`.
    pub fn load(path: &Path) -> Result<Night, ScenarioError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ScenarioError(format!("cannot read {}: {e}", path.display())))?;
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        Night::parse(&text, &dir).map_err(|e| ScenarioError(format!("{}: {}", path.display(), e.0)))
    }

    /// Parses a night file whose relative paths start at `dir`.
    pub fn parse(text: &str, dir: &Path) -> Result<Night, ScenarioError> {
        let raw: RawNight =
            toml::from_str(text).map_err(|e| ScenarioError(one_line(&e.to_string())))?;
        let rounds = raw.rounds.unwrap_or(DEFAULT_ROUNDS);
        if !(1..=1000).contains(&rounds) {
            return Err(bad(
                "rounds",
                "give 1 to 1000 (the leak verdict needs at least 6)",
            ));
        }
        let gap = Span::parse("gap", raw.gap.as_deref().unwrap_or("2%"))?;
        if let Span::Share(s) = gap
            && s * f64::from(rounds) >= 0.5
        {
            return Err(bad(
                "gap",
                "the quiet gaps would take half the night or more",
            ));
        }
        let idle_requests = raw.idle.map(|i| i.requests).unwrap_or(5);
        if !(1..=1000).contains(&idle_requests) {
            return Err(bad("idle.requests", "give 1 to 1000"));
        }
        let client = match raw.client {
            None => ClientPolicy {
                max_retries: 2,
                retry_after_cap: Duration::from_secs(60),
            },
            Some(c) => ClientPolicy {
                max_retries: c.max_retries.unwrap_or(2).min(100),
                retry_after_cap: match c.retry_after_cap {
                    None => Duration::from_secs(60),
                    Some(t) => parse_duration(&t, BareNumber::Seconds).ok_or_else(|| {
                        bad("client.retry_after_cap", format!("`{t}` is not a duration"))
                    })?,
                },
            },
        };
        if raw.stream.is_empty() {
            return Err(ScenarioError(
                "no [[stream]]: a night needs at least one".into(),
            ));
        }
        let mut names = BTreeSet::new();
        let mut streams = Vec::new();
        for (i, s) in raw.stream.into_iter().enumerate() {
            let stream = stream(s, i, dir)?;
            if !names.insert(stream.name.clone()) {
                return Err(bad(
                    &format!("stream[{i}].name"),
                    format!("`{}` is used twice", stream.name),
                ));
            }
            streams.push(stream);
        }
        let mut faults = Vec::new();
        for (i, f) in raw.fault.into_iter().enumerate() {
            faults.push(fault(f, i, &streams)?);
        }
        Ok(Night {
            name: raw.name,
            dir: dir.to_path_buf(),
            seed: raw.seed.unwrap_or(29),
            rounds,
            gap,
            idle_requests,
            client,
            streams,
            faults,
        })
    }

    pub fn stream(&self, name: &str) -> Option<&Stream> {
        self.streams.iter().find(|s| s.name == name)
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn duration_key(key: &str, text: &str) -> Result<Duration, ScenarioError> {
    parse_duration(text, BareNumber::Seconds)
        .filter(|d| !d.is_zero())
        .ok_or_else(|| bad(key, format!("`{text}` is not a positive duration")))
}

fn stream(s: RawStream, i: usize, dir: &Path) -> Result<Stream, ScenarioError> {
    let key = |k: &str| format!("stream[{i}].{k}");
    if !valid_name(&s.name) {
        return Err(bad(
            &key("name"),
            "letters, digits, `-` and `_` only (at most 64)",
        ));
    }
    let kind = match s.kind.as_str() {
        "transcription" => StreamKind::Transcription,
        "speech" => StreamKind::Speech,
        "chat" => StreamKind::Chat,
        other => {
            return Err(bad(
                &key("kind"),
                format!("`{other}`: give transcription, speech or chat"),
            ));
        }
    };
    let arrivals = match (s.per_minute, s.workers) {
        (Some(r), None) if r.is_finite() && r > 0.0 && r <= 6000.0 => {
            if s.think.is_some() {
                return Err(bad(&key("think"), "goes with `workers`, not `per_minute`"));
            }
            Arrivals::Poisson { per_minute: r }
        }
        (Some(_), None) => {
            return Err(bad(
                &key("per_minute"),
                "give a rate above 0 and at most 6000",
            ));
        }
        (None, Some(w)) if (1..=256).contains(&w) => Arrivals::Workers {
            workers: w,
            think: match &s.think {
                None => Duration::ZERO,
                Some(t) => parse_duration(t, BareNumber::Seconds)
                    .ok_or_else(|| bad(&key("think"), format!("`{t}` is not a duration")))?,
            },
        },
        (None, Some(_)) => return Err(bad(&key("workers"), "give 1 to 256")),
        _ => {
            return Err(bad(
                &format!("stream[{i}]"),
                "give exactly one of `per_minute` (arrivals at random) and `workers` (clients back to back)",
            ));
        }
    };
    let deadline = match &s.deadline {
        Some(t) => duration_key(&key("deadline"), t)?,
        None => Duration::from_secs(if kind == StreamKind::Chat { 300 } else { 120 }),
    };
    if let Some(r) = s.p99_vs_idle
        && !(r.is_finite() && r >= 1.0)
    {
        return Err(bad(&key("p99_vs_idle"), "give a ratio of at least 1"));
    }
    let p99_vs_idle = s.p99_vs_idle.or(kind.is_audio().then_some(1.5));
    // Keys that belong to another kind of stream are a mistake, not something to ignore.
    let given = [
        ("clip", s.clip.is_some()),
        ("repeat", s.repeat.is_some()),
        ("chars", s.chars.is_some()),
        ("voice", s.voice.is_some()),
        ("format", s.format.is_some()),
        ("instruction", s.instruction.is_some()),
        ("input_tokens", s.input_tokens.is_some()),
        ("max_tokens", s.max_tokens.is_some()),
        ("stream", s.stream.is_some()),
    ];
    let applies: &[&str] = match kind {
        StreamKind::Transcription => &["clip", "repeat"],
        StreamKind::Speech => &["chars", "voice", "format", "stream"],
        StreamKind::Chat => &["instruction", "input_tokens", "max_tokens", "stream"],
    };
    if let Some((k, _)) = given
        .iter()
        .find(|(k, present)| *present && !applies.contains(k))
    {
        return Err(bad(
            &key(k),
            format!("does not apply to a {} stream", kind.as_str()),
        ));
    }
    let payload = match kind {
        StreamKind::Transcription => {
            let clip = s
                .clip
                .ok_or_else(|| bad(&key("clip"), "a transcription stream needs a WAV clip"))?;
            let repeat = s.repeat.unwrap_or(1);
            if !(1..=1000).contains(&repeat) {
                return Err(bad(&key("repeat"), "give 1 to 1000"));
            }
            Payload::Audio {
                clip: dir.join(clip),
                repeat,
            }
        }
        StreamKind::Speech => {
            let chars = s.chars.unwrap_or(80);
            if !(1..=100_000).contains(&chars) {
                return Err(bad(&key("chars"), "give 1 to 100000"));
            }
            let format = s.format.unwrap_or_else(|| "wav".into());
            if !matches!(
                format.as_str(),
                "wav" | "pcm" | "mp3" | "opus" | "flac" | "aac"
            ) {
                return Err(bad(
                    &key("format"),
                    format!("`{format}`: give wav, pcm, mp3, opus, flac or aac"),
                ));
            }
            Payload::Speech {
                chars,
                voice: s.voice.unwrap_or_else(|| "alloy".into()),
                format,
                stream: s.stream.unwrap_or(false),
            }
        }
        StreamKind::Chat => {
            let input_tokens = s.input_tokens.unwrap_or(200);
            let max_tokens = s.max_tokens.unwrap_or(128);
            if !(1..=1_000_000).contains(&input_tokens) {
                return Err(bad(&key("input_tokens"), "give 1 to 1000000"));
            }
            if !(1..=100_000).contains(&max_tokens) {
                return Err(bad(&key("max_tokens"), "give 1 to 100000"));
            }
            Payload::Chat {
                instruction: s
                    .instruction
                    .unwrap_or_else(|| "Clean up this transcript:".into()),
                input_tokens,
                max_tokens,
                stream: s.stream.unwrap_or(true),
            }
        }
    };
    let model = s.model.unwrap_or_else(|| {
        match kind {
            StreamKind::Transcription => "whisper-1",
            StreamKind::Speech => "tts-1",
            StreamKind::Chat => "smollm2",
        }
        .into()
    });
    Ok(Stream {
        name: s.name,
        kind,
        backend: s.backend,
        model,
        arrivals,
        deadline,
        p99_vs_idle,
        payload,
    })
}

fn fault(f: RawFault, i: usize, streams: &[Stream]) -> Result<Fault, ScenarioError> {
    let key = |k: &str| format!("fault[{i}].{k}");
    let at = Span::parse(&key("at"), &f.at)?;
    if let Span::Share(s) = at
        && s >= 1.0
    {
        return Err(bad(
            &key("at"),
            "a fault at 100 % would happen after the night",
        ));
    }
    let stream_of = |what: &str| -> Result<String, ScenarioError> {
        let name = f.stream.clone().ok_or_else(|| {
            bad(
                &key("stream"),
                format!("a {what} fault needs the stream whose requests it sends"),
            )
        })?;
        if !streams.iter().any(|s| s.name == name) {
            return Err(bad(&key("stream"), format!("no stream named `{name}`")));
        }
        Ok(name)
    };
    let count = f.count.unwrap_or(1);
    if !(1..=1000).contains(&count) {
        return Err(bad(&key("count"), "give 1 to 1000"));
    }
    let action = match f.kind.as_str() {
        "kill9" => FaultAction::Kill9 {
            backend: f
                .backend
                .ok_or_else(|| bad(&key("backend"), "a kill9 fault needs the backend to kill"))?,
        },
        "leave_mid_stream" => {
            let stream = stream_of("leave_mid_stream")?;
            let s = streams
                .iter()
                .find(|s| s.name == stream)
                .expect("checked above");
            if !s.payload.streams() {
                return Err(bad(
                    &key("stream"),
                    format!("`{stream}` is not streamed (set stream = true on it)"),
                ));
            }
            FaultAction::LeaveMidStream {
                stream,
                after_events: f.after_events.unwrap_or(3).max(1),
                count,
            }
        }
        "oversize" => FaultAction::Oversize {
            stream: stream_of("oversize")?,
            bytes: match &f.bytes {
                Some(b) => parse_size(b).map_err(|e| bad(&key("bytes"), e))?,
                None => 64 << 20,
            },
        },
        "malformed" => FaultAction::Malformed {
            stream: stream_of("malformed")?,
        },
        "slow_client" => FaultAction::SlowClient {
            stream: stream_of("slow_client")?,
            bytes_per_second: f.bytes_per_second.unwrap_or(4096).max(1),
            count,
        },
        "co_tenant" => FaultAction::CoTenant {
            amount: Amount::parse(
                &key("bytes"),
                f.bytes.as_deref().ok_or_else(|| {
                    bad(
                        &key("bytes"),
                        "a co_tenant fault needs what it holds (\"15%\" of capacity or a size)",
                    )
                })?,
            )?,
            hold: Span::parse(
                &key("hold"),
                f.hold.as_deref().ok_or_else(|| {
                    bad(&key("hold"), "a co_tenant fault needs how long it holds")
                })?,
            )?,
        },
        other => {
            return Err(bad(
                &key("kind"),
                format!(
                    "`{other}`: give kill9, leave_mid_stream, oversize, malformed, slow_client or co_tenant"
                ),
            ));
        }
    };
    Ok(Fault { at, action })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
name = "test night"
rounds = 6
gap = "5%"
[idle]
requests = 3
[[stream]]
name = "dictation"
kind = "transcription"
clip = "fox.wav"
per_minute = 6
[[stream]]
name = "rewrite"
kind = "chat"
workers = 2
think = "1s"
input_tokens = 1500
max_tokens = 256
[[fault]]
at = "30%"
kind = "kill9"
backend = "whisper"
[[fault]]
at = "50%"
kind = "co_tenant"
bytes = "15%"
hold = "90s"
[[fault]]
at = "60%"
kind = "leave_mid_stream"
stream = "rewrite"
count = 2
"#;

    #[test]
    fn a_small_night_parses_with_its_defaults() {
        let n = Night::parse(SMALL, Path::new("/scen")).unwrap();
        assert_eq!(n.rounds, 6);
        assert_eq!(n.idle_requests, 3);
        assert_eq!(n.client.max_retries, 2);
        assert_eq!(n.streams.len(), 2);
        let d = &n.streams[0];
        assert_eq!(d.kind, StreamKind::Transcription);
        assert_eq!(d.arrivals, Arrivals::Poisson { per_minute: 6.0 });
        assert_eq!(
            d.p99_vs_idle,
            Some(1.5),
            "audio lanes carry the 1.5x verdict by default"
        );
        assert_eq!(
            d.payload,
            Payload::Audio {
                clip: PathBuf::from("/scen/fox.wav"),
                repeat: 1
            }
        );
        let r = &n.streams[1];
        assert_eq!(
            r.p99_vs_idle, None,
            "text lanes have no latency verdict by default"
        );
        assert_eq!(
            r.arrivals,
            Arrivals::Workers {
                workers: 2,
                think: Duration::from_secs(1)
            }
        );
        assert!(r.payload.streams());
        assert_eq!(n.faults.len(), 3);
        assert_eq!(
            n.faults[1].action,
            FaultAction::CoTenant {
                amount: Amount::ShareOfCapacity(0.15),
                hold: Span::Fixed(Duration::from_secs(90))
            }
        );
    }

    #[test]
    fn spans_scale_with_the_night_and_fixed_ones_do_not() {
        let night = Duration::from_secs(3600);
        assert_eq!(
            Span::parse("k", "30%").unwrap().of(night),
            Duration::from_secs(1080)
        );
        assert_eq!(
            Span::parse("k", "30%")
                .unwrap()
                .of(Duration::from_secs(240)),
            Duration::from_secs(72)
        );
        assert_eq!(
            Span::parse("k", "90s").unwrap().of(night),
            Duration::from_secs(90)
        );
        assert!(Span::parse("k", "130%").is_err());
        assert!(Span::parse("k", "soon").is_err());
        assert_eq!(
            Amount::parse("k", "15%").unwrap().bytes(1 << 30),
            161_061_273
        );
        assert_eq!(
            Amount::parse("k", "200MiB").unwrap().bytes(1 << 30),
            200 << 20
        );
    }

    #[test]
    fn bad_files_name_the_key() {
        let cases = [
            (
                SMALL.replace("kind = \"kill9\"", "kind = \"reboot\""),
                "fault[0].kind",
            ),
            (
                SMALL.replace("stream = \"rewrite\"", "stream = \"nope\""),
                "fault[2].stream",
            ),
            (
                SMALL.replace("per_minute = 6", "per_minute = 6\nworkers = 2"),
                "stream[0]",
            ),
            (
                SMALL.replace("per_minute = 6", "per_minute = 6\nmax_tokens = 9"),
                "stream[0].max_tokens",
            ),
            (SMALL.replace("clip = \"fox.wav\"", ""), "stream[0].clip"),
            (
                SMALL.replace("name = \"rewrite\"", "name = \"dictation\""),
                "stream[1].name",
            ),
            (
                SMALL.replace("rounds = 6", "rounds = 6\nsurprise = 1"),
                "surprise",
            ),
            (SMALL.replace("gap = \"5%\"", "gap = \"9%\""), "gap"),
            (
                SMALL.replace("bytes = \"15%\"", "bytes = \"lots\""),
                "fault[1].bytes",
            ),
        ];
        for (text, key) in cases {
            let err = Night::parse(&text, Path::new(".")).unwrap_err().0;
            assert!(err.contains(key), "{key}: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[test]
    fn leaving_a_stream_needs_a_streamed_stream() {
        let text = SMALL.replace("stream = \"rewrite\"\ncount = 2", "stream = \"dictation\"");
        let err = Night::parse(&text, Path::new(".")).unwrap_err().0;
        assert!(err.contains("not streamed"), "{err}");
    }

    #[test]
    fn the_example_night_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/night.toml");
        let n = Night::load(&path).unwrap();
        assert!(n.rounds >= 6, "the leak verdict needs six rounds");
        for kind in [
            StreamKind::Transcription,
            StreamKind::Speech,
            StreamKind::Chat,
        ] {
            assert!(n.streams.iter().any(|s| s.kind == kind), "{kind:?}");
        }
        let faults: BTreeSet<&str> = n.faults.iter().map(|f| f.action.name()).collect();
        for f in [
            "kill9",
            "leave_mid_stream",
            "oversize",
            "malformed",
            "slow_client",
            "co_tenant",
        ] {
            assert!(faults.contains(f), "{f}");
        }
    }
}
