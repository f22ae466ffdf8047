//! One `[[lanes]]` table: its keys as written ([`RawLane`]), their validation, and the lane
//! after validation ([`LaneSettings`], plain data) with the gate's [`LaneSpec`] inside. The
//! lane's live pieces (its loaded tokenizer, its response header) are built from these by
//! [`crate::live_config`].

use std::time::Duration;

use headroom_gate::{EngineLimits, GpuNeed, LaneSpec, Outlier, PREEMPT_ALL, Policy, PreemptMode};
use serde::Deserialize;

use super::Env;
use super::error::{ConfigError, key_err};
use super::memory::{MemoryConfig, ProbeKind};
use super::parse::{parse_bytes, parse_duration, upstream_url};

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
pub struct LaneSettings {
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
    /// The lane's requests may run twice (`idempotent = true`): one that failed after it was
    /// sent but before any response byte is sent again (a fresh connection, then another
    /// replica). Off by default: such a request is answered 502, never repeated.
    pub idempotent: bool,
}

impl LaneSettings {
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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLane {
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
    idempotent: Option<bool>,
    eject_after_failures: Option<i64>,
    base_ejection_time: Option<String>,
    max_ejection_time: Option<String>,
    max_ejection_percent: Option<i64>,
}

const DEFAULT_MAX_BODY: u64 = 25 * 1024 * 1024;
/// Seconds of speech per input character when a lane does not say: English is spoken at about
/// 150 words a minute, and a word with its space averages about 5.7 characters, so about 14
/// characters a second (piper's US voices measure 0.06–0.07 s a character).
pub const DEFAULT_SPEECH_SECONDS_PER_CHAR: f64 = 0.07;

const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
    "/v1/audio/speech",
];

/// Names a lane's keys in errors (`lanes[1] (audio).upstreams`) and reads its common value
/// kinds with that name on failure.
struct LaneKeys<'a> {
    index: usize,
    name: &'a str,
}

impl LaneKeys<'_> {
    fn key(&self, key: &str) -> String {
        format!("lanes[{}] ({}).{key}", self.index, self.name)
    }

    /// A count of at least `min`, `default` when absent.
    fn count(
        &self,
        key: &str,
        v: Option<i64>,
        default: usize,
        min: i64,
    ) -> Result<usize, ConfigError> {
        match v {
            None => Ok(default),
            Some(n) if n >= min => Ok(n as usize),
            Some(n) => Err(key_err(
                self.key(key),
                format!("{n} is below the minimum {min}"),
            )),
        }
    }

    /// A duration string, `default` when absent.
    fn duration(
        &self,
        key: &str,
        v: &Option<String>,
        default: Duration,
    ) -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(s) => parse_duration(s).ok_or_else(|| {
                key_err(
                    self.key(key),
                    format!("`{s}` is not a duration like 500ms, 5s or 2m"),
                )
            }),
        }
    }

    /// A byte size, if written.
    fn bytes(&self, key: &str, v: &Option<toml::Value>) -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(v) => parse_bytes(v).map(Some).ok_or_else(|| {
                key_err(
                    self.key(key),
                    "must be a byte count or a size like 512MiB or 2GiB",
                )
            }),
        }
    }

    /// A number of at least 1, if written.
    fn positive(&self, key: &str, v: Option<i64>) -> Result<Option<u64>, ConfigError> {
        match v {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as u64)),
            Some(n) => Err(key_err(self.key(key), format!("{n} must be at least 1"))),
        }
    }
}

