//! llama.cpp's memory, reproduced from its source: context padding (`llama-context.cpp`), KV
//! cells and bytes per layer by ggml type (`llama-kv-cache.cpp`, `llama-kv-cache-iswa.cpp`),
//! layer placement for `--n-gpu-layers` (`llama-model.cpp`), the output buffer, and a model of the
//! compute buffer the scheduler reserves for the worst-case graph. Pure arithmetic: callers hand
//! in the GGUF shape and the server flags; [`plan`] returns bytes per device, and
//! [`largest_ctx`] / [`fit_n_gpu_layers`] answer the inverse questions for a byte budget.
//!
//! Rules, each from llama.cpp's source (build of late 2026, the one the `xllamacpp` wheel embeds):
//! * `n_ctx = pad(n_ctx, 256)`; without `--kv-unified` each of the `--parallel` sequences gets its
//!   own stream of `n_ctx_seq = pad(n_ctx / n_parallel, 256)` cells and `n_ctx = n_ctx_seq ×
//!   n_parallel`; with `--kv-unified` one stream holds all `n_ctx` cells.
//! * Per layer and stream the K tensor is `ggml_row_size(type_k, n_embd_k_gqa) × cells` bytes
//!   (V the same with `type_v`, absent for MLA); block types carry their scales (q8_0: 34 bytes per
//!   32 values). Sliding-window layers hold `pad(min(cells, n_swa × (unified ? n_seq : 1) +
//!   n_ubatch), 256)` cells unless `--swa-full`.
//! * `i_gpu_start = max(n_layer + 1 − ngl, 0)`: repeating layer `il` sits on the GPU when
//!   `il ≥ i_gpu_start`, the output layer (slot `n_layer`) as soon as `ngl ≥ 1`; the token
//!   embeddings always stay on the host. A layer's KV lives where the layer lives unless
//!   `--no-kv-offload`.
//! * `n_batch = min(n_ctx, --batch-size)`, `n_ubatch = min(n_batch, --ubatch-size)`; the output
//!   buffer holds `n_seq_max × n_vocab` f32 logits; a quantized V cache needs flash attention.
//! * Compute buffer: ggml-alloc's high-water mark over the reserved worst-case graph of `n_ubatch`
//!   tokens. With flash attention the peak is the feed-forward block (gate, up and their product:
//!   `3 × n_ff`, plus five `n_embd` rows of residual/norm/attention tensors, f32) and the f16 KQ
//!   mask (`cells_per_stream × n_ubatch × 2`); without it the f32 scores `n_kv × n_ubatch ×
//!   n_head` and the f32 mask dominate, beside five rows of the Q (`n_head × head_dim`) and KV
//!   widths. A model with sliding-window layers has two masks as graph inputs, one over the full
//!   cache's cells and one over the window's. Measured against the real server in
//!   `tests/it/plan_llamacpp.rs` (SmolLM2 and Gemma 3, within 15 %).

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::spec::ModelSpec;
use crate::weights::param_counts;

/// Padding llama.cpp applies to the context and to each sequence's cells.
pub const CTX_PAD: u64 = 256;
/// llama.cpp's default `--batch-size`.
pub const DEFAULT_BATCH: u64 = 2048;
/// llama.cpp's default `--ubatch-size`.
pub const DEFAULT_UBATCH: u64 = 512;
/// `--fit-target`'s default margin per device (MiB), the anchor our own fit is compared with.
pub const FIT_TARGET_MARGIN_BYTES: u64 = 1024 << 20;

/// KV cache element types `--cache-type-k` / `--cache-type-v` accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GgmlType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl GgmlType {
    pub const ALL: [GgmlType; 9] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Iq4Nl,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
    ];

    /// `(values per block, bytes per block)` from ggml's type traits.
    pub fn block(self) -> (u64, u64) {
        match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::Bf16 => (1, 2),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q4_0 | GgmlType::Iq4Nl => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
        }
    }

    /// `ggml_row_size`: bytes of a row of `n` values (`n` a multiple of the block size).
    pub fn row_bytes(self, n: u64) -> u64 {
        let (blk, bytes) = self.block();
        n.div_ceil(blk) * bytes
    }

    pub fn is_quantized(self) -> bool {
        self.block().0 > 1
    }

    /// The spelling llama.cpp's flags and logs use.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Bf16 => "bf16",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Iq4Nl => "iq4_nl",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
        }
    }

    pub fn parse(s: &str) -> Option<GgmlType> {
        let s = s.trim().to_ascii_lowercase();
        GgmlType::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// Flash attention setting (`--flash-attn on|off|auto`); `auto` resolves to on for the CPU and
/// CUDA backends, which support it for standard head sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FlashAttn {
    #[default]
    Auto,
    On,
    Off,
}

