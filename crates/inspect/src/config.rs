//! Hugging Face `config.json` → [`ModelSpec`]: the decoder shape, attention layout (GQA, MLA,
//! sliding windows), MoE, quantization, Whisper's encoder–decoder and VibeVoice's audio tokenizer.
//! The built-in catalog stores real config.json values, so it goes through this same path.

use headroom_plan::{
    AudioTokenizer, Dtype, EncoderDecoder, Mla, ModelKind, ModelSpec, Moe, QuantScheme,
    Quantization,
};
use serde_json::{Map, Value};

use crate::InspectError;

type Obj = Map<String, Value>;

fn u(obj: &Obj, key: &str) -> Option<u64> {
    match obj.get(key)? {
        Value::Number(n) => n
            .as_u64()
            .or_else(|| n.as_f64().filter(|f| *f >= 0.0).map(|f| f as u64)),
        _ => None,
    }
}

fn first_u(obj: &Obj, keys: &[&str]) -> Option<u64> {
    keys.iter().find_map(|k| u(obj, k))
}

fn s<'a>(obj: &'a Obj, key: &str) -> Option<&'a str> {
    obj.get(key)?.as_str()
}

fn b(obj: &Obj, key: &str) -> Option<bool> {
    obj.get(key)?.as_bool()
}

/// Reads a required integer, naming the field and the file when it is missing.
fn need(obj: &Obj, keys: &[&str], file: &str) -> Result<u64, InspectError> {
    first_u(obj, keys).ok_or_else(|| InspectError::MissingField {
        field: keys[0].to_string(),
        file: file.to_string(),
    })
}

/// The object that holds the language model's shape: the top level, or a nested
/// `text_config` / `decoder_config` / `llm_config` for multimodal and audio models.
fn text_object(root: &Obj) -> &Obj {
    if root.contains_key("hidden_size") || root.contains_key("d_model") {
        return root;
    }
    for key in [
        "text_config",
        "decoder_config",
        "llm_config",
        "language_config",
    ] {
        if let Some(Value::Object(o)) = root.get(key)
            && o.contains_key("hidden_size")
        {
            return o;
        }
    }
    root
}

/// Keys that some official configs omit because the transformers class supplies them
/// (Gemma 3's `text_config` in the 4B checkpoint lists only what differs from
/// `Gemma3TextConfig`'s defaults).
fn with_family_defaults(text: &Obj) -> Obj {
    let mut out = text.clone();
    if s(text, "model_type") == Some("gemma3_text") {
        let defaults: [(&str, u64); 6] = [
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("vocab_size", 262_208),
            ("max_position_embeddings", 131_072),
            ("sliding_window_pattern", 6),
        ];
        for (k, v) in defaults {
            out.entry(k.to_string()).or_insert(Value::from(v));
        }
    }
    out
}

fn dtype_of(root: &Obj, text: &Obj) -> Dtype {
    ["torch_dtype", "dtype"]
        .iter()
        .find_map(|k| s(text, k).or_else(|| s(root, k)))
        .and_then(Dtype::parse)
        .filter(|d| *d != Dtype::Fp8)
        .unwrap_or(Dtype::Bf16)
}

