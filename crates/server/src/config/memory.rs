//! The `[memory]` table, shared by `serve`'s config and `up`'s box file: which pool memory
//! admission reads (an NVML device, or the host pool of watched upstream process trees), its
//! capacity and margin, how often it is sampled, when a reservation counts as visible, and how
//! job peaks are learned and saved.
//!
//! ```toml
//! [memory]
//! probe = "host"                      # "nvml" (a GPU through NVML) or "host" (process-tree RSS)
//! device = 0                          # NVML device index (nvml only)
//! capacity = "8GiB"                   # pool size; required for host, a cap below the card for nvml
//! margin = "512MiB"                   # always left free
//! watch = ["http://127.0.0.1:8001"]   # upstreams whose listening process trees are the pool (host)
//! sample_interval = "25ms"            # sampler period (20 Hz or faster: 50ms at most)
//! settle = "3s"                       # reserved-but-unused counts as visible this long after growth stops
//! stale_after = "500ms"               # older readings count as no reading (lanes' gpu_fail_open)
//! learn_quantile = 0.95               # quantile of observed job peaks a learned need covers
//! learn_min_samples = 8               # jobs measured before a learned need replaces the figure
//! calibration = "calibration.json"    # learned needs are saved here and read back at start
//! enforce = true                      # headroom up only: capacity is a hard limit (one memory cgroup)
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::ConfigError;
use super::parse::{parse_bytes, parse_duration};

/// Which memory a pool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeKind {
    /// One GPU, read through NVML.
    Nvml,
    /// Host memory used by the watched upstreams' process trees (no GPU, or unified memory).
    Host,
}

impl ProbeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProbeKind::Nvml => "nvml",
            ProbeKind::Host => "host",
        }
    }
}

/// The `[memory]` table as written (keys documented in the module doc). `up` embeds this in its
/// box file and calls [`MemoryTable::validate`].
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryTable {
    pub probe: Option<String>,
    pub device: Option<i64>,
    pub capacity: Option<toml::Value>,
    pub margin: Option<toml::Value>,
    #[serde(default)]
    pub watch: Vec<String>,
    pub sample_interval: Option<String>,
    pub settle: Option<String>,
    pub stale_after: Option<String>,
    pub learn_quantile: Option<f64>,
    pub learn_min_samples: Option<i64>,
    pub calibration: Option<String>,
    pub enforce: Option<bool>,
}

/// The `[memory]` table after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryConfig {
    pub probe: ProbeKind,
    /// NVML device index (the pool's device; lanes may name another with `gpu_device`).
    pub device: u32,
    /// Pool size in bytes. Host: required. NVML: optional cap below the card's total.
    pub capacity: Option<u64>,
    /// Bytes always left free, on top of each job's need.
    pub margin: u64,
    /// Upstream base URLs (`http://HOST:PORT`) whose listening processes, with their whole
    /// process trees, make up the host pool's use.
    pub watch: Vec<String>,
    /// Sampler period; readings are pushed to the gate at this rate.
    pub sample_interval: Duration,
    /// A reservation counts as wholly visible this long after its measured use last grew (after
    /// admission where the owner's use cannot be measured).
    pub settle: Duration,
    /// A reading older than this counts as none (lanes follow `gpu_fail_open`).
    pub stale_after: Duration,
    pub learn_quantile: f64,
    pub learn_min_samples: usize,
    /// Calibration file the learned needs are saved to and read back from.
    pub calibration: Option<PathBuf>,
    /// `headroom up` only: run every backend in one memory cgroup whose hard limit is
    /// `capacity` (the kernel OOM-kills inside it past the limit, as a card would), and read the
    /// pool's use from that cgroup.
    pub enforce: bool,
    /// Test-only (no TOML key): admit on the reading alone, ignoring reservations, so a test
    /// can show the old comparison over-commits.
    #[doc(hidden)]
    pub ignore_reservations: bool,
}

