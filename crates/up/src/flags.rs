//! The text engine's memory flags from its budget, through `plan`'s arithmetic: llama.cpp
//! `-c`/`--parallel` (and `-ngl` on a GPU) from [`headroom_plan::llamacpp`], vLLM
//! `--gpu-memory-utilization`/`--kv-cache-memory` from [`headroom_plan::plan`] on a GPU, and
//! `VLLM_CPU_KVCACHE_SPACE` for vLLM on the CPU. When nothing fits, a [`DoesNotFit`] with the
//! shortfall and the options that would. The GGUF's llama.cpp shape comes from inspect.

use std::path::Path;

use headroom_inspect::gguf::read_gguf;
use headroom_plan::ModelSpec;
use headroom_plan::llamacpp::{self, LlamaCppModel, LlamaCppRequest};
use headroom_plan::units::GIB;
use serde::Serialize;

use crate::UpError;
use crate::boxfile::TextPlan;
use crate::budget::{AudioFootprint, Budget, mib};

/// What the text engine is started with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TextFlags {
    /// Arguments appended to the backend's own.
    pub args: Vec<String>,
    /// Environment set for it.
    pub env: Vec<(String, String)>,
    /// Sequences it runs at once: the text lane's `max_inflight`.
    pub sequences: u64,
    /// Tokens per sequence.
    pub context_per_sequence: u64,
    /// What the plan expects the engine to allocate (compared with its start-up log).
    pub expected: Expected,
}

impl TextFlags {
    /// Sizing switched off: the arguments and environment given by hand instead of `up`'s (none:
    /// the engine's defaults). The lane keeps its sequences (the gateway's admission), and the
    /// plan's figures stay what `up` would have chosen.
    pub fn sized_by_hand(self, hand: &crate::HandSized) -> TextFlags {
        TextFlags {
            args: hand.args.clone(),
            env: hand.env.clone(),
            ..self
        }
    }

    /// The arguments and environment alone, as said: `the engine's defaults` for none.
    pub fn describe_given(&self) -> String {
        let shown = crate::report::shown_flags(self);
        if shown.is_empty() {
            return "the engine's defaults".into();
        }
        shown.join(" ")
    }

    /// The flags and what the plan expects of them, as `up` says them once the engine's flags
    /// are computed.
    pub fn describe(&self) -> String {
        format!(
            "{}{} ({} sequence(s) of {} tokens; the plan expects {}: {} weights, {} KV for {} tokens)",
            self.args.join(" "),
            self.env
                .iter()
                .map(|(k, v)| format!(" {k}={v}"))
                .collect::<String>(),
            self.sequences,
            self.context_per_sequence,
            mib(self.expected.total_bytes),
            mib(self.expected.weights_bytes),
            mib(self.expected.kv_cache_bytes),
            self.expected.kv_tokens
        )
    }
}

/// The plan's figures for the comparison with the engine's own log.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Expected {
    pub weights_bytes: u64,
    pub kv_cache_bytes: u64,
    pub kv_tokens: u64,
    /// Everything the engine should hold once started.
    pub total_bytes: u64,
}

/// Why the text engine cannot be started in its budget.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DoesNotFit {
    pub budget_bytes: u64,
    /// Bytes the smallest acceptable configuration needs.
    pub needed_bytes: u64,
    pub what: String,
    pub options: Vec<String>,
}

impl DoesNotFit {
    pub fn message(&self) -> String {
        self.message_for("the text engine")
    }

    /// The same line for another engine (`the audio vLLM`).
    pub fn message_for(&self, subject: &str) -> String {
        format!(
            "{subject} does not fit: {} needs {}, its budget is {} (short by {}); options: {}",
            self.what,
            mib(self.needed_bytes),
            mib(self.budget_bytes),
            mib(self.needed_bytes.saturating_sub(self.budget_bytes)),
            self.options.join("; ")
        )
    }
}

/// Reads the GGUF at `path` into the shape llama.cpp's buffers depend on (inspect's reader).
pub fn llamacpp_model(path: &Path) -> Result<LlamaCppModel, UpError> {
    let file = std::fs::File::open(path).map_err(|e| UpError::Io {
        what: format!("model {}", path.display()),
        source: e,
    })?;
    let shown = path.display().to_string();
    let meta = read_gguf(std::io::BufReader::new(file), &shown).map_err(UpError::Model)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    headroom_inspect::llamacpp::model_from_gguf(&meta, &name, &shown).map_err(UpError::Model)
}