/// Adds what `quantization_config` leaves unquantized: bitsandbytes double quantization and the
/// decoder modules named in `modules_to_not_convert` / `llm_int8_skip_modules` / `ignore`
/// (a pattern with `layers.N.` names one layer, without it every layer; `lm_head`, routers and
/// embeddings are already kept wide).
fn with_unconverted(mut quant: Quantization, root: &Obj, text: &Obj, layers: u64) -> Quantization {
    let Some(Value::Object(q)) = root
        .get("quantization_config")
        .or(text.get("quantization_config"))
    else {
        return quant;
    };
    quant.double_quant = b(q, "bnb_4bit_use_double_quant").unwrap_or(false);
    let names: Vec<&str> = ["modules_to_not_convert", "llm_int8_skip_modules", "ignore"]
        .iter()
        .filter_map(|k| q.get(*k)?.as_array())
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let count = |is: &dyn Fn(&str) -> bool| -> u64 {
        let mut indexed = std::collections::BTreeSet::new();
        for n in names.iter().filter(|n| is(n)) {
            let idx = n
                .split("layers.")
                .nth(1)
                .and_then(|r| r.split('.').next())
                .and_then(|i| i.parse::<u64>().ok());
            match idx {
                Some(i) => {
                    indexed.insert(i);
                }
                None => return layers,
            }
        }
        (indexed.len() as u64).min(layers)
    };
    quant.unconverted_attention_layers =
        count(&|n: &str| n.contains("self_attn") || n.contains("attention"));
    quant.unconverted_mlp_layers = count(&|n: &str| {
        (n.contains("mlp") || n.contains("feed_forward") || n.contains("experts"))
            && !n.ends_with("gate")
    });
    quant
}

fn quantization_of(root: &Obj, text: &Obj) -> Quantization {
    let q = match root
        .get("quantization_config")
        .or(text.get("quantization_config"))
    {
        Some(Value::Object(q)) => q,
        _ => return Quantization::NONE,
    };
    let method = s(q, "quant_method").unwrap_or("").to_ascii_lowercase();
    let group_size = u(q, "group_size")
        .or_else(|| {
            // compressed-tensors keeps it under config_groups.*.weights.group_size
            q.get("config_groups")?
                .as_object()?
                .values()
                .find_map(|g| u(g.get("weights")?.as_object()?, "group_size"))
        })
        .unwrap_or(128);
    let bits = u(q, "bits").or_else(|| u(q, "w_bit")).unwrap_or(4);
    let scheme = match method.as_str() {
        "awq" => QuantScheme::Awq,
        "gptq" if bits >= 8 => QuantScheme::Fp8,
        "gptq" => QuantScheme::Gptq,
        "bitsandbytes" => {
            if b(q, "load_in_8bit") == Some(true) {
                QuantScheme::Bnb8
            } else {
                QuantScheme::Bnb4
            }
        }
        "fp8" | "fbgemm_fp8" => QuantScheme::Fp8,
        "mxfp4" => QuantScheme::Mxfp4,
        "modelopt" => match s(q, "quant_algo")
            .unwrap_or("")
            .to_ascii_uppercase()
            .as_str()
        {
            "NVFP4" => QuantScheme::Nvfp4,
            _ => QuantScheme::Fp8,
        },
        "compressed-tensors" => {
            let format = s(q, "format").unwrap_or("");
            let text = serde_json::to_string(q).unwrap_or_default();
            if format.contains("nvfp4") {
                QuantScheme::Nvfp4
            } else if text.contains("\"num_bits\":4") {
                QuantScheme::Awq
            } else if text.contains("\"num_bits\":8") {
                QuantScheme::Fp8
            } else {
                QuantScheme::None
            }
        }
        _ => QuantScheme::None,
    };
    // gpt-oss keeps attention, router, embeddings and lm_head in bf16: only experts are mxfp4.
    let experts_only = scheme == QuantScheme::Mxfp4
        && q.get("modules_to_not_convert")
            .and_then(Value::as_array)
            .is_some_and(|m| {
                m.iter()
                    .any(|v| v.as_str().is_some_and(|s| s.contains("attn")))
            });
    Quantization {
        scheme,
        group_size,
        experts_only,
        ..Quantization::NONE
    }
}

