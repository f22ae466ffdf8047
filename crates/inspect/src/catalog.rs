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
    /// The checkpoint's tensors by module, when the entry lists them (VibeVoice): their sum at
    /// each component's stored dtype is `weights_bytes`.
    #[serde(default)]
    pub components: Vec<CatalogComponent>,
}

/// One module of a checkpoint: its element count, the dtype the checkpoint stores it in, and the
/// dtype the serving engine converts it to when that differs.
#[derive(Debug, Clone, Deserialize)]
pub struct CatalogComponent {
    pub name: String,
    pub params: u64,
    pub dtype: String,
    #[serde(default)]
    pub loaded_dtype: Option<String>,
}

impl CatalogModel {
    /// The listed components as the planner's type (empty when none are listed).
    pub fn weight_components(&self) -> Result<Vec<headroom_plan::WeightComponent>, InspectError> {
        let dtype = |c: &CatalogComponent, d: &str| {
            headroom_plan::Dtype::parse(d).ok_or_else(|| InspectError::Malformed {
                file: "catalog models.json".into(),
                reason: format!("{}: {}: unknown dtype '{d}'", self.id, c.name),
            })
        };
        self.components
            .iter()
            .map(|c| {
                let stored = dtype(c, &c.dtype)?;
                let loaded = match c.loaded_dtype.as_deref() {
                    Some(d) => dtype(c, d)?,
                    None => stored,
                };
                Ok(headroom_plan::WeightComponent {
                    name: c.name.clone(),
                    params: c.params,
                    stored_dtype: stored,
                    loaded_dtype: loaded,
                    bytes: c.params * stored.bytes(),
                })
            })
            .collect()
    }

    /// Bytes of the listed components at their stored dtypes (`None` when none are listed).
    pub fn components_bytes(&self) -> Result<Option<u64>, InspectError> {
        let parts = self.weight_components()?;
        Ok((!parts.is_empty()).then(|| parts.iter().map(|c| c.bytes).sum()))
    }
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
    spec.weight_components = m.weight_components()?;
    if let Some(sum) = m.components_bytes()?
        && m.weights_bytes != Some(sum)
    {
        return Err(InspectError::Malformed {
            file: "catalog models.json".into(),
            reason: format!(
                "{}: components add up to {sum} B, weights_bytes is {:?}",
                m.id, m.weights_bytes
            ),
        });
    }
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

    /// Element counts of VibeVoice's modules, written from the module definitions of
    /// microsoft/VibeVoice (`modular_vibevoice_tokenizer.py`, `modular_vibevoice_diffusion_head.py`,
    /// `SpeechConnector`, `BinaryClassifier`) and transformers' Qwen2, fed with the entry's own
    /// config values.
    mod vibevoice_shapes {
        use serde_json::Value;

        fn n(v: &Value, k: &str) -> u64 {
            v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
        }

        /// (ratios, depths, n_filters) of a tokenizer config.
        fn tokenizer(c: &Value) -> (Vec<u64>, Vec<u64>, u64) {
            assert_eq!(c["mixer_layer"], "depthwise_conv");
            assert_eq!(c["layernorm"], "RMSNorm");
            assert_eq!(c["conv_bias"], true);
            assert_eq!(c["disable_last_norm"], true);
            assert!(c["layer_scale_init_value"].as_f64().unwrap() > 0.0);
            let ratios = c["encoder_ratios"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r.as_u64().unwrap())
                .collect();
            let depths = c["encoder_depths"]
                .as_str()
                .unwrap()
                .split('-')
                .map(|d| d.parse().unwrap())
                .collect();
            (ratios, depths, n(c, "encoder_n_filters"))
        }

        /// A Block1D of width c: two RMSNorm weights, a depthwise k=7 conv with bias, an FFN
        /// c → 4c → c with biases, and the two layer-scale vectors.
        fn block(c: u64) -> u64 {
            2 * c + (7 * c + c) + (4 * c * c + 4 * c) + (4 * c * c + c) + 2 * c
        }

        /// Stages of 2^i × n_filters channels, depths[i] blocks each.
        fn stages(depths: &[u64], f: u64) -> u64 {
            depths
                .iter()
                .enumerate()
                .map(|(i, d)| d * block(f << i))
                .sum()
        }

