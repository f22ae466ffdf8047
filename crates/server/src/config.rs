//! The `headroom serve` configuration file: TOML keys, their defaults, duration and size parsing,
//! validation with the offending key named, the commented example, and conversion into the gate's
//! [`LaneSpec`]s. The `[memory]` table lives in [`crate::memory_config`].

use std::net::SocketAddr;
use std::time::Duration;

use headroom_gate::{
    EngineLimits, GpuNeed, LaneSpec, LedgerSettings, PREEMPT_ALL, Policy, PoolKind, PreemptMode,
};
use serde::Deserialize;

use crate::memory_config::{MemoryConfig, MemoryTable, ProbeKind};

/// Why a configuration file was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file is not TOML, or a key is unknown or of the wrong type; the message names the
    /// line, the key and what to write instead.
    #[error("{0}")]
    Toml(String),
    #[error("{}`{key}`: {message}", line.map(|n| format!("line {n}: ")).unwrap_or_default())]
    Key {
        key: String,
        message: String,
        /// 1-based line of the file where the key is written, when it is.
        line: Option<usize>,
    },
}

pub(crate) fn key_err(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Key {
        key: key.into(),
        message: message.into(),
        line: None,
    }
}

/// The line where `key` (`listen`, `lanes[1] (audio).upstreams`) is written in `text`: within the
/// right `[[lanes]]` table for lane keys.
fn key_line(text: &str, key: &str) -> Option<usize> {
    let (lane, leaf) = match key.strip_prefix("lanes[") {
        Some(rest) => {
            let (index, after) = rest.split_once(']')?;
            (
                Some(index.parse::<usize>().ok()?),
                after.rsplit('.').next()?,
            )
        }
        None => (None, key),
    };
    let mut table: Option<usize> = None;
    let mut lanes_seen = 0;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.starts_with('[') {
            table = if t.starts_with("[[lanes]]") {
                lanes_seen += 1;
                Some(lanes_seen - 1)
            } else {
                Some(usize::MAX)
            };
            continue;
        }
        let written = t
            .split_once('=')
            .is_some_and(|(k, _)| k.trim().trim_matches('"') == leaf);
        let right_table = match lane {
            Some(n) => table == Some(n),
            None => table.is_none(),
        };
        if written && right_table {
            return Some(i + 1);
        }
    }
    None
}

/// Adds the line to a key error.
fn with_line(text: &str, e: ConfigError) -> ConfigError {
    match e {
        ConfigError::Key {
            key,
            message,
            line: None,
        } => {
            let line = key_line(text, &key);
            ConfigError::Key { key, message, line }
        }
        other => other,
    }
}

/// What `max_output_tokens` does to a request that asks for more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputTokensMode {
    /// Lower `max_tokens` to the cap and forward.
    Cap,
    /// Answer 400.
    Reject,
}

/// Refusals a lane answers with its fallback unless `fallback_reasons` says otherwise: only
/// overload of the lane itself, where a cheaper answer now beats a 429.
pub const DEFAULT_FALLBACK_REASONS: &[&str] = &["lane_saturated", "lane_queue_full"];

/// Refusal codes `fallback_reasons` may name (`shutting_down` never falls back).
pub const FALLBACK_REASONS: &[&str] = &[
    "lane_saturated",
    "lane_queue_full",
    "queue_timeout",
    "lane_yielding",
    "device_saturated",
    "engine_saturated",
    "gpu_memory",
];

/// The fallback a lane answers with under the `fallback` policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackKind {
    /// Chat completions answered by the rule-based transcript cleaner.
    RuleBasedCleanup,
}

/// Which engine an upstream runs, for metrics scraping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineKind {
    Vllm,
    LlamaCpp,
}

/// One lane after validation.
#[derive(Debug, Clone)]
pub struct LaneConfig {
    pub spec: LaneSpec,
    pub paths: Vec<String>,
    /// Model names this lane takes (exact, or a prefix ending in `*`); empty = any.
    pub models: Vec<String>,
    /// Whether chat requests that carry audio parts belong here.
    pub chat_audio: bool,
    pub max_body_bytes: u64,
    pub max_input_tokens: Option<u64>,
    /// `tokenizer.json` used to count input tokens exactly (else the characters / 4 estimate).
    pub tokenizer_path: Option<std::path::PathBuf>,
    /// The loaded tokenizer (filled when the gateway starts).
    pub tokenizer: Option<crate::tokens::TokenCounter>,
    pub max_output_tokens: Option<u64>,
    pub output_tokens_mode: OutputTokensMode,
    pub max_audio_seconds: Option<f64>,
    /// Longest speech `input` accepted, in characters (400 `input_too_long` above it).
    pub max_input_chars: Option<u64>,
    /// Seconds of speech one input character makes: a speech request's audio seconds (its cost
    /// in memory per audio second) are its characters times this, divided by its `speed`.
    pub speech_seconds_per_char: f64,
    pub fallback: Option<FallbackKind>,
    /// Refusal codes the fallback may answer (default [`DEFAULT_FALLBACK_REASONS`]); never
    /// `shutting_down`.
    pub fallback_reasons: Vec<String>,
    pub engine: Option<EngineKind>,
    pub metrics_path: String,
    /// Bearer key sent to the upstream (never the client's key).
    pub upstream_api_key: Option<String>,
    /// With `preempt` (abort) and an `engine`: how long a job that stopped this lane's running
    /// requests waits, before it is forwarded, for the lane's engines to report them stopped
    /// (zero: it does not wait). An engine reads a cancel only between two decode steps.
    pub preempt_settle: Duration,
    /// The lane's name as the `x-headroom-lane` response value, built once.
    pub lane_header: axum::http::HeaderValue,
}

