//! headroom-hub: what `plan` needs of a model that is not on disk, read from the Hugging Face Hub
//! without its weights. One revision's file list (`/api/models/{repo}/revision/{rev}`), its
//! `config.json` and `model.safetensors.index.json` whole, and of each safetensors shard only the
//! header: an HTTP range request for the first bytes (an 8-byte little-endian length, then that
//! many bytes of JSON), and a second one when the header is longer. Everything is written into the
//! Hugging Face cache layout (`models--ORG--NAME/blobs`, `snapshots/<commit>`, `refs/<rev>`), so
//! the next plan finds it offline.
//!
//! A header is not a shard. It is stored as `blobs/<etag>.headroom-header` and linked from
//! `snapshots/<commit>/<shard>.headroom-header`: no file of the real shard's name or etag is
//! created, so huggingface_hub, vLLM and every `*.safetensors` glob still see the shard as absent
//! and download it in full; `headroom-inspect` reads the header files as what they are.
//!
//! Hub behaviour mirrored (huggingface_hub's `file_download.py` and `utils/_http.py`): resolve
//! URLs `{endpoint}/{repo}/resolve/{rev}/{file}`; the commit in `X-Repo-Commit`; the blob name from
//! `X-Linked-Etag` (large files, whose answer is a redirect to a CDN) or `ETag`, without `W/` and
//! quotes; redirects followed by hand, the token sent only to the Hub's own host; `X-Error-Code`
//! (`RepoNotFound`, `GatedRepo`, `RevisionNotFound`, `EntryNotFound`) telling a 401/404 apart.
//! `HF_ENDPOINT`, `HF_TOKEN` (else the token file `huggingface-cli login` writes) and
//! `HF_HUB_OFFLINE` are honoured.

mod cache;
mod client;
#[cfg(feature = "test-server")]
pub mod testing;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use cache::HEADER_SUFFIX;

/// The public Hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Bytes asked for in the first range request of a shard: most headers fit, so one request each.
pub const FIRST_RANGE_BYTES: u64 = 256 * 1024;

/// Why the Hub could not describe a model.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    #[error("HF_HUB_OFFLINE is set, so the Hub ({endpoint}) was not asked")]
    Offline { endpoint: String },
    #[error("could not reach the Hub: GET {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("the Hub has no model '{repo}' (GET {url}: {status}{})", if *.had_token { "" } else { "; a private repository needs HF_TOKEN" })]
    NotFound {
        repo: String,
        url: String,
        status: u16,
        had_token: bool,
    },
    #[error("'{repo}' is gated on the Hub (GET {url}: {status}): {}", if *.had_token { "accept its terms on its Hub page with the account whose HF_TOKEN is set" } else { "accept its terms on its Hub page and set HF_TOKEN" })]
    Gated {
        repo: String,
        url: String,
        status: u16,
        had_token: bool,
    },
    #[error("GET {url}: HTTP {status}")]
    Status { url: String, status: u16 },
    #[error("GET {url}: {reason}")]
    Malformed { url: String, reason: String },
    #[error("cannot write the Hugging Face cache at {path}: {reason}")]
    Io { path: String, reason: String },
}

/// Where and how to ask.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `HF_ENDPOINT`, else [`DEFAULT_ENDPOINT`]; no trailing slash.
    pub endpoint: String,
    pub token: Option<String>,
    /// The hub cache to write into (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
    /// `HF_HUB_OFFLINE` set to a true value: nothing is asked.
    pub offline: bool,
    /// Limit for each request.
    pub timeout: Duration,
}

impl HubConfig {
    /// From environment values (`var` returns a variable's value, `None` when unset or empty).
    /// `None` when no cache directory can be named.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Option<HubConfig> {
        let env = headroom_inspect::resolve::Env {
            hf_hub_cache: var("HF_HUB_CACHE").map(PathBuf::from),
            hf_home: var("HF_HOME").map(PathBuf::from),
            home: var("HOME").map(PathBuf::from),
        };
        let cache_dir = env.hub_cache_dir()?;
        let token = var("HF_TOKEN")
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| token_file(&var, &env));
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "on" | "yes" | "true"
            )
        });
        Some(HubConfig {
            endpoint: var("HF_ENDPOINT")
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
                .trim_end_matches('/')
                .to_string(),
            token: token
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty()),
            cache_dir,
            offline,
            timeout: Duration::from_secs(30),
        })
    }

    /// From this process's environment.
    pub fn from_process() -> Option<HubConfig> {
        HubConfig::from_env(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }
}

/// The token `huggingface-cli login` stores: `$HF_TOKEN_PATH`, else `$HF_HOME/token`, else
/// `~/.cache/huggingface/token`.
fn token_file(
    var: &impl Fn(&str) -> Option<String>,
    env: &headroom_inspect::resolve::Env,
) -> Option<String> {
    let path = var("HF_TOKEN_PATH").map(PathBuf::from).or_else(|| {
        env.hf_home.as_ref().map(|h| h.join("token")).or_else(|| {
            env.home
                .as_ref()
                .map(|h| h.join(".cache/huggingface/token"))
        })
    })?;
    std::fs::read_to_string(path).ok()
}

/// What was read and where it was kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetched {
    pub repo: String,
    pub commit: String,
    /// `snapshots/<commit>` in the cache: resolve the model from here.
    pub snapshot: PathBuf,
    /// Safetensors shards whose headers were read.
    pub shards: Vec<String>,
    /// Bytes received for all the shards' headers together.
    pub header_bytes: u64,
}

