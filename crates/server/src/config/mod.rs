//! The `headroom serve` configuration file: TOML keys, their defaults, duration and size parsing,
//! validation with the offending key named, the commented example, and conversion into the gate's
//! [`LaneSpec`]s.
//!
//! Submodules: [`error`] (why a file is refused), [`parse`] (single values), [`lane`] (one
//! `[[lanes]]` table), [`memory`] (`[memory]`), [`balancer`] (`[balancer]`), [`example`].

pub mod balancer;
pub mod error;
mod example;
pub mod lane;
pub mod memory;
mod parse;

use std::net::SocketAddr;
use std::time::Duration;

use headroom_gate::{LaneSpec, LedgerSettings, PoolKind};
use serde::Deserialize;

use balancer::{BalancerConfig, BalancerTable};
use error::{toml_error, with_line};
use lane::{RawLane, lane_config};
use memory::{MemoryConfig, MemoryTable, ProbeKind};
use parse::{DEFAULT_LISTEN, parse_listen};

pub use error::ConfigError;
pub(crate) use error::key_err;
pub use example::EXAMPLE_CONFIG;
pub use lane::{
    DEFAULT_FALLBACK_REASONS, DEFAULT_SPEECH_SECONDS_PER_CHAR, EngineKind, FALLBACK_REASONS,
    FallbackKind, LaneSettings, OutputTokensMode,
};
pub use parse::{parse_bytes, parse_duration};

/// Reads an environment variable (`api_keys_env`, `upstream_api_key_env`): the process's own in
/// [`ServeSettings::from_toml`], a given one in [`ServeSettings::from_toml_with_env`].
pub type Env = dyn Fn(&str) -> Option<String>;

/// The whole gateway configuration after validation: plain data, no live objects (the gateway
/// builds those once from it, see [`crate::live_config::ServeConfig`]).
#[derive(Debug, Clone)]
pub struct ServeSettings {
    pub listen: SocketAddr,
    pub api_keys: Vec<String>,
    pub max_inflight_total: Option<usize>,
    pub shutdown_grace: Duration,
    pub max_header_bytes: usize,
    /// Longest a client may take to send a request head, counted from the connection's start or
    /// from the head's first byte (nginx's `client_header_timeout`); past it the connection closes.
    pub client_header_timeout: Duration,
    /// Longest a connection may wait idle for its next request (nginx's `keepalive_timeout`).
    pub keepalive_timeout: Duration,
    /// Longest a write to the client may make no progress (nginx's `send_timeout`): a client that
    /// stops reading its response is dropped and its request's slot and memory freed.
    pub send_timeout: Duration,
    /// Most request-body bytes held in memory at once across all requests; `None`: the default
    /// for this machine (see [`ServeSettings::body_memory_cap`]).
    pub max_body_memory: Option<u64>,
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
    pub balancer: BalancerConfig,
    pub lanes: Vec<LaneSettings>,
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
    client_header_timeout: Option<String>,
    keepalive_timeout: Option<String>,
    send_timeout: Option<String>,
    max_body_memory: Option<toml::Value>,
    scrape_interval: Option<String>,
    scrape_timeout: Option<String>,
    worker_threads: Option<i64>,
    memory: Option<MemoryTable>,
    balancer: Option<BalancerTable>,
    #[serde(default)]
    lanes: Vec<RawLane>,
}

impl ServeSettings {
    /// Parses and validates a configuration file's text; errors name the key and its line.
    /// Environment variables it names are read from this process's environment.
    pub fn from_toml(text: &str) -> Result<ServeSettings, ConfigError> {
        Self::from_toml_with_env(text, &|var| std::env::var(var).ok())
    }

    /// [`ServeSettings::from_toml`], reading the variables it names with `env`.
    pub fn from_toml_with_env(text: &str, env: &Env) -> Result<ServeSettings, ConfigError> {
        Self::from_toml_unlocated(text, env).map_err(|e| with_line(text, e))
    }

    /// Validates a configuration already held as a TOML table (what `up` derives for its box):
    /// no text is written or parsed on the way. A refusal reads as [`ServeSettings::from_toml`]'s
    /// of the same table written out, which is written only then.
    pub fn from_table(table: toml::Table) -> Result<ServeSettings, ConfigError> {
        Self::from_table_with_env(table, &|var| std::env::var(var).ok())
    }

    /// [`ServeSettings::from_table`], reading the variables it names with `env`.
    pub fn from_table_with_env(
        table: toml::Table,
        env: &Env,
    ) -> Result<ServeSettings, ConfigError> {
        let written = |table: &toml::Table| toml::to_string(table).unwrap_or_default();
        match toml::Value::Table(table.clone()).try_into::<RawConfig>() {
            Ok(raw) => Self::from_raw(raw, env).map_err(|e| with_line(&written(&table), e)),
            // The same refusal, located in the table's text.
            Err(_) => Self::from_toml_with_env(&written(&table), env),
        }
    }