impl LaneConfig {
    /// `audio` when the lane takes audio (an `/v1/audio/…` path, or chat requests with audio
    /// parts), else `text`: the `kind` label of `headroom_lane_info`.
    pub fn kind(&self) -> &'static str {
        if self.chat_audio || self.paths.iter().any(|p| p.starts_with("/v1/audio/")) {
            "audio"
        } else {
            "text"
        }
    }
}

/// The whole gateway configuration after validation.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub listen: SocketAddr,
    pub api_keys: Vec<String>,
    pub max_inflight_total: Option<usize>,
    pub shutdown_grace: Duration,
    pub max_header_bytes: usize,
    pub scrape_interval: Duration,
    /// How long one read of an engine's metrics may take. Apart from `scrape_interval`: a busy
    /// engine answers `/metrics` slowly exactly when its queue matters (vLLM on a loaded CPU took
    /// 100–1,200 ms while generating), and a reading that lands late is still a reading.
    pub scrape_timeout: Duration,
    /// Threads that run the gateway's request handling (`headroom serve`'s async runtime).
    pub worker_threads: usize,
    /// The `[memory]` table (defaults: NVML device 0, no capacity cap, no margin).
    pub memory: MemoryConfig,
    /// The `[balancer]` table: signals for a load balancer in front of several boxes.
    pub balancer: crate::balancer::BalancerConfig,
    pub lanes: Vec<LaneConfig>,
    /// What was read differently from how it was written (an upstream's `/v1` dropped), to be
    /// shown to the user once.
    pub notes: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    listen: Option<String>,
    #[serde(default)]
    api_keys: Vec<String>,
    api_keys_env: Option<String>,
    max_inflight_total: Option<i64>,
    shutdown_grace: Option<String>,
    max_header_bytes: Option<toml::Value>,
    scrape_interval: Option<String>,
    scrape_timeout: Option<String>,
    worker_threads: Option<i64>,
    memory: Option<MemoryTable>,
    balancer: Option<crate::balancer::BalancerTable>,
    #[serde(default)]
    lanes: Vec<RawLane>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLane {
    name: String,
    #[serde(default)]
    paths: Vec<String>,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default)]
    chat_audio: bool,
    #[serde(default)]
    upstreams: Vec<String>,
    max_inflight: Option<i64>,
    max_queue: Option<i64>,
    queue_timeout: Option<String>,
    request_timeout: Option<String>,
    policy: Option<String>,
    priority: Option<i64>,
    #[serde(default)]
    yield_to: Vec<String>,
    max_yield: Option<String>,
    yield_linger: Option<String>,
    #[serde(default)]
    preempt: bool,
    preempt_per_job: Option<toml::Value>,
    preempt_mode: Option<String>,
    preempt_settle: Option<String>,
    max_body_bytes: Option<toml::Value>,
    max_input_tokens: Option<i64>,
    tokenizer: Option<String>,
    max_output_tokens: Option<i64>,
    output_tokens_mode: Option<String>,
    max_audio_seconds: Option<f64>,
    max_input_chars: Option<i64>,
    speech_seconds_per_char: Option<f64>,
    fallback: Option<String>,
    fallback_reasons: Option<Vec<String>>,
    gpu_device: Option<i64>,
    gpu_memory_per_job: Option<toml::Value>,
    gpu_memory_per_audio_second: Option<toml::Value>,
    gpu_memory_margin: Option<toml::Value>,
    gpu_fail_open: Option<bool>,
    learn: Option<bool>,
    engine: Option<String>,
    metrics_path: Option<String>,
    engine_max_waiting: Option<f64>,
    engine_max_kv_cache_usage: Option<f64>,
    engine_metrics_stale_after: Option<String>,
    engine_fail_open: Option<bool>,
    upstream_api_key: Option<String>,
    upstream_api_key_env: Option<String>,
}

/// Parses `500ms`, `5s`, `2m` (and a bare number of seconds).
pub fn parse_duration(text: &str) -> Option<Duration> {
    headroom_plan::units::parse_duration(text, headroom_plan::units::BareNumber::Seconds)
}

/// Parses a byte size: an integer, or a string like `25MiB`, `512KiB`, `2GiB`, `10MB` (the same
/// spellings `headroom plan` takes).
pub fn parse_bytes(value: &toml::Value) -> Option<u64> {
    match value {
        toml::Value::Integer(i) if *i >= 0 => Some(*i as u64),
        toml::Value::String(s) => headroom_plan::units::parse_size(s).ok(),
        _ => None,
    }
}

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// `listen`: an IP address and a port; `localhost:PORT` means 127.0.0.1:PORT.
fn parse_listen(text: &str) -> Result<SocketAddr, ConfigError> {
    let t = text.trim();
    let local = t
        .strip_prefix("localhost:")
        .map(|port| format!("127.0.0.1:{port}"));
    if let Ok(addr) = local.as_deref().unwrap_or(t).parse::<SocketAddr>() {
        return Ok(addr);
    }
    let instead = match t.rsplit_once(':') {
        Some(("", port)) => format!(
            "write \"127.0.0.1:{port}\" (this machine only) or \"0.0.0.0:{port}\" (every interface, API keys required)"
        ),
        Some((_, port)) if port.parse::<u16>().is_ok() => format!(
            "a host name other than localhost is not an address; write its IP address, e.g. \"127.0.0.1:{port}\" or \"0.0.0.0:{port}\""
        ),
        _ => "write an IP address and a port, e.g. \"127.0.0.1:8080\" (localhost:8080 is accepted)"
            .to_string(),
    };
    Err(key_err(
        "listen",
        format!("`{t}` is not HOST:PORT: {instead}"),
    ))
}

