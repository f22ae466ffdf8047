//! llama.cpp's view of a model ([`LlamaCppModel`]): from a local GGUF file's metadata and tensor
//! table (exact bytes per block, embeddings and output), or from any other model description
//! (catalog, config.json) with weights estimated for a uniform GGUF weight type.

use std::path::Path;

use headroom_plan::llamacpp::{LlamaCppModel, WeightType};

use crate::InspectError;
use crate::gguf::{GgufMeta, MetaValue, read_gguf};
use crate::resolve::{Env, resolve_model};

/// A model for the llama.cpp planner and where it came from.
#[derive(Debug, Clone)]
pub struct LlamaCppSource {
    pub model: LlamaCppModel,
    /// The GGUF path, or the catalog/config source with the weight type assumed.
    pub source: String,
    /// True when the bytes come from a GGUF tensor table.
    pub exact: bool,
}

/// Architectures whose GGUF `attention.sliding_window` applies to some layers, and how many of
/// every `n` layers slide (llama.cpp's `set_swa_pattern`).
fn swa_share(arch: &str) -> Option<(u64, u64)> {
    match arch {
        "gemma3" | "gemma3n" => Some((5, 6)),
        "gemma2" | "gpt-oss" | "cohere2" => Some((1, 2)),
        _ => None,
    }
}

/// Builds the planner's model from a GGUF's `{arch}.*` keys and tensor table.
pub fn model_from_gguf(
    meta: &GgufMeta,
    name: &str,
    file: &str,
) -> Result<LlamaCppModel, InspectError> {
    let arch = match meta.metadata.get("general.architecture") {
        Some(MetaValue::Str(a)) => a.clone(),
        _ => {
            return Err(InspectError::MissingField {
                field: "general.architecture".into(),
                file: file.into(),
            });
        }
    };
    let get = |k: &str| {
        meta.metadata
            .get(&format!("{arch}.{k}"))
            .and_then(MetaValue::as_u64)
    };
    let need = |k: &str| {
        get(k).ok_or(InspectError::MissingField {
            field: format!("{arch}.{k}"),
            file: file.to_string(),
        })
    };
    let n_layer = need("block_count")?;
    let n_embd = need("embedding_length")?;
    let n_head = need("attention.head_count")?;
    let kv_lora = get("attention.kv_lora_rank");
    let mla = kv_lora.is_some();
    let (n_head_kv, head_dim_k, head_dim_v) = match kv_lora {
        // MLA caches the compressed latent plus the rope part, one "head".
        Some(rank) => (1, rank + get("rope.dimension_count").unwrap_or(64), 0),
        None => {
            let k = get("attention.key_length").unwrap_or(n_embd / n_head.max(1));
            (
                get("attention.head_count_kv").unwrap_or(n_head),
                k,
                get("attention.value_length").unwrap_or(k),
            )
        }
    };
    let n_vocab = get("vocab_size")
        .or_else(|| match meta.metadata.get("tokenizer.ggml.tokens") {
            Some(MetaValue::Array { len }) => Some(*len),
            _ => None,
        })
        .unwrap_or(0);
    let n_swa = get("attention.sliding_window").unwrap_or(0);
    let n_swa_layers = match swa_share(&arch) {
        Some((num, den)) if n_swa > 0 => n_layer * num / den,
        _ => 0,
    };

    let mut layer_bytes = vec![0u64; n_layer as usize];
    let (mut token_embd, mut output, mut output_norm, mut has_output) = (0, 0, 0, false);
    for t in &meta.tensors {
        if let Some(rest) = t.name.strip_prefix("blk.") {
            let idx = rest.split('.').next().and_then(|i| i.parse::<usize>().ok());
            if let Some(slot) = idx.and_then(|i| layer_bytes.get_mut(i)) {
                *slot += t.bytes;
            }
        } else if t.name == "token_embd.weight" {
            token_embd = t.bytes;
        } else if t.name == "output.weight" {
            output = t.bytes;
            has_output = true;
        } else if t.name.starts_with("output_norm") {
            output_norm += t.bytes;
        } else {
            // Position embeddings and other input-side tensors stay with the input layer.
            token_embd += t.bytes;
        }
    }
    if !has_output {
        // Tied embeddings: llama.cpp duplicates token_embd for the output layer.
        output = token_embd;
    }
    Ok(LlamaCppModel {
        name: name.to_string(),
        n_layer,
        n_embd,
        n_ff: get("feed_forward_length").unwrap_or(4 * n_embd),
        n_head,
        n_head_kv,
        head_dim_k,
        head_dim_v,
        n_vocab,
        n_ctx_train: get("context_length").unwrap_or(4096),
        n_swa,
        n_swa_layers,
        mla,
        layer_bytes,
        token_embd_bytes: token_embd,
        output_bytes: output + output_norm,
        output_tied: !has_output,
    })
}