fn moe_of(text: &Obj, layers: u64, intermediate: u64) -> Option<Moe> {
    let experts = first_u(
        text,
        &["num_local_experts", "num_experts", "n_routed_experts"],
    )?;
    if experts <= 1 {
        return None;
    }
    let top_k = first_u(
        text,
        &["num_experts_per_tok", "experts_per_token", "moe_topk"],
    )
    .unwrap_or(2);
    let expert_size = first_u(text, &["moe_intermediate_size"]).unwrap_or(intermediate);
    let shared = u(text, "n_shared_experts").unwrap_or(0);
    let (shared_n, shared_size) = match u(text, "shared_expert_intermediate_size") {
        Some(size) if size > 0 => (1, size),
        _ => (shared, expert_size),
    };
    let mut first_dense = u(text, "first_k_dense_replace").unwrap_or(0);
    if let Some(Value::Array(only)) = text.get("mlp_only_layers") {
        first_dense += only.len() as u64;
    }
    Some(Moe {
        num_experts: experts,
        experts_per_token: top_k,
        expert_intermediate_size: expert_size,
        num_shared_experts: shared_n,
        shared_intermediate_size: shared_size,
        first_dense_layers: first_dense.min(layers),
        gated: true,
    })
}

/// `(window, sliding layer count)` as vLLM applies them.
fn sliding_of(
    root: &Obj,
    text: &Obj,
    model_type: &str,
    layers: u64,
    max_pos: u64,
) -> (Option<u64>, u64) {
    if let Some(Value::Array(types)) = text.get("layer_types") {
        let sliding = types
            .iter()
            .filter(|t| t.as_str().is_some_and(|t| t.contains("sliding")))
            .count() as u64;
        let window = u(text, "sliding_window");
        return match window {
            Some(w) if sliding > 0 => (Some(w), sliding),
            _ => (None, 0),
        };
    }
    let Some(window) = u(text, "sliding_window").or_else(|| u(root, "sliding_window")) else {
        return (None, 0);
    };
    if b(text, "use_sliding_window") == Some(false) {
        return (None, 0);
    }
    if window >= max_pos {
        return (None, 0);
    }
    let sliding = if model_type.starts_with("gemma3") {
        let pattern = u(text, "sliding_window_pattern").unwrap_or(6).max(1);
        layers - layers / pattern
    } else if model_type.starts_with("gemma2") || model_type == "cohere2" {
        layers / 2
    } else if b(text, "use_sliding_window") == Some(true) {
        layers.saturating_sub(u(text, "max_window_layers").unwrap_or(0))
    } else {
        layers
    };
    (Some(window), sliding)
}

/// Parameters of a ViT-style tower described by `vision_config`, if any: `(all, linear)`, the
/// second being those in vLLM's parallel linear layers (split over tensor-parallel ranks,
/// quantized at load time). Its attention projections always are; its MLP only when the hidden
/// and intermediate sizes are multiples of 64, as vLLM's SigLIP tower requires before it passes
/// the quantization config on.
fn vision_params(root: &Obj) -> (u64, u64) {
    let Some(Value::Object(v)) = root.get("vision_config") else {
        return (0, 0);
    };
    let (Some(h), Some(i), Some(l)) = (
        u(v, "hidden_size"),
        u(v, "intermediate_size"),
        first_u(v, &["num_hidden_layers", "depth"]),
    ) else {
        return (0, 0);
    };
    let attention = l * 4 * h * h;
    let mlp = l * 2 * h * i;
    let mlp_linear = if h % 64 == 0 && i % 64 == 0 { mlp } else { 0 };
    (attention + mlp, attention + mlp_linear)
}

fn kind_of(root: &Obj, model_type: &str, arch: &str) -> ModelKind {
    let a = arch.to_ascii_lowercase();
    if model_type == "whisper" || a.contains("asr") || a.contains("speechseq2seq") {
        ModelKind::SpeechToText
    } else if model_type.contains("vibevoice") && !a.contains("asr") {
        if root.contains_key("semantic_tokenizer_config") && a.contains("asr") {
            ModelKind::SpeechToText
        } else {
            ModelKind::TextToSpeech
        }
    } else {
        ModelKind::Text
    }
}

/// Layer kinds whose memory is attention KV, which the planner sizes (`layer_types` values).
const ATTENTION_LAYER_TYPES: [&str; 4] = [
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "attention",
];

