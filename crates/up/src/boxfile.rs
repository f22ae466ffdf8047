//! The box file (`headroom up --config box.toml`): the memory pool (`[memory]`, the same keys and
//! meaning as in `serve`'s config), the backends in start order (`[[backends]]`) and the gateway
//! (`[serve]`). Parsing, defaults and validation with the offending key named; paths are resolved
//! against the box file's folder, and files the sequence needs (commands, warm-up requests, the
//! text model) are checked before anything starts.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use headroom_plan::units::{BareNumber, parse_duration, parse_size};

use serde::Deserialize;

use crate::UpError;

/// `[memory]` is `serve`'s own table (same keys, same meaning); the box file reuses its type.
pub use headroom_server::config::memory::{MemoryConfig, MemoryTable, ProbeKind};

/// `audio` or `text`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Audio,
    Text,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Audio => "audio",
            Role::Text => "text",
        }
    }
}

/// What a backend runs, which decides how its flags are computed and its log is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    LlamaCpp,
    Whisper,
    Other,
}

impl Engine {
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::LlamaCpp => "llamacpp",
            Engine::Whisper => "whisper",
            Engine::Other => "other",
        }
    }
}

/// A representative job run against an audio backend while its memory is sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct Warmup {
    /// Route the job is posted to, e.g. `/v1/audio/transcriptions`.
    pub path: String,
    /// Audio file sent as the multipart field `file` (transcription), or
    pub file: Option<PathBuf>,
    /// a JSON body sent as is (speech: `{"input": "...", "voice": "..."}`).
    pub json: Option<String>,
    /// Extra multipart form fields sent with `file`.
    pub form: BTreeMap<String, String>,
    /// `file` (a 16-bit PCM WAV) sent as this many copies in a row, one clip: a job as long as
    /// the box's longest from a short recording.
    pub repeat: u32,
    /// How many times to run it.
    pub runs: u32,
    /// Deadline for one run.
    pub timeout: Duration,
}

/// What the text engine should get; `up` turns the budget into its flags.
#[derive(Debug, Clone, PartialEq)]
pub struct TextPlan {
    /// GGUF file (llama.cpp) or model directory / Hugging Face id / catalog name (vLLM).
    pub model: String,
    /// Tokens each sequence should hold (llama.cpp per-slot context, vLLM `--max-model-len`).
    pub context: u64,
    /// The shortest context still worth starting: below it `up` refuses (exit 3).
    pub min_context: u64,
    /// Most sequences at once (llama.cpp `--parallel`, vLLM `--max-num-seqs`).
    pub max_parallel: u64,
    /// Memory the engine's runtime holds beside weights, KV and compute buffers.
    pub overhead: u64,
    /// llama.cpp's micro-batch (`-ub`), for its compute-buffer estimate.
    pub ubatch: u64,
}

/// What an audio backend that is itself a vLLM (`role = "audio"`, `engine = "vllm"`: VibeVoice-ASR
/// through its vLLM plugin) is planned from; `up` computes its memory flags before it starts.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioVllmPlan {
    /// Model directory (config.json + safetensors), Hugging Face id or catalog name.
    pub model: String,
    /// The longest audio the lane accepts, in seconds: it sizes `--max-model-len` (and the lane
    /// refuses longer clips with 413).
    pub max_audio_seconds: f64,
    /// Audio tokens per second of audio, for a model whose rate headroom does not know (a known
    /// audio tokenizer, VibeVoice's 7.5/s, is used when this is not given).
    pub audio_tokens_per_second: Option<f64>,
    /// Its share of the pool: the most this backend may hold (weights, KV, runtime).
    pub memory: Option<u64>,
    /// Sequences at once the user asks for (capped by what `memory` holds).
    pub max_parallel: Option<u64>,
    /// Memory its runtime holds beside weights and KV (vLLM on the CPU: several GiB of torch).
    pub overhead: u64,
}

/// One `[[backends]]` entry after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendConfig {
    pub name: String,
    pub role: Role,
    pub engine: Engine,
    /// Program to run (resolved against the box folder when it contains a `/`).
    pub command: PathBuf,
    /// Arguments; `{port}` is replaced by `port`.
    pub args: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub port: u16,
    pub health: String,
    pub ready_timeout: Duration,
    /// Window over which memory must stay flat to count as steady, and the longest wait.
    pub steady_window: Duration,
    pub steady_timeout: Duration,
    pub warmup: Option<Warmup>,
    pub text: Option<TextPlan>,
    /// For an audio backend with `engine = "vllm"`: what its flags are planned from.
    pub audio_vllm: Option<AudioVllmPlan>,
    /// Grace period between SIGTERM and SIGKILL when stopping.
    pub stop_grace: Duration,
}