/// Validates one `[[lanes]]` table (the `index`th); an upstream read differently from how it was
/// written adds a line to `notes`; `env` reads `upstream_api_key_env`. Keys are checked in a fixed order, so the first fault named
/// is always the same one.
pub(super) fn lane_config(
    index: usize,
    raw: RawLane,
    memory: &MemoryConfig,
    env: &Env,
    notes: &mut Vec<String>,
) -> Result<LaneSettings, ConfigError> {
    let name = raw.name.trim().to_string();
    if name.is_empty() {
        return Err(key_err(format!("lanes[{index}].name"), "must not be empty"));
    }
    let k = LaneKeys { index, name: &name };
    let outlier = outlier(&raw, &k)?;
    check_paths(&raw, &k)?;
    let upstreams = upstreams(&raw, &k, notes)?;
    let policy = policy(&raw, &k)?;
    let (fallback, fallback_reasons) = fallback(&raw, policy, &k)?;
    let output_tokens_mode = output_tokens_mode(&raw, &k)?;
    let speech_seconds_per_char = audio_length(&raw, &k)?;
    let gpu = gpu_need(&raw, memory, &k)?;
    let (engine_kind, engine) = engine(&raw, &k)?;
    let upstream_api_key = upstream_api_key(&raw, env, &k)?;
    let preemption = preemption(&raw, engine_kind, &k)?;
    let queueing = queueing(&raw, &k)?;
    let spec = LaneSpec {
        name: name.clone(),
        priority: raw
            .priority
            .unwrap_or(0)
            .clamp(i32::MIN as i64, i32::MAX as i64) as i32,
        max_inflight: queueing.max_inflight,
        max_queue: queueing.max_queue,
        queue_timeout: queueing.queue_timeout,
        request_timeout: queueing.request_timeout,
        policy,
        yield_to: raw.yield_to,
        max_yield: queueing.max_yield,
        yield_linger: queueing.yield_linger,
        preempt: raw.preempt,
        preempt_per_job: preemption.per_job,
        preempt_mode: preemption.mode,
        upstreams,
        gpu,
        engine,
        outlier,
    };
    Ok(LaneSettings {
        spec,
        paths: raw.paths,
        models: raw.models,
        chat_audio: raw.chat_audio,
        max_body_bytes: k
            .bytes("max_body_bytes", &raw.max_body_bytes)?
            .unwrap_or(DEFAULT_MAX_BODY),
        max_input_tokens: k.positive("max_input_tokens", raw.max_input_tokens)?,
        tokenizer_path: raw.tokenizer.map(std::path::PathBuf::from),
        max_output_tokens: k.positive("max_output_tokens", raw.max_output_tokens)?,
        output_tokens_mode,
        max_audio_seconds: raw.max_audio_seconds,
        max_input_chars: k.positive("max_input_chars", raw.max_input_chars)?,
        speech_seconds_per_char,
        fallback,
        fallback_reasons,
        engine: engine_kind,
        metrics_path: raw.metrics_path.unwrap_or_else(|| "/metrics".into()),
        upstream_api_key,
        preempt_settle: preemption.settle,
        idempotent: raw.idempotent.unwrap_or(false),
    })
}

/// `paths`: at least one, each a route the gateway serves.
fn check_paths(raw: &RawLane, k: &LaneKeys) -> Result<(), ConfigError> {
    if raw.paths.is_empty() {
        return Err(key_err(k.key("paths"), "at least one path is required"));
    }
    for p in &raw.paths {
        if !ROUTES.contains(&p.as_str()) {
            return Err(key_err(
                k.key("paths"),
                format!(
                    "`{p}` is not a route the gateway serves ({})",
                    ROUTES.join(", ")
                ),
            ));
        }
    }
    Ok(())
}

/// `upstreams`: at least one, each as `http://HOST:PORT` (a dropped `/v1` noted).
fn upstreams(
    raw: &RawLane,
    k: &LaneKeys,
    notes: &mut Vec<String>,
) -> Result<Vec<String>, ConfigError> {
    if raw.upstreams.is_empty() {
        return Err(key_err(
            k.key("upstreams"),
            "at least one upstream URL is required",
        ));
    }
    let mut upstreams = Vec::new();
    for u in &raw.upstreams {
        let (url, note) = upstream_url(u).map_err(|why| key_err(k.key("upstreams"), why))?;
        if let Some(note) = note {
            notes.push(format!("{}: {note}", k.key("upstreams")));
        }
        upstreams.push(url);
    }
    Ok(upstreams)
}

/// `policy`: reject (default), queue or fallback.
fn policy(raw: &RawLane, k: &LaneKeys) -> Result<Policy, ConfigError> {
    match raw.policy.as_deref() {
        None => Ok(Policy::Reject),
        Some(p) => Policy::parse(p).ok_or_else(|| {
            key_err(
                k.key("policy"),
                format!("`{p}` is not one of reject, queue, fallback"),
            )
        }),
    }
}