/// Model types that keep a recurrent or state-space state instead of (or beside) a KV cache.
const STATE_MODEL_TYPES: [&str; 7] = [
    "mamba",
    "mamba2",
    "falcon_mamba",
    "rwkv",
    "rwkv6",
    "rwkv7",
    "xlstm",
];

/// What the planner lacks to plan this config, if anything: layers that are not attention
/// (linear attention, Mamba, convolution or recurrent blocks) keep a per-sequence state whose
/// size it does not model.
fn missing_piece(root: &Obj, text: &Obj, model_type: &str, layers: u64) -> Option<String> {
    if STATE_MODEL_TYPES.contains(&model_type) {
        return Some(format!(
            "model_type '{model_type}' keeps a recurrent (state-space) state per sequence instead of a KV cache, which the planner does not size"
        ));
    }
    let kinds: Vec<String> = if let Some(Value::Array(types)) = text.get("layer_types") {
        types
            .iter()
            .filter_map(|t| t.as_str().map(str::to_ascii_lowercase))
            .collect()
    } else if let Some(Value::Array(types)) = text
        .get("layers_block_type")
        .or_else(|| root.get("layers_block_type"))
    {
        types
            .iter()
            .filter_map(|t| t.as_str().map(str::to_ascii_lowercase))
            .collect()
    } else if let Some(pattern) = s(text, "hybrid_override_pattern") {
        // Nemotron-H: M = Mamba-2, * = attention, - = MLP.
        pattern
            .chars()
            .filter(|c| *c == 'M')
            .map(|_| "mamba".to_string())
            .collect()
    } else {
        Vec::new()
    };
    let other: Vec<&String> = kinds
        .iter()
        .filter(|k| !ATTENTION_LAYER_TYPES.contains(&k.as_str()) && !k.is_empty())
        .collect();
    let first = other.first()?;
    let same = other.iter().filter(|k| k == &first).count();
    Some(format!(
        "{same} of {} layers are '{first}' layers, whose per-sequence state the planner does not size",
        layers.max(kinds.len() as u64)
    ))
}