/// An upstream as `http://HOST:PORT`. A trailing `/v1` (the OpenAI base URL people copy) is
/// dropped with a note, since the gateway forwards the request's own `/v1/...` path.
fn upstream_url(u: &str) -> Result<(String, Option<String>), String> {
    let t = u.trim().trim_end_matches('/');
    if let Some(rest) = t.strip_prefix("https://") {
        return Err(format!(
            "`{u}`: https upstreams are not supported; the gateway talks plain HTTP to engines on this machine or a private network (TLS belongs in front of the gateway). Write http://{} if the engine also listens on plain HTTP",
            rest.split('/').next().unwrap_or(rest)
        ));
    }
    let Some(rest) = t.strip_prefix("http://") else {
        let host = t.split("://").last().unwrap_or(t);
        return Err(format!(
            "`{u}` has no http:// scheme: write \"http://{}\"",
            host.split('/').next().unwrap_or(host)
        ));
    };
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(format!(
            "`{u}` names no host: write http://HOST:PORT, e.g. \"http://127.0.0.1:8000\""
        ));
    }
    match path {
        "" => Ok((format!("http://{host}"), None)),
        "v1" => Ok((
            format!("http://{host}"),
            Some(format!(
                "`{u}`: the trailing /v1 was dropped (the gateway forwards each request's own /v1/... path); write \"http://{host}\" to silence this"
            )),
        )),
        _ => Err(format!(
            "`{u}` has a path (/{path}): write the engine's address only, \"http://{host}\""
        )),
    }
}

/// One readable error for a TOML or schema failure: the line, the key, and what to write
/// instead (the nearest known key for a typo, a quoted duration for `queue_timeout = 5`).
fn toml_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let message = e.message().trim().to_string();
    let line_no = e
        .span()
        .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
    let line_text = line_no
        .and_then(|n| text.lines().nth(n - 1))
        .map(str::trim)
        .unwrap_or("");
    let at = line_no.map(|n| format!("line {n}: ")).unwrap_or_default();
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let key = rest.split('`').next().unwrap_or("");
        let known: Vec<&str> = message
            .split_once("expected")
            .map(|(_, list)| list.split('`').skip(1).step_by(2).collect())
            .unwrap_or_default();
        let hint = match nearest(key, &known) {
            Some(near) => format!("did you mean `{near}`?"),
            None => "see `headroom serve --print-example-config` for every key".to_string(),
        };
        return ConfigError::Toml(format!("{at}unknown key `{key}`: {hint}"));
    }
    let key = line_text
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"'))
        .filter(|k| !k.is_empty() && !k.contains(' '));
    let hint = match key {
        Some(k) if DURATION_KEYS.contains(&k) => format!(
            "; a duration is a quoted string: {k} = \"{}s\"",
            line_text
                .split_once('=')
                .map(|(_, v)| v.trim().trim_matches('"'))
                .unwrap_or("5")
        ),
        _ => String::new(),
    };
    let first = message.lines().next().unwrap_or("not valid TOML");
    match key {
        Some(k) => ConfigError::Toml(format!("{at}`{k}`: {first}{hint}")),
        None => ConfigError::Toml(format!("{at}config is not valid TOML: {first}")),
    }
}

/// Keys whose values are duration strings.
const DURATION_KEYS: [&str; 8] = [
    "shutdown_grace",
    "scrape_interval",
    "scrape_timeout",
    "queue_timeout",
    "request_timeout",
    "max_yield",
    "yield_linger",
    "engine_metrics_stale_after",
];

/// The known key closest to `key` by edit distance, when it is close enough to be a typo.
fn nearest<'a>(key: &str, known: &[&'a str]) -> Option<&'a str> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, k)| *d <= 1 + k.len().max(key.len()) / 3)
        .min()
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
const DEFAULT_MAX_BODY: u64 = 25 * 1024 * 1024;
/// Seconds of speech per input character when a lane does not say: English is spoken at about
/// 150 words a minute, and a word with its space averages about 5.7 characters, so about 14
/// characters a second (piper's US voices measure 0.06–0.07 s a character).
pub const DEFAULT_SPEECH_SECONDS_PER_CHAR: f64 = 0.07;

impl ServeConfig {
    /// Parses and validates a configuration file's text; errors name the key and its line.
    pub fn from_toml(text: &str) -> Result<ServeConfig, ConfigError> {
        Self::from_toml_unlocated(text).map_err(|e| with_line(text, e))
    }