/// The shape of a GGUF model, as far as llama.cpp's buffers care.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaCppModel {
    pub name: String,
    /// Repeating blocks (`<arch>.block_count`).
    pub n_layer: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    /// `attention.key_length` (else `n_embd / n_head`); for MLA the latent + rope width.
    pub head_dim_k: u64,
    pub head_dim_v: u64,
    pub n_vocab: u64,
    pub n_ctx_train: u64,
    /// Sliding window in tokens and how many layers use it (0 when none).
    pub n_swa: u64,
    pub n_swa_layers: u64,
    /// MLA caches one latent per token and no V tensor.
    pub mla: bool,
    /// Bytes of each repeating block's tensors (`blk.N.*`), `n_layer` entries; when shorter the
    /// last entry (or the mean of `weights_bytes`) stands for the missing ones.
    pub layer_bytes: Vec<u64>,
    /// `token_embd.weight` (always on the host).
    pub token_embd_bytes: u64,
    /// `output.weight` + `output_norm.weight`; with tied embeddings llama.cpp duplicates
    /// `token_embd` for the output layer, so this is that size again.
    pub output_bytes: u64,
    /// The output layer reuses `token_embd` (no `output.weight`): on the host it is the same
    /// mapped tensor (no extra bytes), on the GPU a copy.
    #[serde(default)]
    pub output_tied: bool,
}

impl LlamaCppModel {
    fn layer(&self, il: u64) -> u64 {
        match self.layer_bytes.get(il as usize) {
            Some(b) => *b,
            None => self.layer_bytes.last().copied().unwrap_or(0),
        }
    }

    /// Every tensor's bytes as the GGUF holds them (a tied output is not stored twice).
    pub fn weights_bytes(&self) -> u64 {
        let output = if self.output_tied {
            self.output_bytes.saturating_sub(self.token_embd_bytes)
        } else {
            self.output_bytes
        };
        (0..self.n_layer).map(|il| self.layer(il)).sum::<u64>() + self.token_embd_bytes + output
    }

    fn n_embd_k_gqa(&self) -> u64 {
        self.n_head_kv * self.head_dim_k
    }

    fn n_embd_v_gqa(&self) -> u64 {
        self.n_head_kv * self.head_dim_v
    }
}

/// Uniform GGUF weight types for models known only by their shape (bits from ggml's block
/// sizes: q4_K stores 256 weights in 144 bytes, q6_K in 210, q8_0 32 in 34).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightType {
    F16,
    Bf16,
    Q8_0,
    Q6K,
    Q5K,
    Q4K,
    Q4_0,
}

impl WeightType {
    pub const ALL: [WeightType; 7] = [
        WeightType::F16,
        WeightType::Bf16,
        WeightType::Q8_0,
        WeightType::Q6K,
        WeightType::Q5K,
        WeightType::Q4K,
        WeightType::Q4_0,
    ];

    /// `(weights per block, bytes per block)`.
    pub fn block(self) -> (u64, u64) {
        match self {
            WeightType::F16 | WeightType::Bf16 => (1, 2),
            WeightType::Q8_0 => (32, 34),
            WeightType::Q6K => (256, 210),
            WeightType::Q5K => (256, 176),
            WeightType::Q4K => (256, 144),
            WeightType::Q4_0 => (32, 18),
        }
    }

    /// Bytes of `params` weights, rounded up to whole blocks.
    pub fn bytes(self, params: u64) -> u64 {
        let (blk, bytes) = self.block();
        params.div_ceil(blk) * bytes
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightType::F16 => "f16",
            WeightType::Bf16 => "bf16",
            WeightType::Q8_0 => "q8_0",
            WeightType::Q6K => "q6_k",
            WeightType::Q5K => "q5_k",
            WeightType::Q4K => "q4_k",
            WeightType::Q4_0 => "q4_0",
        }
    }

    pub fn parse(s: &str) -> Option<WeightType> {
        let s = s.trim().to_ascii_lowercase();
        let s = s
            .strip_suffix("_m")
            .or_else(|| s.strip_suffix("_s"))
            .unwrap_or(&s);
        WeightType::ALL.into_iter().find(|t| t.name() == s)
    }
}