/// Builds a spec from a parsed config.json. `file` names the source in error messages.
pub fn spec_from_config(name: &str, file: &str, config: &Value) -> Result<ModelSpec, InspectError> {
    let root = config.as_object().ok_or_else(|| InspectError::Malformed {
        file: file.to_string(),
        reason: "config.json is not a JSON object".to_string(),
    })?;
    let model_type = s(root, "model_type").unwrap_or("").to_ascii_lowercase();
    let architecture = root
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or(if model_type.is_empty() {
            "unknown"
        } else {
            &model_type
        })
        .to_string();

    if model_type == "whisper" {
        return whisper_spec(name, file, root, architecture);
    }

    let text = &with_family_defaults(text_object(root));
    let layer_count = first_u(text, &["num_hidden_layers", "n_layer", "num_layers"]).unwrap_or(0);
    if let Some(piece) = missing_piece(root, text, &model_type, layer_count) {
        return Err(InspectError::Unsupported {
            name: name.to_string(),
            architecture,
            file: file.to_string(),
            piece,
        });
    }
    let hidden = need(text, &["hidden_size", "n_embd", "d_model"], file)?;
    let layers = need(text, &["num_hidden_layers", "n_layer", "num_layers"], file)?;
    let heads = need(text, &["num_attention_heads", "n_head"], file)?;
    let kv_heads = first_u(text, &["num_key_value_heads", "num_kv_heads"]).unwrap_or(heads);
    let intermediate =
        first_u(text, &["intermediate_size", "n_inner", "ffn_dim"]).unwrap_or(4 * hidden);
    let vocab =
        need(text, &["vocab_size"], file).or_else(|e| first_u(root, &["vocab_size"]).ok_or(e))?;
    let head_dim = first_u(text, &["head_dim"]).unwrap_or(hidden / heads.max(1));
    let head_dim_v = first_u(text, &["v_head_dim_attn"]).unwrap_or(head_dim);
    let max_pos = first_u(
        text,
        &[
            "max_position_embeddings",
            "n_positions",
            "max_sequence_length",
            "seq_length",
        ],
    )
    .or_else(|| u(root, "max_position_embeddings"));
    let positions_known = max_pos.is_some();
    let max_pos = max_pos.unwrap_or(4096);
    let tie = b(text, "tie_word_embeddings")
        .or_else(|| b(root, "tie_word_embeddings"))
        .unwrap_or(model_type.starts_with("gemma"));

    let mla = match u(text, "kv_lora_rank") {
        Some(kv_lora_rank) => Some(Mla {
            kv_lora_rank,
            qk_rope_head_dim: need(text, &["qk_rope_head_dim"], file)?,
            qk_nope_head_dim: u(text, "qk_nope_head_dim").unwrap_or(head_dim),
            v_head_dim: u(text, "v_head_dim").unwrap_or(head_dim),
            q_lora_rank: u(text, "q_lora_rank"),
        }),
        None => None,
    };
    let (sliding_window, num_sliding_layers) = sliding_of(root, text, &model_type, layers, max_pos);
    let vision = vision_params(root);

    let audio_tokenizer =
        if root.contains_key("acoustic_tokenizer_config") || model_type.contains("vibevoice") {
            Some(AudioTokenizer {
                sample_rate_hz: first_u(root, &["target_sample_rate", "sampling_rate"])
                    .unwrap_or(24_000),
                samples_per_token: first_u(root, &["speech_tok_compress_ratio"]).unwrap_or(3200),
            })
        } else {
            None
        };

    Ok(ModelSpec {
        name: name.to_string(),
        source: file.to_string(),
        kind: kind_of(root, &model_type, &architecture),
        architecture,
        dtype: dtype_of(root, text),
        hidden_size: hidden,
        intermediate_size: intermediate,
        gated_mlp: !matches!(model_type.as_str(), "gpt2" | "opt" | "gpt_bigcode" | "phi"),
        num_layers: layers,
        num_attention_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        head_dim_v,
        vocab_size: vocab,
        tie_word_embeddings: tie,
        max_position_embeddings: max_pos,
        positions_known,
        sliding_window,
        num_sliding_layers,
        mla,
        moe: moe_of(text, layers, intermediate),
        quantization: with_unconverted(quantization_of(root, text), root, text, layers),
        encoder_decoder: None,
        audio_tokenizer,
        extra_params: vision.0,
        extra_dtype: dtype_of(root, text),
        extra_linear_params: vision.1,
        exact_weights: None,
        weight_components: Vec::new(),
    })
}