    fn from_toml_unlocated(text: &str) -> Result<ServeConfig, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        let listen_text = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen = parse_listen(listen_text)?;
        let mut api_keys: Vec<String> =
            raw.api_keys.into_iter().filter(|k| !k.is_empty()).collect();
        if let Some(var) = raw.api_keys_env {
            let value = std::env::var(&var).map_err(|_| {
                key_err(
                    "api_keys_env",
                    format!("environment variable {var} is not set"),
                )
            })?;
            api_keys.extend(
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
                    .map(String::from),
            );
        }
        if !listen.ip().is_loopback() && api_keys.is_empty() {
            return Err(key_err(
                "api_keys",
                format!(
                    "listen address {listen} is not loopback, so API keys are required (set api_keys or api_keys_env)"
                ),
            ));
        }
        let max_inflight_total = match raw.max_inflight_total {
            None => None,
            Some(n) if n >= 1 => Some(n as usize),
            Some(_) => return Err(key_err("max_inflight_total", "must be at least 1")),
        };
        let duration = |key: &str, v: Option<&String>, default: Duration| match v {
            None => Ok(default),
            Some(s) => parse_duration(s).ok_or_else(|| {
                key_err(key, format!("`{s}` is not a duration like 500ms, 5s or 2m"))
            }),
        };
        let shutdown_grace = duration(
            "shutdown_grace",
            raw.shutdown_grace.as_ref(),
            Duration::from_secs(30),
        )?;
        // A scrape more often than this, or given less time, reads the engine to no purpose.
        let scrape_floor = Duration::from_millis(50);
        let scrape_interval = duration(
            "scrape_interval",
            raw.scrape_interval.as_ref(),
            Duration::from_secs(1),
        )?;
        let scrape_timeout = duration(
            "scrape_timeout",
            raw.scrape_timeout.as_ref(),
            Duration::from_secs(2),
        )?;
        for (key, value) in [
            ("scrape_interval", scrape_interval),
            ("scrape_timeout", scrape_timeout),
        ] {
            if value < scrape_floor {
                return Err(key_err(key, "must be at least 50ms"));
            }
        }
        let max_header_bytes = match &raw.max_header_bytes {
            None => 16 * 1024,
            Some(v) => parse_bytes(v)
                .filter(|b| *b >= 1024)
                .ok_or_else(|| key_err("max_header_bytes", "must be a size of at least 1KiB"))?
                as usize,
        };
        let worker_threads = match raw.worker_threads {
            None => 1,
            Some(n) if (1..=1024).contains(&n) => n as usize,
            Some(_) => return Err(key_err("worker_threads", "must be between 1 and 1024")),
        };
        if raw.lanes.is_empty() {
            return Err(key_err("lanes", "at least one [[lanes]] table is required"));
        }
        let memory = raw.memory.unwrap_or_default().validate("memory")?;
        if memory.enforce {
            return Err(key_err(
                "memory.enforce",
                "only `headroom up` enforces capacity (it starts the backends inside the limit); serve watches upstreams it did not start",
            ));
        }
        let balancer = raw.balancer.unwrap_or_default().validate()?;
        let mut lanes = Vec::with_capacity(raw.lanes.len());
        let mut notes = Vec::new();
        for (i, lane) in raw.lanes.into_iter().enumerate() {
            lanes.push(lane_config(i, lane, &memory, &mut notes)?);
        }
        let config = ServeConfig {
            listen,
            api_keys,
            max_inflight_total,
            shutdown_grace,
            max_header_bytes,
            scrape_interval,
            scrape_timeout,
            worker_threads,
            memory,
            balancer,
            lanes,
            notes,
        };
        // Let the gate check what it owns (names, yield_to targets).
        headroom_gate::Gate::new(config.lane_specs(), max_inflight_total, None)
            .map_err(|e| key_err("lanes", e.to_string()))?;
        Ok(config)
    }

    pub fn lane_specs(&self) -> Vec<LaneSpec> {
        self.lanes.iter().map(|l| l.spec.clone()).collect()
    }

    /// Whether any lane needs GPU memory readings to admit work.
    pub fn needs_gpu_probe(&self) -> bool {
        self.lanes.iter().any(|l| l.spec.gpu.is_some())
    }

    /// How the gate's memory ledger treats readings, from the `[memory]` table.
    pub fn ledger_settings(&self) -> LedgerSettings {
        let m = &self.memory;
        LedgerSettings {
            kind: match m.probe {
                ProbeKind::Nvml => PoolKind::Gpu,
                ProbeKind::Host => PoolKind::Host,
            },
            settle: m.settle,
            stale_after: m.stale_after,
            learn_quantile: m.learn_quantile,
            learn_min_samples: m.learn_min_samples,
            ignore_reservations: m.ignore_reservations,
        }
    }
}

const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
];

