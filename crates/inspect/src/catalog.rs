//! The built-in catalog, embedded at build time: models (real config.json values with their
//! sources), GPUs (total memory as the driver reports it) and audio co-tenant reservation profiles.
//! Lookups forgive case, punctuation, vendor prefixes and organisation names.

use std::sync::OnceLock;

use headroom_plan::{ExactWeights, ModelSpec, WeightsOrigin, units::MIB};
use serde::Deserialize;
use serde_json::Value;

use crate::InspectError;
use crate::config::spec_from_config;

const MODELS_JSON: &str = include_str!("../data/models.json");
const GPUS_JSON: &str = include_str!("../data/gpus.json");
const RESERVE_JSON: &str = include_str!("../data/reserve.json");

/// The driver keeps part of the card to itself; CUDA (and so vLLM) sees the rest. Used when a
/// catalog entry has no measured CUDA total. vLLM logs `total_gpu_memory` 23.58 GiB on 24,564 MiB
/// RTX 4090s and 24,576 MiB RTX 3090s, and 79.22 GiB on 81,559 MiB H100s: 0.41–0.43 GiB less.
pub const DRIVER_RESERVED_BYTES: u64 = 420 * MIB;

#[derive(Debug, Clone, Deserialize)]
pub struct CatalogModel {
    pub id: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    #[serde(default)]
    pub kind: Option<String>,
    pub source: String,
    #[serde(default)]
    pub weights_bytes: Option<u64>,
    #[serde(default)]
    pub weights_source: Option<String>,
    pub config: Value,
    /// Another entry whose config fills the keys this one lacks (a quantized variant of the
    /// same architecture).
    #[serde(default)]
    pub inherits: Option<String>,
    /// Parameters outside the decoder (VibeVoice's audio tokenizers, connectors and heads) and the
    /// dtype the serving engine holds them in, when it differs from the checkpoint's.
    #[serde(default)]
    pub extra_params: Option<u64>,
    #[serde(default)]
    pub extra_dtype: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CatalogGpu {
    pub name: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    pub total_bytes: u64,
    #[serde(default)]
    pub cuda_total_bytes: Option<u64>,
    pub source: String,
}

impl CatalogGpu {
    /// Memory CUDA reports as total, which is what vLLM multiplies by its utilization.
    pub fn cuda_visible_bytes(&self) -> u64 {
        self.cuda_total_bytes
            .unwrap_or(self.total_bytes.saturating_sub(DRIVER_RESERVED_BYTES))
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ReserveProfile {
    pub name: String,
    #[serde(default)]
    pub aliases: Vec<String>,
    pub stack: String,
    pub bytes: u64,
    pub why: String,
    pub source: String,
}

#[derive(Deserialize)]
struct Models {
    models: Vec<CatalogModel>,
}
#[derive(Deserialize)]
struct Gpus {
    gpus: Vec<CatalogGpu>,
}
#[derive(Deserialize)]
struct Profiles {
    profiles: Vec<ReserveProfile>,
}

/// Every catalog model.
pub fn models() -> &'static [CatalogModel] {
    static CELL: OnceLock<Vec<CatalogModel>> = OnceLock::new();
    CELL.get_or_init(|| {
        serde_json::from_str::<Models>(MODELS_JSON)
            .expect("embedded models.json is valid (checked by tests)")
            .models
    })
}

/// Every catalog GPU.
pub fn gpus() -> &'static [CatalogGpu] {
    static CELL: OnceLock<Vec<CatalogGpu>> = OnceLock::new();
    CELL.get_or_init(|| {
        serde_json::from_str::<Gpus>(GPUS_JSON)
            .expect("embedded gpus.json is valid (checked by tests)")
            .gpus
    })
}

/// Every reservation profile.
pub fn reserve_profiles() -> &'static [ReserveProfile] {
    static CELL: OnceLock<Vec<ReserveProfile>> = OnceLock::new();
    CELL.get_or_init(|| {
        serde_json::from_str::<Profiles>(RESERVE_JSON)
            .expect("embedded reserve.json is valid (checked by tests)")
            .profiles
    })
}

/// Lower-case alphanumerics only: `NVIDIA GeForce RTX 4090` → `nvidiageforcertx4090`.
pub fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

fn model_keys(m: &CatalogModel) -> impl Iterator<Item = String> + '_ {
    let short = m.id.rsplit('/').next().unwrap_or(&m.id).to_string();
    std::iter::once(normalize(&m.id))
        .chain(std::iter::once(normalize(&short)))
        .chain(m.aliases.iter().map(|a| normalize(a)))
}

/// Finds a catalog model by id, short name or alias.
pub fn find_model(name: &str) -> Option<&'static CatalogModel> {
    let key = normalize(name);
    if key.is_empty() {
        return None;
    }
    models().iter().find(|m| model_keys(m).any(|k| k == key))
}