fn whisper_spec(
    name: &str,
    file: &str,
    root: &Obj,
    architecture: String,
) -> Result<ModelSpec, InspectError> {
    let d = need(root, &["d_model"], file)?;
    let dec_layers = need(root, &["decoder_layers"], file)?;
    let enc_layers = need(root, &["encoder_layers"], file)?;
    let heads = need(root, &["decoder_attention_heads"], file)?;
    let dec_ffn = need(root, &["decoder_ffn_dim"], file)?;
    let enc_ffn = u(root, "encoder_ffn_dim").unwrap_or(dec_ffn);
    let vocab = need(root, &["vocab_size"], file)?;
    let source_positions = u(root, "max_source_positions").unwrap_or(1500);
    let target_positions = u(root, "max_target_positions").unwrap_or(448);
    let mel = u(root, "num_mel_bins").unwrap_or(80);
    // Encoder layers, the two input convolutions, positional tables, and each decoder layer's
    // cross-attention projections: all outside the plain decoder the planner counts.
    let encoder =
        enc_layers * (4 * d * d + 2 * d * enc_ffn) + mel * d * 3 + d * d * 3 + source_positions * d;
    let cross = dec_layers * 4 * d * d + target_positions * d;
    // The encoder's and cross-attention's projections are vLLM linear layers; the convolutions
    // and positional tables are not.
    let linear = enc_layers * (4 * d * d + 2 * d * enc_ffn) + dec_layers * 4 * d * d;
    let dtype = dtype_of(root, root);
    Ok(ModelSpec {
        name: name.to_string(),
        source: file.to_string(),
        architecture,
        kind: ModelKind::SpeechToText,
        dtype,
        hidden_size: d,
        intermediate_size: dec_ffn,
        gated_mlp: false,
        num_layers: dec_layers,
        num_attention_heads: heads,
        num_kv_heads: heads,
        head_dim: d / heads.max(1),
        head_dim_v: d / heads.max(1),
        vocab_size: vocab,
        tie_word_embeddings: true,
        max_position_embeddings: target_positions,
        positions_known: true,
        sliding_window: None,
        num_sliding_layers: 0,
        mla: None,
        moe: None,
        quantization: Quantization::NONE,
        encoder_decoder: Some(EncoderDecoder {
            encoder_layers: enc_layers,
            encoder_positions: source_positions,
            num_mel_bins: mel,
        }),
        audio_tokenizer: None,
        extra_params: encoder + cross,
        extra_dtype: dtype,
        extra_linear_params: linear,
        exact_weights: None,
        weight_components: Vec::new(),
    })
}

#[cfg(test)]
mod unconverted_tests {
    use super::*;