/// Longest sampler period: learning needs 20 Hz or faster.
pub const MAX_SAMPLE_INTERVAL: Duration = Duration::from_millis(50);
/// Shortest sampler period.
pub const MIN_SAMPLE_INTERVAL: Duration = Duration::from_millis(5);

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            probe: ProbeKind::Nvml,
            device: 0,
            capacity: None,
            margin: 0,
            watch: Vec::new(),
            sample_interval: Duration::from_millis(50),
            settle: Duration::from_secs(5),
            stale_after: Duration::from_secs(1),
            learn_quantile: 0.95,
            learn_min_samples: 8,
            calibration: None,
            enforce: false,
            ignore_reservations: false,
        }
    }
}

fn key_err(key: String, message: impl Into<String>) -> ConfigError {
    ConfigError::Key {
        key,
        message: message.into(),
        line: None,
    }
}

/// Checks an upstream base URL the way lanes do and returns it without a trailing slash.
pub(crate) fn upstream_url(u: &str) -> Option<String> {
    let trimmed = u.trim_end_matches('/');
    trimmed
        .strip_prefix("http://")
        .is_some_and(|rest| !rest.is_empty() && !rest.contains('/'))
        .then(|| trimmed.to_string())
}

impl MemoryTable {
    /// Validates the table; `prefix` is the table's key in error messages (`memory`).
    pub fn validate(self, prefix: &str) -> Result<MemoryConfig, ConfigError> {
        let k = |key: &str| format!("{prefix}.{key}");
        let d = MemoryConfig::default();
        let probe = match self.probe.as_deref() {
            None | Some("nvml") => ProbeKind::Nvml,
            Some("host") => ProbeKind::Host,
            Some(other) => {
                return Err(key_err(
                    k("probe"),
                    format!("`{other}` is not nvml or host"),
                ));
            }
        };
        let device = match self.device {
            None => 0,
            Some(i) if (0..=u32::MAX as i64).contains(&i) => i as u32,
            Some(_) => return Err(key_err(k("device"), "must be a device index (0 or more)")),
        };
        let size = |key: &str, v: &Option<toml::Value>| -> Result<Option<u64>, ConfigError> {
            match v {
                None => Ok(None),
                Some(v) => parse_bytes(v).map(Some).ok_or_else(|| {
                    key_err(k(key), "must be a byte count or a size like 512MiB or 2GiB")
                }),
            }
        };
        let capacity = size("capacity", &self.capacity)?;
        if capacity == Some(0) {
            return Err(key_err(k("capacity"), "must be larger than 0"));
        }
        let margin = size("margin", &self.margin)?.unwrap_or(0);
        if let Some(c) = capacity
            && margin >= c
        {
            return Err(key_err(k("margin"), "must be smaller than capacity"));
        }
        if probe == ProbeKind::Host && capacity.is_none() {
            return Err(key_err(
                k("capacity"),
                "probe = \"host\" needs a capacity (the memory the watched upstreams may use together)",
            ));
        }
        let mut watch = Vec::new();
        for u in &self.watch {
            let url = upstream_url(u).ok_or_else(|| {
                key_err(
                    k("watch"),
                    format!("`{u}` must look like http://HOST:PORT (plain HTTP, no path)"),
                )
            })?;
            watch.push(url);
        }
        if probe == ProbeKind::Host && watch.is_empty() {
            return Err(key_err(
                k("watch"),
                "probe = \"host\" needs the upstream URLs whose processes make up the pool",
            ));
        }
        let duration = |key: &str, v: &Option<String>, default: Duration| match v {
            None => Ok(default),
            Some(s) => parse_duration(s).ok_or_else(|| {
                key_err(
                    k(key),
                    format!("`{s}` is not a duration like 500ms, 5s or 2m"),
                )
            }),
        };
        let sample_interval =
            duration("sample_interval", &self.sample_interval, d.sample_interval)?;
        if !(MIN_SAMPLE_INTERVAL..=MAX_SAMPLE_INTERVAL).contains(&sample_interval) {
            return Err(key_err(
                k("sample_interval"),
                "must be between 5ms and 50ms (job peaks are learned from 20 Hz or faster)",
            ));
        }
        let settle = duration("settle", &self.settle, d.settle)?;
        let stale_after = duration("stale_after", &self.stale_after, d.stale_after)?;
        if stale_after < sample_interval {
            return Err(key_err(
                k("stale_after"),
                "must be at least one sample_interval",
            ));
        }
        let enforce = self.enforce.unwrap_or(false);
        if enforce && probe != ProbeKind::Host {
            return Err(key_err(
                k("enforce"),
                "needs probe = \"host\" (a GPU enforces its own memory: past it, allocations fail)",
            ));
        }
        let learn_quantile = self.learn_quantile.unwrap_or(d.learn_quantile);
        if !(learn_quantile > 0.0 && learn_quantile <= 1.0) {
            return Err(key_err(
                k("learn_quantile"),
                "must be a fraction above 0 and at most 1",
            ));
        }
        let learn_min_samples = match self.learn_min_samples {
            None => d.learn_min_samples,
            Some(n) if (1..=10_000).contains(&n) => n as usize,
            Some(_) => return Err(key_err(k("learn_min_samples"), "must be 1 to 10000")),
        };
        Ok(MemoryConfig {
            probe,
            device,
            capacity,
            margin,
            watch,
            sample_interval,
            settle,
            stale_after,
            learn_quantile,
            learn_min_samples,
            calibration: self.calibration.map(PathBuf::from),
            enforce,
            ignore_reservations: false,
        })
    }
}