/// The catalog model as a spec.
pub fn model_spec(m: &CatalogModel) -> Result<ModelSpec, InspectError> {
    let mut config = m.config.clone();
    if let Some(base) = m.inherits.as_deref().and_then(find_model)
        && let (Some(own), Some(inherited)) = (config.as_object_mut(), base.config.as_object())
    {
        for (k, v) in inherited {
            own.entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
    let mut spec = spec_from_config(&m.id, &m.source, &config)?;
    spec.source = format!("built-in catalog ({})", m.source);
    if let Some(bytes) = m.weights_bytes {
        spec.exact_weights = Some(ExactWeights {
            bytes,
            origin: WeightsOrigin::Catalog,
        });
    }
    if let Some(n) = m.extra_params {
        spec.extra_params = n;
    }
    if let Some(d) = m.extra_dtype.as_deref() {
        spec.extra_dtype =
            headroom_plan::Dtype::parse(d).ok_or_else(|| InspectError::Malformed {
                file: "catalog models.json".into(),
                reason: format!("{}: unknown extra_dtype '{d}'", m.id),
            })?;
    }
    Ok(spec)
}

/// Finds a GPU forgivingly: `RTX 4090`, `4090`, `NVIDIA GeForce RTX 4090`, `h100`.
pub fn find_gpu(name: &str) -> Option<&'static CatalogGpu> {
    let key = normalize(name);
    if key.is_empty() {
        return None;
    }
    let stripped = key
        .trim_start_matches("nvidia")
        .trim_start_matches("geforce")
        .to_string();
    let keys = |g: &'static CatalogGpu| {
        std::iter::once(normalize(&g.name))
            .chain(g.aliases.iter().map(|a| normalize(a)))
            .map(|k| {
                k.trim_start_matches("nvidia")
                    .trim_start_matches("geforce")
                    .to_string()
            })
            .collect::<Vec<_>>()
    };
    gpus()
        .iter()
        .find(|g| keys(g).contains(&stripped))
        .or_else(|| {
            // "rtx4090" → "4090": drop the product-line prefix as well.
            let bare = stripped
                .trim_start_matches("rtx")
                .trim_start_matches("tesla");
            gpus().iter().find(|g| {
                keys(g)
                    .iter()
                    .any(|k| k.trim_start_matches("rtx").trim_start_matches("tesla") == bare)
            })
        })
}

/// Finds a reservation profile by name or alias.
pub fn find_profile(name: &str) -> Option<&'static ReserveProfile> {
    let key = normalize(name);
    reserve_profiles()
        .iter()
        .find(|p| normalize(&p.name) == key || p.aliases.iter().any(|a| normalize(a) == key))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The `n` catalog names closest to `name` (ids), nearest first.
pub fn closest_models(name: &str, n: usize) -> Vec<String> {
    let key = normalize(name);
    let mut scored: Vec<(usize, &str)> = models()
        .iter()
        .map(|m| {
            let d = model_keys(m)
                .map(|k| {
                    let base = edit_distance(&key, &k);
                    // A shared substring is a strong hint ("qwen7b" vs "qwen25-7b-instruct").
                    if !key.is_empty() && (k.contains(&key) || key.contains(&k)) {
                        base / 4
                    } else {
                        base
                    }
                })
                .min()
                .unwrap_or(usize::MAX);
            (d, m.id.as_str())
        })
        .collect();
    scored.sort();
    scored
        .into_iter()
        .take(n)
        .map(|(_, id)| id.to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_plan::kv::{KvCacheDtype, KvLayout, KvSettings};

    #[test]
    fn every_catalog_model_becomes_a_spec() {
        assert!(models().len() >= 30);
        for m in models() {
            let spec = model_spec(m).unwrap_or_else(|e| panic!("{}: {e}", m.id));
            assert!(spec.num_layers > 0 && spec.hidden_size > 0, "{}", m.id);
            assert!(m.source.len() > 10, "{} names its source", m.id);
        }
    }

    #[test]
    fn catalog_kv_figures_match_the_published_arithmetic() {
        let per_token = |id: &str, tp: u64| {
            let spec = model_spec(find_model(id).unwrap()).unwrap();
            KvLayout::new(
                &spec,
                KvSettings {
                    dtype: KvCacheDtype::Auto,
                    tensor_parallel_size: tp,
                    block_size: 16,
                    hybrid_manager: true,
                },
            )
            .bytes_per_token()
        };
        assert_eq!(per_token("meta-llama/Llama-3.1-8B-Instruct", 1), 131_072);
        assert_eq!(per_token("Qwen/Qwen2.5-7B-Instruct", 1), 57_344);
        assert_eq!(per_token("deepseek-ai/DeepSeek-V2-Lite-Chat", 1), 31_104);
        assert_eq!(per_token("meta-llama/Llama-3.1-70B-Instruct", 4), 81_920);
    }

    #[test]
    fn gpus_match_forgivingly() {
        let g = find_gpu("RTX 4090").unwrap();
        assert_eq!(find_gpu("4090").unwrap().name, g.name);
        assert_eq!(find_gpu("NVIDIA GeForce RTX 4090").unwrap().name, g.name);
        assert_eq!(find_gpu("rtx4090").unwrap().name, g.name);
        assert!(find_gpu("h100").is_some());
        assert!(find_gpu("voodoo 5").is_none());
        for required in [
            "RTX 2060 12GB",
            "RTX 3060",
            "RTX 3090",
            "RTX 4060",
            "RTX 4060 Ti 16GB",
            "RTX 4070",
            "RTX 4080",
            "RTX 4090",
            "RTX 5090",
            "L4",
            "A10G",
            "L40S",
            "A100 40GB",
            "A100 80GB",
            "H100",
            "H200",
        ] {
            assert!(find_gpu(required).is_some(), "{required}");
        }
        assert!(g.cuda_visible_bytes() < g.total_bytes);
    }

    #[test]
    fn closest_names_for_a_typo() {
        let near = closest_models("Qwen2.5-7B-Instruct-AWK", 5);
        assert_eq!(near.len(), 5);
        assert!(
            near[..2]
                .iter()
                .any(|n| n == "Qwen/Qwen2.5-7B-Instruct-AWQ"),
            "{near:?}"
        );
    }

    #[test]
    fn whisper_profile_is_found() {
        let p = find_profile("whisper-large-v3").unwrap();
        assert!(p.bytes > 2 * 1024 * MIB);
    }
}
