//! KV-cache arithmetic as vLLM's paged allocator does it: bytes per token per layer for each
//! attention kind, the grouping of layers into pages, blocks from a byte budget, blocks one request
//! needs, and the longest sequence a budget can hold.

use serde::{Deserialize, Serialize};

use crate::spec::ModelSpec;
use crate::units::cdiv;

/// `--kv-cache-dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtype {
    /// The model dtype.
    Auto,
    /// One byte per element (`fp8`, `fp8_e4m3`, `fp8_e5m2`).
    Fp8,
}

impl KvCacheDtype {
    pub fn parse(s: &str) -> Option<KvCacheDtype> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" | "fp8_e5m2" => Some(KvCacheDtype::Fp8),
            _ => None,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Fp8 => "fp8",
        }
    }

    fn element_bytes(self, spec: &ModelSpec) -> u64 {
        match self {
            KvCacheDtype::Auto => spec.dtype.bytes(),
            KvCacheDtype::Fp8 => 1,
        }
    }
}

/// The attention kind of one group of layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LayerKind {
    /// Full-length self-attention (MHA, GQA or MLA).
    Full,
    /// Sliding-window self-attention over `window` tokens.
    Sliding { window: u64 },
    /// Cross-attention over `positions` encoder outputs (Whisper).
    Cross { positions: u64 },
}

/// Layers of one kind and what each costs per token on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerGroup {
    pub kind: LayerKind,
    pub layers: u64,
    pub bytes_per_token_per_layer: u64,
}

/// The KV layout of a model on one rank under given settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvLayout {
    pub groups: Vec<LayerGroup>,
    pub block_size: u64,
    /// Whether sliding layers keep only their window (vLLM's hybrid KV-cache manager).
    pub hybrid_manager: bool,
}

/// Settings that change the KV layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSettings {
    pub dtype: KvCacheDtype,
    pub tensor_parallel_size: u64,
    pub block_size: u64,
    pub hybrid_manager: bool,
}

/// Bytes of K and V one token costs in one layer on one rank.
pub fn bytes_per_token_per_layer(spec: &ModelSpec, dtype: KvCacheDtype, tp: u64) -> u64 {
    let b = dtype.element_bytes(spec);
    match spec.mla {
        // One latent vector (compressed KV + the rope key), no separate V, not split across ranks.
        Some(m) => (m.kv_lora_rank + m.qk_rope_head_dim) * b,
        None => {
            let heads_per_rank = (spec.num_kv_heads / tp.max(1)).max(1);
            heads_per_rank * (spec.head_dim + spec.head_dim_v) * b
        }
    }
}

impl KvLayout {
    pub fn new(spec: &ModelSpec, s: KvSettings) -> KvLayout {
        let per_layer = bytes_per_token_per_layer(spec, s.dtype, s.tensor_parallel_size);
        let mut groups = Vec::new();
        let sliding = spec.num_sliding_layers.min(spec.num_layers);
        let full = spec.num_layers - sliding;
        match spec.sliding_window {
            Some(window) if sliding > 0 && s.hybrid_manager => {
                if full > 0 {
                    groups.push(LayerGroup {
                        kind: LayerKind::Full,
                        layers: full,
                        bytes_per_token_per_layer: per_layer,
                    });
                }
                groups.push(LayerGroup {
                    kind: LayerKind::Sliding { window },
                    layers: sliding,
                    bytes_per_token_per_layer: per_layer,
                });
            }
            _ => groups.push(LayerGroup {
                kind: LayerKind::Full,
                layers: spec.num_layers,
                bytes_per_token_per_layer: per_layer,
            }),
        }
        if let Some(ed) = spec.encoder_decoder {
            groups.push(LayerGroup {
                kind: LayerKind::Cross {
                    positions: ed.encoder_positions,
                },
                layers: spec.num_layers,
                bytes_per_token_per_layer: per_layer,
            });
        }
        KvLayout {
            groups,
            block_size: s.block_size.max(1),
            hybrid_manager: s.hybrid_manager,
        }
    }

    /// Bytes one token costs across every self-attention layer (the figure usually quoted).
    pub fn bytes_per_token(&self) -> u64 {
        self.groups
            .iter()
            .filter(|g| !matches!(g.kind, LayerKind::Cross { .. }))
            .map(|g| g.layers * g.bytes_per_token_per_layer)
            .sum()
    }