        /// Encoder: stem conv 1 → f (k 7), one strided conv per ratio (kernel 2r, the ratios
        /// reversed), the stages, and a k=7 head to the latent width.
        pub fn encoder(c: &Value, vae_dim: u64) -> u64 {
            let (ratios, depths, f) = tokenizer(c);
            let stem = f * 7 + f;
            let down: u64 = ratios
                .iter()
                .rev()
                .enumerate()
                .map(|(i, r)| (f << i) * (f << (i + 1)) * 2 * r + (f << (i + 1)))
                .sum();
            let top = f << (depths.len() - 1);
            stem + down + stages(&depths, f) + top * vae_dim * 7 + vae_dim
        }

        /// Decoder: stem conv latent → top (k 7), one transposed conv per ratio (kernel 2r),
        /// the same stages in reverse, and a k=7 head to one channel.
        pub fn decoder(c: &Value, vae_dim: u64) -> u64 {
            let (ratios, depths, f) = tokenizer(c);
            let top = f << (depths.len() - 1);
            let stem = vae_dim * top * 7 + top;
            let up: u64 = ratios
                .iter()
                .enumerate()
                .map(|(i, r)| (top >> i) * (top >> (i + 1)) * 2 * r + (top >> (i + 1)))
                .sum();
            stem + up + stages(&depths, f) + f * 7 + 1
        }

        /// fc1 in → h with bias, an RMSNorm, fc2 h → h with bias.
        pub fn connector(input: u64, h: u64) -> u64 {
            input * h + h + h + h * h + h
        }

        /// Qwen2 decoder layers (q/k/v with bias, o without, gated MLP, two norms).
        pub fn qwen2_layers(d: &Value, layers: u64) -> u64 {
            let h = n(d, "hidden_size");
            let kv = n(d, "num_key_value_heads") * (h / n(d, "num_attention_heads"));
            let per =
                (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * n(d, "intermediate_size") + 2 * h;
            layers * per
        }

        pub fn embedding(d: &Value) -> u64 {
            n(d, "vocab_size") * n(d, "hidden_size")
        }

        /// Diffusion head: latent and condition projections, the timestep MLP (256 → h → h),
        /// head_layers × (gated FFN of h × ratio, RMSNorm, adaLN h → 3h), final adaLN h → 2h
        /// and h → latent.
        pub fn diffusion_head(c: &Value) -> u64 {
            let h = n(c, "hidden_size");
            let l = n(c, "latent_size");
            let ffn = (h as f64 * c["head_ffn_ratio"].as_f64().unwrap()) as u64;
            let layer = 3 * h * ffn + h + h * 3 * h;
            l * h + h * h + (256 * h + h * h) + n(c, "head_layers") * layer + (h * 2 * h + h * l)
        }
    }

    fn entry(id: &str) -> &'static CatalogModel {
        find_model(id).unwrap()
    }

    fn listed(m: &CatalogModel, name: &str) -> u64 {
        m.components
            .iter()
            .find(|c| c.name.starts_with(name))
            .unwrap_or_else(|| panic!("{}: {name}", m.id))
            .params
    }