impl BackendConfig {
    pub fn upstream(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The arguments with `{port}` filled in.
    pub fn expanded_args(&self) -> Vec<String> {
        let port = self.port.to_string();
        self.args
            .iter()
            .map(|a| a.replace("{port}", &port))
            .collect()
    }
}

/// `[serve]` after validation: the gateway's own keys, passed on to `serve`'s config.
#[derive(Debug, Clone, PartialEq)]
pub struct ServeSection {
    pub listen: SocketAddr,
    /// Keys of `serve`'s top level (api_keys, shutdown_grace, max_inflight_total, ...), as given.
    pub top: toml::Table,
    /// Per-lane keys that override the derived lanes, by lane (= backend) name.
    pub lanes: BTreeMap<String, toml::Table>,
}

/// The whole box.
#[derive(Debug, Clone, PartialEq)]
pub struct BoxConfig {
    /// The box file's folder: backends run there and relative paths start there.
    pub dir: PathBuf,
    pub memory: MemoryConfig,
    pub backends: Vec<BackendConfig>,
    pub serve: ServeSection,
    /// Restart backoff: first delay and cap.
    pub restart_backoff: Duration,
    pub restart_backoff_max: Duration,
    /// Growth past the measured peak that is reported as drift (fraction of the peak).
    pub drift_margin: f64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBox {
    memory: MemoryTable,
    #[serde(default)]
    backends: Vec<RawBackend>,
    serve: Option<toml::Table>,
    restart_backoff: Option<String>,
    restart_backoff_max: Option<String>,
    drift_margin: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBackend {
    name: String,
    role: String,
    engine: Option<String>,
    command: String,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    port: i64,
    health: Option<String>,
    ready_timeout: Option<String>,
    steady_window: Option<String>,
    steady_timeout: Option<String>,
    stop_grace: Option<String>,
    warmup: Option<RawWarmup>,
    model: Option<String>,
    context: Option<i64>,
    min_context: Option<i64>,
    max_parallel: Option<i64>,
    overhead: Option<toml::Value>,
    ubatch: Option<i64>,
    max_audio_seconds: Option<f64>,
    audio_tokens_per_second: Option<f64>,
    memory: Option<toml::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWarmup {
    path: Option<String>,
    file: Option<String>,
    json: Option<String>,
    #[serde(default)]
    form: BTreeMap<String, String>,
    repeat: Option<i64>,
    runs: Option<i64>,
    timeout: Option<String>,
}

fn bad(key: impl Into<String>, message: impl Into<String>) -> UpError {
    UpError::Config {
        key: key.into(),
        message: message.into(),
    }
}

fn size(key: &str, v: &toml::Value) -> Result<u64, UpError> {
    match v {
        toml::Value::Integer(i) if *i >= 0 => Ok(*i as u64),
        toml::Value::String(s) => parse_size(s).map_err(|e| {
            bad(
                key,
                format!("`{s}` is not a size like 512MiB or 8GiB ({e})"),
            )
        }),
        _ => Err(bad(
            key,
            "must be a byte count or a size like 512MiB or 8GiB",
        )),
    }
}

fn duration(key: &str, v: Option<&String>, default: Duration) -> Result<Duration, UpError> {
    match v {
        None => Ok(default),
        Some(s) => parse_duration(s, BareNumber::Seconds)
            .ok_or_else(|| bad(key, format!("`{s}` is not a duration like 500ms, 5s or 2m"))),
    }
}

fn count(key: &str, v: Option<i64>, default: u64, min: i64) -> Result<u64, UpError> {
    match v {
        None => Ok(default),
        Some(n) if n >= min => Ok(n as u64),
        Some(n) => Err(bad(key, format!("{n} is below the minimum {min}"))),
    }
}

/// What the command line changes without editing the box file: the gateway's address, the
/// backends' ports, and whether the capacity is enforced.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Replaces `[serve] listen`.
    pub listen: Option<SocketAddr>,
    /// Backend k (in file order, from 0) listens on `port_base + k`; `{port}` in its arguments
    /// and its upstream follow.
    pub port_base: Option<u16>,
    /// Sets `[memory] enforce = true` (`--enforce`).
    pub enforce: bool,
}

/// The clause every path error ends with: which folder relative paths were taken from.
pub(crate) fn relative_to(dir: &Path) -> String {
    format!(
        "relative paths start at the box file's folder, {}",
        dir.display()
    )
}

impl BoxConfig {
    /// Reads and validates a box file.
    pub fn load(path: &Path) -> Result<BoxConfig, UpError> {
        Self::load_with(path, Overrides::default())
    }

    /// [`BoxConfig::load`] with the command line's overrides applied before validation.
    pub fn load_with(path: &Path, overrides: Overrides) -> Result<BoxConfig, UpError> {
        let text = std::fs::read_to_string(path).map_err(|e| UpError::Io {
            what: format!("box file {}", path.display()),
            source: e,
        })?;
        let dir = path
            .parent()
            .map(Path::to_path_buf)
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or_else(|| PathBuf::from("."));
        // Absolute, so paths mean the same from the backends' working folder (this one).
        let dir = std::fs::canonicalize(&dir).unwrap_or(dir);
        Self::parse_with(&text, &dir, overrides)
    }

    /// Parses a box file's text; `dir` is the folder relative paths start from.
    pub fn parse(text: &str, dir: &Path) -> Result<BoxConfig, UpError> {
        Self::parse_with(text, dir, Overrides::default())
    }

    /// [`BoxConfig::parse`] with the command line's overrides.
    pub fn parse_with(text: &str, dir: &Path, overrides: Overrides) -> Result<BoxConfig, UpError> {
        let raw: RawBox =
            toml::from_str(text).map_err(|e| UpError::Toml(flatten(&e.to_string())))?;
        if raw.backends.is_empty() {
            return Err(bad(
                "backends",
                "at least one [[backends]] table is required",
            ));
        }
        let mut backends = Vec::new();
        for (i, b) in raw.backends.into_iter().enumerate() {
            backends.push(backend(i, b, dir)?);
        }
        if let Some(base) = overrides.port_base {
            move_ports(&mut backends, base)?;
        }
        check_backends(&backends)?;
        if raw.memory.probe.is_none() {
            return Err(bad(
                "memory.probe",
                "say which pool the box shares: \"nvml\" or \"host\"",
            ));
        }
        // The backends are the pool's members: watched by serve like any upstream.
        let mut table = raw.memory;
        if overrides.enforce {
            table.enforce = Some(true);
        }
        if table.probe.as_deref() == Some("host") {
            for b in &backends {
                if !table.watch.contains(&b.upstream()) {
                    table.watch.push(b.upstream());
                }
            }
        }
        let mut memory = table
            .validate("memory")
            .map_err(|e| UpError::Memory(e.to_string()))?;
        // The calibration file (measured figures, and the needs serve's ledger learns) sits
        // beside the box file unless the table names one; relative paths start at the box.
        if let Some(c) = &memory.calibration
            && c.is_relative()
        {
            memory.calibration = Some(dir.join(c));
        }
        let mut serve_table = raw.serve.unwrap_or_default();
        if let Some(listen) = overrides.listen {
            serve_table.insert("listen".into(), toml::Value::String(listen.to_string()));
        }
        let serve = serve_section(serve_table, &backends)?;
        lane_audio_seconds(&mut backends, &serve)?;
        let drift_margin = raw.drift_margin.unwrap_or(0.1);
        if !(drift_margin.is_finite() && drift_margin >= 0.0) {
            return Err(bad("drift_margin", "must be a fraction of 0 or more"));
        }
        Ok(BoxConfig {
            dir: dir.to_path_buf(),
            memory,
            backends,
            serve,
            restart_backoff: duration(
                "restart_backoff",
                raw.restart_backoff.as_ref(),
                Duration::from_secs(1),
            )?,
            restart_backoff_max: duration(
                "restart_backoff_max",
                raw.restart_backoff_max.as_ref(),
                Duration::from_secs(30),
            )?,
            drift_margin,
        })
    }

    pub fn audio(&self) -> impl Iterator<Item = &BackendConfig> {
        self.backends.iter().filter(|b| b.role == Role::Audio)
    }

    pub fn text(&self) -> Option<&BackendConfig> {
        self.backends.iter().find(|b| b.role == Role::Text)
    }
}

fn flatten(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn resolve(dir: &Path, p: &str) -> PathBuf {
    let path = Path::new(p);
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        dir.join(path)
    }
}

fn backend(i: usize, raw: RawBackend, dir: &Path) -> Result<BackendConfig, UpError> {
    let name = raw.name.trim().to_string();
    let k = |key: &str| format!("backends[{i}] ({name}).{key}");
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err(bad(
            format!("backends[{i}].name"),
            "must be non-empty letters, digits, - or _",
        ));
    }
    let role = match raw.role.as_str() {
        "audio" => Role::Audio,
        "text" => Role::Text,
        other => return Err(bad(k("role"), format!("`{other}` is not audio or text"))),
    };
    let engine = match raw.engine.as_deref().unwrap_or("other") {
        "vllm" => Engine::Vllm,
        "llamacpp" | "llama.cpp" => Engine::LlamaCpp,
        "whisper" => Engine::Whisper,
        "other" => Engine::Other,
        other => {
            return Err(bad(
                k("engine"),
                format!("`{other}` is not vllm, llamacpp, whisper or other"),
            ));
        }
    };
    if raw.command.trim().is_empty() {
        return Err(bad(k("command"), "must name a program"));
    }
    let command = if raw.command.contains('/') {
        resolve(dir, &raw.command)
    } else {
        PathBuf::from(&raw.command)
    };
    let port = u16::try_from(raw.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| {
            bad(
                k("port"),
                format!("{} is not a TCP port (1-65535)", raw.port),
            )
        })?;
    let audio_keys = AudioKeys {
        model: raw.model.clone(),
        max_audio_seconds: raw.max_audio_seconds,
        audio_tokens_per_second: raw.audio_tokens_per_second,
        memory: raw.memory.clone(),
        max_parallel: raw.max_parallel,
        overhead: raw.overhead.clone(),
    };
    let health = raw.health.unwrap_or_else(|| "/health".into());
    if !health.starts_with('/') {
        return Err(bad(k("health"), "must be a path starting with /"));
    }
    let warmup = match raw.warmup {
        None => None,
        Some(w) => Some(warmup(&k, w, dir, engine)?),
    };
    if role == Role::Text && warmup.is_some() {
        return Err(bad(k("warmup"), "only audio backends take a warm-up job"));
    }
    let text = if role == Role::Text {
        if !matches!(engine, Engine::Vllm | Engine::LlamaCpp) {
            return Err(bad(
                k("engine"),
                "the text backend must be vllm or llamacpp, so up can compute its memory flags",
            ));
        }
        let model = raw.model.ok_or_else(|| {
            bad(
                k("model"),
                "the text backend needs the model its flags are planned from",
            )
        })?;
        let context = count(&k("context"), raw.context, 2048, 16)?;
        let min_context = count(&k("min_context"), raw.min_context, context.min(512), 16)?;
        if min_context > context {
            return Err(bad(k("min_context"), "must not be above context"));
        }
        let default_overhead = match engine {
            Engine::Vllm => 0,
            _ => 64 * 1024 * 1024,
        };
        Some(TextPlan {
            model,
            context,
            min_context,
            max_parallel: count(&k("max_parallel"), raw.max_parallel, 4, 1)?,
            overhead: match &raw.overhead {
                None => default_overhead,
                Some(v) => size(&k("overhead"), v)?,
            },
            ubatch: count(&k("ubatch"), raw.ubatch, 512, 1)?,
        })
    } else {
        if raw.context.is_some() || raw.min_context.is_some() || raw.ubatch.is_some() {
            return Err(bad(
                k("context"),
                "context, min_context and ubatch belong to the text backend",
            ));
        }
        if engine != Engine::Vllm
            && (raw.model.is_some() || raw.max_parallel.is_some() || raw.overhead.is_some())
        {
            return Err(bad(
                k("model"),
                "model, max_parallel and overhead belong to the text backend or an audio vLLM",
            ));
        }
        None
    };
    let audio_vllm = if role == Role::Audio && engine == Engine::Vllm {
        Some(audio_vllm_plan(&k, &audio_keys)?)
    } else {
        if audio_keys.max_audio_seconds.is_some()
            || audio_keys.audio_tokens_per_second.is_some()
            || audio_keys.memory.is_some()
        {
            return Err(bad(
                k("max_audio_seconds"),
                "max_audio_seconds, audio_tokens_per_second and memory belong to an audio backend with engine = \"vllm\"",
            ));
        }
        None
    };
    Ok(BackendConfig {
        name: name.clone(),
        role,
        engine,
        command,
        args: raw.args,
        env: raw.env,
        port,
        health,
        ready_timeout: duration(
            &k("ready_timeout"),
            raw.ready_timeout.as_ref(),
            Duration::from_secs(120),
        )?,
        steady_window: duration(
            &k("steady_window"),
            raw.steady_window.as_ref(),
            Duration::from_secs(2),
        )?,
        steady_timeout: duration(
            &k("steady_timeout"),
            raw.steady_timeout.as_ref(),
            Duration::from_secs(30),
        )?,
        stop_grace: duration(
            &k("stop_grace"),
            raw.stop_grace.as_ref(),
            Duration::from_secs(10),
        )?,
        warmup,
        text,
        audio_vllm,
    })
}

/// The keys an audio vLLM is planned from, as written.
struct AudioKeys {
    model: Option<String>,
    max_audio_seconds: Option<f64>,
    audio_tokens_per_second: Option<f64>,
    memory: Option<toml::Value>,
    max_parallel: Option<i64>,
    overhead: Option<toml::Value>,
}

fn audio_vllm_plan(k: &dyn Fn(&str) -> String, raw: &AudioKeys) -> Result<AudioVllmPlan, UpError> {
    let model = raw.model.clone().ok_or_else(|| {
        bad(
            k("model"),
            "an audio vLLM needs the model its flags are planned from (a folder, a Hugging Face id or a catalog name such as microsoft/VibeVoice-ASR)",
        )
    })?;
    if let Some(s) = raw.max_audio_seconds
        && !(s.is_finite() && s > 0.0)
    {
        return Err(bad(
            k("max_audio_seconds"),
            "must be a positive number of seconds",
        ));
    }
    if let Some(r) = raw.audio_tokens_per_second
        && !(r.is_finite() && r > 0.0)
    {
        return Err(bad(k("audio_tokens_per_second"), "must be a positive rate"));
    }
    let memory = match &raw.memory {
        None => None,
        Some(v) => Some(size(&k("memory"), v)?).filter(|m| *m > 0),
    };
    let max_parallel = match raw.max_parallel {
        None => None,
        n => Some(count(&k("max_parallel"), n, 1, 1)?),
    };
    if memory.is_none() && max_parallel.is_none() {
        return Err(bad(
            k("memory"),
            "an audio vLLM needs its share of the pool (`memory`, e.g. \"20GiB\") or the sequences it runs at once (`max_parallel`), so it leaves the rest to the text engine",
        ));
    }
    Ok(AudioVllmPlan {
        model,
        // Filled from the lane's own key when the backend does not give it.
        max_audio_seconds: raw.max_audio_seconds.unwrap_or(0.0),
        audio_tokens_per_second: raw.audio_tokens_per_second,
        memory,
        max_parallel,
        overhead: match &raw.overhead {
            None => 0,
            Some(v) => size(&k("overhead"), v)?,
        },
    })
}

/// An audio vLLM's longest audio: its own `max_audio_seconds`, else its lane's
/// (`[serve.lanes.NAME] max_audio_seconds`); one of the two is required.
fn lane_audio_seconds(backends: &mut [BackendConfig], serve: &ServeSection) -> Result<(), UpError> {
    for (i, b) in backends.iter_mut().enumerate() {
        let name = b.name.clone();
        let Some(a) = b.audio_vllm.as_mut() else {
            continue;
        };
        let lane = serve
            .lanes
            .get(&name)
            .and_then(|t| t.get("max_audio_seconds"))
            .and_then(|v| v.as_float().or_else(|| v.as_integer().map(|i| i as f64)));
        if a.max_audio_seconds > 0.0 {
            if let Some(l) = lane
                && (l - a.max_audio_seconds).abs() > 1e-9
            {
                return Err(bad(
                    format!("serve.lanes.{name}.max_audio_seconds"),
                    format!(
                        "{l} differs from backends[{i}] ({name}).max_audio_seconds = {}: give it once",
                        a.max_audio_seconds
                    ),
                ));
            }
            continue;
        }
        match lane {
            Some(l) if l.is_finite() && l > 0.0 => a.max_audio_seconds = l,
            _ => {
                return Err(bad(
                    format!("backends[{i}] ({name}).max_audio_seconds"),
                    "an audio vLLM's --max-model-len comes from the longest audio its lane accepts: give max_audio_seconds (here or in [serve.lanes.NAME])",
                ));
            }
        }
    }
    Ok(())
}

fn warmup(
    k: &dyn Fn(&str) -> String,
    raw: RawWarmup,
    dir: &Path,
    engine: Engine,
) -> Result<Warmup, UpError> {
    let path = raw.path.unwrap_or_else(|| match engine {
        Engine::Whisper => "/v1/audio/transcriptions".into(),
        _ => String::new(),
    });
    if !path.starts_with('/') {
        return Err(bad(
            k("warmup.path"),
            "must be the route the job is posted to, e.g. /v1/audio/transcriptions",
        ));
    }
    if raw.file.is_some() == raw.json.is_some() {
        return Err(bad(
            k("warmup"),
            "give exactly one of file (an audio clip) or json (a request body)",
        ));
    }
    let file = raw.file.map(|f| resolve(dir, &f));
    if let Some(f) = &file
        && !f.is_file()
    {
        return Err(bad(
            k("warmup.file"),
            format!("{} does not exist ({})", f.display(), relative_to(dir)),
        ));
    }
    let repeat = match (raw.repeat, &file) {
        (Some(_), None) => {
            return Err(bad(
                k("warmup.repeat"),
                "repeats the audio `file`; a json body has none",
            ));
        }
        (r, _) => count(&k("warmup.repeat"), r, 1, 1)?.min(1000) as u32,
    };
    Ok(Warmup {
        path,
        file,
        json: raw.json,
        form: raw.form,
        repeat,
        runs: count(&k("warmup.runs"), raw.runs, 3, 1)? as u32,
        timeout: duration(
            &k("warmup.timeout"),
            raw.timeout.as_ref(),
            Duration::from_secs(120),
        )?,
    })
}

/// Backend k listens on `base + k` (`--port-base`).
fn move_ports(backends: &mut [BackendConfig], base: u16) -> Result<(), UpError> {
    let last = u32::from(base) + backends.len() as u32 - 1;
    if base == 0 || last > u32::from(u16::MAX) {
        return Err(bad(
            "--port-base",
            format!(
                "{base} leaves no room for {} backend ports (1-65535)",
                backends.len()
            ),
        ));
    }
    for (k, b) in backends.iter_mut().enumerate() {
        b.port = base + k as u16;
    }
    Ok(())
}

fn check_backends(backends: &[BackendConfig]) -> Result<(), UpError> {
    let texts = backends.iter().filter(|b| b.role == Role::Text).count();
    if texts > 1 {
        return Err(bad(
            "backends",
            "at most one backend may have role = \"text\"",
        ));
    }
    for (i, a) in backends.iter().enumerate() {
        for b in &backends[..i] {
            if a.name == b.name {
                return Err(bad(
                    "backends",
                    format!("two backends are named `{}`", a.name),
                ));
            }
            if a.port == b.port {
                return Err(bad(
                    "backends",
                    format!("`{}` and `{}` both use port {}", b.name, a.name, a.port),
                ));
            }
        }
    }
    if let Some(text) = backends.iter().position(|b| b.role == Role::Text)
        && backends[text + 1..].iter().any(|b| b.role == Role::Audio)
    {
        return Err(bad(
            "backends",
            "list the audio backends before the text backend: it gets what they leave",
        ));
    }
    Ok(())
}

fn serve_section(
    mut table: toml::Table,
    backends: &[BackendConfig],
) -> Result<ServeSection, UpError> {
    let listen_text = match table.remove("listen") {
        None => "127.0.0.1:8080".to_string(),
        Some(toml::Value::String(s)) => s,
        Some(_) => return Err(bad("serve.listen", "must be a string HOST:PORT")),
    };
    let listen: SocketAddr = listen_text
        .parse()
        .map_err(|_| bad("serve.listen", format!("`{listen_text}` is not HOST:PORT")))?;
    if backends.iter().any(|b| b.port == listen.port()) {
        return Err(bad(
            "serve.listen",
            format!("port {} is also a backend's port", listen.port()),
        ));
    }
    let mut lanes = BTreeMap::new();
    match table.remove("lanes") {
        None => {}
        Some(toml::Value::Table(t)) => {
            for (name, v) in t {
                if !backends.iter().any(|b| b.name == name) {
                    return Err(bad(
                        format!("serve.lanes.{name}"),
                        "names no backend; lanes are named after their backend",
                    ));
                }
                match v {
                    toml::Value::Table(t) => {
                        lanes.insert(name, t);
                    }
                    _ => {
                        return Err(bad(
                            format!("serve.lanes.{name}"),
                            "must be a table of lane keys",
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(bad(
                "serve.lanes",
                "must be a table: [serve.lanes.BACKEND] with lane keys",
            ));
        }
    }
    Ok(ServeSection {
        listen,
        top: table,
        lanes,
    })
}

/// Resolves the text model: a path relative to the box folder (a glob like
/// `lib/python3*/site-packages/pkg/*.gguf` picks the first match), else the name as given
/// (a Hugging Face id or catalog name for vLLM).
pub fn resolve_model(dir: &Path, model: &str) -> Result<String, UpError> {
    let candidate = resolve(dir, model);
    if candidate.exists() {
        return Ok(candidate.display().to_string());
    }
    if model.contains(['*', '?', '[']) {
        let pattern = candidate.display().to_string();
        let mut found = glob::glob(&pattern)
            .map_err(|e| bad("model", format!("`{model}` is not a valid pattern: {e}")))?
            .flatten();
        return found
            .next()
            .map(|p| p.display().to_string())
            .ok_or_else(|| {
                bad(
                    "model",
                    format!("no file matches {pattern} ({})", relative_to(dir)),
                )
            });
    }
    if model.starts_with('.') || model.starts_with('/') {
        return Err(bad(
            "model",
            format!(
                "{} does not exist ({})",
                candidate.display(),
                relative_to(dir)
            ),
        ));
    }
    Ok(model.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
[memory]
probe = "host"
capacity = "4GiB"
margin = "128MiB"

[[backends]]
name = "stt"
role = "audio"
engine = "whisper"
command = "whisper-server"
args = ["--port", "{port}"]
port = 20081

[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "llama-server"
port = 20080
model = "model.gguf"

[serve]
listen = "127.0.0.1:20000"
shutdown_grace = "5s"
[serve.lanes.llm]
max_output_tokens = 256
"#;

    #[test]
    fn a_minimal_box_parses_with_defaults() {
        let b = BoxConfig::parse(MINIMAL, Path::new("/box")).unwrap();
        assert_eq!(b.memory.probe, ProbeKind::Host);
        assert_eq!(b.memory.capacity, Some(4 << 30));
        assert_eq!(b.memory.margin, 128 << 20);
        assert_eq!(b.backends[0].expanded_args(), vec!["--port", "20081"]);
        assert_eq!(b.backends[0].health, "/health");
        let text = b.text().unwrap().text.as_ref().unwrap();
        assert_eq!(
            (text.context, text.min_context, text.max_parallel),
            (2048, 512, 4)
        );
        assert_eq!(b.serve.listen.port(), 20000);
        assert!(b.serve.top.contains_key("shutdown_grace"));
        assert!(b.serve.lanes["llm"].contains_key("max_output_tokens"));
    }

    fn err(text: &str) -> String {
        BoxConfig::parse(text, Path::new("/box"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn bad_keys_are_named() {
        assert!(err(&MINIMAL.replace("\"host\"", "\"tpu\"")).contains("memory.probe"));
        assert!(
            err(&MINIMAL.replace("port = 20080", "port = 20081")).contains("both use port 20081")
        );
        assert!(err(&MINIMAL.replace("role = \"audio\"", "role = \"video\"")).contains("role"));
        assert!(err(&MINIMAL.replace("model = \"model.gguf\"", "")).contains("model"));
        assert!(
            err(&MINIMAL.replace("[serve.lanes.llm]", "[serve.lanes.nope]"))
                .contains("serve.lanes.nope")
        );
        assert!(
            err(&MINIMAL.replace("capacity = \"4GiB\"", "capacity = \"lots\""))
                .contains("memory.capacity")
        );
        assert!(err(&format!("unknown = 1\n{MINIMAL}")).contains("unknown"));
    }

    #[test]
    fn a_missing_warmup_file_is_refused_before_anything_starts() {
        let text = MINIMAL.replace(
            "port = 20081\n",
            "port = 20081\n[backends.warmup]\nfile = \"no-such.wav\"\n",
        );
        let e = err(&text);
        assert!(
            e.contains("warmup.file") && e.contains("no-such.wav"),
            "{e}"
        );
    }

    #[test]
    fn the_text_backend_comes_last() {
        let text = MINIMAL.replace(
            "[serve]",
            "[[backends]]\nname = \"tts\"\nrole = \"audio\"\ncommand = \"x\"\nport = 20082\n[serve]",
        );
        assert!(err(&text).contains("before the text backend"));
    }

    fn with_audio_vllm(keys: &str, lane: &str) -> String {
        MINIMAL.replace(
            "[[backends]]\nname = \"llm\"",
            &format!(
                "[[backends]]\nname = \"asr\"\nrole = \"audio\"\nengine = \"vllm\"\ncommand = \"vllm\"\nport = 20083\n{keys}\n[[backends]]\nname = \"llm\""
            ),
        ) + lane
    }

    #[test]
    fn an_audio_vllm_takes_its_planning_keys() {
        let text = with_audio_vllm(
            "model = \"microsoft/VibeVoice-ASR\"\nmax_audio_seconds = 3600\nmemory = \"30GiB\"\nmax_parallel = 2",
            "",
        );
        let b = BoxConfig::parse(&text, Path::new("/box")).unwrap();
        let a = b.backends[1].audio_vllm.as_ref().unwrap();
        assert_eq!(a.model, "microsoft/VibeVoice-ASR");
        assert_eq!(a.max_audio_seconds, 3600.0);
        assert_eq!((a.memory, a.max_parallel), (Some(30 << 30), Some(2)));
        assert_eq!(a.audio_tokens_per_second, None);
        // The lane's own max_audio_seconds serves when the backend does not give one.
        let text = with_audio_vllm(
            "model = \"m\"\nmax_parallel = 1\naudio_tokens_per_second = 10.0",
            "[serve.lanes.asr]\nmax_audio_seconds = 45.0\n",
        );
        let b = BoxConfig::parse(&text, Path::new("/box")).unwrap();
        let a = b.backends[1].audio_vllm.as_ref().unwrap();
        assert_eq!(
            (a.max_audio_seconds, a.audio_tokens_per_second),
            (45.0, Some(10.0))
        );
    }

    #[test]
    fn an_audio_vllm_without_its_keys_is_refused_with_the_key_named() {
        let e = err(&with_audio_vllm("model = \"m\"\nmax_parallel = 1", ""));
        assert!(e.contains("(asr).max_audio_seconds"), "{e}");
        let e = err(&with_audio_vllm(
            "model = \"m\"\nmax_audio_seconds = 30",
            "",
        ));
        assert!(
            e.contains("(asr).memory") && e.contains("max_parallel"),
            "{e}"
        );
        let e = err(&with_audio_vllm(
            "max_audio_seconds = 30\nmax_parallel = 1",
            "",
        ));
        assert!(e.contains("(asr).model"), "{e}");
        let e = err(&with_audio_vllm(
            "model = \"m\"\nmax_parallel = 1\nmax_audio_seconds = 30",
            "[serve.lanes.asr]\nmax_audio_seconds = 60.0\n",
        ));
        assert!(e.contains("serve.lanes.asr.max_audio_seconds"), "{e}");
        // The audio vLLM keys mean nothing on a whisper backend.
        let e = err(&MINIMAL.replace("port = 20081\n", "port = 20081\nmax_audio_seconds = 30\n"));
        assert!(e.contains("(stt).max_audio_seconds"), "{e}");
    }

    #[test]
    fn the_seed_one_example_parses() {
        let text = include_str!("../../../examples/gpu-vibevoice.up.toml");
        let b = BoxConfig::parse(text, Path::new("/box")).unwrap();
        assert_eq!(b.memory.probe, ProbeKind::Nvml);
        let asr = b.backends[0].audio_vllm.as_ref().unwrap();
        assert_eq!(asr.model, "microsoft/VibeVoice-ASR");
        assert_eq!(asr.max_audio_seconds, 3600.0);
        assert_eq!(b.text().unwrap().engine, Engine::Vllm);
    }

    #[test]
    fn the_command_line_moves_the_gateway_and_the_backends() {
        let moved = Overrides {
            listen: Some("127.0.0.1:19299".parse().unwrap()),
            port_base: Some(19250),
            ..Overrides::default()
        };
        let b = BoxConfig::parse_with(MINIMAL, Path::new("/box"), moved).unwrap();
        assert_eq!(b.serve.listen.to_string(), "127.0.0.1:19299");
        // In file order from the base; `{port}`, the upstream and the pool's members follow.
        assert_eq!((b.backends[0].port, b.backends[1].port), (19250, 19251));
        assert_eq!(b.backends[0].expanded_args(), vec!["--port", "19250"]);
        assert_eq!(b.backends[1].upstream(), "http://127.0.0.1:19251");
        assert!(
            b.memory
                .watch
                .contains(&"http://127.0.0.1:19250".to_string())
        );
        assert!(!b.memory.watch.iter().any(|u| u.ends_with(":20081")));
        // A gateway moved onto a backend's new port, or a base with no room, is refused.
        let clash = Overrides {
            listen: Some("127.0.0.1:19251".parse().unwrap()),
            port_base: Some(19250),
            ..Overrides::default()
        };
        let e = BoxConfig::parse_with(MINIMAL, Path::new("/box"), clash).unwrap_err();
        assert!(e.to_string().contains("also a backend's port"), "{e}");
        let full = Overrides {
            port_base: Some(65535),
            ..Overrides::default()
        };
        let e = BoxConfig::parse_with(MINIMAL, Path::new("/box"), full).unwrap_err();
        assert!(e.to_string().contains("--port-base"), "{e}");
    }

    #[test]
    fn the_command_line_enforces_the_capacity_and_the_table_s_own_rules_still_hold() {
        let plain = BoxConfig::parse(MINIMAL, Path::new("/box")).unwrap();
        assert!(!plain.memory.enforce);
        let enforce = Overrides {
            enforce: true,
            ..Overrides::default()
        };
        let b = BoxConfig::parse_with(MINIMAL, Path::new("/box"), enforce).unwrap();
        assert!(b.memory.enforce);
        // On a GPU pool the card is the limit: --enforce is refused as the key is.
        let gpu = MINIMAL.replace("probe = \"host\"", "probe = \"nvml\"");
        assert!(BoxConfig::parse_with(&gpu, Path::new("/box"), enforce).is_err());
    }

    #[test]
    fn a_missing_relative_path_names_the_folder_it_was_taken_from() {
        let dir = tempfile::tempdir().unwrap();
        let text = MINIMAL.replace(
            "port = 20081\n",
            "port = 20081\n[backends.warmup]\nfile = \"../clips/fox.wav\"\n",
        );
        let e = BoxConfig::parse(&text, dir.path()).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "relative paths start at the box file's folder, {}",
                dir.path().display()
            )),
            "{e}"
        );
        let e = resolve_model(dir.path(), "./models/m.gguf")
            .unwrap_err()
            .to_string();
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
    }

    #[test]
    fn models_resolve_by_glob() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("lib/python3.11/pkg")).unwrap();
        std::fs::write(dir.path().join("lib/python3.11/pkg/m.gguf"), b"x").unwrap();
        let found = resolve_model(dir.path(), "lib/python3*/pkg/*.gguf").unwrap();
        assert!(found.ends_with("lib/python3.11/pkg/m.gguf"), "{found}");
        assert!(resolve_model(dir.path(), "lib/none*/x.gguf").is_err());
        assert_eq!(resolve_model(dir.path(), "org/model").unwrap(), "org/model");
    }
}