    /// Bytes of one block of one layer (vLLM's `page_size_bytes`).
    pub fn page_bytes(&self) -> u64 {
        self.groups
            .iter()
            .map(|g| g.bytes_per_token_per_layer)
            .max()
            .unwrap_or(0)
            * self.block_size
    }

    fn is_uniform(&self) -> bool {
        self.groups.len() == 1
    }

    /// How many layers share one block id: all layers for a uniform model; for hybrid models the
    /// size vLLM picks for its groups (the smallest per-kind layer count, or the largest when the
    /// counts are within 25 % of each other so no padding is needed).
    pub fn group_size(&self) -> u64 {
        if self.is_uniform() {
            return self.groups[0].layers.max(1);
        }
        let min = self
            .groups
            .iter()
            .map(|g| g.layers)
            .min()
            .unwrap_or(1)
            .max(1);
        let max = self.groups.iter().map(|g| g.layers).max().unwrap_or(1);
        if (max as f64) < min as f64 * 1.25 {
            max
        } else {
            min
        }
    }

    /// Groups of `group_size` layers each kind is split into.
    fn groups_of(&self, g: &LayerGroup) -> u64 {
        if self.is_uniform() {
            1
        } else {
            cdiv(g.layers, self.group_size())
        }
    }

    /// Number of KV groups vLLM creates.
    pub fn num_kv_groups(&self) -> u64 {
        self.groups.iter().map(|g| self.groups_of(g)).sum()
    }

    /// Bytes of one block id across the layers that share it.
    pub fn bytes_per_block(&self) -> u64 {
        self.page_bytes() * self.group_size()
    }

    /// Blocks a byte budget holds (vLLM: `available // page_size // layers_per_group`).
    pub fn num_blocks(&self, kv_bytes: u64) -> u64 {
        let page = self.page_bytes();
        if page == 0 {
            return 0;
        }
        kv_bytes / page / self.group_size()
    }

    /// Tokens vLLM reports as "GPU KV cache size" for `num_blocks` blocks.
    pub fn tokens(&self, num_blocks: u64) -> u64 {
        num_blocks / self.num_kv_groups().max(1) * self.block_size
    }

    /// Blocks one request of `seq_len` tokens holds at its peak.
    pub fn blocks_per_request(&self, seq_len: u64, max_num_batched_tokens: u64) -> u64 {
        let bs = self.block_size;
        self.groups
            .iter()
            .map(|g| {
                let per_group = match g.kind {
                    LayerKind::Full => cdiv(seq_len, bs),
                    LayerKind::Sliding { window } => {
                        let held = (window.saturating_sub(1) + max_num_batched_tokens).min(seq_len);
                        cdiv(held, bs) + 1
                    }
                    LayerKind::Cross { positions } => cdiv(positions, bs),
                };
                per_group * self.groups_of(g)
            })
            .sum()
    }

    /// Bytes one request of `seq_len` tokens needs.
    pub fn bytes_per_request(&self, seq_len: u64, max_num_batched_tokens: u64) -> u64 {
        self.blocks_per_request(seq_len, max_num_batched_tokens) * self.bytes_per_block()
    }

    /// Requests of `seq_len` the pool serves at once (vLLM's "Maximum concurrency").
    pub fn max_concurrency(&self, num_blocks: u64, seq_len: u64, mbt: u64) -> f64 {
        let per = self.blocks_per_request(seq_len, mbt);
        if per == 0 {
            return 0.0;
        }
        num_blocks as f64 / per as f64
    }