fn lane_config(
    index: usize,
    raw: RawLane,
    memory: &MemoryConfig,
    notes: &mut Vec<String>,
) -> Result<LaneConfig, ConfigError> {
    let name = raw.name.trim().to_string();
    let k = |key: &str| format!("lanes[{index}] ({name}).{key}");
    if name.is_empty() {
        return Err(key_err(format!("lanes[{index}].name"), "must not be empty"));
    }
    if raw.paths.is_empty() {
        return Err(key_err(k("paths"), "at least one path is required"));
    }
    for p in &raw.paths {
        if !ROUTES.contains(&p.as_str()) {
            return Err(key_err(
                k("paths"),
                format!(
                    "`{p}` is not a route the gateway serves ({})",
                    ROUTES.join(", ")
                ),
            ));
        }
    }
    if raw.upstreams.is_empty() {
        return Err(key_err(
            k("upstreams"),
            "at least one upstream URL is required",
        ));
    }
    let mut upstreams = Vec::new();
    for u in &raw.upstreams {
        let (url, note) = upstream_url(u).map_err(|why| key_err(k("upstreams"), why))?;
        if let Some(note) = note {
            notes.push(format!("{}: {note}", k("upstreams")));
        }
        upstreams.push(url);
    }
    let count =
        |key: &str, v: Option<i64>, default: usize, min: i64| -> Result<usize, ConfigError> {
            match v {
                None => Ok(default),
                Some(n) if n >= min => Ok(n as usize),
                Some(n) => Err(key_err(k(key), format!("{n} is below the minimum {min}"))),
            }
        };
    let duration = |key: &str, v: &Option<String>, default: Duration| match v {
        None => Ok(default),
        Some(s) => parse_duration(s).ok_or_else(|| {
            key_err(
                k(key),
                format!("`{s}` is not a duration like 500ms, 5s or 2m"),
            )
        }),
    };
    let bytes = |key: &str, v: &Option<toml::Value>| -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(v) => parse_bytes(v).map(Some).ok_or_else(|| {
                key_err(k(key), "must be a byte count or a size like 512MiB or 2GiB")
            }),
        }
    };
    let positive = |key: &str, v: Option<i64>| -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as u64)),
            Some(n) => Err(key_err(k(key), format!("{n} must be at least 1"))),
        }
    };
    let policy = match raw.policy.as_deref() {
        None => Policy::Reject,
        Some(p) => Policy::parse(p).ok_or_else(|| {
            key_err(
                k("policy"),
                format!("`{p}` is not one of reject, queue, fallback"),
            )
        })?,
    };
    let fallback = match raw.fallback.as_deref() {
        None => None,
        Some("rule-based-cleanup") => Some(FallbackKind::RuleBasedCleanup),
        Some(other) => {
            return Err(key_err(
                k("fallback"),
                format!("`{other}` is not a known fallback (rule-based-cleanup)"),
            ));
        }
    };
    let fallback_reasons = match raw.fallback_reasons {
        None => DEFAULT_FALLBACK_REASONS
            .iter()
            .map(|r| r.to_string())
            .collect(),
        Some(list) => {
            for r in &list {
                if !FALLBACK_REASONS.contains(&r.as_str()) {
                    return Err(key_err(
                        k("fallback_reasons"),
                        format!(
                            "`{r}` cannot fall back; use some of {}",
                            FALLBACK_REASONS.join(", ")
                        ),
                    ));
                }
            }
            list
        }
    };
    if policy == Policy::Fallback && fallback.is_none() {
        return Err(key_err(
            k("fallback"),
            "policy = \"fallback\" needs fallback = \"rule-based-cleanup\"",
        ));
    }
    let output_tokens_mode = match raw.output_tokens_mode.as_deref() {
        None | Some("cap") => OutputTokensMode::Cap,
        Some("reject") => OutputTokensMode::Reject,
        Some(other) => {
            return Err(key_err(
                k("output_tokens_mode"),
                format!("`{other}` is not cap or reject"),
            ));
        }
    };
    if let Some(s) = raw.max_audio_seconds
        && !(s.is_finite() && s > 0.0)
    {
        return Err(key_err(
            k("max_audio_seconds"),
            "must be a positive number of seconds",
        ));
    }
    let speech_seconds_per_char = match raw.speech_seconds_per_char {
        None => DEFAULT_SPEECH_SECONDS_PER_CHAR,
        Some(s) if s.is_finite() && s > 0.0 && s <= 10.0 => s,
        Some(_) => {
            return Err(key_err(
                k("speech_seconds_per_char"),
                "must be a positive number of seconds (at most 10)",
            ));
        }
    };
    let gpu_per_job = bytes("gpu_memory_per_job", &raw.gpu_memory_per_job)?;
    let gpu_per_second = bytes(
        "gpu_memory_per_audio_second",
        &raw.gpu_memory_per_audio_second,
    )?;
    if gpu_per_second.is_some() && raw.max_audio_seconds.is_none() {
        return Err(key_err(
            k("max_audio_seconds"),
            "gpu_memory_per_audio_second needs max_audio_seconds: audio of unknown length is counted as that long",
        ));
    }
    if raw.learn == Some(true) && gpu_per_job.is_none() && gpu_per_second.is_none() {
        return Err(key_err(
            k("learn"),
            "learn = true needs gpu_memory_per_job or gpu_memory_per_audio_second as the figure to start from",
        ));
    }
    let gpu = if gpu_per_job.is_some() || gpu_per_second.is_some() {
        Some(GpuNeed {
            device: match raw.gpu_device {
                None if memory.probe == ProbeKind::Host => 0,
                None => memory.device,
                Some(d) if d >= 0 => d as u32,
                Some(_) => {
                    return Err(key_err(
                        k("gpu_device"),
                        "must be a device index (0 or more)",
                    ));
                }
            },
            bytes_per_job: gpu_per_job.unwrap_or(0),
            bytes_per_audio_second: gpu_per_second.unwrap_or(0),
            // The pool's margin unless the lane asks for more.
            margin_bytes: bytes("gpu_memory_margin", &raw.gpu_memory_margin)?
                .unwrap_or(0)
                .max(memory.margin),
            fail_open: raw.gpu_fail_open.unwrap_or(false),
            learn: raw.learn.unwrap_or(false),
            longest_clip_seconds: raw.max_audio_seconds,
        })
    } else {
        None
    };
    let engine_kind = match raw.engine.as_deref() {
        None => None,
        Some("vllm") => Some(EngineKind::Vllm),
        Some("llamacpp" | "llama.cpp") => Some(EngineKind::LlamaCpp),
        Some(other) => {
            return Err(key_err(
                k("engine"),
                format!("`{other}` is not vllm or llamacpp"),
            ));
        }
    };
    if let Some(kv) = raw.engine_max_kv_cache_usage
        && !(0.0..=1.0).contains(&kv)
    {
        return Err(key_err(
            k("engine_max_kv_cache_usage"),
            "must be a fraction between 0 and 1",
        ));
    }
    let engine = if raw.engine_max_waiting.is_some() || raw.engine_max_kv_cache_usage.is_some() {
        if engine_kind.is_none() {
            return Err(key_err(
                k("engine"),
                "engine thresholds need engine = \"vllm\" or \"llamacpp\" so its metrics can be read",
            ));
        }
        Some(EngineLimits {
            max_waiting: raw.engine_max_waiting,
            max_kv_cache_usage: raw.engine_max_kv_cache_usage,
            stale_after: duration(
                "engine_metrics_stale_after",
                &raw.engine_metrics_stale_after,
                Duration::from_secs(5),
            )?,
            fail_open: raw.engine_fail_open.unwrap_or(false),
        })
    } else {
        None
    };
    let upstream_api_key = match (&raw.upstream_api_key, &raw.upstream_api_key_env) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(var)) => Some(std::env::var(var).map_err(|_| {
            key_err(
                k("upstream_api_key_env"),
                format!("environment variable {var} is not set"),
            )
        })?),
        (None, None) => None,
    };
    let preempt_mode = match raw.preempt_mode.as_deref() {
        None => PreemptMode::Abort,
        Some(text) => PreemptMode::parse(text)
            .ok_or_else(|| key_err(k("preempt_mode"), "must be \"abort\" or \"pause\""))?,
    };
    if preempt_mode == PreemptMode::Pause && !raw.preempt {
        return Err(key_err(
            k("preempt_mode"),
            "\"pause\" needs preempt = true (it is how this lane is preempted)",
        ));
    }
    let preempt_per_job = match &raw.preempt_per_job {
        None => 1,
        Some(toml::Value::Integer(n)) if *n >= 1 => *n as usize,
        Some(toml::Value::String(all)) if all == "all" => PREEMPT_ALL,
        Some(other) => {
            return Err(key_err(
                k("preempt_per_job"),
                format!("{other} is neither a count of at least 1 nor \"all\""),
            ));
        }
    };
    let preempt_settle = duration("preempt_settle", &raw.preempt_settle, Duration::ZERO)?;
    if !preempt_settle.is_zero()
        && (!raw.preempt || preempt_mode != PreemptMode::Abort || engine_kind.is_none())
    {
        return Err(key_err(
            k("preempt_settle"),
            "needs preempt = true (abort) and an `engine` whose metrics say when its requests \
             have stopped",
        ));
    }
    let spec = LaneSpec {
        name: name.clone(),
        priority: raw
            .priority
            .unwrap_or(0)
            .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
        max_inflight: count("max_inflight", raw.max_inflight, 1, 1)?,
        max_queue: count("max_queue", raw.max_queue, 0, 0)?,
        queue_timeout: duration("queue_timeout", &raw.queue_timeout, Duration::from_secs(5))?,
        request_timeout: duration(
            "request_timeout",
            &raw.request_timeout,
            Duration::from_secs(60),
        )?,
        policy,
        yield_to: raw.yield_to,
        max_yield: duration("max_yield", &raw.max_yield, Duration::from_secs(10))?,
        yield_linger: duration("yield_linger", &raw.yield_linger, Duration::ZERO)?,
        preempt: raw.preempt,
        preempt_per_job,
        preempt_mode,
        upstreams,
        gpu,
        engine,
    };
    if spec.request_timeout.is_zero() {
        return Err(key_err(k("request_timeout"), "must be longer than 0"));
    }
    let lane_header = axum::http::HeaderValue::from_str(&spec.name)
        .unwrap_or(axum::http::HeaderValue::from_static("?"));
    Ok(LaneConfig {
        lane_header,
        spec,
        paths: raw.paths,
        models: raw.models,
        chat_audio: raw.chat_audio,
        max_body_bytes: bytes("max_body_bytes", &raw.max_body_bytes)?.unwrap_or(DEFAULT_MAX_BODY),
        max_input_tokens: positive("max_input_tokens", raw.max_input_tokens)?,
        tokenizer_path: raw.tokenizer.map(std::path::PathBuf::from),
        tokenizer: None,
        max_output_tokens: positive("max_output_tokens", raw.max_output_tokens)?,
        output_tokens_mode,
        max_audio_seconds: raw.max_audio_seconds,
        max_input_chars: positive("max_input_chars", raw.max_input_chars)?,
        speech_seconds_per_char,
        fallback,
        fallback_reasons,
        engine: engine_kind,
        metrics_path: raw.metrics_path.unwrap_or_else(|| "/metrics".into()),
        upstream_api_key,
        preempt_settle,
    })
}