/// llama-server's host-RAM prompt cache (`--cache-ram`, 8192 MiB by default since late 2025) keeps
/// the states of prompts that left their slots: memory that grows with the traffic, outside the
/// KV cache the budget was turned into. `up` turns it off; each slot still reuses its own prompt.
pub const PROMPT_CACHE_OFF: [&str; 2] = ["--cache-ram", "0"];

/// llama.cpp flags for `budget_bytes`: the most sequences (up to `max_parallel`) that each get
/// `context` tokens, with the whole budget turned into context; else one sequence with the
/// longest context down to `min_context`; else [`DoesNotFit`]. `gpu`: offload to a GPU (`-ngl`).
pub fn llamacpp_flags(
    model: &LlamaCppModel,
    text: &TextPlan,
    budget_bytes: u64,
    gpu: bool,
) -> Result<TextFlags, DoesNotFit> {
    let for_buffers = budget_bytes.saturating_sub(text.overhead);
    let request = |parallel: u64| {
        let mut r = LlamaCppRequest::new(model.clone());
        r.parallel = parallel;
        r.ubatch_size = text.ubatch;
        r.has_gpu = gpu;
        r
    };
    let mut chosen = None;
    for parallel in (1..=text.max_parallel).rev() {
        let req = request(parallel);
        if let Some(ctx) = llamacpp::largest_ctx(&req, for_buffers)
            && ctx / parallel >= text.context.min(model.n_ctx_train)
        {
            chosen = Some((parallel, ctx));
            break;
        }
    }
    if chosen.is_none()
        && let Some(ctx) = llamacpp::largest_ctx(&request(1), for_buffers)
        && ctx >= text.min_context
    {
        chosen = Some((1, ctx));
    }
    let mut ngl = None;
    if chosen.is_none() && gpu {
        // Not even the shortest context fits fully offloaded: keep layers on the host.
        let mut req = request(1);
        req.ctx_size = text.min_context;
        let layers = llamacpp::fit_n_gpu_layers(&req, for_buffers);
        if layers > 0 {
            chosen = Some((1, text.min_context));
            ngl = Some(layers);
        }
    }
    let Some((parallel, ctx)) = chosen else {
        let mut req = request(1);
        req.ctx_size = text.min_context;
        let need = llamacpp::plan(&req);
        let needed = if gpu { need.gpu_bytes } else { need.host_bytes } + text.overhead;
        return Err(DoesNotFit {
            budget_bytes,
            needed_bytes: needed,
            what: format!(
                "llama.cpp with 1 slot of {} tokens ({} weights, {} KV, {} compute, {} runtime)",
                text.min_context,
                mib(need.weights_bytes),
                mib(need.kv_cache_bytes),
                mib(need.compute_buffer_bytes + need.output_buffer_bytes),
                mib(text.overhead)
            ),
            options: vec![
                format!(
                    "raise [memory] capacity by {}",
                    mib(needed.saturating_sub(budget_bytes))
                ),
                "lower [memory] margin".into(),
                "a smaller or more quantized model (text backend `model`)".into(),
                "a smaller min_context".into(),
            ],
        });
    };
    let mut req = request(parallel);
    req.ctx_size = ctx;
    req.n_gpu_layers = ngl;
    let p = llamacpp::plan(&req);
    let mut args = vec![
        "-c".to_string(),
        p.n_ctx.to_string(),
        "--parallel".to_string(),
        parallel.to_string(),
    ];
    if gpu {
        args.push("-ngl".into());
        args.push(p.n_gpu_layers.to_string());
    }
    args.extend(PROMPT_CACHE_OFF.map(String::from));
    let on_device = if gpu { p.gpu_bytes } else { p.host_bytes };
    Ok(TextFlags {
        args,
        env: Vec::new(),
        sequences: parallel,
        context_per_sequence: p.n_ctx_seq,
        expected: Expected {
            weights_bytes: p.weights_bytes,
            kv_cache_bytes: p.kv_cache_bytes,
            kv_tokens: p.n_ctx,
            total_bytes: on_device + text.overhead,
        },
    })
}

