//! One `[[lanes]]` table: its keys as written ([`RawLane`]), their validation, and the lane
//! after validation ([`LaneConfig`]) with the gate's [`LaneSpec`] inside.

use std::time::Duration;

use headroom_gate::{EngineLimits, GpuNeed, LaneSpec, Outlier, PREEMPT_ALL, Policy, PreemptMode};
use serde::Deserialize;

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
    /// The lane's requests may run twice (`idempotent = true`): one that failed after it was
    /// sent but before any response byte is sent again (a fresh connection, then another
    /// replica). Off by default: such a request is answered 502, never repeated.
    pub idempotent: bool,
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

pub(super) fn lane_config(
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
    let outlier = outlier(&raw, &k)?;
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
        outlier,
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
        idempotent: raw.idempotent.unwrap_or(false),
    })
}

/// A lane's passive-health keys (`eject_after_failures`, `base_ejection_time`,
/// `max_ejection_time`, `max_ejection_percent`) over the defaults.
fn outlier(raw: &RawLane, k: &dyn Fn(&str) -> String) -> Result<Outlier, ConfigError> {
    let d = Outlier::default();
    let time = |key: &str, v: &Option<String>, default: Duration| match v {
        None => Ok(default),
        Some(s) => parse_duration(s)
            .filter(|d| !d.is_zero() && *d <= Duration::from_secs(24 * 3600))
            .ok_or_else(|| {
                key_err(
                    k(key),
                    format!("`{s}` is not a duration between 1ms and 24h, like 500ms, 5s or 2m"),
                )
            }),
    };
    let eject_after_failures = match raw.eject_after_failures {
        None => d.eject_after_failures,
        Some(n) if (1..=1000).contains(&n) => n as u32,
        Some(n) => {
            return Err(key_err(
                k("eject_after_failures"),
                format!("{n} is not a count of failures between 1 and 1000"),
            ));
        }
    };
    let max_ejection_percent = match raw.max_ejection_percent {
        None => d.max_ejection_percent,
        Some(n) if (0..=100).contains(&n) => n as u8,
        Some(n) => {
            return Err(key_err(
                k("max_ejection_percent"),
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
            k("max_ejection_time"),
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