/// The commented example printed by `headroom serve --print-example-config`. Every key appears.
pub const EXAMPLE_CONFIG: &str = r#"# headroom serve configuration. Durations accept ms, s, m (e.g. "500ms", "5s", "2m");
# sizes accept a byte count or KiB/MiB/GiB (KB/MB/GB) strings.

# Address to listen on. Anything other than a loopback address requires API keys.
listen = "127.0.0.1:8080"

# Bearer keys clients must send (Authorization: Bearer KEY). Compared in constant time.
# Required whenever `listen` is not loopback. /healthz and /readyz stay open.
api_keys = []
# Extra keys read from an environment variable, comma separated (optional).
# api_keys_env = "HEADROOM_API_KEYS"

# Cap on requests in flight across all lanes together (they share one GPU). Optional.
# max_inflight_total = 4

# On SIGTERM/Ctrl-C: stop accepting, let in-flight work finish for at most this long.
shutdown_grace = "30s"
# Requests whose headers together exceed this get 431.
max_header_bytes = "16KiB"
# How often engine /metrics are read, and how long one read may take (a busy engine answers
# slowly; the next read starts when this one has ended).
scrape_interval = "1s"
scrape_timeout = "2s"
# Threads handling requests. One serves tens of thousands of proxied requests a second (far more
# than the engines behind it answer) and, like an nginx worker, keeps each request on one core
# with no hand-off between threads; tokenizer counts run on a separate blocking pool.
worker_threads = 1

# The memory pool lanes with gpu_memory_* admit on (the same table as in `headroom up`'s box
# file). A job is admitted only while free memory, less what admitted jobs have reserved and the
# readings do not show yet, covers its need plus the margin. Readings are taken by a sampler
# task, never on the request path.
[memory]
probe = "nvml"                         # nvml: a GPU; host: RSS of the `watch` process trees
device = 0                             # NVML device index (lanes may override with gpu_device)
# capacity = "8GiB"                    # pool size (required for host; a cap below the card for nvml)
margin = 0                              # always left free (a lane's gpu_memory_margin may ask for more)
watch = []                             # host: upstream URLs whose listening process trees are the pool
sample_interval = "50ms"               # sampler period (5ms to 50ms)
settle = "5s"                          # reserved-but-unused counts as in the reading this long after growth stops
stale_after = "1s"                     # older readings count as none (see gpu_fail_open)
learn_quantile = 0.95                  # learned needs cover this quantile of measured job peaks
learn_min_samples = 8                  # measured jobs before a learned need replaces the figure
# calibration = "calibration.json"     # learned needs are saved here and read back at start