    #[test]
    fn modules_left_unconverted_are_counted_per_layer() {
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "vocab_size": 100, "intermediate_size": 128,
            "quantization_config": {
                "quant_method": "fp8",
                "modules_to_not_convert": ["lm_head", "model.layers.0.self_attn", "model.layers.3.self_attn", "model.layers.1.mlp"]
            }
        });
        let spec = spec_from_config("m", "c.json", &cfg).unwrap();
        assert_eq!(spec.quantization.unconverted_attention_layers, 2);
        assert_eq!(spec.quantization.unconverted_mlp_layers, 1);
        let cfg = serde_json::json!({
            "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "vocab_size": 100,
            "quantization_config": {
                "quant_method": "bitsandbytes", "load_in_4bit": true,
                "bnb_4bit_use_double_quant": true, "llm_int8_skip_modules": ["self_attn"]
            }
        });
        let spec = spec_from_config("m", "c.json", &cfg).unwrap();
        assert!(spec.quantization.double_quant);
        assert_eq!(spec.quantization.unconverted_attention_layers, 4);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_plan::kv::{KvCacheDtype, KvLayout, KvSettings};
    use serde_json::json;

    fn per_token(spec: &ModelSpec, tp: u64) -> u64 {
        KvLayout::new(
            spec,
            KvSettings {
                dtype: KvCacheDtype::Auto,
                tensor_parallel_size: tp,
                block_size: 16,
                hybrid_manager: true,
            },
        )
        .bytes_per_token()
    }

    #[test]
    fn qwen2_ignores_its_disabled_sliding_window() {
        let cfg = json!({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":3584,
            "intermediate_size":18944,"num_hidden_layers":28,"num_attention_heads":28,"num_key_value_heads":4,
            "vocab_size":152064,"max_position_embeddings":32768,"sliding_window":131072,"use_sliding_window":false,
            "max_window_layers":28,"tie_word_embeddings":false,"torch_dtype":"bfloat16"});
        let spec = spec_from_config("qwen", "config.json", &cfg).unwrap();
        assert_eq!(spec.sliding_window, None);
        assert_eq!(per_token(&spec, 1), 57_344);
    }

    #[test]
    fn gemma3_nests_its_text_config_and_slides_five_of_six_layers() {
        let cfg = json!({"architectures":["Gemma3ForConditionalGeneration"],"model_type":"gemma3",
            "text_config":{"model_type":"gemma3_text","hidden_size":5376,"intermediate_size":21504,
            "num_hidden_layers":62,"num_attention_heads":32,"num_key_value_heads":16,"head_dim":128,
            "sliding_window":1024,"sliding_window_pattern":6,"vocab_size":262208,"max_position_embeddings":131072},
            "vision_config":{"hidden_size":1152,"intermediate_size":4304,"num_hidden_layers":27},
            "torch_dtype":"bfloat16"});
        let spec = spec_from_config("gemma", "config.json", &cfg).unwrap();
        assert_eq!(spec.num_sliding_layers, 52);
        assert_eq!(spec.sliding_window, Some(1024));
        assert!(spec.tie_word_embeddings);
        assert!(spec.extra_params > 400_000_000);
    }

    #[test]
    fn deepseek_mla_and_moe() {
        let cfg = json!({"architectures":["DeepseekV2ForCausalLM"],"model_type":"deepseek_v2","hidden_size":2048,
            "intermediate_size":10944,"moe_intermediate_size":1408,"num_hidden_layers":27,"num_attention_heads":16,
            "num_key_value_heads":16,"n_routed_experts":64,"n_shared_experts":2,"num_experts_per_tok":6,
            "first_k_dense_replace":1,"kv_lora_rank":512,"q_lora_rank":null,"qk_rope_head_dim":64,
            "qk_nope_head_dim":128,"v_head_dim":128,"vocab_size":102400,"max_position_embeddings":163840,
            "torch_dtype":"bfloat16"});
        let spec = spec_from_config("dsv2", "config.json", &cfg).unwrap();
        assert_eq!(per_token(&spec, 1), 31_104);
        let moe = spec.moe.unwrap();
        assert_eq!(
            (
                moe.num_experts,
                moe.num_shared_experts,
                moe.first_dense_layers
            ),
            (64, 2, 1)
        );
        let params = headroom_plan::weights::param_counts(&spec).total();
        assert!(
            (15_000_000_000..16_500_000_000).contains(&params),
            "{params}"
        );
    }

    #[test]
    fn awq_quantization_config_is_read() {
        let cfg = json!({"model_type":"qwen2","hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,
            "vocab_size":100,"quantization_config":{"quant_method":"awq","bits":4,"group_size":128}});
        let spec = spec_from_config("q", "config.json", &cfg).unwrap();
        assert_eq!(spec.quantization.scheme, QuantScheme::Awq);
        assert_eq!(spec.num_kv_heads, 4);
    }

    #[test]
    fn gpt_oss_quantizes_only_experts() {
        let cfg = json!({"model_type":"gpt_oss","hidden_size":2880,"intermediate_size":2880,"num_hidden_layers":24,
            "num_attention_heads":64,"num_key_value_heads":8,"head_dim":64,"num_local_experts":32,
            "num_experts_per_tok":4,"vocab_size":201088,"sliding_window":128,
            "layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],
            "quantization_config":{"quant_method":"mxfp4","modules_to_not_convert":["model.layers.*.self_attn","model.layers.*.mlp.router","model.embed_tokens","lm_head"]}});
        let spec = spec_from_config("oss", "config.json", &cfg).unwrap();
        assert!(spec.quantization.experts_only);
        assert_eq!(spec.num_sliding_layers, 2);
        assert_eq!(spec.moe.unwrap().num_experts, 32);
    }

    #[test]
    fn whisper_is_an_encoder_decoder() {
        let cfg = json!({"model_type":"whisper","architectures":["WhisperForConditionalGeneration"],"d_model":1280,
            "decoder_layers":32,"encoder_layers":32,"decoder_attention_heads":20,"encoder_attention_heads":20,
            "decoder_ffn_dim":5120,"encoder_ffn_dim":5120,"vocab_size":51866,"max_source_positions":1500,
            "max_target_positions":448,"num_mel_bins":128,"torch_dtype":"float16"});
        let spec = spec_from_config("whisper", "config.json", &cfg).unwrap();
        assert_eq!(spec.kind, ModelKind::SpeechToText);
        let params = headroom_plan::weights::param_counts(&spec).total();
        // whisper-large-v3 has 1.55 B parameters.
        assert!((1_500_000_000..1_600_000_000).contains(&params), "{params}");
    }

    #[test]
    fn layers_that_are_not_attention_are_named_not_guessed() {
        // Qwen3-Next: three linear-attention (Gated DeltaNet) layers to every full one.
        let mut types = Vec::new();
        for i in 0..48 {
            types.push(if i % 4 == 3 {
                "full_attention"
            } else {
                "linear_attention"
            });
        }
        let cfg = json!({"architectures":["Qwen3NextForCausalLM"],"model_type":"qwen3_next",
            "hidden_size":2048,"num_hidden_layers":48,"num_attention_heads":16,"num_key_value_heads":2,
            "vocab_size":151936,"layer_types":types});
        let err = spec_from_config("Qwen/Qwen3-Next-80B-A3B-Instruct", "c.json", &cfg).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, InspectError::Unsupported { .. }), "{text}");
        assert!(text.contains("Qwen3NextForCausalLM"), "{text}");
        assert!(
            text.contains("36 of 48 layers are 'linear_attention'"),
            "{text}"
        );
        // Nemotron-H's pattern and a plain Mamba.
        let cfg = json!({"architectures":["NemotronHForCausalLM"],"model_type":"nemotron_h",
            "hidden_size":4096,"num_hidden_layers":4,"num_attention_heads":32,"vocab_size":1000,
            "hybrid_override_pattern":"M-M*"});
        let text = spec_from_config("n", "c.json", &cfg)
            .unwrap_err()
            .to_string();
        assert!(text.contains("2 of 4 layers are 'mamba'"), "{text}");
        let cfg = json!({"model_type":"mamba","hidden_size":768,"num_hidden_layers":24,"vocab_size":50280});
        let text = spec_from_config("m", "c.json", &cfg)
            .unwrap_err()
            .to_string();
        assert!(text.contains("model_type 'mamba'"), "{text}");
        // Attention-only layer types are planned as before.
        let cfg = json!({"model_type":"gpt_oss","hidden_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":100,"sliding_window":8,
            "layer_types":["sliding_attention","full_attention"]});
        assert!(spec_from_config("o", "c.json", &cfg).is_ok());
    }

    #[test]
    fn a_vision_towers_linear_layers_are_counted_apart() {
        // Gemma 3's SigLIP: 4,304 is not a multiple of 64, so vLLM leaves its MLP unquantized.
        let cfg = json!({"model_type":"gemma3","text_config":{"model_type":"gemma3_text",
            "hidden_size":2560,"intermediate_size":10240,"num_hidden_layers":34},
            "vision_config":{"hidden_size":1152,"intermediate_size":4304,"num_hidden_layers":27}});
        let spec = spec_from_config("g", "c.json", &cfg).unwrap();
        assert_eq!(spec.extra_params, 27 * (4 * 1152 * 1152 + 2 * 1152 * 4304));
        assert_eq!(spec.extra_linear_params, 27 * 4 * 1152 * 1152);
        let cfg = json!({"model_type":"x","hidden_size":64,"num_hidden_layers":2,
            "num_attention_heads":4,"vocab_size":100,
            "vision_config":{"hidden_size":1280,"intermediate_size":5120,"depth":32}});
        let spec = spec_from_config("q", "c.json", &cfg).unwrap();
        assert_eq!(spec.extra_linear_params, spec.extra_params);
    }

    #[test]
    fn a_missing_field_is_named_with_its_file() {
        let cfg =
            json!({"model_type":"llama","hidden_size":64,"num_attention_heads":4,"vocab_size":100});
        let err = spec_from_config("x", "/models/x/config.json", &cfg).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/models/x/config.json has no 'num_hidden_layers', which the plan needs"
        );
    }
}