    /// Longest sequence whose KV fits in `kv_bytes`, found by binary search the way vLLM's
    /// `estimate_max_model_len` does. Returns 0 when not even one token fits.
    pub fn max_seq_len_for(&self, kv_bytes: u64, upper: u64, mbt: u64) -> u64 {
        let fits = |len: u64| self.bytes_per_request(len, mbt) <= kv_bytes;
        if upper == 0 || !fits(1) {
            return 0;
        }
        let (mut lo, mut hi) = (1u64, upper);
        if fits(hi) {
            return hi;
        }
        while lo + 1 < hi {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{EncoderDecoder, Mla};
    use crate::units::GIB;

    fn settings(dtype: KvCacheDtype, tp: u64) -> KvSettings {
        KvSettings {
            dtype,
            tensor_parallel_size: tp,
            block_size: 16,
            hybrid_manager: true,
        }
    }

    fn llama_8b() -> ModelSpec {
        ModelSpec::dense("llama", 4096, 14336, 32, 32, 8, 128_256)
    }

    #[test]
    fn gqa_bytes_per_token() {
        let l = KvLayout::new(&llama_8b(), settings(KvCacheDtype::Auto, 1));
        assert_eq!(l.bytes_per_token(), 131_072);
        let l = KvLayout::new(&llama_8b(), settings(KvCacheDtype::Fp8, 1));
        assert_eq!(l.bytes_per_token(), 65_536);
    }

    #[test]
    fn blocks_tokens_and_concurrency_from_a_fixed_budget() {
        let l = KvLayout::new(&llama_8b(), settings(KvCacheDtype::Auto, 1));
        let blocks = l.num_blocks(4 * GIB);
        assert_eq!(blocks, 2048);
        assert_eq!(l.tokens(blocks), 32_768);
        assert_eq!(l.max_concurrency(blocks, 8192, 2048), 4.0);
    }

    #[test]
    fn mla_is_one_latent_and_not_split_by_tp() {
        let mut spec = ModelSpec::dense("dsv2-lite", 2048, 10944, 27, 16, 16, 102_400);
        spec.mla = Some(Mla {
            kv_lora_rank: 512,
            qk_rope_head_dim: 64,
            qk_nope_head_dim: 128,
            v_head_dim: 128,
            q_lora_rank: None,
        });
        for tp in [1, 2, 4] {
            let l = KvLayout::new(&spec, settings(KvCacheDtype::Auto, tp));
            assert_eq!(l.bytes_per_token(), 31_104);
        }
    }

    #[test]
    fn heads_are_replicated_once_tp_exceeds_them() {
        let spec = llama_8b();
        let per = |tp| KvLayout::new(&spec, settings(KvCacheDtype::Auto, tp)).bytes_per_token();
        assert_eq!(per(8), 16_384);
        assert_eq!(per(16), 16_384);
    }

    #[test]
    fn sliding_layers_hold_only_their_window_with_the_hybrid_manager() {
        // gpt-oss-120b: 36 layers, half sliding over 128 tokens, 8 KV heads of 64.
        let mut spec = ModelSpec::dense("gpt-oss-120b", 2880, 2880, 36, 64, 8, 201_088);
        spec.head_dim = 64;
        spec.head_dim_v = 64;
        spec.sliding_window = Some(128);
        spec.num_sliding_layers = 18;
        let hybrid = KvLayout::new(&spec, settings(KvCacheDtype::Auto, 1));
        assert_eq!(hybrid.group_size(), 18);
        assert_eq!(hybrid.num_kv_groups(), 2);
        // 5.38 GiB of KV gives vLLM's logged 78,384 tokens within one block group.
        let blocks = hybrid.num_blocks((5.38 * GIB as f64) as u64);
        let tokens = hybrid.tokens(blocks);
        assert!((78_000..78_500).contains(&tokens), "{tokens}");
        // A long request needs far fewer blocks than with every layer at full length.
        let mut off = settings(KvCacheDtype::Auto, 1);
        off.hybrid_manager = false;
        let full = KvLayout::new(&spec, off);
        assert!(hybrid.bytes_per_request(131_072, 8192) < full.bytes_per_request(131_072, 8192));
    }

    #[test]
    fn whisper_cross_attention_costs_the_encoder_length_per_request() {
        let mut spec = ModelSpec::dense("whisper", 1280, 5120, 32, 20, 20, 51_866);
        spec.encoder_decoder = Some(EncoderDecoder {
            encoder_layers: 32,
            encoder_positions: 1500,
            num_mel_bins: 128,
        });
        let l = KvLayout::new(&spec, settings(KvCacheDtype::Auto, 1));
        assert_eq!(l.bytes_per_token(), 32 * 2 * 20 * 64 * 2);
        // 448 decoder tokens (28 blocks) + 1500 encoder positions (94 blocks), in two groups.
        assert_eq!(l.blocks_per_request(448, 8192), 28 + 94);
    }

    #[test]
    fn longest_sequence_search_matches_a_direct_check() {
        let l = KvLayout::new(&llama_8b(), settings(KvCacheDtype::Auto, 1));
        let kv = (1.1 * GIB as f64) as u64;
        let len = l.max_seq_len_for(kv, 131_072, 2048);
        assert!(l.bytes_per_request(len, 2048) <= kv);
        assert!(l.bytes_per_request(len + 16, 2048) > kv);
        assert_eq!(l.max_seq_len_for(0, 131_072, 2048), 0);
    }
}