fn read_gguf_file(path: &Path) -> Result<GgufMeta, InspectError> {
    let file = std::fs::File::open(path).map_err(|e| InspectError::io(path, e))?;
    read_gguf(std::io::BufReader::new(file), &path.display().to_string())
}

/// The first `*.gguf` in a directory (sorted by name, so split files start at part 1).
fn gguf_in_dir(dir: &Path) -> Option<std::path::PathBuf> {
    let mut found: Vec<_> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

/// `--model X` for `plan --engine llamacpp`: a local GGUF file (or a directory holding one) is
/// read exactly; anything else resolves as for vLLM and is estimated as a uniform `weight_type`
/// GGUF.
pub fn resolve_llamacpp(
    name: &str,
    env: &Env,
    weight_type: WeightType,
) -> Result<LlamaCppSource, InspectError> {
    let path = Path::new(name);
    let gguf = if path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        Some(path.to_path_buf())
    } else if path.is_dir() {
        gguf_in_dir(path)
    } else {
        None
    };
    if let Some(file) = gguf {
        let meta = read_gguf_file(&file)?;
        let shown = file.display().to_string();
        return Ok(LlamaCppSource {
            model: model_from_gguf(&meta, name, &shown)?,
            source: shown,
            exact: true,
        });
    }
    let resolved = resolve_model(name, env)?;
    Ok(LlamaCppSource {
        model: LlamaCppModel::from_spec(&resolved.spec, weight_type),
        source: format!(
            "{} (weights estimated as a uniform {} GGUF)",
            resolved.spec.source,
            weight_type.name()
        ),
        exact: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::tests::build_gguf;

    #[test]
    fn per_layer_bytes_and_tied_output_from_the_tensor_table() {
        let data = build_gguf(&[
            ("token_embd.weight", &[64, 3], 1),
            ("blk.0.attn_q.weight", &[64, 64], 1),
            ("blk.1.attn_q.weight", &[64, 64], 8),
            ("output_norm.weight", &[64], 0),
        ]);
        let meta = read_gguf(&data[..], "m.gguf").unwrap();
        let m = model_from_gguf(&meta, "m", "m.gguf").unwrap();
        assert_eq!((m.n_layer, m.n_embd, m.n_head, m.n_head_kv), (2, 64, 4, 2));
        assert_eq!(m.head_dim_k, 16);
        // f16 64×64 = 8,192 B; q8_0: 4,096 / 32 × 34 = 4,352 B.
        assert_eq!(m.layer_bytes, vec![8192, 4352]);
        assert_eq!(m.token_embd_bytes, 64 * 3 * 2);
        // No output.weight: token_embd is duplicated, plus the f32 norm.
        assert_eq!(m.output_bytes, 64 * 3 * 2 + 64 * 4);
        assert_eq!(m.n_ctx_train, 2048);
        assert!(m.output_tied);
        // Stored once: 8,192 + 4,352 + 384 + the 256-byte norm.
        assert_eq!(m.weights_bytes(), 8192 + 4352 + 384 + 256);
    }
}