impl LlamaCppModel {
    /// The llama.cpp shape of a model described by its Hugging Face config, with every weight
    /// matrix stored as `weights` (an estimate: real GGUF mixes keep some tensors wider).
    pub fn from_spec(spec: &ModelSpec, weights: WeightType) -> LlamaCppModel {
        let p = param_counts(spec);
        let layers = spec.num_layers.max(1);
        // `small` holds two norms per layer and the final norm (kept with the output layer).
        let final_norm = spec.hidden_size;
        let per_layer =
            (p.attention + p.dense_mlp + p.experts + p.small.saturating_sub(final_norm)) / layers;
        let (n_head_kv, head_dim_k, head_dim_v, mla) = match spec.mla {
            Some(m) => (1, m.kv_lora_rank + m.qk_rope_head_dim, 0, true),
            None => (spec.num_kv_heads, spec.head_dim, spec.head_dim_v, false),
        };
        let n_ff = match spec.moe {
            Some(m) => {
                m.expert_intermediate_size * m.experts_per_token
                    + m.shared_intermediate_size * m.num_shared_experts
            }
            None => spec.intermediate_size,
        };
        let embd = weights.bytes(p.embedding);
        LlamaCppModel {
            name: spec.name.clone(),
            n_layer: spec.num_layers,
            n_embd: spec.hidden_size,
            n_ff,
            n_head: spec.num_attention_heads,
            n_head_kv,
            head_dim_k,
            head_dim_v,
            n_vocab: spec.vocab_size,
            n_ctx_train: spec.max_position_embeddings,
            n_swa: spec.sliding_window.unwrap_or(0),
            n_swa_layers: if spec.sliding_window.is_some() {
                spec.num_sliding_layers
            } else {
                0
            },
            mla,
            layer_bytes: vec![weights.bytes(per_layer); spec.num_layers as usize],
            token_embd_bytes: embd,
            output_bytes: if spec.tie_word_embeddings {
                embd
            } else {
                weights.bytes(p.lm_head)
            },
            output_tied: spec.tie_word_embeddings,
        }
    }
}

/// The server's memory-relevant flags, by llama.cpp's long names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaCppRequest {
    pub model: LlamaCppModel,
    /// `--ctx-size`; 0 takes the model's training context.
    pub ctx_size: u64,
    /// `--parallel` (sequences / slots).
    pub parallel: u64,
    pub batch_size: u64,
    pub ubatch_size: u64,
    pub cache_type_k: GgmlType,
    pub cache_type_v: GgmlType,
    pub kv_unified: bool,
    /// `--n-gpu-layers`; `None` offloads everything (llama.cpp's "all").
    pub n_gpu_layers: Option<u64>,
    pub flash_attn: FlashAttn,
    /// `--no-kv-offload`: every layer's KV stays on the host.
    pub no_kv_offload: bool,
    /// `--swa-full`: sliding-window layers get the full cell count.
    pub swa_full: bool,
    /// Logits rows the worst-case graph reserves; the server asks for one per sequence.
    pub n_outputs: Option<u64>,
    /// Whether a GPU backend exists at all (false: a CPU-only build, everything on the host).
    pub has_gpu: bool,
}

impl LlamaCppRequest {
    /// llama-server's defaults for `model` on a machine with a GPU.
    pub fn new(model: LlamaCppModel) -> LlamaCppRequest {
        LlamaCppRequest {
            model,
            ctx_size: 0,
            parallel: 1,
            batch_size: DEFAULT_BATCH,
            ubatch_size: DEFAULT_UBATCH,
            cache_type_k: GgmlType::F16,
            cache_type_v: GgmlType::F16,
            kv_unified: false,
            n_gpu_layers: None,
            flash_attn: FlashAttn::Auto,
            no_kv_offload: false,
            swa_full: false,
            n_outputs: None,
            has_gpu: true,
        }
    }
}

/// Settings llama.cpp itself refuses.
#[derive(Debug, Error, PartialEq)]
#[non_exhaustive]
pub enum LlamaCppError {
    #[error("--{0} must be at least 1")]
    Zero(&'static str),
    #[error(
        "quantized V cache (--cache-type-v {0}) requires flash attention; drop --flash-attn off"
    )]
    QuantizedVNeedsFlashAttn(&'static str),
    #[error("the model has no layers")]
    NoLayers,
}

/// What llama.cpp will allocate, per device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaCppPlan {
    /// Context after padding (all sequences).
    pub n_ctx: u64,
    /// Cells per stream (the `cells` of llama.cpp's `llama_kv_cache: size` line).
    pub n_ctx_seq: u64,
    /// KV streams: `--parallel` without `--kv-unified`, else 1.
    pub n_stream: u64,
    pub n_batch: u64,
    pub n_ubatch: u64,
    pub flash_attn: bool,
    /// `--n-gpu-layers` as resolved (0 ..= n_layer + 1).
    pub n_gpu_layers: u64,
    /// Repeating layers on the GPU.
    pub gpu_layers: u64,
    pub output_on_gpu: bool,
    /// The whole KV buffer, all devices; and its K and V halves.
    pub kv_cache_bytes: u64,
    pub kv_k_bytes: u64,
    pub kv_v_bytes: u64,
    pub kv_cache_gpu_bytes: u64,
    pub kv_cache_host_bytes: u64,
    /// Compute buffers, all devices, and their split.
    pub compute_buffer_bytes: u64,
    pub compute_buffer_gpu_bytes: u64,
    pub compute_buffer_host_bytes: u64,
    /// Logits buffer (host).
    pub output_buffer_bytes: u64,
    pub weights_bytes: u64,
    pub weights_gpu_bytes: u64,
    pub weights_host_bytes: u64,
    /// Everything on the GPU: its weights, KV and compute buffer.
    pub gpu_bytes: u64,
    /// Everything in host RAM: layers left on the CPU (mapped), host KV, compute and output buffers.
    pub host_bytes: u64,
}

