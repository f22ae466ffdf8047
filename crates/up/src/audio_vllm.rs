//! The memory flags of an audio backend that is itself a vLLM (VibeVoice-ASR through its vLLM
//! plugin). vLLM pre-allocates, so `up` plans it *before* it starts, through `plan`'s arithmetic:
//! `--max-model-len` from the longest audio its lane accepts (audio tokens at the model's rate, the
//! transcript allowance and the prompt), `--max-num-seqs` = the whole sequences of that length its
//! KV pool holds inside its share of the pool (or the user's concurrency, capped by that), and the
//! pool itself as vLLM's own flags: on a GPU `--gpu-memory-utilization` just above what the
//! right-sized instance uses with `--kv-cache-memory` pinning the KV pool (so `util × total` is free
//! at its start and what it leaves is the rest of the pool), on the CPU `VLLM_CPU_KVCACHE_SPACE`.
//! It is then started and measured like any audio backend, and the text engine is planned from
//! what its measured peak leaves.

use headroom_plan::units::GIB;
use headroom_plan::vllm::{asr_sequence_tokens, audio_tokens_at_rate, plan_unadvised};
use headroom_plan::{KvCacheDtype, KvLayout, KvSettings, ModelSpec, PlanRequest};
use serde::Serialize;

use crate::UpError;
use crate::boxfile::AudioVllmPlan;
use crate::budget::mib;
use crate::flags::{DoesNotFit, Expected, TextFlags};

/// The sequence length an audio vLLM is planned with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AudioLength {
    pub max_audio_seconds: f64,
    pub tokens_per_second: f64,
    /// `box file` (audio_tokens_per_second) or `model` (its audio tokenizer).
    pub rate_from: &'static str,
    pub audio_tokens: u64,
    pub transcript_tokens: u64,
    /// `--max-model-len`.
    pub max_model_len: u64,
}

/// `--max-model-len` for the longest audio: the box file's `audio_tokens_per_second`, else the
/// model's own audio tokenizer (VibeVoice: 24 kHz / 3,200 samples = 7.5 tokens/s); a model with
/// neither is refused with the key to give. A length above the model's positions is refused too.
pub fn audio_length(spec: &ModelSpec, a: &AudioVllmPlan) -> Result<AudioLength, UpError> {
    let seconds = a.max_audio_seconds;
    let (rate, audio_tokens, from) = match (a.audio_tokens_per_second, spec.audio_tokenizer) {
        (Some(r), _) => (r, audio_tokens_at_rate(seconds, r), "box file"),
        (None, Some(tok)) => (
            tok.tokens_per_second(),
            tok.tokens_for_seconds(seconds),
            "model",
        ),
        (None, None) => {
            return Err(UpError::Config {
                key: "audio_tokens_per_second".into(),
                message: format!(
                    "{} has no audio tokenizer headroom knows, so its audio tokens per second are unknown: give audio_tokens_per_second for this backend",
                    spec.name
                ),
            });
        }
    };
    let (transcript, len) = asr_sequence_tokens(audio_tokens, seconds);
    let positions = spec.max_position_embeddings;
    if spec.positions_known && positions > 0 && len > positions {
        return Err(UpError::Config {
            key: "max_audio_seconds".into(),
            message: format!(
                "{seconds} s of audio need {len} tokens ({audio_tokens} audio + {transcript} transcript + prompt), above {}'s {positions} positions: lower max_audio_seconds",
                spec.name
            ),
        });
    }
    Ok(AudioLength {
        max_audio_seconds: seconds,
        tokens_per_second: rate,
        rate_from: from,
        audio_tokens,
        transcript_tokens: transcript,
        max_model_len: len,
    })
}

/// The pool as an audio vLLM on a GPU sees it when it is planned.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuPool {
    /// The card's memory as vLLM sees it (`cudaMemGetInfo` total: NVML total − reserved); vLLM's
    /// `--gpu-memory-utilization` is a fraction of this.
    pub device_total: u64,
    /// The pool `up` shares (the box file's `capacity`, at most the card).
    pub capacity: u64,
    /// What is already held in the pool: earlier audio backends' measured peaks and co-tenants.
    pub held: u64,
    pub margin: u64,
}

impl GpuPool {
    /// What the pool has left for this backend.
    pub fn rest(&self) -> u64 {
        self.capacity.saturating_sub(self.held + self.margin)
    }
}

