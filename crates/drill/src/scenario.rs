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
    /// Closed loop: `workers` clients, each sending the next request a think time after its last
    /// answer (an overnight batch job, or the one person at a workstation).
    Workers { workers: u32, think: Think },
    /// Sent by the clients of stream `stream` (a closed-loop one), right after one of its
    /// requests is answered, for this share of them: the assistant's spoken answer to what its
    /// user just dictated. Such a stream has no clients of its own.
    After { stream: usize, share: f64 },
}

/// How long a closed-loop client waits between an answer and its next request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Think {
    /// The mean wait.
    pub mean: Duration,
    /// Drawn at random (`min` plus an exponential wait, `mean` on average) rather than fixed: a
    /// person speaks the whole utterance (`min`, the clip's length) before it is sent, and
    /// pauses for a random while before speaking.
    pub at_random: bool,
    pub min: Duration,
}

impl Think {
    /// A fixed wait.
    pub fn fixed(mean: Duration) -> Think {
        Think {
            mean,
            at_random: false,
            min: Duration::ZERO,
        }
    }

    /// The next wait.
    pub fn draw(&self, rng: &mut headroom_bench::arrivals::Rng) -> Duration {
        if !self.at_random {
            return self.mean;
        }
        let above = self.mean.saturating_sub(self.min).as_secs_f64();
        if above <= 0.0 {
            return self.min;
        }
        // 1 - unit() lies in (0, 1]: its logarithm is finite.
        let wait = -(1.0 - rng.unit()).ln() * above;
        self.min + Duration::from_secs_f64(wait.min(above * 50.0))
    }
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

/// How a night is cut into rounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rounds {
    /// This many, whatever the night's length.
    Count(u32),
    /// One every this long (a longer night has more rounds, which the leak verdict needs to tell
    /// a one-time step from a slow rise), and never fewer than [`MIN_ROUNDS`].
    Every(Duration),
}

/// The fewest rounds the leak verdict can judge.
pub const MIN_ROUNDS: u32 = 6;

impl Rounds {
    /// How many rounds a night of `length` has.
    pub fn of(&self, length: Duration) -> u32 {
        match *self {
            Rounds::Count(n) => n.max(1),
            Rounds::Every(each) => {
                let n = (length.as_secs_f64() / each.as_secs_f64().max(1e-9)).round();
                (n.min(1000.0) as u32).max(MIN_ROUNDS)
            }
        }
    }
}