impl MemoryConfig {
    /// The table as `serve` reads it (what `up` writes into the config of the `serve` it starts;
    /// `enforce` stays with `up`, which runs the cgroup and hands serve its probe).
    pub fn to_toml(&self) -> String {
        let mut out = String::from("[memory]\n");
        let quote = |s: &str| toml::Value::String(s.to_string()).to_string();
        out.push_str(&format!("probe = {}\n", quote(self.probe.as_str())));
        out.push_str(&format!("device = {}\n", self.device));
        if let Some(c) = self.capacity {
            out.push_str(&format!("capacity = {c}\n"));
        }
        out.push_str(&format!("margin = {}\n", self.margin));
        let watch: Vec<String> = self.watch.iter().map(|u| quote(u)).collect();
        out.push_str(&format!("watch = [{}]\n", watch.join(", ")));
        let ms = |d: Duration| quote(&format!("{}ms", d.as_millis()));
        out.push_str(&format!("sample_interval = {}\n", ms(self.sample_interval)));
        out.push_str(&format!("settle = {}\n", ms(self.settle)));
        out.push_str(&format!("stale_after = {}\n", ms(self.stale_after)));
        out.push_str(&format!("learn_quantile = {}\n", self.learn_quantile));
        out.push_str(&format!("learn_min_samples = {}\n", self.learn_min_samples));
        if let Some(p) = &self.calibration {
            out.push_str(&format!("calibration = {}\n", quote(&p.to_string_lossy())));
        }
        out
    }

    /// The same keys as [`MemoryConfig::to_toml`], as the `[memory]` table's value (what `up`
    /// hands `serve` with the lanes it derives, no text on the way).
    pub fn to_table(&self) -> toml::Table {
        use toml::Value;
        let mut t = toml::Table::new();
        let int = |n: u64| Value::Integer(i64::try_from(n).unwrap_or(i64::MAX));
        let ms = |d: Duration| Value::String(format!("{}ms", d.as_millis()));
        t.insert("probe".into(), Value::String(self.probe.as_str().into()));
        t.insert("device".into(), int(u64::from(self.device)));
        if let Some(c) = self.capacity {
            t.insert("capacity".into(), int(c));
        }
        t.insert("margin".into(), int(self.margin));
        let watch = self
            .watch
            .iter()
            .map(|u| Value::String(u.clone()))
            .collect();
        t.insert("watch".into(), Value::Array(watch));
        t.insert("sample_interval".into(), ms(self.sample_interval));
        t.insert("settle".into(), ms(self.settle));
        t.insert("stale_after".into(), ms(self.stale_after));
        t.insert("learn_quantile".into(), Value::Float(self.learn_quantile));
        t.insert(
            "learn_min_samples".into(),
            int(self.learn_min_samples as u64),
        );
        if let Some(p) = &self.calibration {
            t.insert(
                "calibration".into(),
                Value::String(p.to_string_lossy().into_owned()),
            );
        }
        t
    }