/// `fallback` and `fallback_reasons` (the refusals it may answer); the `fallback` policy needs a
/// fallback.
fn fallback(
    raw: &RawLane,
    policy: Policy,
    k: &LaneKeys,
) -> Result<(Option<FallbackKind>, Vec<String>), ConfigError> {
    let fallback = match raw.fallback.as_deref() {
        None => None,
        Some("rule-based-cleanup") => Some(FallbackKind::RuleBasedCleanup),
        Some(other) => {
            return Err(key_err(
                k.key("fallback"),
                format!("`{other}` is not a known fallback (rule-based-cleanup)"),
            ));
        }
    };
    let fallback_reasons = match &raw.fallback_reasons {
        None => DEFAULT_FALLBACK_REASONS
            .iter()
            .map(|r| r.to_string())
            .collect(),
        Some(list) => {
            for r in list {
                if !FALLBACK_REASONS.contains(&r.as_str()) {
                    return Err(key_err(
                        k.key("fallback_reasons"),
                        format!(
                            "`{r}` cannot fall back; use some of {}",
                            FALLBACK_REASONS.join(", ")
                        ),
                    ));
                }
            }
            list.clone()
        }
    };
    if policy == Policy::Fallback && fallback.is_none() {
        return Err(key_err(
            k.key("fallback"),
            "policy = \"fallback\" needs fallback = \"rule-based-cleanup\"",
        ));
    }
    Ok((fallback, fallback_reasons))
}

/// `output_tokens_mode`: cap (default) or reject.
fn output_tokens_mode(raw: &RawLane, k: &LaneKeys) -> Result<OutputTokensMode, ConfigError> {
    match raw.output_tokens_mode.as_deref() {
        None | Some("cap") => Ok(OutputTokensMode::Cap),
        Some("reject") => Ok(OutputTokensMode::Reject),
        Some(other) => Err(key_err(
            k.key("output_tokens_mode"),
            format!("`{other}` is not cap or reject"),
        )),
    }
}

/// `max_audio_seconds` (positive when written) and `speech_seconds_per_char` (returned, its
/// default when absent).
fn audio_length(raw: &RawLane, k: &LaneKeys) -> Result<f64, ConfigError> {
    if let Some(s) = raw.max_audio_seconds
        && !(s.is_finite() && s > 0.0)
    {
        return Err(key_err(
            k.key("max_audio_seconds"),
            "must be a positive number of seconds",
        ));
    }
    match raw.speech_seconds_per_char {
        None => Ok(DEFAULT_SPEECH_SECONDS_PER_CHAR),
        Some(s) if s.is_finite() && s > 0.0 && s <= 10.0 => Ok(s),
        Some(_) => Err(key_err(
            k.key("speech_seconds_per_char"),
            "must be a positive number of seconds (at most 10)",
        )),
    }
}

/// The memory one job needs from the `[memory]` pool (`gpu_memory_*`, `gpu_device`, `learn`),
/// when the lane names any.
fn gpu_need(
    raw: &RawLane,
    memory: &MemoryConfig,
    k: &LaneKeys,
) -> Result<Option<GpuNeed>, ConfigError> {
    let gpu_per_job = k.bytes("gpu_memory_per_job", &raw.gpu_memory_per_job)?;
    let gpu_per_second = k.bytes(
        "gpu_memory_per_audio_second",
        &raw.gpu_memory_per_audio_second,
    )?;
    if gpu_per_second.is_some() && raw.max_audio_seconds.is_none() {
        return Err(key_err(
            k.key("max_audio_seconds"),
            "gpu_memory_per_audio_second needs max_audio_seconds: audio of unknown length is counted as that long",
        ));
    }
    if raw.learn == Some(true) && gpu_per_job.is_none() && gpu_per_second.is_none() {
        return Err(key_err(
            k.key("learn"),
            "learn = true needs gpu_memory_per_job or gpu_memory_per_audio_second as the figure to start from",
        ));
    }
    if gpu_per_job.is_none() && gpu_per_second.is_none() {
        return Ok(None);
    }
    Ok(Some(GpuNeed {
        device: match raw.gpu_device {
            None if memory.probe == ProbeKind::Host => 0,
            None => memory.device,
            Some(d) if d >= 0 => d as u32,
            Some(_) => {
                return Err(key_err(
                    k.key("gpu_device"),
                    "must be a device index (0 or more)",
                ));
            }
        },
        bytes_per_job: gpu_per_job.unwrap_or(0),
        bytes_per_audio_second: gpu_per_second.unwrap_or(0),
        // The pool's margin unless the lane asks for more.
        margin_bytes: k
            .bytes("gpu_memory_margin", &raw.gpu_memory_margin)?
            .unwrap_or(0)
            .max(memory.margin),
        fail_open: raw.gpu_fail_open.unwrap_or(false),
        learn: raw.learn.unwrap_or(false),
        longest_clip_seconds: raw.max_audio_seconds,
    }))
}