fn pad(x: u64, to: u64) -> u64 {
    x.div_ceil(to) * to
}

/// `(n_ctx, n_ctx_seq, n_stream)` as `llama_context` computes them.
pub fn context_cells(ctx_size: u64, parallel: u64, kv_unified: bool) -> (u64, u64, u64) {
    let n_ctx = pad(ctx_size, CTX_PAD);
    if kv_unified {
        (n_ctx, n_ctx, 1)
    } else {
        let seq = pad(n_ctx / parallel, CTX_PAD).max(CTX_PAD);
        (seq * parallel, seq, parallel)
    }
}

fn resolved_ngl(req: &LlamaCppRequest) -> u64 {
    if !req.has_gpu {
        return 0;
    }
    let all = req.model.n_layer + 1;
    req.n_gpu_layers.map_or(all, |n| n.min(all))
}

fn validate(req: &LlamaCppRequest) -> Result<(), LlamaCppError> {
    if req.model.n_layer == 0 {
        return Err(LlamaCppError::NoLayers);
    }
    for (name, v) in [
        ("parallel", req.parallel),
        ("batch-size", req.batch_size),
        ("ubatch-size", req.ubatch_size),
    ] {
        if v == 0 {
            return Err(LlamaCppError::Zero(name));
        }
    }
    if req.flash_attn == FlashAttn::Off && req.cache_type_v.is_quantized() {
        return Err(LlamaCppError::QuantizedVNeedsFlashAttn(
            req.cache_type_v.name(),
        ));
    }
    Ok(())
}

/// KV bytes of one layer (K, V) for `cells` cells per stream.
fn layer_kv(req: &LlamaCppRequest, cells: u64, n_stream: u64) -> (u64, u64) {
    let m = &req.model;
    let k = req.cache_type_k.row_bytes(m.n_embd_k_gqa()) * cells * n_stream;
    let v = if m.mla {
        0
    } else {
        req.cache_type_v.row_bytes(m.n_embd_v_gqa()) * cells * n_stream
    };
    (k, v)
}

/// Cells of a sliding-window layer (`llama-kv-cache-iswa.cpp`).
fn swa_cells(req: &LlamaCppRequest, base: u64, n_ubatch: u64) -> u64 {
    if req.swa_full {
        return base;
    }
    let seqs = if req.kv_unified { req.parallel } else { 1 };
    pad(base.min(req.model.n_swa * seqs + n_ubatch), CTX_PAD)
}

/// The compute buffer model: high-water mark of the worst-case `n_ubatch` graph (see the module
/// comment), in bytes. `swa_cells_per_stream` is the window cache's cells (0 without
/// sliding-window layers): its mask is a second graph input beside the full cache's.
pub fn compute_buffer_bytes(
    model: &LlamaCppModel,
    n_ubatch: u64,
    cells_per_stream: u64,
    swa_cells_per_stream: u64,
    flash_attn: bool,
    n_outputs: u64,
) -> u64 {
    let f32b = 4;
    // Token ids and positions, i32 each.
    let inputs = n_ubatch * 8;
    let ffn = n_ubatch * f32b * (3 * model.n_ff + 5 * model.n_embd);
    let output = n_outputs * model.n_vocab * f32b + n_ubatch * model.n_embd * f32b;
    let mask_cells = cells_per_stream + swa_cells_per_stream;
    let (mask, attention) = if flash_attn {
        (mask_cells * n_ubatch * 2, 0)
    } else {
        // Q is n_head × head_dim wide, which is not n_embd for every model (Gemma 3: 4 × 256
        // against 640); MLA's head_dim_k is the latent width, so its Q stays n_embd here.
        let q = if model.mla {
            model.n_embd
        } else {
            model.n_head * model.head_dim_k
        };
        let qkv = 5 * (q + model.n_head_kv * model.head_dim_k);
        (
            mask_cells * n_ubatch * f32b,
            cells_per_stream * n_ubatch * model.n_head * f32b + n_ubatch * f32b * qkv,
        )
    };
    inputs + mask + ffn.max(attention).max(output)
}

