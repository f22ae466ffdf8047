//! GGUF metadata: the key/value header and the tensor table (names, shapes, ggml types), read
//! without touching tensor data. Exact weight bytes come from the types' block sizes.

use std::collections::BTreeMap;
use std::io::Read;

use headroom_plan::{Dtype, ExactWeights, ModelKind, ModelSpec, Quantization, WeightsOrigin};

use crate::InspectError;

/// A metadata value; arrays keep only their length and, for strings and numbers, nothing else
/// (tokenizer vocabularies can hold hundreds of thousands of entries).
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array { len: u64 },
}

impl MetaValue {
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            MetaValue::Int(i) if *i >= 0 => u64::try_from(*i).ok(),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    pub bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct GgufMeta {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
}

/// `(block elements, bytes per block)` of a ggml tensor type.
fn ggml_block(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0
        3 => (32, 20),    // Q4_1
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        16 => (256, 66),  // IQ2_XXS
        17 => (256, 74),  // IQ2_XS
        18 => (256, 98),  // IQ3_XXS
        19 => (256, 50),  // IQ1_S
        20 => (32, 18),   // IQ4_NL
        21 => (256, 110), // IQ3_S
        22 => (256, 82),  // IQ2_S
        23 => (256, 136), // IQ4_XS
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        29 => (256, 56),  // IQ1_M
        30 => (1, 2),     // BF16
        34 => (256, 54),  // TQ1_0
        35 => (256, 66),  // TQ2_0
        39 => (32, 17),   // MXFP4
        _ => return None,
    })
}

struct Reader<R> {
    inner: R,
    file: String,
}

/// Caps that keep a corrupt file from asking for absurd allocations.
const MAX_STRING: u64 = 1 << 20;
const MAX_COUNT: u64 = 1 << 24;

impl<R: Read> Reader<R> {
    fn err(&self, reason: impl Into<String>) -> InspectError {
        InspectError::Malformed {
            file: self.file.clone(),
            reason: reason.into(),
        }
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], InspectError> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|_| self.err("GGUF header ends early"))?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32, InspectError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64, InspectError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String, InspectError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.err(format!("string of {len} bytes in GGUF header")));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| self.err("GGUF string ends early"))?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
    fn skip(&mut self, n: u64) -> Result<(), InspectError> {
        let copied = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|_| self.err("GGUF header ends early"))?;
        if copied != n {
            return Err(self.err("GGUF header ends early"));
        }
        Ok(())
    }
    fn value(&mut self, ty: u32) -> Result<MetaValue, InspectError> {
        Ok(match ty {
            0 => MetaValue::Int(self.bytes::<1>()?[0] as i128),
            1 => MetaValue::Int(self.bytes::<1>()?[0] as i8 as i128),
            2 => MetaValue::Int(u16::from_le_bytes(self.bytes()?) as i128),
            3 => MetaValue::Int(i16::from_le_bytes(self.bytes()?) as i128),
            4 => MetaValue::Int(self.u32()? as i128),
            5 => MetaValue::Int(i32::from_le_bytes(self.bytes()?) as i128),
            6 => MetaValue::Float(f32::from_le_bytes(self.bytes()?) as f64),
            7 => MetaValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => MetaValue::Str(self.string()?),
            9 => {
                let item = self.u32()?;
                let len = self.u64()?;
                if len > MAX_COUNT * 16 {
                    return Err(self.err(format!("array of {len} items in GGUF header")));
                }
                match item {
                    8 => {
                        for _ in 0..len {
                            let n = self.u64()?;
                            if n > MAX_STRING {
                                return Err(self.err("oversized string in GGUF array"));
                            }
                            self.skip(n)?;
                        }
                    }
                    9 => return Err(self.err("nested GGUF arrays are not supported")),
                    t => {
                        let size = match t {
                            0 | 1 | 7 => 1,
                            2 | 3 => 2,
                            4..=6 => 4,
                            10..=12 => 8,
                            _ => return Err(self.err(format!("unknown GGUF value type {t}"))),
                        };
                        self.skip(len * size)?;
                    }
                }
                MetaValue::Array { len }
            }
            10 => MetaValue::Int(self.u64()? as i128),
            11 => MetaValue::Int(i64::from_le_bytes(self.bytes()?) as i128),
            12 => MetaValue::Float(f64::from_le_bytes(self.bytes()?)),
            t => return Err(self.err(format!("unknown GGUF value type {t}"))),
        })
    }
}