/// vLLM on a GPU: `plan` with the audio peaks (an audio vLLM's among them) as reservations, the
/// co-tenants as memory others hold and the margin as safety margin, so `util × total` fits
/// vLLM's start-up free-memory check by construction; the KV pool is pinned with
/// `--kv-cache-memory`. `device_total` is the card as vLLM sees it: its utilization is a fraction
/// of the whole card, so a pool `capacity` below the card counts the rest as held by others.
pub(crate) fn vllm_gpu_flags(
    spec: &ModelSpec,
    text: &TextPlan,
    budget: &Budget,
    audio: &[AudioFootprint],
    device_total: u64,
) -> Result<TextFlags, DoesNotFit> {
    let device_total = device_total.max(budget.capacity_bytes);
    let mut req = headroom_plan::PlanRequest::new(device_total);
    req.max_model_len = Some(text.context);
    req.max_num_seqs = Some(text.max_parallel);
    req.other_used_bytes =
        budget.cotenant_bytes + device_total.saturating_sub(budget.capacity_bytes);
    req.safety_margin_bytes = budget.margin_bytes;
    req.reservations = audio
        .iter()
        .map(|a| headroom_plan::Reservation {
            name: a.name.clone(),
            bytes: a.peak_bytes,
            why: "measured peak during warm-up".into(),
        })
        .collect();
    let first = headroom_plan::plan(spec, &req).map_err(|e| DoesNotFit {
        budget_bytes: budget.text_bytes,
        needed_bytes: 0,
        what: e.to_string(),
        options: Vec::new(),
    })?;
    // Pin the KV pool to what the utilization leaves, so later versions that count graphs
    // differently cannot grow it.
    req.gpu_memory_utilization = Some(first.gpu_memory_utilization);
    req.kv_cache_memory = Some(first.kv_cache_bytes);
    let plan = headroom_plan::plan(spec, &req).unwrap_or(first);
    if !plan.fits || plan.kv_cache_bytes == 0 {
        return Err(DoesNotFit {
            budget_bytes: budget.text_bytes,
            needed_bytes: budget.text_bytes + plan.shortfall_bytes,
            what: format!(
                "vLLM with {} (max-model-len {}, {} sequences)",
                spec.name, text.context, text.max_parallel
            ),
            options: plan
                .options
                .iter()
                .filter(|o| o.fits)
                .map(|o| o.description.clone())
                .collect(),
        });
    }
    let sequences = plan.lanes.text_max_inflight.clamp(1, text.max_parallel);
    Ok(TextFlags {
        args: plan.vllm_args.clone(),
        env: Vec::new(),
        sequences,
        context_per_sequence: plan.max_model_len,
        expected: Expected {
            weights_bytes: plan.weights_bytes,
            kv_cache_bytes: plan.kv_cache_bytes,
            kv_tokens: plan.kv_cache_tokens,
            total_bytes: plan.device_peak_bytes.saturating_sub(plan.reserved_bytes),
        },
    })
}