/// Predicts llama.cpp's buffers for `req`.
pub fn try_plan(req: &LlamaCppRequest) -> Result<LlamaCppPlan, LlamaCppError> {
    validate(req)?;
    let m = &req.model;
    // `--ctx-size 0` takes the training context for all sequences together.
    let ctx = if req.ctx_size == 0 {
        m.n_ctx_train.max(1)
    } else {
        req.ctx_size
    };
    let (n_ctx, n_ctx_seq, n_stream) = context_cells(ctx, req.parallel, req.kv_unified);
    let n_batch = n_ctx.min(req.batch_size);
    let n_ubatch = n_batch.min(req.ubatch_size);
    let flash_attn = req.flash_attn != FlashAttn::Off;

    let ngl = resolved_ngl(req);
    let i_gpu_start = (m.n_layer + 1).saturating_sub(ngl);
    let gpu_layers = m.n_layer.saturating_sub(i_gpu_start);
    // The output layer is slot `n_layer`, the first one `-ngl 1` offloads.
    let output_on_gpu = ngl >= 1;

    // Sliding-window layers are taken to be the first `n_swa_layers` of the pattern; only the
    // count matters for bytes, the split between devices follows the same proportion.
    let swa_layers = if m.n_swa > 0 {
        m.n_swa_layers.min(m.n_layer)
    } else {
        0
    };
    let swa = swa_cells(req, n_ctx_seq, n_ubatch);
    let (mut k_all, mut v_all, mut kv_gpu) = (0u64, 0u64, 0u64);
    let (mut w_gpu, mut w_host) = (0u64, m.token_embd_bytes);
    for il in 0..m.n_layer {
        let is_swa =
            swa_layers > 0 && (il * swa_layers) / m.n_layer != ((il + 1) * swa_layers) / m.n_layer;
        let cells = if is_swa { swa } else { n_ctx_seq };
        let (k, v) = layer_kv(req, cells, n_stream);
        k_all += k;
        v_all += v;
        let on_gpu = il >= i_gpu_start;
        if on_gpu && !req.no_kv_offload {
            kv_gpu += k + v;
        }
        if on_gpu {
            w_gpu += m.layer(il);
        } else {
            w_host += m.layer(il);
        }
    }
    if output_on_gpu {
        w_gpu += m.output_bytes;
    } else if m.output_tied {
        // The duplicated token_embd is the same mapped tensor; only the norm is extra.
        w_host += m.output_bytes.saturating_sub(m.token_embd_bytes);
    } else {
        w_host += m.output_bytes;
    }
    let kv_all = k_all + v_all;

    let n_outputs = req.n_outputs.unwrap_or(req.parallel).min(n_ubatch);
    let swa_mask_cells = if swa_layers > 0 { swa } else { 0 };
    let graph = compute_buffer_bytes(
        m,
        n_ubatch,
        n_ctx_seq,
        swa_mask_cells,
        flash_attn,
        n_outputs,
    );
    // Fully on the CPU: one CPU buffer. With a GPU: the graph runs there (large-batch matmuls of
    // host layers are offloaded too), and the host keeps the staged inputs (embeddings rows and
    // the mask), or the whole graph again when layers stay on the CPU.
    let (cb_gpu, cb_host) = if ngl == 0 {
        (0, graph)
    } else if gpu_layers < m.n_layer {
        (graph, graph)
    } else {
        let staged = n_ubatch * m.n_embd * 4 + n_ctx_seq * n_ubatch * 2;
        (graph, staged)
    };
    let output_buffer = req.parallel * m.n_vocab * 4;

    let gpu = w_gpu + kv_gpu + cb_gpu;
    let host = w_host + (kv_all - kv_gpu) + cb_host + output_buffer;
    Ok(LlamaCppPlan {
        n_ctx,
        n_ctx_seq,
        n_stream,
        n_batch,
        n_ubatch,
        flash_attn,
        n_gpu_layers: ngl,
        gpu_layers,
        output_on_gpu,
        kv_cache_bytes: kv_all,
        kv_k_bytes: k_all,
        kv_v_bytes: v_all,
        kv_cache_gpu_bytes: kv_gpu,
        kv_cache_host_bytes: kv_all - kv_gpu,
        compute_buffer_bytes: cb_gpu + cb_host,
        compute_buffer_gpu_bytes: cb_gpu,
        compute_buffer_host_bytes: cb_host,
        output_buffer_bytes: output_buffer,
        weights_bytes: w_gpu + w_host,
        weights_gpu_bytes: w_gpu,
        weights_host_bytes: w_host,
        gpu_bytes: gpu,
        host_bytes: host,
    })
}

/// [`try_plan`] for callers that validated the request already; invalid settings are planned
/// with the nearest valid ones (0 → 1, a quantized V cache turns flash attention on), as
/// llama.cpp's own parameter fitting does.
pub fn plan(req: &LlamaCppRequest) -> LlamaCppPlan {
    let mut r = req.clone();
    r.parallel = r.parallel.max(1);
    r.batch_size = r.batch_size.max(1);
    r.ubatch_size = r.ubatch_size.max(1);
    r.model.n_layer = r.model.n_layer.max(1);
    if r.cache_type_v.is_quantized() && r.flash_attn == FlashAttn::Off {
        r.flash_attn = FlashAttn::On;
    }
    try_plan(&r).expect("normalized request is valid")
}