/// `engine` (whose metrics are read) and the `engine_*` thresholds admission holds on.
fn engine(
    raw: &RawLane,
    k: &LaneKeys,
) -> Result<(Option<EngineKind>, Option<EngineLimits>), ConfigError> {
    let engine_kind = match raw.engine.as_deref() {
        None => None,
        Some("vllm") => Some(EngineKind::Vllm),
        Some("llamacpp" | "llama.cpp") => Some(EngineKind::LlamaCpp),
        Some(other) => {
            return Err(key_err(
                k.key("engine"),
                format!("`{other}` is not vllm or llamacpp"),
            ));
        }
    };
    if let Some(kv) = raw.engine_max_kv_cache_usage
        && !(0.0..=1.0).contains(&kv)
    {
        return Err(key_err(
            k.key("engine_max_kv_cache_usage"),
            "must be a fraction between 0 and 1",
        ));
    }
    if raw.engine_max_waiting.is_none() && raw.engine_max_kv_cache_usage.is_none() {
        return Ok((engine_kind, None));
    }
    if engine_kind.is_none() {
        return Err(key_err(
            k.key("engine"),
            "engine thresholds need engine = \"vllm\" or \"llamacpp\" so its metrics can be read",
        ));
    }
    let limits = EngineLimits {
        max_waiting: raw.engine_max_waiting,
        max_kv_cache_usage: raw.engine_max_kv_cache_usage,
        stale_after: k.duration(
            "engine_metrics_stale_after",
            &raw.engine_metrics_stale_after,
            Duration::from_secs(5),
        )?,
        fail_open: raw.engine_fail_open.unwrap_or(false),
    };
    Ok((engine_kind, Some(limits)))
}

/// `upstream_api_key`, or the variable `upstream_api_key_env` names.
fn upstream_api_key(raw: &RawLane, env: &Env, k: &LaneKeys) -> Result<Option<String>, ConfigError> {
    match (&raw.upstream_api_key, &raw.upstream_api_key_env) {
        (Some(key), _) => Ok(Some(key.clone())),
        (None, Some(var)) => Ok(Some(env(var).ok_or_else(|| {
            key_err(
                k.key("upstream_api_key_env"),
                format!("environment variable {var} is not set"),
            )
        })?)),
        (None, None) => Ok(None),
    }
}

/// How the lane's running requests are stopped for the lanes it yields to.
struct Preemption {
    mode: PreemptMode,
    per_job: usize,
    settle: Duration,
}

