//! Why a configuration was refused: [`ConfigError`], with the offending key, the line it is
//! written on and, for a typo, the nearest known key.

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
pub(super) fn with_line(text: &str, e: ConfigError) -> ConfigError {
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

/// One readable error for a TOML or schema failure: the line, the key, and what to write
/// instead (the nearest known key for a typo, a quoted duration for `queue_timeout = 5`).
pub(super) fn toml_error(text: &str, e: &toml::de::Error) -> ConfigError {
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
const DURATION_KEYS: [&str; 13] = [
    "shutdown_grace",
    "client_header_timeout",
    "keepalive_timeout",
    "send_timeout",
    "scrape_interval",
    "scrape_timeout",
    "queue_timeout",
    "request_timeout",
    "max_yield",
    "yield_linger",
    "engine_metrics_stale_after",
    "base_ejection_time",
    "max_ejection_time",
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
