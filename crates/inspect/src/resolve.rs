//! `--model X` → a spec: a local path first, then the Hugging Face cache
//! (`$HF_HUB_CACHE`, `$HF_HOME/hub`, `~/.cache/huggingface/hub`), then the built-in catalog.
//! Exact weight bytes come from tensor headers whenever a checkpoint is on disk.

use std::fs::File;
use std::path::{Path, PathBuf};

use headroom_plan::{Dtype, ExactWeights, ModelSpec, WeightsOrigin};
use serde_json::Value;

use crate::InspectError;
use crate::catalog::{closest_models, find_model, model_spec};
use crate::config::spec_from_config;
use crate::gguf::read_gguf;
use crate::safetensors::{read_file_header, weights_in_dir};

/// Where a spec came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedFrom {
    LocalPath(PathBuf),
    HfCache(PathBuf),
    Catalog,
}

#[derive(Debug, Clone)]
pub struct Resolved {
    pub spec: ModelSpec,
    pub from: ResolvedFrom,
}

/// Environment values resolution depends on, passed in so tests control them.
#[derive(Debug, Clone, Default)]
pub struct Env {
    pub hf_hub_cache: Option<PathBuf>,
    pub hf_home: Option<PathBuf>,
    pub home: Option<PathBuf>,
}

impl Env {
    /// Reads `HF_HUB_CACHE`, `HF_HOME` and `HOME`.
    pub fn from_process() -> Env {
        let var = |k| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        Env {
            hf_hub_cache: var("HF_HUB_CACHE"),
            hf_home: var("HF_HOME"),
            home: var("HOME"),
        }
    }

    /// The hub cache new files are written to: the first of [`Env::hub_dirs`]'s folders.
    pub fn hub_cache_dir(&self) -> Option<PathBuf> {
        self.hub_dirs().into_iter().next()
    }

    /// The hub caches searched, in order: `$HF_HUB_CACHE`, `$HF_HOME/hub`,
    /// `~/.cache/huggingface/hub`.
    pub fn hub_dirs(&self) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(c) = &self.hf_hub_cache {
            dirs.push(c.clone());
        }
        if let Some(h) = &self.hf_home {
            dirs.push(h.join("hub"));
        }
        if let Some(h) = &self.home {
            dirs.push(h.join(".cache/huggingface/hub"));
        }
        dirs
    }
}

/// Resolves `name` as described in the module docs.
pub fn resolve_model(name: &str, env: &Env) -> Result<Resolved, InspectError> {
    let path = Path::new(name);
    if path.exists() {
        return Ok(Resolved {
            spec: from_path(name, path)?,
            from: ResolvedFrom::LocalPath(path.to_path_buf()),
        });
    }
    if let Some(snapshot) = find_in_hf_cache(name, env) {
        return Ok(Resolved {
            spec: from_dir(name, &snapshot)?,
            from: ResolvedFrom::HfCache(snapshot),
        });
    }
    if let Some(m) = find_model(name) {
        return Ok(Resolved {
            spec: model_spec(m)?,
            from: ResolvedFrom::Catalog,
        });
    }
    Err(InspectError::UnknownModel {
        name: name.to_string(),
        closest: closest_models(name, 5),
    })
}

/// `models--ORG--NAME/snapshots/<rev>/` with a config.json (or a GGUF), newest first.
fn find_in_hf_cache(name: &str, env: &Env) -> Option<PathBuf> {
    let (org, repo) = name.split_once('/')?;
    if org.is_empty() || repo.is_empty() || repo.contains('/') {
        return None;
    }
    let folder = format!("models--{org}--{repo}");
    for hub in env.hub_dirs() {
        let snapshots = hub.join(&folder).join("snapshots");
        let Ok(entries) = std::fs::read_dir(&snapshots) else {
            continue;
        };
        let mut candidates: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("config.json").is_file() || has_ext(p, "gguf"))
            .map(|p| {
                let t = std::fs::metadata(&p)
                    .and_then(|m| m.modified())
                    .unwrap_or(std::time::UNIX_EPOCH);
                (t, p)
            })
            .collect();
        candidates.sort();
        if let Some((_, p)) = candidates.pop() {
            return Some(p);
        }
    }
    None
}

fn has_ext(dir: &Path, ext: &str) -> bool {
    std::fs::read_dir(dir)
        .map(|it| {
            it.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == ext))
        })
        .unwrap_or(false)
}