/// Reads the metadata and tensor table of a GGUF stream.
pub fn read_gguf(reader: impl Read, file: &str) -> Result<GgufMeta, InspectError> {
    let mut r = Reader {
        inner: reader,
        file: file.to_string(),
    };
    if &r.bytes::<4>()? != b"GGUF" {
        return Err(r.err("no GGUF magic"));
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(r.err(format!("GGUF version {version} is not supported")));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    if tensor_count > MAX_COUNT || kv_count > MAX_COUNT {
        return Err(r.err("implausible tensor or key count"));
    }
    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = r.string()?;
        let ty = r.u32()?;
        let v = r.value(ty)?;
        metadata.insert(key, v);
    }
    let mut tensors = Vec::with_capacity(tensor_count.min(65_536) as usize);
    for _ in 0..tensor_count {
        let name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims > 8 {
            return Err(r.err(format!("tensor '{name}' has {n_dims} dimensions")));
        }
        let dims = (0..n_dims)
            .map(|_| r.u64())
            .collect::<Result<Vec<_>, _>>()?;
        let ggml_type = r.u32()?;
        let _offset = r.u64()?;
        let (block, size) = ggml_block(ggml_type)
            .ok_or_else(|| r.err(format!("tensor '{name}' has unknown ggml type {ggml_type}")))?;
        // Dimensions come from the file: a product or size past u64 is a broken file, not a
        // model (found by the fuzz harness: it overflowed here).
        let bytes = dims
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(*d))
            .and_then(|elements| elements.div_ceil(block).checked_mul(size))
            .ok_or_else(|| r.err(format!("tensor '{name}' is larger than 2^64 bytes")))?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            bytes,
        });
    }
    Ok(GgufMeta {
        version,
        metadata,
        tensors,
    })
}

impl GgufMeta {
    fn get_u(&self, key: &str) -> Option<u64> {
        self.metadata.get(key).and_then(MetaValue::as_u64)
    }