[[lanes]]
name = "audio"                         # shown in metrics, /admin/lanes, x-headroom-lane
# Routes this lane serves. A request goes to the lane named in its x-headroom-lane header,
# else to the first lane whose `models` matches the request's model, else to the first lane
# with an empty `models` list that serves the route.
paths = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech"]
models = []                            # exact names or prefixes ending in "*"; empty = any
chat_audio = false                     # true: chat requests carrying audio parts come here
upstreams = ["http://127.0.0.1:8001"]  # replicas; the least loaded one gets each request
priority = 10                          # higher goes first when lanes compete for max_inflight_total
max_inflight = 1                       # requests running upstream at once
max_queue = 8                          # requests allowed to wait (0 allowed)
queue_timeout = "30s"                  # longest wait in the queue, then 503 queue_timeout
request_timeout = "120s"               # whole-request deadline, then 504 (or a final SSE error event)
policy = "queue"                       # reject | queue | fallback
max_body_bytes = "25MiB"               # larger bodies get 413 before they are read
max_audio_seconds = 600.0              # from the WAV/FLAC/MP3/OGG header; longer gets 413
# Speech (/v1/audio/speech) costs what it makes: its audio seconds are the input's characters
# times this (English at about 150 words a minute), divided by the request's `speed`.
speech_seconds_per_char = 0.07
# max_input_chars = 4096               # longer speech input gets 400 input_too_long
# Memory one job needs from the [memory] pool (GPU or host, whichever it is); audio of unknown
# length counts as max_audio_seconds.
# gpu_device = 0
# gpu_memory_per_job = "1GiB"
# gpu_memory_per_audio_second = "4MiB"
# gpu_memory_margin = "512MiB"
# gpu_fail_open = false                # true: admit when the pool cannot be read
# learn = false                        # true: measure job peaks and use a high quantile of them
# upstream_api_key = "..."             # Bearer key sent upstream (or upstream_api_key_env = "VAR")