/// Which figure a budget bounds.
fn budget_figure(p: &LlamaCppPlan) -> u64 {
    if p.n_gpu_layers > 0 {
        p.gpu_bytes
    } else {
        p.host_bytes
    }
}

/// The largest `--ctx-size` (a multiple of llama.cpp's padding: 256 × `--parallel` per sequence
/// without `--kv-unified`, 256 with it) whose plan fits `budget_bytes` on the GPU (or the host
/// when nothing is offloaded), with `req.parallel` sequences; capped at the training context per
/// sequence. `None` when not even the smallest context fits.
pub fn largest_ctx(req: &LlamaCppRequest, budget_bytes: u64) -> Option<u64> {
    let parallel = req.parallel.max(1);
    let step = if req.kv_unified {
        CTX_PAD
    } else {
        CTX_PAD * parallel
    };
    let per_seq_cap = req.model.n_ctx_train.max(CTX_PAD);
    let cap_total = if req.kv_unified {
        per_seq_cap * parallel
    } else {
        pad(per_seq_cap, CTX_PAD) * parallel
    };
    let max_k = (cap_total / step).max(1);
    let fits = |k: u64| {
        let mut r = req.clone();
        r.ctx_size = k * step;
        budget_figure(&plan(&r)) <= budget_bytes
    };
    if !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1u64, max_k);
    if fits(hi) {
        return Some(hi * step);
    }
    // Invariant: fits(lo) and !fits(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) { lo = mid } else { hi = mid }
    }
    Some(lo * step)
}