    pub fn tensor_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |acc, t| acc.saturating_add(t.bytes))
    }

    /// A spec from `{arch}.*` keys; weights exact from the tensor table.
    pub fn to_spec(&self, name: &str, file: &str) -> Result<ModelSpec, InspectError> {
        let arch = match self.metadata.get("general.architecture") {
            Some(MetaValue::Str(a)) => a.clone(),
            _ => {
                return Err(InspectError::MissingField {
                    field: "general.architecture".into(),
                    file: file.into(),
                });
            }
        };
        let need = |k: &str| {
            let key = format!("{arch}.{k}");
            self.get_u(&key).ok_or(InspectError::MissingField {
                field: key,
                file: file.to_string(),
            })
        };
        let hidden = need("embedding_length")?;
        let layers = need("block_count")?;
        let heads = need("attention.head_count")?;
        let kv_heads = self
            .get_u(&format!("{arch}.attention.head_count_kv"))
            .unwrap_or(heads);
        let head_dim = self
            .get_u(&format!("{arch}.attention.key_length"))
            .unwrap_or(hidden / heads.max(1));
        let head_dim_v = self
            .get_u(&format!("{arch}.attention.value_length"))
            .unwrap_or(head_dim);
        let vocab = self
            .get_u(&format!("{arch}.vocab_size"))
            .or_else(|| match self.metadata.get("tokenizer.ggml.tokens") {
                Some(MetaValue::Array { len }) => Some(*len),
                _ => None,
            })
            .unwrap_or(0);
        let tied = !self.tensors.iter().any(|t| t.name == "output.weight");
        let dense_dtype = if self.tensors.iter().any(|t| t.ggml_type == 30) {
            Dtype::Bf16
        } else {
            Dtype::F16
        };
        let sliding = self.get_u(&format!("{arch}.attention.sliding_window"));
        let experts = self.get_u(&format!("{arch}.expert_count")).unwrap_or(0);
        let intermediate = self
            .get_u(&format!("{arch}.feed_forward_length"))
            .unwrap_or(4 * hidden);
        Ok(ModelSpec {
            name: name.to_string(),
            source: file.to_string(),
            architecture: arch.clone(),
            kind: if arch == "whisper" {
                ModelKind::SpeechToText
            } else {
                ModelKind::Text
            },
            dtype: dense_dtype,
            hidden_size: hidden,
            intermediate_size: intermediate,
            gated_mlp: true,
            num_layers: layers,
            num_attention_heads: heads,
            num_kv_heads: kv_heads,
            head_dim,
            head_dim_v,
            vocab_size: vocab,
            tie_word_embeddings: tied,
            max_position_embeddings: self
                .get_u(&format!("{arch}.context_length"))
                .unwrap_or(4096),
            positions_known: self.get_u(&format!("{arch}.context_length")).is_some(),
            sliding_window: sliding,
            num_sliding_layers: if sliding.is_some() { layers } else { 0 },
            mla: None,
            moe: (experts > 1).then(|| headroom_plan::Moe {
                num_experts: experts,
                experts_per_token: self
                    .get_u(&format!("{arch}.expert_used_count"))
                    .unwrap_or(2),
                expert_intermediate_size: self
                    .get_u(&format!("{arch}.expert_feed_forward_length"))
                    .unwrap_or(intermediate),
                num_shared_experts: 0,
                shared_intermediate_size: 0,
                first_dense_layers: 0,
                gated: true,
            }),
            quantization: Quantization::NONE,
            encoder_decoder: None,
            audio_tokenizer: None,
            extra_params: 0,
            extra_dtype: dense_dtype,
            extra_linear_params: 0,
            exact_weights: Some(ExactWeights {
                bytes: self.tensor_bytes(),
                origin: WeightsOrigin::GgufTensors,
            }),
            weight_components: Vec::new(),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a small GGUF v3 file: llama metadata and the given tensors.
    pub(crate) fn build_gguf(tensors: &[(&str, &[u64], u32)]) -> Vec<u8> {
        let mut out = Vec::new();
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        out.extend(b"GGUF");
        out.extend(3u32.to_le_bytes());
        out.extend((tensors.len() as u64).to_le_bytes());
        let kvs: Vec<(&str, u64)> = vec![
            ("llama.block_count", 2),
            ("llama.embedding_length", 64),
            ("llama.feed_forward_length", 128),
            ("llama.attention.head_count", 4),
            ("llama.attention.head_count_kv", 2),
            ("llama.context_length", 2048),
        ];
        out.extend((kvs.len() as u64 + 2).to_le_bytes());
        string(&mut out, "general.architecture");
        out.extend(8u32.to_le_bytes());
        string(&mut out, "llama");
        for (k, v) in kvs {
            string(&mut out, k);
            out.extend(4u32.to_le_bytes());
            out.extend((v as u32).to_le_bytes());
        }
        string(&mut out, "tokenizer.ggml.tokens");
        out.extend(9u32.to_le_bytes());
        out.extend(8u32.to_le_bytes());
        out.extend(3u64.to_le_bytes());
        for t in ["a", "bc", "def"] {
            string(&mut out, t);
        }
        for (name, dims, ty) in tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(0u64.to_le_bytes());
        }
        out
    }

    #[test]
    fn reads_metadata_and_exact_tensor_bytes() {
        let data = build_gguf(&[
            ("token_embd.weight", &[64, 3], 1),
            ("blk.0.attn_q.weight", &[64, 64], 12),
            ("blk.0.ffn_down.weight", &[128, 64], 3),
        ]);
        let meta = read_gguf(&data[..], "m.gguf").unwrap();
        assert_eq!(meta.tensors.len(), 3);
        // F16: 192 × 2; Q4_K: 4096 / 256 × 144; Q4_1: 8192 / 32 × 20.
        assert_eq!(meta.tensor_bytes(), 384 + 2304 + 5120);
        let spec = meta.to_spec("m", "m.gguf").unwrap();
        assert_eq!(
            (spec.num_layers, spec.num_kv_heads, spec.vocab_size),
            (2, 2, 3)
        );
        assert!(spec.tie_word_embeddings);
        assert_eq!(spec.exact_weights.unwrap().bytes, 7808);
    }

    #[test]
    fn truncated_or_foreign_files_are_errors() {
        let data = build_gguf(&[("x", &[4], 0)]);
        for cut in [0, 3, 10, 30, data.len() - 1] {
            assert!(read_gguf(&data[..cut], "m.gguf").is_err(), "cut at {cut}");
        }
        assert!(read_gguf(&b"GGML\x03\x00\x00\x00"[..], "m.gguf").is_err());
    }
}