fn from_path(name: &str, path: &Path) -> Result<ModelSpec, InspectError> {
    if path.is_dir() {
        return from_dir(name, path);
    }
    let file_name = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
    if file_name.ends_with(".gguf") {
        return from_gguf(name, path);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    if file_name.ends_with(".safetensors") {
        let header = read_file_header(path)?;
        let mut spec = read_config(name, &dir.join("config.json"))?;
        apply_weights(
            &mut spec,
            header.tensor_bytes,
            WeightsOrigin::SafetensorsHeaders,
            header.dominant_dtype(),
        );
        return Ok(spec);
    }
    if file_name.ends_with(".json") {
        // A config.json (or index) named directly: read what sits beside it.
        return from_dir(name, dir);
    }
    Err(InspectError::NothingToRead {
        path: path.display().to_string(),
    })
}

fn from_gguf(name: &str, path: &Path) -> Result<ModelSpec, InspectError> {
    let file = File::open(path).map_err(|e| InspectError::io(path, e))?;
    let reader = std::io::BufReader::new(file);
    read_gguf(reader, &path.display().to_string())?.to_spec(name, &path.display().to_string())
}

fn read_config(name: &str, path: &Path) -> Result<ModelSpec, InspectError> {
    let text = std::fs::read_to_string(path).map_err(|e| InspectError::io(path, e))?;
    let value: Value = serde_json::from_str(&text).map_err(|e| InspectError::Malformed {
        file: path.display().to_string(),
        reason: format!("not valid JSON: {e}"),
    })?;
    spec_from_config(name, &path.display().to_string(), &value)
}

fn apply_weights(spec: &mut ModelSpec, bytes: u64, origin: WeightsOrigin, dtype: Option<&str>) {
    spec.exact_weights = Some(ExactWeights { bytes, origin });
    // A config without torch_dtype: the dominant tensor dtype says what the engine will use.
    if let Some(d) = dtype.and_then(|d| Dtype::parse(&d.to_ascii_lowercase()))
        && d != Dtype::Fp8
        && spec.dtype != d
        && d == Dtype::F16
    {
        spec.dtype = d;
    }
}

fn from_dir(name: &str, dir: &Path) -> Result<ModelSpec, InspectError> {
    let config = dir.join("config.json");
    if !config.is_file() {
        let gguf = std::fs::read_dir(dir)
            .map_err(|e| InspectError::io(dir, e))?
            .flatten()
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "gguf"));
        return match gguf {
            Some(g) => from_gguf(name, &g),
            None => Err(InspectError::NothingToRead {
                path: dir.display().to_string(),
            }),
        };
    }
    let mut spec = read_config(name, &config)?;
    if let Some((summary, from_headers)) = weights_in_dir(dir)? {
        let origin = if from_headers {
            WeightsOrigin::SafetensorsHeaders
        } else {
            WeightsOrigin::IndexTotalSize
        };
        apply_weights(
            &mut spec,
            summary.tensor_bytes,
            origin,
            summary.dominant_dtype(),
        );
    }
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
        "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
        "vocab_size":128256,"max_position_embeddings":131072,"torch_dtype":"bfloat16"}"#;

    #[test]
    fn hf_cache_snapshot_is_found_before_the_catalog() {
        let tmp = tempfile::tempdir().unwrap();
        let snap = tmp
            .path()
            .join("hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::write(snap.join("config.json"), CONFIG).unwrap();
        let env = Env {
            hf_home: Some(tmp.path().to_path_buf()),
            ..Env::default()
        };
        let r = resolve_model("meta-llama/Llama-3.1-8B-Instruct", &env).unwrap();
        assert_eq!(r.from, ResolvedFrom::HfCache(snap));
        let r = resolve_model("meta-llama/Llama-3.1-8B-Instruct", &Env::default()).unwrap();
        assert_eq!(r.from, ResolvedFrom::Catalog);
    }

    #[test]
    fn unknown_models_name_five_close_catalog_entries() {
        let err = resolve_model("Qwen/Qwen2.5-7B-Instrukt", &Env::default()).unwrap_err();
        match &err {
            InspectError::UnknownModel { closest, .. } => {
                assert_eq!(closest.len(), 5);
                assert_eq!(closest[0], "Qwen/Qwen2.5-7B-Instruct");
            }
            e => panic!("{e}"),
        }
        assert!(err.to_string().contains("closest catalog names"));
    }

    #[test]
    fn a_directory_without_model_files_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let err = resolve_model(tmp.path().to_str().unwrap(), &Env::default()).unwrap_err();
        assert!(matches!(err, InspectError::NothingToRead { .. }), "{err}");
    }
}