/// The largest `--n-gpu-layers` whose GPU share fits `gpu_budget_bytes` with the request's
/// context (0 when not even one layer does).
pub fn fit_n_gpu_layers(req: &LlamaCppRequest, gpu_budget_bytes: u64) -> u64 {
    let all = req.model.n_layer + 1;
    (0..=all)
        .rev()
        .find(|&n| {
            let mut r = req.clone();
            r.n_gpu_layers = Some(n);
            plan(&r).gpu_bytes <= gpu_budget_bytes
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::MIB;

    /// SmolLM2-135M's GGUF shape (the model our CPU box runs).
    fn smollm2() -> LlamaCppModel {
        LlamaCppModel {
            name: "SmolLM2-135M".into(),
            n_layer: 30,
            n_embd: 576,
            n_ff: 1536,
            n_head: 9,
            n_head_kv: 3,
            head_dim_k: 64,
            head_dim_v: 64,
            n_vocab: 49_152,
            n_ctx_train: 8192,
            n_swa: 0,
            n_swa_layers: 0,
            mla: false,
            layer_bytes: vec![3_000_000; 30],
            token_embd_bytes: 20_000_000,
            output_bytes: 20_000_000,
            output_tied: true,
        }
    }

    fn llama8b() -> LlamaCppModel {
        LlamaCppModel {
            name: "Llama-3.1-8B".into(),
            n_layer: 32,
            n_embd: 4096,
            n_ff: 14_336,
            n_head: 32,
            n_head_kv: 8,
            head_dim_k: 128,
            head_dim_v: 128,
            n_vocab: 128_256,
            n_ctx_train: 131_072,
            n_swa: 0,
            n_swa_layers: 0,
            mla: false,
            layer_bytes: vec![200 * MIB; 32],
            token_embd_bytes: 400 * MIB,
            output_bytes: 500 * MIB,
            output_tied: false,
        }
    }

    #[test]
    fn cells_are_padded_per_sequence() {
        // 3,000 → 3,072 (multiple of 256); 3,000 over 3 slots: 3,072 / 3 = 1,024 per stream.
        assert_eq!(context_cells(3000, 1, false), (3072, 3072, 1));
        assert_eq!(context_cells(3000, 3, false), (3072, 1024, 3));
        // 4,096 over 3 slots: 1,365 → padded to 1,536 each, n_ctx grows to 4,608.
        assert_eq!(context_cells(4096, 3, false), (4608, 1536, 3));
        assert_eq!(context_cells(4096, 4, true), (4096, 4096, 1));
    }

    #[test]
    fn kv_bytes_follow_row_size_of_the_cache_type() {
        let mut req = LlamaCppRequest::new(smollm2());
        req.ctx_size = 4096;
        req.has_gpu = false;
        let p = plan(&req);
        // K: 3 heads × 64 = 192 f16 values per cell and layer.
        let k = 30 * 4096 * 192 * 2;
        assert_eq!(p.kv_k_bytes, k);
        assert_eq!(p.kv_cache_bytes, 2 * k);
        req.cache_type_k = GgmlType::Q8_0;
        req.cache_type_v = GgmlType::Q4_0;
        let p = plan(&req);
        // q8_0: 192 / 32 = 6 blocks × 34 B; q4_0: 6 blocks × 18 B.
        assert_eq!(p.kv_k_bytes, 30 * 4096 * 6 * 34);
        assert_eq!(p.kv_v_bytes, 30 * 4096 * 6 * 18);
    }

    #[test]
    fn parallel_streams_and_unified_hold_the_same_cells_when_divisible() {
        let mut req = LlamaCppRequest::new(smollm2());
        req.ctx_size = 8192;
        req.parallel = 4;
        let split = plan(&req);
        req.kv_unified = true;
        let unified = plan(&req);
        assert_eq!(split.n_stream, 4);
        assert_eq!(split.n_ctx_seq, 2048);
        assert_eq!(unified.n_stream, 1);
        assert_eq!(split.kv_cache_bytes, unified.kv_cache_bytes);
        // Per-stream masks are smaller: 2,048 vs 8,192 cells × 512 tokens × 2 B.
        assert_eq!(
            unified.compute_buffer_gpu_bytes - split.compute_buffer_gpu_bytes,
            (8192 - 2048) * 512 * 2
        );
    }

    #[test]
    fn layers_offload_from_the_back_and_output_last() {
        let mut req = LlamaCppRequest::new(llama8b());
        req.ctx_size = 8192;
        req.n_gpu_layers = Some(10);
        let p = plan(&req);
        // i_gpu_start = 33 − 10 = 23: layers 23..31 (9 layers) and the output layer.
        assert_eq!(p.gpu_layers, 9);
        assert!(p.output_on_gpu);
        let per_layer_kv = 8192 * 8 * 128 * 2 * 2;
        assert_eq!(p.kv_cache_gpu_bytes, 9 * per_layer_kv);
        assert_eq!(p.kv_cache_host_bytes, 23 * per_layer_kv);
        assert_eq!(p.weights_gpu_bytes, 9 * 200 * MIB + 500 * MIB);
        assert_eq!(p.weights_host_bytes, 23 * 200 * MIB + 400 * MIB);
        req.n_gpu_layers = Some(32);
        let p = plan(&req);
        // i_gpu_start = 1: layers 1..31 and the output ("offloaded 32/33 layers").
        assert_eq!(p.gpu_layers, 31);
        assert!(p.output_on_gpu);
        req.n_gpu_layers = Some(0);
        assert!(!plan(&req).output_on_gpu);
        req.no_kv_offload = true;
        req.n_gpu_layers = None;
        let p = plan(&req);
        assert_eq!(p.gpu_layers, 32);
        assert_eq!(p.kv_cache_gpu_bytes, 0);
    }

    #[test]
    fn a_tied_output_costs_nothing_on_the_host_and_a_copy_on_the_gpu() {
        let mut req = LlamaCppRequest::new(smollm2());
        req.ctx_size = 2048;
        req.n_gpu_layers = Some(0);
        let cpu = plan(&req);
        // 30 layers × 3 MB + the 20 MB embedding table, held once.
        assert_eq!(cpu.weights_host_bytes, 30 * 3_000_000 + 20_000_000);
        req.n_gpu_layers = Some(1);
        let one = plan(&req);
        assert_eq!(one.weights_gpu_bytes, 20_000_000);
        assert_eq!(one.weights_host_bytes, 30 * 3_000_000 + 20_000_000);
    }

    #[test]
    fn sliding_window_layers_hold_window_plus_ubatch() {
        let mut m = llama8b();
        m.n_swa = 1024;
        m.n_swa_layers = 16;
        let mut req = LlamaCppRequest::new(m);
        req.ctx_size = 32_768;
        let p = plan(&req);
        let per_cell_layer = 8 * 128 * 2 * 2;
        // pad(1024 + 512, 256) = 1,536 cells on 16 layers; 32,768 on the other 16.
        assert_eq!(
            p.kv_cache_bytes,
            16 * per_cell_layer * 1536 + 16 * per_cell_layer * 32_768
        );
    }

    #[test]
    fn compute_buffer_with_and_without_flash_attention() {
        let m = smollm2();
        let fa = compute_buffer_bytes(&m, 512, 4096, 0, true, 1);
        // FFN peak: 512 tokens × 4 B × (3 × 1536 + 5 × 576); f16 mask 4096 × 512 × 2; ids.
        assert_eq!(
            fa,
            512 * 4 * (3 * 1536 + 5 * 576) + 4096 * 512 * 2 + 512 * 8
        );
        let no_fa = compute_buffer_bytes(&m, 512, 4096, 0, false, 1);
        // Scores: 4096 × 512 × 9 heads × 4 B dominate.
        assert!(no_fa > 4096 * 512 * 9 * 4);
        assert!(no_fa > 4 * fa);
    }

    /// Gemma 3 270M's GGUF shape as llama.cpp prints it: 18 layers, 15 of them with a 512-token
    /// window, 4 heads of 256 (Q 1,024 wide against n_embd 640), 1 KV head.
    fn gemma3_270m() -> LlamaCppModel {
        LlamaCppModel {
            name: "gemma-3-270m".into(),
            n_layer: 18,
            n_embd: 640,
            n_ff: 2048,
            n_head: 4,
            n_head_kv: 1,
            head_dim_k: 256,
            head_dim_v: 256,
            n_vocab: 262_144,
            n_ctx_train: 32_768,
            n_swa: 512,
            n_swa_layers: 15,
            mla: false,
            layer_bytes: vec![6_000_000; 18],
            token_embd_bytes: 100_000_000,
            output_bytes: 100_000_000,
            output_tied: true,
        }
    }

    #[test]
    fn sliding_window_models_carry_two_masks_and_a_wider_q() {
        let m = gemma3_270m();
        let mut req = LlamaCppRequest::new(m.clone());
        req.ctx_size = 4096;
        req.n_gpu_layers = Some(0);
        let p = plan(&req);
        // Full-cache mask over 4,096 cells and window mask over pad(512 + 512, 256) = 1,024
        // cells, f16 with flash attention; the feed-forward block is the peak.
        let ffn = 512 * 4 * (3 * 2048 + 5 * 640);
        let mask = (4096 + 1024) * 512 * 2;
        assert_eq!(p.compute_buffer_bytes, 512 * 8 + mask + ffn);
        // Without flash attention, 2 slots of 2,048 cells: f32 masks over 2,048 + 1,024 cells,
        // and the scores 2,048 × 512 × 4 heads beside five rows of Q (4 × 256) and K (256).
        req.parallel = 2;
        req.flash_attn = FlashAttn::Off;
        let p = plan(&req);
        let mask = (2048 + 1024) * 512 * 4;
        let attention = 2048 * 512 * 4 * 4 + 512 * 4 * 5 * (4 * 256 + 256);
        assert_eq!(p.compute_buffer_bytes, 512 * 8 + mask + attention);
    }

    #[test]
    fn largest_ctx_is_the_last_padded_step_that_fits() {
        let mut req = LlamaCppRequest::new(llama8b());
        req.parallel = 2;
        let budget = 12 * 1024 * MIB;
        let ctx = largest_ctx(&req, budget).unwrap();
        assert_eq!(ctx % (256 * 2), 0);
        let mut r = req.clone();
        r.ctx_size = ctx;
        assert!(plan(&r).gpu_bytes <= budget);
        r.ctx_size = ctx + 512;
        assert!(plan(&r).gpu_bytes > budget);
        // Nothing fits a budget below the weights.
        assert_eq!(largest_ctx(&req, 1024 * MIB), None);
    }

    #[test]
    fn fit_n_gpu_layers_finds_the_largest_that_fits() {
        let mut req = LlamaCppRequest::new(llama8b());
        req.ctx_size = 8192;
        let budget = 4 * 1024 * MIB;
        let n = fit_n_gpu_layers(&req, budget);
        assert!(n > 0 && n < 33);
        let mut r = req.clone();
        r.n_gpu_layers = Some(n);
        assert!(plan(&r).gpu_bytes <= budget);
        r.n_gpu_layers = Some(n + 1);
        assert!(plan(&r).gpu_bytes > budget);
    }

    #[test]
    fn catalog_shapes_become_uniform_gguf_weights() {
        let spec = ModelSpec::dense("llama", 4096, 14_336, 32, 32, 8, 128_256);
        let m = LlamaCppModel::from_spec(&spec, WeightType::Q4K);
        // Attention: q and o 4096², k and v 4096 × 1024; MLP 3 × 4096 × 14,336; two norms.
        let per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14_336 + 2 * 4096;
        assert_eq!(m.layer_bytes[0], (per_layer as u64).div_ceil(256) * 144);
        assert_eq!(m.token_embd_bytes, (128_256u64 * 4096).div_ceil(256) * 144);
        assert_eq!((m.n_head_kv, m.head_dim_k, m.n_ff), (8, 128, 14_336));
        assert_eq!(WeightType::parse("Q4_K_M"), Some(WeightType::Q4K));
    }

    #[test]
    fn bad_settings_are_errors() {
        let mut req = LlamaCppRequest::new(smollm2());
        req.flash_attn = FlashAttn::Off;
        req.cache_type_v = GgmlType::Q8_0;
        assert_eq!(
            try_plan(&req),
            Err(LlamaCppError::QuantizedVNeedsFlashAttn("q8_0"))
        );
        let mut req = LlamaCppRequest::new(smollm2());
        req.parallel = 0;
        assert_eq!(try_plan(&req), Err(LlamaCppError::Zero("parallel")));
        assert_eq!(GgmlType::parse("Q8_0"), Some(GgmlType::Q8_0));
        assert_eq!(GgmlType::parse("q3_k"), None);
    }
}