/// Its budget: `memory` when given (at most the rest of the pool), else the rest of the pool.
fn budget(a: &AudioVllmPlan, rest: u64) -> u64 {
    a.memory.map_or(rest, |m| m.min(rest))
}

fn base_request(len: &AudioLength, pool: &GpuPool) -> PlanRequest {
    let mut req = PlanRequest::new(pool.device_total);
    req.max_model_len = Some(len.max_model_len);
    // Memory outside the pool (a capacity below the card) counts as held by others: vLLM's
    // fraction is of the whole card, and its start-up check looks at the whole card's free memory.
    req.other_used_bytes = pool.held + pool.device_total.saturating_sub(pool.capacity);
    req.safety_margin_bytes = pool.margin;
    // Exactly the sequences it admits: what is left over goes to the text engine.
    req.kv_slack = 0.0;
    req
}

/// Everything the instance holds on the card with `n` sequences, and its plan.
fn gpu_instance(
    spec: &ModelSpec,
    base: &PlanRequest,
    n: u64,
    overhead: u64,
) -> Option<(u64, headroom_plan::Plan)> {
    let mut req = base.clone();
    req.target_concurrency = Some(n);
    req.max_num_seqs = Some(n);
    let p = plan_unadvised(spec, &req).ok()?;
    let instance = p.device_peak_bytes.saturating_sub(p.reserved_bytes) + overhead;
    Some((instance, p))
}

/// vLLM on the CPU hands out KV in blocks of 128 tokens unless `--block-size` is given
/// (`vllm/platforms/cpu.py`: `cache_config.block_size = 128` when the user did not set one).
pub const CPU_BLOCK_SIZE: u64 = 128;

/// The most sequences looked at when the user gives no concurrency.
const MAX_SEQUENCES: u64 = 1024;

/// On a GPU: the most sequences (up to `max_parallel`) whose right-sized instance — weights,
/// activations, non-torch memory, the KV pool for exactly those sequences, CUDA graphs and context
/// — fits its budget and passes vLLM's start-up check (`free ≥ util × total`, with `free` the card
/// less what is held), as `--gpu-memory-utilization`, `--kv-cache-memory`, `--max-model-len` and
/// `--max-num-seqs`.
pub fn gpu_flags(
    spec: &ModelSpec,
    a: &AudioVllmPlan,
    len: &AudioLength,
    pool: &GpuPool,
) -> Result<TextFlags, DoesNotFit> {
    let budget_bytes = budget(a, pool.rest());
    let base = base_request(len, pool);
    let fits = |n: u64| {
        gpu_instance(spec, &base, n, a.overhead)
            .filter(|(bytes, p)| p.fits && *bytes <= budget_bytes)
    };
    let Some(mut best) = fits(1).map(|f| (1, f)) else {
        let one = gpu_instance(spec, &base, 1, a.overhead);
        let needed = one.as_ref().map_or(0, |(b, _)| *b);
        let why = one
            .as_ref()
            .and_then(|(_, p)| p.failure.as_ref().map(|f| f.message()))
            .or_else(|| one.as_ref().and_then(|(_, p)| p.refused.first().cloned()))
            .unwrap_or_else(|| "its budget is too small".into());
        return Err(DoesNotFit {
            budget_bytes,
            needed_bytes: needed,
            what: format!(
                "the audio vLLM with {} and one {}-token sequence ({} s of audio): {why}",
                spec.name, len.max_model_len, len.max_audio_seconds
            ),
            options: vec![
                format!(
                    "raise its memory (or [memory] capacity) by {}",
                    mib(needed.saturating_sub(budget_bytes))
                ),
                "a lower max_audio_seconds".into(),
                "lower [memory] margin".into(),
            ],
        });
    };
    // The footprint grows with the sequences: the largest that fits, by bisection.
    let mut hi = a.max_parallel.unwrap_or(MAX_SEQUENCES).max(1);
    let mut lo = 1;
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match fits(mid) {
            Some(f) => {
                lo = mid;
                best = (mid, f);
            }
            None => hi = mid - 1,
        }
    }
    let (n, (instance, p)) = best;
    Ok(TextFlags {
        args: p.vllm_args.clone(),
        env: Vec::new(),
        sequences: n,
        context_per_sequence: p.max_model_len,
        expected: Expected {
            weights_bytes: p.weights_bytes + p.weights_upcast_bytes,
            kv_cache_bytes: p.kv_cache_bytes,
            kv_tokens: p.kv_cache_tokens,
            total_bytes: instance,
        },
    })
}