    fn from_toml_unlocated(text: &str, env: &Env) -> Result<ServeSettings, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        Self::from_raw(raw, env)
    }

    /// Validates what the user wrote, whatever it was read from.
    fn from_raw(raw: RawConfig, env: &Env) -> Result<ServeSettings, ConfigError> {
        let listen_text = raw.listen.as_deref().unwrap_or(DEFAULT_LISTEN);
        let listen = parse_listen(listen_text)?;
        let mut api_keys: Vec<String> =
            raw.api_keys.into_iter().filter(|k| !k.is_empty()).collect();
        if let Some(var) = raw.api_keys_env {
            let value = env(&var).ok_or_else(|| {
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
        // nginx's defaults: client_header_timeout 60s, keepalive_timeout 75s, send_timeout 60s.
        let client_header_timeout = duration(
            "client_header_timeout",
            raw.client_header_timeout.as_ref(),
            Duration::from_secs(60),
        )?;
        let keepalive_timeout = duration(
            "keepalive_timeout",
            raw.keepalive_timeout.as_ref(),
            Duration::from_secs(75),
        )?;
        let send_timeout = duration(
            "send_timeout",
            raw.send_timeout.as_ref(),
            Duration::from_secs(60),
        )?;
        for (key, value) in [
            ("client_header_timeout", client_header_timeout),
            ("keepalive_timeout", keepalive_timeout),
            ("send_timeout", send_timeout),
        ] {
            if value.is_zero() {
                return Err(key_err(key, "must be longer than 0"));
            }
        }
        let max_body_memory =
            match &raw.max_body_memory {
                None => None,
                Some(v) => Some(parse_bytes(v).filter(|b| *b > 0).ok_or_else(|| {
                    key_err("max_body_memory", "must be a size like 256MiB or 2GiB")
                })?),
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
        // The agent listener tells anyone who connects how loaded the box is, with no key of
        // its own: off loopback, the same rule as `listen`.
        if let Some(agent) = balancer.agent_listen
            && !agent.ip().is_loopback()
            && api_keys.is_empty()
        {
            return Err(key_err(
                "balancer.agent_listen",
                format!(
                    "{agent} is not loopback, so API keys are required as for `listen` (set api_keys or api_keys_env)"
                ),
            ));
        }
        let mut lanes = Vec::with_capacity(raw.lanes.len());
        let mut notes = Vec::new();
        for (i, lane) in raw.lanes.into_iter().enumerate() {
            lanes.push(lane_config(i, lane, &memory, env, &mut notes)?);
        }
        let config = ServeSettings {
            listen,
            api_keys,
            max_inflight_total,
            shutdown_grace,
            max_header_bytes,
            client_header_timeout,
            keepalive_timeout,
            send_timeout,
            max_body_memory,
            scrape_interval,
            scrape_timeout,
            worker_threads,
            memory,
            balancer,
            lanes,
            notes,
        };
        let largest = config.largest_body();
        if let Some(cap) = config.max_body_memory
            && cap < largest
        {
            return Err(key_err(
                "max_body_memory",
                format!(
                    "{cap} bytes is below the largest lane max_body_bytes ({largest}): such a body could never be read"
                ),
            ));
        }
        // Let the gate check what it owns (names, yield_to targets).
        headroom_gate::Gate::new(config.lane_specs(), max_inflight_total, None)
            .map_err(|e| key_err("lanes", e.to_string()))?;
        Ok(config)
    }

    /// The largest `max_body_bytes` of any lane.
    pub fn largest_body(&self) -> u64 {
        self.lanes
            .iter()
            .map(|l| l.max_body_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The cap on request-body bytes held in memory: `max_body_memory`, or by default four of
    /// the largest bodies a lane takes (at least 64 MiB), no more than an eighth of the
    /// machine's memory (`mem_total`, when known), and never below one largest body.
    pub fn body_memory_cap(&self, mem_total: Option<u64>) -> u64 {
        if let Some(cap) = self.max_body_memory {
            return cap;
        }
        let largest = self.largest_body();
        let wanted = largest.saturating_mul(4).max(64 << 20);
        let machine = mem_total.map_or(u64::MAX, |m| m / 8);
        wanted.min(machine).max(largest)
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

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_gate::{Outlier, PREEMPT_ALL, Policy};

    #[test]
    fn a_table_validates_as_its_written_text_does() {
        let none = |_: &str| None;
        let table: toml::Table = MINIMAL.parse().unwrap();
        let from_table = ServeSettings::from_table_with_env(table.clone(), &none).unwrap();
        let from_text = ServeSettings::from_toml_with_env(MINIMAL, &none).unwrap();
        assert_eq!(format!("{from_table:?}"), format!("{from_text:?}"));
        assert_eq!(from_table.lanes[0].spec.max_inflight, 2);
        // A refusal names the key and its line in the table written out (`up`'s derived lanes).
        let mut bad = table.clone();
        bad["lanes"].as_array_mut().unwrap()[0]
            .as_table_mut()
            .unwrap()
            .insert("max_inflight".into(), toml::Value::Integer(0));
        let written = toml::to_string(&bad).unwrap();
        let e = ServeSettings::from_table_with_env(bad.clone(), &none).unwrap_err();
        assert!(e.to_string().contains("max_inflight"), "{e}");
        assert!(e.to_string().contains("line "), "{e}");
        assert_eq!(
            e.to_string(),
            ServeSettings::from_toml_with_env(&written, &none)
                .unwrap_err()
                .to_string()
        );
        // So does a key serve does not know, which the table cannot even be read with.
        let mut unknown = table;
        unknown.insert("listne".into(), toml::Value::String("x".into()));
        let e = ServeSettings::from_table_with_env(unknown.clone(), &none).unwrap_err();
        let written = toml::to_string(&unknown).unwrap();
        assert!(e.to_string().contains("listne"), "{e}");
        assert_eq!(
            e.to_string(),
            ServeSettings::from_toml_with_env(&written, &none)
                .unwrap_err()
                .to_string()
        );
    }

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
        let c = ServeSettings::from_toml(MINIMAL).unwrap();
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
        let c = ServeSettings::from_toml(EXAMPLE_CONFIG).unwrap();
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
            "client_header_timeout",
            "keepalive_timeout",
            "send_timeout",
            "max_body_memory",
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
            "idempotent",
            "eject_after_failures",
            "base_ejection_time",
            "max_ejection_time",
            "max_ejection_percent",
        ] {
            assert!(
                EXAMPLE_CONFIG.contains(&format!("{key} =")),
                "example lacks {key}"
            );
        }
    }

    #[test]
    fn an_agent_listener_off_loopback_needs_api_keys_like_listen() {
        let lane =
            "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\n";
        let with = |top: &str, agent: &str| {
            format!("{top}\n[balancer]\nagent_listen = \"{agent}\"\n{lane}")
        };
        ServeSettings::from_toml(&with("", "127.0.0.1:9101")).unwrap();
        let e = ServeSettings::from_toml(&with("", "0.0.0.0:9101"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("balancer.agent_listen") && e.contains("API keys are required"),
            "{e}"
        );
        ServeSettings::from_toml(&with("api_keys = [\"k\"]", "0.0.0.0:9101")).unwrap();
    }

    #[test]
    fn passive_health_keys_default_like_the_docs_and_bad_values_name_the_key() {
        let lane = |extra: &str| {
            format!(
                "[[lanes]]\nname=\"t\"\npaths=[\"/v1/completions\"]\nupstreams=[\"http://a:1\"]\n{extra}"
            )
        };
        let l = ServeSettings::from_toml(&lane("")).unwrap().lanes.remove(0);
        assert!(!l.idempotent);
        assert_eq!(l.spec.outlier, Outlier::default());
        assert_eq!(l.spec.outlier.eject_after_failures, 3);
        assert_eq!(l.spec.outlier.base_ejection_time, Duration::from_secs(5));
        let l = ServeSettings::from_toml(&lane(
            "idempotent = true\neject_after_failures = 5\nbase_ejection_time = \"30s\"\nmax_ejection_percent = 10",
        ))
        .unwrap()
        .lanes
        .remove(0);
        assert!(l.idempotent);
        assert_eq!(l.spec.outlier.eject_after_failures, 5);
        assert_eq!(l.spec.outlier.base_ejection_time, Duration::from_secs(30));
        assert_eq!(l.spec.outlier.max_ejection_percent, 10);
        for (extra, key) in [
            ("eject_after_failures = 0", "eject_after_failures"),
            ("max_ejection_percent = 101", "max_ejection_percent"),
            ("base_ejection_time = \"0s\"", "base_ejection_time"),
            (
                "base_ejection_time = \"10s\"\nmax_ejection_time = \"5s\"",
                "max_ejection_time",
            ),
        ] {
            let e = ServeSettings::from_toml(&lane(extra))
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{extra}: {e}");
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
        let first = |text: &str| ServeSettings::from_toml(text).unwrap().lanes.remove(0);
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
            let err = ServeSettings::from_toml(text).unwrap_err().to_string();
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