    /// The `RejectReason` code family this pool's refusals use.
    pub fn is_host(&self) -> bool {
        self.probe == ProbeKind::Host
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<MemoryConfig, ConfigError> {
        let t: MemoryTable = toml::from_str(text).map_err(|e| ConfigError::Toml(e.to_string()))?;
        t.validate("memory")
    }

    #[test]
    fn the_table_holds_what_the_text_says() {
        let c = parse(
            "probe = \"host\"\ncapacity = \"1GiB\"\nmargin = \"64MiB\"\nwatch = [\"http://127.0.0.1:1\"]\ncalibration = \"/tmp/c.json\"\n",
        )
        .unwrap();
        let text: toml::Table = c.to_toml().parse().unwrap();
        assert_eq!(Some(&toml::Value::Table(c.to_table())), text.get("memory"));
        let back: MemoryTable = toml::Value::Table(c.to_table()).try_into().unwrap();
        assert_eq!(back.validate("memory").unwrap(), c);
        assert_eq!(c.to_table()["capacity"], toml::Value::Integer(1 << 30));
    }

    #[test]
    fn host_pool_parses_and_round_trips() {
        let c = parse(
            "probe = \"host\"\ncapacity = \"2GiB\"\nmargin = \"128MiB\"\nwatch = [\"http://127.0.0.1:9/\"]\nsample_interval = \"20ms\"\nsettle = \"2s\"\ncalibration = \"cal.json\"\n",
        )
        .unwrap();
        assert_eq!(c.probe, ProbeKind::Host);
        assert_eq!(c.capacity, Some(2 << 30));
        assert_eq!(c.margin, 128 << 20);
        assert_eq!(c.watch, vec!["http://127.0.0.1:9"]);
        assert_eq!(c.sample_interval, Duration::from_millis(20));
        assert_eq!(c.settle, Duration::from_secs(2));
        let again: MemoryTable = toml::from_str(
            c.to_toml()
                .strip_prefix("[memory]\n")
                .expect("table header"),
        )
        .unwrap();
        assert_eq!(again.validate("memory").unwrap(), c);
    }

    #[test]
    fn enforce_is_a_host_pool_key_that_serve_is_not_handed() {
        let c = parse(
            "probe = \"host\"\ncapacity = \"1GiB\"\nwatch = [\"http://127.0.0.1:9\"]\nenforce = true\n",
        )
        .unwrap();
        assert!(c.enforce);
        assert!(!c.to_toml().contains("enforce"), "{}", c.to_toml());
        assert!(!c.to_table().contains_key("enforce"));
        let nvml = parse("probe = \"nvml\"\nenforce = true\n").unwrap_err();
        assert!(nvml.to_string().contains("probe = \"host\""), "{nvml}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (text, want) in [
            ("probe = \"rocm\"", "memory.probe"),
            (
                "probe = \"host\"\nwatch = [\"http://a:1\"]",
                "memory.capacity",
            ),
            ("probe = \"host\"\ncapacity = \"1GiB\"", "memory.watch"),
            (
                "probe = \"host\"\ncapacity = \"1GiB\"\nwatch = [\"https://a\"]",
                "memory.watch",
            ),
            ("capacity = \"1GiB\"\nmargin = \"2GiB\"", "memory.margin"),
            ("sample_interval = \"200ms\"", "memory.sample_interval"),
            ("learn_quantile = 1.5", "memory.learn_quantile"),
            ("learn_min_samples = 0", "memory.learn_min_samples"),
            ("device = -1", "memory.device"),
            ("bogus = 1", "unknown field"),
            ("enforce = true", "memory.enforce"),
            ("enforce = \"yes\"", "enforce"),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(want), "{text:?} gave {err:?}, wanted {want:?}");
        }
    }
}