/// vLLM on the CPU: its KV pool is `VLLM_CPU_KVCACHE_SPACE` whole GiB, taken from what the
/// budget leaves after the weights and the runtime (`overhead`: torch and its worker processes).
pub(crate) fn vllm_cpu_flags(
    spec: &ModelSpec,
    text: &TextPlan,
    budget_bytes: u64,
) -> Result<TextFlags, DoesNotFit> {
    let req = headroom_plan::PlanRequest::new(budget_bytes.max(1));
    let weights = headroom_plan::plan(spec, &req)
        .map(|p| p.weights_bytes)
        .unwrap_or_else(|_| {
            headroom_plan::weights::estimated_weight_bytes(spec, spec.quantization)
        });
    let fixed = weights + text.overhead;
    let kv_gib = budget_bytes.saturating_sub(fixed) / GIB;
    if kv_gib == 0 {
        return Err(DoesNotFit {
            budget_bytes,
            needed_bytes: fixed + GIB,
            what: format!(
                "vLLM on the CPU with {} ({} weights, {} runtime, 1 GiB KV, the smallest VLLM_CPU_KVCACHE_SPACE)",
                spec.name,
                mib(weights),
                mib(text.overhead)
            ),
            options: vec![
                format!(
                    "raise [memory] capacity by {}",
                    mib((fixed + GIB).saturating_sub(budget_bytes))
                ),
                "lower [memory] margin".into(),
                "a smaller model".into(),
            ],
        });
    }
    let kv_bytes = kv_gib * GIB;
    let per_token = headroom_plan::KvLayout::new(
        spec,
        headroom_plan::KvSettings {
            dtype: headroom_plan::KvCacheDtype::Auto,
            tensor_parallel_size: 1,
            block_size: headroom_plan::vllm::DEFAULT_BLOCK_SIZE,
            hybrid_manager: true,
        },
    )
    .bytes_per_token()
    .max(1);
    let tokens = kv_bytes / per_token;
    let sequences = (tokens / text.context.max(1)).clamp(1, text.max_parallel);
    if tokens < text.min_context {
        return Err(DoesNotFit {
            budget_bytes,
            needed_bytes: fixed + text.min_context * per_token,
            what: format!(
                "vLLM on the CPU: {kv_gib} GiB of KV holds {tokens} tokens, below min_context {}",
                text.min_context
            ),
            options: vec![
                "raise [memory] capacity".into(),
                "a smaller min_context".into(),
            ],
        });
    }
    Ok(TextFlags {
        args: vec![
            "--max-model-len".into(),
            text.context.min(tokens).to_string(),
            "--max-num-seqs".into(),
            sequences.to_string(),
        ],
        env: vec![("VLLM_CPU_KVCACHE_SPACE".into(), kv_gib.to_string())],
        sequences,
        context_per_sequence: text.context.min(tokens),
        expected: Expected {
            weights_bytes: weights,
            kv_cache_bytes: kv_bytes,
            kv_tokens: tokens,
            total_bytes: fixed + kv_bytes,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_plan::units::MIB;

    /// SmolLM2-135M as its GGUF describes it (30 blocks of 576, 3 KV heads of 64, 49,152 tokens).
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
            layer_bytes: vec![2_600_000; 30],
            token_embd_bytes: 15_000_000,
            output_bytes: 15_000_000,
            output_tied: true,
        }
    }

    fn text() -> TextPlan {
        TextPlan {
            model: "m.gguf".into(),
            context: 2048,
            min_context: 512,
            max_parallel: 4,
            overhead: 64 * MIB,
            ubatch: 512,
        }
    }

    fn ctx_of(f: &TextFlags) -> u64 {
        f.args[1].parse().unwrap()
    }

    #[test]
    fn kv_bytes_per_token_match_llama_cpp_s_own_log() {
        // llama.cpp logged "size = 90.00 MiB (2048 cells, 30 layers, 2/2 seqs)" for -c 4096
        // --parallel 2: 4096 cells × 30 layers × (192 + 192) values × 2 bytes.
        let mut req = LlamaCppRequest::new(smollm2());
        req.ctx_size = 4096;
        req.parallel = 2;
        req.has_gpu = false;
        assert_eq!(llamacpp::plan(&req).kv_cache_bytes, 90 * MIB);
    }

    #[test]
    fn sizing_switched_off_passes_the_hand_given_flags_and_keeps_the_lane() {
        let f = llamacpp_flags(&smollm2(), &text(), 400 * MIB, false).unwrap();
        assert!(f.args.iter().any(|a| a == "--cache-ram"), "{:?}", f.args);
        let (sequences, per) = (f.sequences, f.context_per_sequence);
        let hand = crate::HandSized {
            args: vec!["-c".into(), "32768".into(), "--parallel".into(), "4".into()],
            env: Vec::new(),
        };
        let d = f.clone().sized_by_hand(&hand);
        assert_eq!(d.args, ["-c", "32768", "--parallel", "4"]);
        assert_eq!((d.sequences, d.context_per_sequence), (sequences, per));
        assert_eq!(d.describe_given(), "-c 32768 --parallel 4");
        let none = f.sized_by_hand(&crate::HandSized::default());
        assert!(none.args.is_empty() && none.env.is_empty());
        assert_eq!(none.describe_given(), "the engine's defaults");
        let vllm = none.sized_by_hand(&crate::HandSized {
            args: Vec::new(),
            env: vec![("VLLM_CPU_KVCACHE_SPACE".into(), "1".into())],
        });
        assert_eq!(vllm.describe_given(), "VLLM_CPU_KVCACHE_SPACE=1");
    }

    #[test]
    fn a_large_budget_gets_every_slot_and_fills_it_with_context() {
        let f = llamacpp_flags(&smollm2(), &text(), 2048 * MIB, false).unwrap();
        assert_eq!(f.args[2..4], ["--parallel", "4"]);
        // Capped at the training context per sequence: 4 × 8192.
        assert_eq!(ctx_of(&f), 4 * 8192);
        assert!(f.expected.total_bytes <= 2048 * MIB);
    }

    #[test]
    fn less_capacity_means_fewer_slots_then_less_context_then_a_refusal() {
        let budgets = [900, 400, 260, 210, 160];
        let flags: Vec<_> = budgets
            .iter()
            .map(|b| llamacpp_flags(&smollm2(), &text(), b * MIB, false))
            .collect();
        let ok: Vec<(u64, u64)> = flags
            .iter()
            .filter_map(|f| f.as_ref().ok())
            .map(|f| (ctx_of(f), f.sequences))
            .collect();
        // Each smaller budget gets strictly less total context, never more slots.
        for w in ok.windows(2) {
            assert!(w[1].0 < w[0].0 && w[1].1 <= w[0].1, "{ok:?}");
        }
        for (f, b) in flags.iter().zip(budgets) {
            if let Ok(f) = f {
                assert!(f.expected.total_bytes <= b * MIB, "{f:?} over {b} MiB");
                assert!(f.context_per_sequence >= 512);
            }
        }
        // Weights ~93 MB (the tied output is the same mapped tensor) + 64 MiB runtime + compute:
        // 160 MiB cannot hold a 512-token slot.
        let err = flags.last().unwrap().as_ref().unwrap_err();
        assert!(err.needed_bytes > 160 * MIB, "{err:?}");
        assert!(
            err.message().contains("raise [memory] capacity"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn on_a_gpu_the_layers_are_offloaded() {
        let f = llamacpp_flags(&smollm2(), &text(), 2048 * MIB, true).unwrap();
        assert_eq!(f.args[4..6], ["-ngl", "31"]);
    }

    #[test]
    fn the_prompt_cache_that_grows_outside_the_budget_is_turned_off() {
        // Measured by headroom drill on the CPU box: with llama-server's default --cache-ram
        // (8192 MiB), SmolLM2 given -c 10240 --parallel 2 (planned 401 MiB) held 854 MB after
        // three minutes of 400- and 1800-token prompts.
        for gpu in [false, true] {
            let f = llamacpp_flags(&smollm2(), &text(), 900 * MIB, gpu).unwrap();
            let at = f
                .args
                .iter()
                .position(|a| a == "--cache-ram")
                .expect("--cache-ram");
            assert_eq!(f.args[at + 1], "0");
        }
    }

    fn dense_spec() -> ModelSpec {
        // A Llama-3-8B-shaped model in bf16 (about 16 GB of weights).
        let mut s = ModelSpec::dense("llama-8b", 4096, 14336, 32, 32, 8, 128_256);
        s.max_position_embeddings = 8192;
        s
    }

    #[test]
    fn vllm_on_a_gpu_gets_a_utilization_that_leaves_the_audio_peaks() {
        let text = TextPlan {
            context: 8192,
            max_parallel: 16,
            overhead: 0,
            ..text()
        };
        let audio = [AudioFootprint {
            name: "stt".into(),
            resident_bytes: 2 * GIB,
            peak_bytes: 3 * GIB,
        }];
        let budget = Budget::new(48 * GIB, &audio, GIB, GIB / 2);
        let f = vllm_gpu_flags(&dense_spec(), &text, &budget, &audio, 48 * GIB).unwrap();
        let util: f64 = f.args[f
            .args
            .iter()
            .position(|a| a == "--gpu-memory-utilization")
            .unwrap()
            + 1]
        .parse()
        .unwrap();
        // 48 − 3 − 1 − 0.5 = 43.5 GiB at most, minus graphs and context outside the budget.
        assert!(util > 0.5 && util <= 43.5 / 48.0, "{util}");
        assert!(
            f.args.iter().any(|a| a == "--kv-cache-memory"),
            "{:?}",
            f.args
        );
        assert!(f.sequences >= 1 && f.sequences <= 16);
        // A card too small for the weights beside the audio peak is refused.
        let small = Budget::new(16 * GIB, &audio, 0, GIB / 2);
        assert!(vllm_gpu_flags(&dense_spec(), &text, &small, &audio, 16 * GIB).is_err());
    }

    #[test]
    fn vllm_on_the_cpu_gets_whole_gib_of_kv_space() {
        let spec = ModelSpec::dense("small", 576, 1536, 30, 9, 3, 49_152);
        let text = TextPlan {
            overhead: 4 * GIB,
            context: 512,
            ..text()
        };
        let weights = headroom_plan::weights::estimated_weight_bytes(&spec, spec.quantization);
        // Room for 2 GiB of KV and a bit more.
        let f = vllm_cpu_flags(&spec, &text, weights + 4 * GIB + 2 * GIB + 300 * MIB).unwrap();
        assert_eq!(
            f.env,
            vec![("VLLM_CPU_KVCACHE_SPACE".to_string(), "2".to_string())]
        );
        assert_eq!(f.args[..2], ["--max-model-len", "512"]);
        // Less than 1 GiB beyond weights and runtime: refused.
        assert!(vllm_cpu_flags(&spec, &text, weights + 4 * GIB + 900 * MIB).is_err());
    }
}