/// On the CPU (host pool): the weights and `overhead` fixed, the KV pool in whole GiB of
/// `VLLM_CPU_KVCACHE_SPACE`: the most sequences (up to `max_parallel`) the budget's whole GiB
/// hold, and just the GiB those sequences need.
pub fn cpu_flags(
    spec: &ModelSpec,
    a: &AudioVllmPlan,
    len: &AudioLength,
    rest_bytes: u64,
) -> Result<TextFlags, DoesNotFit> {
    let budget_bytes = budget(a, rest_bytes);
    let req = PlanRequest::new(budget_bytes.max(1));
    let weights = plan_unadvised(spec, &req)
        .map(|p| p.weights_bytes + p.weights_upcast_bytes)
        .unwrap_or_else(|_| {
            headroom_plan::weights::estimated_weight_bytes(spec, spec.quantization)
        });
    let layout = KvLayout::new(
        spec,
        KvSettings {
            dtype: KvCacheDtype::Auto,
            tensor_parallel_size: 1,
            block_size: CPU_BLOCK_SIZE,
            hybrid_manager: true,
        },
    );
    // vLLM hands out whole blocks: a sequence holds its blocks, a pool its whole blocks.
    let blocks_each = layout
        .blocks_per_request(len.max_model_len, len.max_model_len)
        .max(1);
    let per_sequence = blocks_each * layout.bytes_per_block();
    let fixed = weights + a.overhead;
    let room_gib = budget_bytes.saturating_sub(fixed) / GIB;
    let whole = layout.num_blocks(room_gib * GIB) / blocks_each;
    let n = a.max_parallel.map_or(whole, |p| p.min(whole));
    if n == 0 {
        let needed = fixed + per_sequence.div_ceil(GIB).max(1) * GIB;
        return Err(DoesNotFit {
            budget_bytes,
            needed_bytes: needed,
            what: format!(
                "the audio vLLM on the CPU with {} ({} weights, {} runtime, one {}-token sequence in whole GiB of VLLM_CPU_KVCACHE_SPACE)",
                spec.name,
                mib(weights),
                mib(a.overhead),
                len.max_model_len
            ),
            options: vec![
                format!(
                    "raise its memory (or [memory] capacity) by {}",
                    mib(needed.saturating_sub(budget_bytes))
                ),
                "a lower max_audio_seconds".into(),
                "a smaller model".into(),
            ],
        });
    }
    let kv_gib = (n * per_sequence).div_ceil(GIB).max(1);
    let kv_bytes = kv_gib * GIB;
    Ok(TextFlags {
        args: vec![
            "--max-model-len".into(),
            len.max_model_len.to_string(),
            "--max-num-seqs".into(),
            n.to_string(),
        ],
        env: vec![("VLLM_CPU_KVCACHE_SPACE".into(), kv_gib.to_string())],
        sequences: n,
        context_per_sequence: len.max_model_len,
        expected: Expected {
            weights_bytes: weights,
            kv_cache_bytes: kv_bytes,
            // vLLM logs its KV size in tokens as whole-length sequences it holds × their length.
            kv_tokens: layout.num_blocks(kv_bytes) * len.max_model_len / blocks_each,
            total_bytes: fixed + kv_bytes,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::{AudioFootprint, Budget};
    use crate::flags::vllm_gpu_flags;
    use headroom_gpu::{DeviceSnapshot, GpuProbe, ProcessMemory, ScriptedProbe};
    use headroom_plan::units::MIB;
    use headroom_plan::{AudioTokenizer, Dtype, ModelKind};

    use crate::boxfile::TextPlan;

    fn asr_plan(seconds: f64) -> AudioVllmPlan {
        AudioVllmPlan {
            model: "m".into(),
            max_audio_seconds: seconds,
            audio_tokens_per_second: None,
            memory: None,
            max_parallel: None,
            overhead: 0,
        }
    }

    /// VibeVoice-ASR from the catalog (its checkpoint's tensor total, tokenizers loaded as float32).
    fn vibevoice_asr() -> ModelSpec {
        let m = headroom_inspect::catalog::find_model("microsoft/VibeVoice-ASR").unwrap();
        headroom_inspect::catalog::model_spec(m).unwrap()
    }

    #[test]
    fn the_longest_audio_sizes_max_model_len() {
        // 60 min at 24,000 Hz / 3,200 samples a token = 27,000 audio tokens; 250 transcript
        // tokens a minute = 15,000; plus the 128-token prompt.
        let l = audio_length(&vibevoice_asr(), &asr_plan(3600.0)).unwrap();
        assert_eq!((l.audio_tokens, l.transcript_tokens), (27_000, 15_000));
        assert_eq!(l.max_model_len, 42_128);
        assert_eq!(l.rate_from, "model");
        // A rate from the box file: 30 s × 10/s = 300, half a minute of transcript = 125.
        let mut text = ModelSpec::dense("smol", 576, 1536, 30, 9, 3, 49_152);
        text.max_position_embeddings = 8192;
        let mut a = asr_plan(30.0);
        a.audio_tokens_per_second = Some(10.0);
        let l = audio_length(&text, &a).unwrap();
        assert_eq!(l.max_model_len, 300 + 125 + 128);
        // No rate at all: the key to give is named.
        let e = audio_length(&text, &asr_plan(30.0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("audio_tokens_per_second"), "{e}");
        // Longer than the model's positions: refused with the figures.
        a.max_audio_seconds = 3600.0;
        let e = audio_length(&text, &a).unwrap_err().to_string();
        assert!(
            e.contains("8192 positions") && e.contains("max_audio_seconds"),
            "{e}"
        );
    }

    fn arg(args: &[String], flag: &str) -> Option<String> {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].clone())
    }

    /// One card: `used` held by the listed processes.
    fn frame(total: u64, procs: &[(u32, u64)]) -> Vec<DeviceSnapshot> {
        let used = procs.iter().map(|p| p.1).sum();
        let mut d = DeviceSnapshot::with_memory(0, total, used);
        d.processes = procs
            .iter()
            .map(|&(pid, used_bytes)| ProcessMemory {
                pid,
                name: format!("pid{pid}"),
                used_bytes,
            })
            .collect();
        vec![d]
    }

    /// KV bytes a token costs, from the model's shape: K and V, per KV head, per layer.
    fn kv_per_token(layers: u64, kv_heads: u64, head_dim: u64, bytes: u64) -> u64 {
        layers * 2 * kv_heads * head_dim * bytes
    }

    struct Card {
        total: u64,
        /// The pool `up` shares (a capacity below the card leaves the rest alone).
        capacity: u64,
        display: u64,
        margin: u64,
    }

    /// Two vLLMs on one card through a scripted probe: the audio vLLM is planned from the first
    /// reading, "starts" and holds what the script says (more than planned: the measurement
    /// counts, not the plan), the text vLLM is planned from the measured peak. Each start is
    /// checked against vLLM's documented rule (gpu_worker.py): it refuses to start when the free
    /// memory it sees is below `gpu_memory_utilization × total`, with `total` the whole card.
    fn two_vllms(
        card: &Card,
        audio: &ModelSpec,
        a: &AudioVllmPlan,
        text_spec: &ModelSpec,
        text: &TextPlan,
        per_token: u64,
    ) -> (TextFlags, TextFlags) {
        let probe = ScriptedProbe::new([Ok(frame(card.total, &[(1, card.display)]))]);
        let before = probe.snapshot().unwrap()[0].clone();
        let len = audio_length(audio, a).unwrap();
        let pool = GpuPool {
            device_total: card.total,
            capacity: card.capacity,
            held: before.used_bytes,
            margin: card.margin,
        };
        let fa = gpu_flags(audio, a, &len, &pool).unwrap();
        let util_a: f64 = arg(&fa.args, "--gpu-memory-utilization")
            .unwrap()
            .parse()
            .unwrap();
        // vLLM's check for the first instance: what the probe shows free ≥ util × total.
        assert!(
            before.free_bytes as f64 >= util_a * card.total as f64,
            "audio vLLM: {} free < {util_a} × {}",
            before.free_bytes,
            card.total
        );
        // Its KV pool holds exactly --max-num-seqs whole sequences of --max-model-len tokens
        // (16-token blocks), and --max-model-len is the audio's.
        let kv: u64 = arg(&fa.args, "--kv-cache-memory").unwrap().parse().unwrap();
        let n: u64 = arg(&fa.args, "--max-num-seqs").unwrap().parse().unwrap();
        assert_eq!(
            arg(&fa.args, "--max-model-len").unwrap(),
            len.max_model_len.to_string()
        );
        let per_seq = len.max_model_len.div_ceil(16) * 16 * per_token;
        assert_eq!(kv / per_seq, n, "kv {kv}, {per_seq} a sequence");
        if let Some(p) = a.max_parallel {
            assert!(n <= p);
        }
        // It stays inside its share and leaves the rest of the pool.
        if let Some(m) = a.memory {
            assert!(fa.expected.total_bytes <= m, "{:?}", fa.expected);
        }
        assert!(util_a * (card.total as f64) < (card.capacity - card.margin) as f64);

        // The audio vLLM runs and holds 1 GiB more than planned at its peak.
        let held = fa.expected.total_bytes + GIB;
        probe.set(Ok(frame(card.total, &[(1, card.display), (2, held)])));
        let after = probe.snapshot().unwrap()[0].clone();
        let peak = after.process_used_bytes(2).unwrap();
        let footprints = [AudioFootprint {
            name: "asr".into(),
            resident_bytes: peak - GIB / 2,
            peak_bytes: peak,
        }];
        let outside = card.total - card.capacity;
        let budget = Budget::new(card.capacity, &footprints, card.display, card.margin);
        let ft = vllm_gpu_flags(text_spec, text, &budget, &footprints, card.total).unwrap();
        let util_t: f64 = arg(&ft.args, "--gpu-memory-utilization")
            .unwrap()
            .parse()
            .unwrap();
        // vLLM's check for the second instance, against what is free with the first one
        // running; and what it asks for stays inside the pool (capacity less margin).
        let requested = util_t * card.total as f64;
        assert!(
            after.free_bytes as f64 >= requested,
            "text vLLM: {} free < {util_t} × {}",
            after.free_bytes,
            card.total
        );
        assert!(
            requested + (card.display + peak + card.margin + outside) as f64 <= card.total as f64,
            "{requested} + display {} + audio {peak} + margin {} + outside {outside} > {}",
            card.display,
            card.margin,
            card.total
        );
        eprintln!(
            "card {} GiB (pool {} GiB): audio vLLM {} (plans {} MiB, holds {} MiB) | free then {} MiB | text vLLM {}",
            card.total / GIB,
            card.capacity / GIB,
            fa.args.join(" "),
            fa.expected.total_bytes / MIB,
            held / MIB,
            after.free_bytes / MIB,
            ft.args.join(" ")
        );
        (fa, ft)
    }

    fn llama_8b() -> ModelSpec {
        let mut s = ModelSpec::dense("llama-8b", 4096, 14_336, 32, 32, 8, 128_256);
        s.max_position_embeddings = 8192;
        s
    }

    #[test]
    fn vibevoice_and_a_text_vllm_share_an_80_gib_card() {
        let card = Card {
            total: 80 * GIB,
            capacity: 80 * GIB,
            display: 512 * MIB,
            margin: GIB,
        };
        let mut a = asr_plan(3600.0);
        a.memory = Some(30 * GIB);
        let text = TextPlan {
            model: "llama-8b".into(),
            context: 8192,
            min_context: 1024,
            max_parallel: 16,
            overhead: 0,
            ubatch: 512,
        };
        // Qwen2.5-7B decoder: 28 layers, 4 KV heads of 128, bf16.
        let per_token = kv_per_token(28, 4, 128, 2);
        let (fa, _) = two_vllms(&card, &vibevoice_asr(), &a, &llama_8b(), &text, per_token);
        // 30 GiB less ~19.4 GB of weights and tokenizers leaves room for a few hour-long jobs.
        assert!(fa.sequences >= 2, "{fa:?}");
        // Asking for fewer gets exactly that many, and a smaller pool.
        a.max_parallel = Some(1);
        let (one, _) = two_vllms(&card, &vibevoice_asr(), &a, &llama_8b(), &text, per_token);
        assert_eq!(one.sequences, 1);
        assert!(one.expected.total_bytes < fa.expected.total_bytes);
    }

    #[test]
    fn two_vllms_share_a_24_gib_card_capped_below_its_size() {
        // A 1.5B speech model (Qwen2-1.5B shape: 28 layers, 2 KV heads of 128) at 7.5 tokens/s,
        // and a 3B text model; the box shares 22 of the card's 24 GiB.
        let mut asr = ModelSpec::dense("asr-1.5b", 1536, 8960, 28, 12, 2, 151_936);
        asr.kind = ModelKind::SpeechToText;
        asr.max_position_embeddings = 32_768;
        asr.audio_tokenizer = Some(AudioTokenizer {
            sample_rate_hz: 24_000,
            samples_per_token: 3200,
        });
        let mut text_spec = ModelSpec::dense("llama-3b", 3072, 8192, 28, 24, 8, 128_256);
        text_spec.max_position_embeddings = 8192;
        let card = Card {
            total: 24 * GIB,
            capacity: 22 * GIB,
            display: 300 * MIB,
            margin: GIB / 2,
        };
        let mut a = asr_plan(600.0);
        a.max_parallel = Some(4);
        let text = TextPlan {
            model: "llama-3b".into(),
            context: 4096,
            min_context: 1024,
            max_parallel: 13,
            overhead: 0,
            ubatch: 512,
        };
        let (fa, ft) = two_vllms(
            &card,
            &asr,
            &a,
            &text_spec,
            &text,
            kv_per_token(28, 2, 128, 2),
        );
        assert_eq!(fa.sequences, 4);
        assert!(ft.sequences >= 1);
        // A share too small for the weights is refused with the shortfall, before anything starts.
        a.memory = Some(2 * GIB);
        let len = audio_length(&asr, &a).unwrap();
        let pool = GpuPool {
            device_total: card.total,
            capacity: card.capacity,
            held: card.display,
            margin: card.margin,
        };
        let e = gpu_flags(&asr, &a, &len, &pool).unwrap_err();
        assert!(e.needed_bytes > 2 * GIB, "{e:?}");
        assert!(
            e.message_for("the audio vLLM")
                .starts_with("the audio vLLM does not fit")
        );
    }

    #[test]
    fn on_the_cpu_the_kv_space_is_whole_gib_for_whole_sequences() {
        // SmolLM2-135M in float32: 30 layers × 2 × 3 KV heads × 64 × 4 B = 46,080 B a token.
        let mut spec = ModelSpec::dense("smol", 576, 1536, 30, 9, 3, 49_152);
        spec.dtype = Dtype::F32;
        spec.max_position_embeddings = 8192;
        let mut a = asr_plan(30.0);
        a.audio_tokens_per_second = Some(10.0);
        a.overhead = 2 * GIB;
        a.max_parallel = Some(4);
        let len = audio_length(&spec, &a).unwrap();
        // 553 tokens in vLLM-on-CPU's 128-token blocks: 5 blocks of 128 × 46,080 B.
        let block = 128 * 46_080;
        let weights = headroom_plan::weights::estimated_weight_bytes(&spec, spec.quantization);
        let f = cpu_flags(&spec, &a, &len, weights + 2 * GIB + 3 * GIB + GIB / 2).unwrap();
        // Four sequences need 118 MB: one GiB of KV space, which vLLM reports as
        // floor(2^30 / block) = 182 blocks, 36.4 sequences of 553 tokens = 20,129 tokens (its log
        // said "CPU KV cache size: 20,129 tokens, Maximum concurrency ... 36.40x").
        assert_eq!(
            f.env,
            vec![("VLLM_CPU_KVCACHE_SPACE".to_string(), "1".to_string())]
        );
        assert_eq!(f.args, ["--max-model-len", "553", "--max-num-seqs", "4"]);
        assert_eq!(f.expected.kv_tokens, 20_129);
        // No concurrency given: every whole sequence 3 GiB hold (546 blocks / 5 = 109).
        a.max_parallel = None;
        let f = cpu_flags(&spec, &a, &len, weights + 2 * GIB + 3 * GIB + GIB / 2).unwrap();
        assert_eq!(f.sequences, (3 * GIB / block) / 5);
        assert_eq!(f.sequences, 109);
        assert_eq!(f.env[0].1, "3");
        // Its own share caps it: 1 GiB of KV space beside weights and runtime (182 / 5 = 36).
        a.memory = Some(weights + 2 * GIB + GIB + GIB / 4);
        let f = cpu_flags(&spec, &a, &len, 20 * GIB).unwrap();
        assert_eq!(f.sequences, 36);
        // Less than a GiB beyond weights and runtime: refused.
        a.memory = Some(weights + 2 * GIB + GIB / 2);
        assert!(cpu_flags(&spec, &a, &len, 20 * GIB).is_err());
    }
}