/// `preempt_mode`, `preempt_per_job` and `preempt_settle` (which needs stopping requests and an
/// engine whose metrics show them gone).
fn preemption(
    raw: &RawLane,
    engine_kind: Option<EngineKind>,
    k: &LaneKeys,
) -> Result<Preemption, ConfigError> {
    let mode = match raw.preempt_mode.as_deref() {
        None => PreemptMode::Abort,
        Some(text) => PreemptMode::parse(text)
            .ok_or_else(|| key_err(k.key("preempt_mode"), "must be \"abort\" or \"pause\""))?,
    };
    if mode == PreemptMode::Pause && !raw.preempt {
        return Err(key_err(
            k.key("preempt_mode"),
            "\"pause\" needs preempt = true (it is how this lane is preempted)",
        ));
    }
    let per_job = match &raw.preempt_per_job {
        None => 1,
        Some(toml::Value::Integer(n)) if *n >= 1 => *n as usize,
        Some(toml::Value::String(all)) if all == "all" => PREEMPT_ALL,
        Some(other) => {
            return Err(key_err(
                k.key("preempt_per_job"),
                format!("{other} is neither a count of at least 1 nor \"all\""),
            ));
        }
    };
    let settle = k.duration("preempt_settle", &raw.preempt_settle, Duration::ZERO)?;
    if !settle.is_zero() && (!raw.preempt || mode != PreemptMode::Abort || engine_kind.is_none()) {
        return Err(key_err(
            k.key("preempt_settle"),
            "needs preempt = true (abort) and an `engine` whose metrics say when its requests \
             have stopped",
        ));
    }
    Ok(Preemption {
        mode,
        per_job,
        settle,
    })
}

/// A lane's concurrency, queue and timeouts.
struct Queueing {
    max_inflight: usize,
    max_queue: usize,
    queue_timeout: Duration,
    request_timeout: Duration,
    max_yield: Duration,
    yield_linger: Duration,
}

/// `max_inflight`, `max_queue`, `queue_timeout`, `request_timeout` (longer than 0), `max_yield`
/// and `yield_linger`.
fn queueing(raw: &RawLane, k: &LaneKeys) -> Result<Queueing, ConfigError> {
    let q = Queueing {
        max_inflight: k.count("max_inflight", raw.max_inflight, 1, 1)?,
        max_queue: k.count("max_queue", raw.max_queue, 0, 0)?,
        queue_timeout: k.duration("queue_timeout", &raw.queue_timeout, Duration::from_secs(5))?,
        request_timeout: k.duration(
            "request_timeout",
            &raw.request_timeout,
            Duration::from_secs(60),
        )?,
        max_yield: k.duration("max_yield", &raw.max_yield, Duration::from_secs(10))?,
        yield_linger: k.duration("yield_linger", &raw.yield_linger, Duration::ZERO)?,
    };
    if q.request_timeout.is_zero() {
        return Err(key_err(k.key("request_timeout"), "must be longer than 0"));
    }
    Ok(q)
}

/// A lane's passive-health keys (`eject_after_failures`, `base_ejection_time`,
/// `max_ejection_time`, `max_ejection_percent`) over the defaults.
fn outlier(raw: &RawLane, k: &LaneKeys) -> Result<Outlier, ConfigError> {
    let d = Outlier::default();
    let time = |key: &str, v: &Option<String>, default: Duration| match v {
        None => Ok(default),
        Some(s) => parse_duration(s)
            .filter(|d| !d.is_zero() && *d <= Duration::from_secs(24 * 3600))
            .ok_or_else(|| {
                key_err(
                    k.key(key),
                    format!("`{s}` is not a duration between 1ms and 24h, like 500ms, 5s or 2m"),
                )
            }),
    };
    let eject_after_failures = match raw.eject_after_failures {
        None => d.eject_after_failures,
        Some(n) if (1..=1000).contains(&n) => n as u32,
        Some(n) => {
            return Err(key_err(
                k.key("eject_after_failures"),
                format!("{n} is not a count of failures between 1 and 1000"),
            ));
        }
    };
    let max_ejection_percent = match raw.max_ejection_percent {
        None => d.max_ejection_percent,
        Some(n) if (0..=100).contains(&n) => n as u8,
        Some(n) => {
            return Err(key_err(
                k.key("max_ejection_percent"),
                format!("{n} is not a percentage between 0 and 100"),
            ));
        }
    };
    let base_ejection_time = time(
        "base_ejection_time",
        &raw.base_ejection_time,
        d.base_ejection_time,
    )?;
    let max_ejection_time = time(
        "max_ejection_time",
        &raw.max_ejection_time,
        d.max_ejection_time,
    )?;
    if max_ejection_time < base_ejection_time {
        return Err(key_err(
            k.key("max_ejection_time"),
            "must not be shorter than base_ejection_time",
        ));
    }
    Ok(Outlier {
        eject_after_failures,
        base_ejection_time,
        max_ejection_time,
        max_ejection_percent,
    })
}