[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["http://127.0.0.1:8000"]
priority = 0
max_inflight = 2
max_queue = 0
queue_timeout = "5s"
request_timeout = "60s"
policy = "fallback"                    # overloaded requests get the fallback below
fallback = "rule-based-cleanup"        # chat answered by the rule-based transcript cleaner
fallback_reasons = ["lane_saturated", "lane_queue_full"]  # refusals that may fall back (the default)
yield_to = ["audio"]                   # admit nothing new while audio has work...
max_yield = "2s"                       # ...for at most this long, so text never starves
yield_linger = "1s"                    # audio counts as busy this long after its last job ends
preempt = false                        # true: audio work stops running text (503 `preempted`)
preempt_per_job = 1                    # with preempt: text requests each admitted audio job stops, youngest
                                       # first; "all": every running one (engines sharing the same cores)
preempt_settle = "0s"                  # with preempt (abort) and `engine`: the audio job waits up to this long
                                       # for the engine's metrics to show the stopped requests gone (0s: no wait)
preempt_mode = "abort"                 # abort: stop them; pause: pause the engine while audio runs (vLLM
                                       # started with VLLM_SERVER_DEV_MODE=1: /sleep?level=0&mode=keep, /wake_up)
max_body_bytes = "1MiB"
max_input_tokens = 8192                # counted with `tokenizer`, else estimated as characters / 4
# tokenizer = "/models/llm/tokenizer.json"  # the model's tokenizer.json (relative: to this file)
max_output_tokens = 1024
output_tokens_mode = "cap"             # cap: lower max_tokens to the cap; reject: answer 400
engine = "vllm"                        # vllm | llamacpp: read its /metrics for admission
metrics_path = "/metrics"
engine_max_waiting = 4                 # hold while the engine's own queue is longer
engine_max_kv_cache_usage = 0.9        # hold while KV cache usage is above this fraction
engine_metrics_stale_after = "5s"      # older metrics count as saturated...
engine_fail_open = false               # ...unless this is true
"#;

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"listen = "127.0.0.1:8080"
[[lanes]]
name = "text"
paths = ["/v1/chat/completions", "/v1/completions"]
upstreams = ["http://127.0.0.1:8000"]
max_inflight = 2
max_queue = 0
queue_timeout = "5s"
request_timeout = "60s"
policy = "reject"
[[lanes]]
name = "audio"
paths = ["/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/speech"]
upstreams = ["http://127.0.0.1:8001"]
max_inflight = 1
max_queue = 8
queue_timeout = "30s"
request_timeout = "120s"
policy = "queue"
"#;

    #[test]
    fn the_minimal_file_from_the_issue_parses_as_written() {
        let c = ServeConfig::from_toml(MINIMAL).unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(c.lanes.len(), 2);
        let text = &c.lanes[0];
        assert_eq!(text.spec.name, "text");
        assert_eq!(text.spec.max_inflight, 2);
        assert_eq!(text.spec.max_queue, 0);
        assert_eq!(text.spec.queue_timeout, Duration::from_secs(5));
        assert_eq!(text.spec.request_timeout, Duration::from_secs(60));
        assert_eq!(text.spec.policy, Policy::Reject);
        assert_eq!(text.spec.upstreams, vec!["http://127.0.0.1:8000"]);
        let audio = &c.lanes[1];
        assert_eq!(audio.paths.len(), 3);
        assert_eq!(audio.spec.max_queue, 8);
        assert_eq!(audio.spec.queue_timeout, Duration::from_secs(30));
        assert_eq!(audio.spec.policy, Policy::Queue);
        assert!(c.api_keys.is_empty());
        // A read of an engine's metrics gets 2 s whatever the interval (1 s by default).
        assert_eq!(c.scrape_interval, Duration::from_secs(1));
        assert_eq!(c.scrape_timeout, Duration::from_secs(2));
    }

    #[test]
    fn the_example_parses_and_names_every_raw_key() {
        let c = ServeConfig::from_toml(EXAMPLE_CONFIG).unwrap();
        assert_eq!(c.lanes.len(), 2);
        assert_eq!(c.lanes[1].fallback, Some(FallbackKind::RuleBasedCleanup));
        assert_eq!(c.lanes[1].spec.yield_to, vec!["audio"]);
        for key in [
            "listen",
            "api_keys",
            "api_keys_env",
            "max_inflight_total",
            "shutdown_grace",
            "max_header_bytes",
            "scrape_interval",
            "scrape_timeout",
            "worker_threads",
            "probe",
            "device",
            "capacity",
            "margin",
            "watch",
            "sample_interval",
            "settle",
            "stale_after",
            "learn_quantile",
            "learn_min_samples",
            "calibration",
            "learn",
            "name",
            "paths",
            "models",
            "chat_audio",
            "upstreams",
            "max_inflight",
            "max_queue",
            "queue_timeout",
            "request_timeout",
            "policy",
            "priority",
            "yield_to",
            "max_yield",
            "max_body_bytes",
            "max_input_tokens",
            "max_output_tokens",
            "output_tokens_mode",
            "max_audio_seconds",
            "max_input_chars",
            "speech_seconds_per_char",
            "fallback",
            "gpu_device",
            "gpu_memory_per_job",
            "gpu_memory_per_audio_second",
            "gpu_memory_margin",
            "gpu_fail_open",
            "engine",
            "metrics_path",
            "engine_max_waiting",
            "engine_max_kv_cache_usage",
            "engine_metrics_stale_after",
            "engine_fail_open",
            "upstream_api_key",
            "upstream_api_key_env",
            "preempt_per_job",
            "preempt_settle",
        ] {
            assert!(
                EXAMPLE_CONFIG.contains(&format!("{key} =")),
                "example lacks {key}"
            );
        }
    }

    #[test]
    fn preempt_per_job_takes_a_count_or_all_and_preempt_settle_a_duration() {
        let lane = |extra: &str| {
            format!(
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\n\
                 engine=\"llamacpp\"\npreempt=true\n{extra}"
            )
        };
        let first = |text: &str| ServeConfig::from_toml(text).unwrap().lanes.remove(0);
        let l = first(&lane(""));
        assert_eq!(
            (l.spec.preempt_per_job, l.preempt_settle),
            (1, Duration::ZERO)
        );
        assert_eq!(first(&lane("preempt_per_job = 3")).spec.preempt_per_job, 3);
        let l = first(&lane(
            "preempt_per_job = \"all\"\npreempt_settle = \"750ms\"",
        ));
        assert_eq!(l.spec.preempt_per_job, PREEMPT_ALL);
        assert_eq!(l.preempt_settle, Duration::from_millis(750));
    }

    #[test]
    fn bad_values_name_their_key() {
        let cases = [
            ("listen = \"nope\"", "`listen`"),
            ("listen = \"0.0.0.0:8080\"", "`api_keys`"),
            ("bogus = 1", "unknown key `bogus`"),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/x\"]\nupstreams=[\"http://a:1\"]",
                "paths",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"https://a\"]",
                "upstreams",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\nqueue_timeout=\"5 parsecs\"",
                "queue_timeout",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\npolicy=\"maybe\"",
                "policy",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\nmax_inflight=0",
                "max_inflight",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\nyield_to=[\"x\"]",
                "unknown lane",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\npolicy=\"fallback\"",
                "fallback",
            ),
            ("listen = \"127.0.0.1:1\"", "lanes"),
            (
                "scrape_interval = \"10ms\"\n[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]",
                "scrape_interval",
            ),
            (
                "scrape_timeout = \"10ms\"\n[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]",
                "scrape_timeout",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/audio/transcriptions\"]\nupstreams=[\"http://a:1\"]\ngpu_memory_per_audio_second=\"1MiB\"",
                "max_audio_seconds",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/audio/transcriptions\"]\nupstreams=[\"http://a:1\"]\nlearn=true",
                "learn",
            ),
            (
                "[memory]\nprobe=\"host\"\n[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]",
                "memory.capacity",
            ),
            (
                "[memory]\nprobe=\"host\"\ncapacity=\"1GiB\"\nwatch=[\"http://a:1\"]\nenforce=true\n[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]",
                "only `headroom up` enforces capacity",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\npreempt=true\npreempt_per_job=\"most\"",
                "preempt_per_job",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\npreempt=true\npreempt_per_job=0",
                "preempt_per_job",
            ),
            (
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\npreempt=true\npreempt_settle=\"1s\"",
                "preempt_settle",
            ),
        ];
        for (text, want) in cases {
            let err = ServeConfig::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?} gave {err:?}, wanted {want:?}");
        }
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Some(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("1 fortnight"), None);
        assert_eq!(
            parse_bytes(&toml::Value::String("2GiB".into())),
            Some(2 << 30)
        );
        assert_eq!(
            parse_bytes(&toml::Value::String("10MB".into())),
            Some(10_000_000)
        );
        assert_eq!(parse_bytes(&toml::Value::Integer(42)), Some(42));
        assert_eq!(parse_bytes(&toml::Value::Integer(-1)), None);
        assert_eq!(parse_bytes(&toml::Value::String("lots".into())), None);
    }
}