    #[test]
    fn vibevoice_asr_weights_are_the_checkpoint_tensor_total() {
        use vibevoice_shapes::*;
        let m = entry("microsoft/VibeVoice-ASR");
        let c = &m.config;
        let d = &c["decoder_config"];
        let layers = d["num_hidden_layers"].as_u64().unwrap();
        let h = d["hidden_size"].as_u64().unwrap();
        assert_eq!(d["tie_word_embeddings"], false);
        let acoustic = c["acoustic_tokenizer_config"]["vae_dim"].as_u64().unwrap();
        let semantic = c["semantic_tokenizer_config"]["vae_dim"].as_u64().unwrap();
        let lm = embedding(d) + qwen2_layers(d, layers) + h;
        let parts = [
            ("model.language_model", lm),
            ("lm_head", embedding(d)),
            (
                "model.acoustic_tokenizer.encoder",
                encoder(&c["acoustic_tokenizer_config"], acoustic),
            ),
            (
                "model.acoustic_tokenizer.decoder",
                decoder(&c["acoustic_tokenizer_config"], acoustic),
            ),
            (
                "model.semantic_tokenizer.encoder",
                encoder(&c["semantic_tokenizer_config"], semantic),
            ),
            ("model.acoustic_connector", connector(acoustic, h)),
            ("model.semantic_connector", connector(semantic, h)),
        ];
        for (name, want) in parts {
            assert_eq!(listed(m, name), want, "{name}");
        }
        let total: u64 = parts.iter().map(|p| p.1).sum();
        // The hub index's metadata.total_parameters for microsoft/VibeVoice-ASR.
        let index_total = 8_674_021_857u64;
        assert!(total.abs_diff(index_total) * 100 <= index_total, "{total}");
        // The decoder + lm_head are Qwen2.5-7B's (its index total_size 15,231,233,024 B, bf16).
        assert_eq!((lm + embedding(d)) * 2, 15_231_233_024);
        // All BF16 in the checkpoint.
        assert_eq!(m.weights_bytes, Some(total * 2));
        // vLLM's plugin holds the tokenizers and connectors in float32.
        assert_eq!(m.extra_params, Some(total - lm - embedding(d)));
        assert_eq!(m.extra_dtype.as_deref(), Some("float32"));
    }

    #[test]
    fn vibevoice_tts_weights_follow_from_their_configs() {
        use vibevoice_shapes::*;
        // VibeVoice-1.5B: tied embeddings, both tokenizers, a diffusion head, two scalar buffers.
        let m = entry("microsoft/VibeVoice-1.5B");
        let c = &m.config;
        let d = &c["decoder_config"];
        let h = d["hidden_size"].as_u64().unwrap();
        assert_eq!(d["tie_word_embeddings"], true);
        let lm = embedding(d) + qwen2_layers(d, d["num_hidden_layers"].as_u64().unwrap()) + h;
        let head = diffusion_head(&c["diffusion_head_config"]);
        let total = lm
            + encoder(&c["acoustic_tokenizer_config"], 64)
            + decoder(&c["acoustic_tokenizer_config"], 64)
            + encoder(&c["semantic_tokenizer_config"], 128)
            + connector(64, h)
            + connector(128, h)
            + head
            + 2;
        assert_eq!(listed(m, "model.prediction_head"), head);
        assert_eq!(listed(m, "model.language_model"), lm);
        assert_eq!(m.weights_bytes, Some(total * 2));
        // The three shards are 5.41 GB on the hub listing (headers included).
        assert!((total * 2).abs_diff(5_410_000_000) * 100 <= 5_410_000_000);

        // VibeVoice-Realtime-0.5B: the 24 decoder layers split 4 + 20 into two models with an
        // embedding table each; the release ships the acoustic decoder but not its encoder.
        let m = entry("microsoft/VibeVoice-Realtime-0.5B");
        let c = &m.config;
        let d = &c["decoder_config"];
        let h = d["hidden_size"].as_u64().unwrap();
        let tts = c["tts_backbone_num_hidden_layers"].as_u64().unwrap();
        let lower = d["num_hidden_layers"].as_u64().unwrap() - tts;
        let total = (embedding(d) + qwen2_layers(d, lower))
            + (embedding(d) + qwen2_layers(d, tts) + h)
            + decoder(&c["acoustic_tokenizer_config"], 64)
            + connector(64, h)
            + diffusion_head(&c["diffusion_head_config"])
            + (h * h + h + h + 1)
            + 2 * h
            + 2;
        assert_eq!(m.weights_bytes, Some(total * 2));
        // The real model.safetensors (HF revision 6bce5f06) is 2,035,332,888 B with its header.
        let file = 2_035_332_888u64;
        assert!(total * 2 < file && (file - total * 2) * 100 <= file);
    }

    #[test]
    fn listed_components_must_add_up_to_the_weights() {
        let mut m = entry("microsoft/VibeVoice-ASR").clone();
        assert!(model_spec(&m).is_ok());
        m.components[0].params += 1;
        let err = model_spec(&m).unwrap_err().to_string();
        assert!(err.contains("components add up to"), "{err}");
    }
}