/// A validated night.
#[derive(Debug, Clone, PartialEq)]
pub struct Night {
    pub name: String,
    /// The file's folder: clip paths are relative to it.
    pub dir: PathBuf,
    pub seed: u64,
    /// How the night is cut into rounds, each ending in a quiet gap whose memory floor feeds the
    /// leak verdict (it needs at least 6).
    pub rounds: Rounds,
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
    round: Option<String>,
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
    think_at_random: Option<bool>,
    #[serde(default)]
    think_min: Option<String>,
    #[serde(default)]
    after: Option<String>,
    #[serde(default)]
    share: Option<f64>,
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
        let rounds = match (raw.rounds, &raw.round) {
            (Some(_), Some(_)) => {
                return Err(bad(
                    "round",
                    "give `rounds` (how many) or `round` (how long each is), not both",
                ));
            }
            (Some(n), None) if !(1..=1000).contains(&n) => {
                return Err(bad(
                    "rounds",
                    "give 1 to 1000 (the leak verdict needs at least 6)",
                ));
            }
            (Some(n), None) => Rounds::Count(n),
            (None, Some(t)) => Rounds::Every(duration_key("round", t)?),
            (None, None) => Rounds::Count(DEFAULT_ROUNDS),
        };
        let gap = Span::parse("gap", raw.gap.as_deref().unwrap_or("2%"))?;
        if let (Span::Share(s), Rounds::Count(n)) = (gap, rounds)
            && s * f64::from(n) >= 0.5
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
        let mut leaders = Vec::new();
        for (i, s) in raw.stream.into_iter().enumerate() {
            let (stream, after) = stream(s, i, dir)?;
            if !names.insert(stream.name.clone()) {
                return Err(bad(
                    &format!("stream[{i}].name"),
                    format!("`{}` is used twice", stream.name),
                ));
            }
            streams.push(stream);
            leaders.push(after);
        }
        for (i, after) in leaders.iter().enumerate() {
            if let Some(name) = after {
                let leader = leader_of(&streams, i, name)?;
                if let Arrivals::After { stream, .. } = &mut streams[i].arrivals {
                    *stream = leader;
                }
            }
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

/// The index of the stream `name` that stream `i` follows: a closed-loop stream other than
/// itself (its clients send the follower's requests).
fn leader_of(streams: &[Stream], i: usize, name: &str) -> Result<usize, ScenarioError> {
    let key = format!("stream[{i}].after");
    let leader = streams
        .iter()
        .position(|s| s.name == name)
        .ok_or_else(|| bad(&key, format!("no stream is named `{name}`")))?;
    if leader == i {
        return Err(bad(&key, "a stream cannot follow itself"));
    }
    match streams[leader].arrivals {
        Arrivals::Workers { .. } => Ok(leader),
        _ => Err(bad(
            &key,
            format!(
                "`{name}` has no clients of its own to send it: follow a stream with `workers`"
            ),
        )),
    }
}

/// The closed loop's think time from the stream's keys.
fn think(s: &RawStream, key: &dyn Fn(&str) -> String) -> Result<Think, ScenarioError> {
    let mean = match &s.think {
        None => Duration::ZERO,
        Some(t) => parse_duration(t, BareNumber::Seconds)
            .ok_or_else(|| bad(&key("think"), format!("`{t}` is not a duration")))?,
    };
    let at_random = s.think_at_random.unwrap_or(false);
    let min = match &s.think_min {
        None => Duration::ZERO,
        Some(_) if !at_random => {
            return Err(bad(
                &key("think_min"),
                "goes with `think_at_random = true` (a fixed think is its own minimum)",
            ));
        }
        Some(t) => parse_duration(t, BareNumber::Seconds)
            .ok_or_else(|| bad(&key("think_min"), format!("`{t}` is not a duration")))?,
    };
    if min > mean {
        return Err(bad(
            &key("think_min"),
            "is longer than `think`, the mean think time",
        ));
    }
    Ok(Think {
        mean,
        at_random,
        min,
    })
}

/// When the stream's requests start, from `per_minute`, `workers` or `after` (exactly one). A
/// follower's leader is resolved once every stream is read.
fn arrivals(s: &RawStream, i: usize) -> Result<Arrivals, ScenarioError> {
    let key = |k: &str| format!("stream[{i}].{k}");
    let closed_loop_keys = [
        ("think", s.think.is_some()),
        ("think_at_random", s.think_at_random.is_some()),
        ("think_min", s.think_min.is_some()),
    ];
    let misplaced = |why: &str| -> Result<(), ScenarioError> {
        match closed_loop_keys.iter().find(|(_, given)| *given) {
            Some((k, _)) => Err(bad(&key(k), why)),
            None => Ok(()),
        }
    };
    if s.share.is_some() && s.after.is_none() {
        return Err(bad(&key("share"), "goes with `after`"));
    }
    match (s.per_minute, s.workers, &s.after) {
        (Some(r), None, None) if r.is_finite() && r > 0.0 && r <= 6000.0 => {
            misplaced("goes with `workers`, not `per_minute`")?;
            Ok(Arrivals::Poisson { per_minute: r })
        }
        (Some(_), None, None) => Err(bad(
            &key("per_minute"),
            "give a rate above 0 and at most 6000",
        )),
        (None, Some(w), None) if (1..=256).contains(&w) => Ok(Arrivals::Workers {
            workers: w,
            think: think(s, &key)?,
        }),
        (None, Some(_), None) => Err(bad(&key("workers"), "give 1 to 256")),
        (None, None, Some(_)) => {
            misplaced(
                "goes with `workers`, not `after` (a follower is sent by its leader's clients)",
            )?;
            let share = s.share.unwrap_or(1.0);
            if !(share.is_finite() && share > 0.0 && share <= 1.0) {
                return Err(bad(&key("share"), "give a share above 0 and at most 1"));
            }
            Ok(Arrivals::After {
                stream: usize::MAX,
                share,
            })
        }
        _ => Err(bad(
            &format!("stream[{i}]"),
            "give exactly one of `per_minute` (arrivals at random), `workers` (clients back to back) and `after` (sent right after another stream's requests)",
        )),
    }
}

fn stream(s: RawStream, i: usize, dir: &Path) -> Result<(Stream, Option<String>), ScenarioError> {
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
    let arrivals = arrivals(&s, i)?;
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
    Ok((
        Stream {
            name: s.name,
            kind,
            backend: s.backend,
            model,
            arrivals,
            deadline,
            p99_vs_idle,
            payload,
        },
        s.after,
    ))
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
        assert_eq!(n.rounds, Rounds::Count(6));
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
                think: Think::fixed(Duration::from_secs(1))
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
                SMALL.replace("rounds = 6", "rounds = 6\nround = \"5m\""),
                "round",
            ),
            (SMALL.replace("rounds = 6", "round = \"often\""), "round"),
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

    /// One person at a workstation: dictation from one client that speaks each clip before
    /// sending it, and the assistant's spoken answer to two in three of them.
    const TURNS: &str = r#"
name = "turns"
[[stream]]
name = "dictation"
kind = "transcription"
clip = "fox.wav"
workers = 1
think = "9s"
think_at_random = true
think_min = "4.3s"
[[stream]]
name = "reply"
kind = "speech"
after = "dictation"
share = 0.67
"#;

    #[test]
    fn a_follower_names_its_leader_and_the_share_of_its_turns() {
        let n = Night::parse(TURNS, Path::new("/scen")).unwrap();
        assert_eq!(
            n.streams[0].arrivals,
            Arrivals::Workers {
                workers: 1,
                think: Think {
                    mean: Duration::from_secs(9),
                    at_random: true,
                    min: Duration::from_millis(4300)
                }
            }
        );
        assert_eq!(
            n.streams[1].arrivals,
            Arrivals::After {
                stream: 0,
                share: 0.67
            }
        );
        // A follower named before its leader is resolved all the same.
        let swapped = r#"
name = "turns"
[[stream]]
name = "reply"
kind = "speech"
after = "dictation"
[[stream]]
name = "dictation"
kind = "speech"
workers = 1
"#;
        let n = Night::parse(swapped, Path::new("/")).unwrap();
        assert_eq!(
            n.streams[0].arrivals,
            Arrivals::After {
                stream: 1,
                share: 1.0
            }
        );
    }

    #[test]
    fn bad_turns_name_the_key() {
        let cases = [
            (
                TURNS.replace("after = \"dictation\"", "after = \"nope\""),
                "stream[1].after",
                "no stream is named",
            ),
            (
                TURNS.replace("after = \"dictation\"", "after = \"reply\""),
                "stream[1].after",
                "itself",
            ),
            (
                TURNS.replace(
                    "workers = 1\nthink = \"9s\"\nthink_at_random = true\nthink_min = \"4.3s\"",
                    "per_minute = 6",
                ),
                "stream[1].after",
                "no clients of its own",
            ),
            (
                TURNS.replace("share = 0.67", "share = 0.67\nworkers = 1"),
                "stream[1]",
                "exactly one of",
            ),
            (
                TURNS.replace("share = 0.67", "share = 0.67\nthink = \"1s\""),
                "stream[1].think",
                "not `after`",
            ),
            (
                TURNS.replace("share = 0.67", "share = 1.5"),
                "stream[1].share",
                "at most 1",
            ),
            (
                TURNS.replace("after = \"dictation\"\n", "per_minute = 4\n"),
                "stream[1].share",
                "goes with `after`",
            ),
            (
                TURNS.replace("think_at_random = true\n", ""),
                "stream[0].think_min",
                "think_at_random",
            ),
            (
                TURNS.replace("think_min = \"4.3s\"", "think_min = \"10s\""),
                "stream[0].think_min",
                "longer than `think`",
            ),
        ];
        for (text, key, why) in cases {
            let err = Night::parse(&text, Path::new(".")).unwrap_err().0;
            assert!(err.contains(key) && err.contains(why), "{key}: {err}");
        }
    }

    #[test]
    fn a_think_at_random_never_ends_before_its_minimum_and_keeps_its_mean() {
        let think = Think {
            mean: Duration::from_secs(9),
            at_random: true,
            min: Duration::from_millis(4300),
        };
        let mut rng = headroom_bench::arrivals::Rng::new(29);
        let draws: Vec<f64> = (0..20_000)
            .map(|_| think.draw(&mut rng).as_secs_f64())
            .collect();
        assert!(
            draws.iter().all(|d| *d >= 4.3),
            "never shorter than speaking the clip"
        );
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 9.0).abs() < 0.2, "mean {mean}");
        // An exponential wait above the minimum: about 1/e of them wait more than its mean
        // (4.7 s) above it.
        let long = draws.iter().filter(|d| **d > 9.0).count() as f64 / draws.len() as f64;
        assert!((long - (-1.0f64).exp()).abs() < 0.02, "{long}");
        let fixed = Think::fixed(Duration::from_secs(2));
        assert_eq!(fixed.draw(&mut rng), Duration::from_secs(2));
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
        for length in [90, 600, 3600] {
            assert!(
                n.rounds.of(Duration::from_secs(length)) >= MIN_ROUNDS,
                "the leak verdict needs six rounds"
            );
        }
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