/// `ORG/NAME` ids the Hub can have: two non-empty parts of letters, digits, `-`, `_`, `.`.
pub fn is_hub_id(name: &str) -> bool {
    let Some((org, repo)) = name.split_once('/') else {
        return false;
    };
    let ok = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    ok(org) && ok(repo) && !repo.contains("..")
}

/// Reads `repo`'s description at `revision` into the cache (see the module docs).
pub async fn fetch(cfg: &HubConfig, repo: &str, revision: &str) -> Result<Fetched, HubError> {
    if cfg.offline {
        return Err(HubError::Offline {
            endpoint: cfg.endpoint.clone(),
        });
    }
    let hub = client::Hub::new(cfg, repo)?;
    let info = hub.revision_info(revision).await?;
    let layout = cache::Layout::new(&cfg.cache_dir, repo, &info.commit);
    let config = hub.whole_file(&info.commit, "config.json").await?;
    let shards = if info.files.iter().any(|f| f == cache::INDEX) {
        let index = hub.whole_file(&info.commit, cache::INDEX).await?;
        layout.store_file(cache::INDEX, &index.etag, &index.bytes)?;
        index_shards(&index.bytes).map_err(|reason| HubError::Malformed {
            url: hub.resolve_url(&info.commit, cache::INDEX),
            reason,
        })?
    } else {
        info.files
            .iter()
            .filter(|f| f.ends_with(".safetensors") && !f.contains('/'))
            .cloned()
            .collect()
    };
    let mut header_bytes = 0;
    for shard in &shards {
        let header = hub.safetensors_header(&info.commit, shard).await?;
        header_bytes += header.bytes.len() as u64;
        layout.store_header(shard, &header.etag, &header.bytes)?;
    }
    // config.json last: a snapshot is found in the cache by it, so a fetch cut short leaves
    // nothing that would be planned from half the headers (the next plan asks the Hub again).
    layout.store_file("config.json", &config.etag, &config.bytes)?;
    if revision != info.commit {
        layout.store_ref(revision)?;
    }
    Ok(Fetched {
        repo: repo.to_string(),
        commit: info.commit.clone(),
        snapshot: layout.snapshot_dir(),
        shards,
        header_bytes,
    })
}

/// [`fetch`] on a runtime of its own, for callers that are not async.
pub fn fetch_blocking(cfg: &HubConfig, repo: &str, revision: &str) -> Result<Fetched, HubError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| HubError::Io {
            path: "(async runtime)".into(),
            reason: e.to_string(),
        })?;
    runtime.block_on(fetch(cfg, repo, revision))
}

/// The shards a `model.safetensors.index.json` names, sorted, each once.
fn index_shards(bytes: &[u8]) -> Result<Vec<String>, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
    let map = v
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or("no weight_map")?;
    let mut shards: Vec<String> = map
        .values()
        .filter_map(|s| s.as_str().map(String::from))
        .collect();
    shards.sort();
    shards.dedup();
    if shards.iter().any(|s| !safe_relative(s)) {
        return Err("a shard name leaves the repository".into());
    }
    Ok(shards)
}

/// A relative path inside a repository: no `..`, no absolute path, no backslash.
fn safe_relative(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('/')
        && !name.contains('\\')
        && Path::new(name)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_two_plain_parts() {
        assert!(is_hub_id("Qwen/Qwen3-8B"));
        assert!(is_hub_id("meta-llama/Llama-3.1-8B-Instruct"));
        for bad in ["llama", "a/b/c", "/x", "a/", "../x", "a/..", "a/b c", "./m"] {
            assert!(!is_hub_id(bad), "{bad}");
        }
    }

    #[test]
    fn config_from_env_reads_the_endpoint_token_and_offline_switch() {
        let vars = |k: &str| -> Option<String> {
            match k {
                "HF_ENDPOINT" => Some("http://127.0.0.1:9/".into()),
                "HF_TOKEN" => Some(" hf_abc \n".into()),
                "HF_HOME" => Some("/tmp/hfhome".into()),
                "HF_HUB_OFFLINE" => Some("TRUE".into()),
                _ => None,
            }
        };
        let c = HubConfig::from_env(vars).unwrap();
        assert_eq!(c.endpoint, "http://127.0.0.1:9");
        assert_eq!(c.token.as_deref(), Some("hf_abc"));
        assert_eq!(c.cache_dir, PathBuf::from("/tmp/hfhome/hub"));
        assert!(c.offline);
        let none = HubConfig::from_env(|k| (k == "HOME").then(|| "/h".to_string())).unwrap();
        assert_eq!(none.endpoint, DEFAULT_ENDPOINT);
        assert_eq!(none.cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
        assert!(!none.offline);
    }

    #[test]
    fn index_shards_are_sorted_unique_and_stay_inside_the_repository() {
        let idx = br#"{"weight_map":{"a":"m-2.safetensors","b":"m-1.safetensors","c":"m-2.safetensors"}}"#;
        assert_eq!(
            index_shards(idx).unwrap(),
            vec!["m-1.safetensors", "m-2.safetensors"]
        );
        assert!(index_shards(br#"{"weight_map":{"a":"../../x.safetensors"}}"#).is_err());
        assert!(index_shards(br#"{"weight_map":{"a":"/etc/x"}}"#).is_err());
        assert!(index_shards(b"nope").is_err());
    }
}
