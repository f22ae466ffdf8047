//! `headroom plan`: raw flags → a validated [`PlanRequest`] and model spec → `headroom-plan` →
//! a table, JSON, or a shell line. Exit 3 when the plan does not fit.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context, bail};
use headroom_inspect::catalog::{find_gpu, find_profile, reserve_profiles};
use headroom_inspect::resolve::{Env, resolve_model};
use headroom_plan::units::{GIB, gib, parse_size, thousands};
use headroom_plan::{
    Dtype, KvCacheDtype, Plan, PlanRequest, QuantScheme, Reservation, plan as make_plan,
};

use super::EXIT_DOES_NOT_FIT;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
    Shell,
}

/// Which engine `plan` sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Engine {
    #[default]
    Vllm,
    Llamacpp,
}

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// vllm, or llamacpp (llama.cpp / llama-server: GGUF, --n-gpu-layers partial offload).
    #[arg(long, value_enum, default_value_t = Engine::Vllm)]
    pub engine: Engine,
    /// Hugging Face id (meta-llama/Llama-3.1-8B-Instruct), local directory or file, or a catalog name.
    #[arg(long)]
    pub model: String,
    /// GPU name (RTX 4090, H100, ...) or its memory (24GiB, 23.58GiB, 24GB, 24576MiB, bytes).
    /// Without it, GPU 0 of this machine is read through NVML, and memory other processes hold
    /// there counts as --other-used.
    #[arg(long)]
    pub gpu: Option<String>,
    /// vLLM's budget as a fraction of total memory; default: the largest that fits beside the co-tenants.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// A fixed KV-cache size (vLLM --kv-cache-memory), e.g. 4GiB.
    #[arg(long)]
    pub kv_cache_memory: Option<String>,
    /// Longest sequence (prompt + output) in tokens; accepts 16k / 128K.
    #[arg(long)]
    pub max_model_len: Option<String>,
    #[arg(long)]
    pub max_num_seqs: Option<u64>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<String>,
    /// auto (the model dtype) or fp8 (fp8_e4m3, fp8_e5m2).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: String,
    /// auto (the checkpoint's), bfloat16, float16 or float32.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// none, awq, gptq, bnb-4bit, bnb-8bit, fp8, mxfp4, nvfp4; default: what the checkpoint declares.
    #[arg(long)]
    pub quantization: Option<String>,
    #[arg(long, visible_alias = "tp", default_value_t = 1)]
    pub tensor_parallel_size: u64,
    /// Decoder layers split over this many GPUs (vLLM --pipeline-parallel-size); figures per GPU.
    #[arg(long, visible_alias = "pp", default_value_t = 1)]
    pub pipeline_parallel_size: u64,
    /// The vLLM release to reproduce (0.6.3, 0.8.5, latest): older ones profile and charge
    /// memory differently.
    #[arg(long, default_value = "latest")]
    pub vllm_version: String,
    /// Memory for another tenant: NAME=SIZE, or a catalog profile (whisper-large-v3). Repeatable.
    #[arg(long)]
    pub reserve: Vec<String>,
    /// Reserve what `headroom up` measured instead of a guessed profile: the calibration file
    /// beside a box file (BOX.calibration.json); each audio backend's measured peak is reserved.
    #[arg(long, value_name = "FILE")]
    pub reserve_from: Option<std::path::PathBuf>,
    /// Memory other processes already hold on the card.
    #[arg(long)]
    pub other_used: Option<String>,
    /// Memory kept free on top of everything else (allocator slack, driver growth).
    #[arg(long, default_value = "256MiB")]
    pub safety_margin: String,
    /// Size --max-model-len for this many minutes of audio (VibeVoice-ASR).
    #[arg(long)]
    pub audio_minutes: Option<f64>,
    /// Sequences of --max-model-len that must run at once: prints the memory needed.
    #[arg(long)]
    pub target_concurrency: Option<u64>,
    #[arg(long, default_value_t = 16)]
    pub block_size: u64,
    /// Plan without CUDA graphs (vLLM --enforce-eager).
    #[arg(long)]
    pub enforce_eager: bool,
    /// Charge sliding-window layers at full length (vLLM --disable-hybrid-kv-cache-manager).
    #[arg(long)]
    pub disable_hybrid_kv_cache_manager: bool,
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// With --max-num-seqs/--target-concurrency: take the largest safe utilization instead of a
    /// KV pool sized to the bound (the pre-v2 behaviour).
    #[arg(long)]
    pub fill: bool,
    /// Extra KV a right-sized pool keeps for prefix caching: a fraction (0.25) or percent (25%).
    #[arg(long, default_value = "25%")]
    pub kv_slack: String,
    #[command(flatten)]
    pub llamacpp: super::plan_llamacpp::LlamaCppArgs,
    #[command(flatten)]
    pub layout: super::plan_layout::LayoutArgs,
}

/// Token counts: `16384`, `16k`, `128K`.
fn parse_tokens(flag: &str, text: &str) -> anyhow::Result<u64> {
    let t = text.trim();
    let (digits, mult) = match t.strip_suffix(['k', 'K']) {
        Some(d) => (d, 1024),
        None => (t, 1),
    };
    let n: u64 = digits.parse().ok().filter(|n| *n > 0).with_context(|| {
        format!("invalid --{flag} '{text}': expected a positive token count such as 16384 or 16k")
    })?;
    Ok(n * mult)
}

fn parse_reserve(text: &str) -> anyhow::Result<Reservation> {
    if let Some((name, size)) = text.split_once('=') {
        let name = name.trim();
        if name.is_empty() {
            bail!("invalid --reserve '{text}': expected NAME=SIZE or a profile name");
        }
        let bytes = parse_size(size).with_context(|| format!("invalid --reserve '{text}'"))?;
        return Ok(Reservation {
            name: name.to_string(),
            bytes,
            why: "given on the command line".to_string(),
        });
    }
    match find_profile(text) {
        Some(p) => Ok(Reservation {
            name: p.name.clone(),
            bytes: p.bytes,
            why: format!("{}: {}", p.stack, p.why),
        }),
        None => {
            let names: Vec<&str> = reserve_profiles().iter().map(|p| p.name.as_str()).collect();
            bail!(
                "unknown --reserve profile '{text}': use NAME=SIZE or one of {}",
                names.join(", ")
            )
        }
    }
}

/// One reservation per audio backend of a calibration file, at its measured peak.
fn reservations_from(path: &std::path::Path) -> anyhow::Result<Vec<Reservation>> {
    let calibration = headroom_gpu::Calibration::load(path).context("invalid --reserve-from")?;
    let reservations: Vec<Reservation> = calibration
        .backends
        .iter()
        .filter(|(_, b)| b.role == "audio")
        .map(|(name, b)| Reservation {
            name: name.clone(),
            bytes: b.peak_bytes,
            why: format!(
                "measured peak ({} warm-up job(s), {:.2} GiB idle) by headroom up on {}",
                b.warmup_runs,
                headroom_plan::units::gib(b.resident_bytes),
                if b.date.is_empty() {
                    &calibration.date
                } else {
                    &b.date
                }
            ),
        })
        .collect();
    if reservations.is_empty() {
        bail!(
            "invalid --reserve-from {}: it holds no audio backend's figures",
            path.display()
        );
    }
    Ok(reservations)
}

/// GPU 0 of this machine, read through NVML.
fn local_gpu() -> anyhow::Result<headroom_gpu::DeviceSnapshot> {
    use headroom_gpu::GpuProbe;
    let probe = headroom_gpu::NvmlProbe::new()
        .context("no --gpu given and this machine's GPU cannot be read; name one with --gpu")?;
    let devices = probe
        .snapshot()
        .context("no --gpu given and this machine's GPU cannot be read; name one with --gpu")?;
    devices
        .into_iter()
        .next()
        .context("no --gpu given and NVML lists no GPU; name one with --gpu")
}

/// `--gpu`: a catalog name first ("3090" is a card, not 3,090 bytes), else a size.
fn gpu_from_flag(gpu: &str) -> anyhow::Result<(Option<String>, u64)> {
    if let Some(g) = find_gpu(gpu) {
        return Ok((Some(g.name.clone()), g.cuda_visible_bytes()));
    }
    match parse_size(gpu) {
        Ok(bytes) if bytes >= GIB => Ok((None, bytes)),
        Ok(_) => bail!(
            "invalid --gpu '{gpu}': a GPU smaller than 1 GiB (did you mean a size such as {}GiB?)",
            gpu.trim()
        ),
        Err(_) => bail!(
            "unknown --gpu '{gpu}': give a size such as 24GiB or one of {}",
            headroom_inspect::catalog::gpus()
                .iter()
                .map(|g| g
                    .name
                    .trim_start_matches("NVIDIA ")
                    .trim_start_matches("GeForce "))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Turns raw flags into a request; every malformed value is an error naming its flag.
fn request(args: &PlanArgs) -> anyhow::Result<PlanRequest> {
    let mut live_other_used = None;
    let (gpu_name, total) = match args.gpu.as_deref() {
        Some(gpu) => gpu_from_flag(gpu)?,
        None => {
            let device = local_gpu()?;
            live_other_used = Some(device.used_without_reserved());
            let visible = if device.reserved_bytes > 0 {
                device.total_bytes - device.reserved_bytes.min(device.total_bytes)
            } else {
                device
                    .total_bytes
                    .saturating_sub(headroom_inspect::catalog::DRIVER_RESERVED_BYTES)
            };
            (Some(device.name), visible)
        }
    };
    let mut req = PlanRequest::new(total);
    req.gpu_name = gpu_name;
    req.gpu_memory_utilization = args.gpu_memory_utilization;
    req.kv_cache_memory = args
        .kv_cache_memory
        .as_deref()
        .map(parse_size)
        .transpose()
        .context("invalid --kv-cache-memory")?;
    req.max_model_len = args
        .max_model_len
        .as_deref()
        .map(|t| parse_tokens("max-model-len", t))
        .transpose()?;
    req.max_num_seqs = args.max_num_seqs;
    req.max_num_batched_tokens = args
        .max_num_batched_tokens
        .as_deref()
        .map(|t| parse_tokens("max-num-batched-tokens", t))
        .transpose()?;
    req.kv_cache_dtype = KvCacheDtype::parse(&args.kv_cache_dtype).with_context(|| {
        format!(
            "invalid --kv-cache-dtype '{}': use auto, fp8, fp8_e4m3 or fp8_e5m2",
            args.kv_cache_dtype
        )
    })?;
    req.dtype = match args.dtype.trim().to_ascii_lowercase().as_str() {
        "auto" => None,
        other => Some(
            Dtype::parse(other)
                .filter(|d| *d != Dtype::Fp8)
                .with_context(|| {
                    format!(
                        "invalid --dtype '{}': use auto, bfloat16, float16 or float32",
                        args.dtype
                    )
                })?,
        ),
    };
    req.quantization = args
        .quantization
        .as_deref()
        .map(|q| {
            QuantScheme::parse(q).with_context(|| {
                format!("invalid --quantization '{q}': use none, awq, gptq, bnb-4bit, bnb-8bit, fp8, mxfp4 or nvfp4")
            })
        })
        .transpose()?;
    req.tensor_parallel_size = args.tensor_parallel_size;
    req.block_size = args.block_size;
    req.enforce_eager = args.enforce_eager;
    req.hybrid_kv_manager = !args.disable_hybrid_kv_cache_manager;
    req.reservations = args
        .reserve
        .iter()
        .map(|r| parse_reserve(r))
        .collect::<anyhow::Result<_>>()?;
    if let Some(path) = &args.reserve_from {
        req.reservations.extend(reservations_from(path)?);
    }
    req.other_used_bytes = args
        .other_used
        .as_deref()
        .map(parse_size)
        .transpose()
        .context("invalid --other-used")?
        .or(live_other_used)
        .unwrap_or(0);
    req.safety_margin_bytes = parse_size(&args.safety_margin).context("invalid --safety-margin")?;
    req.audio_minutes = args.audio_minutes;
    req.target_concurrency = args.target_concurrency;
    req.fill = args.fill;
    req.pipeline_parallel_size = args.pipeline_parallel_size;
    req.vllm_version =
        headroom_plan::VllmVersion::parse(&args.vllm_version).with_context(|| {
            format!(
                "invalid --vllm-version '{}': use a release such as 0.6.3 or 0.10.1, or latest",
                args.vllm_version
            )
        })?;
    req.kv_slack = parse_fraction("kv-slack", &args.kv_slack)?;
    Ok(req)
}

/// `0.25` or `25%`.
fn parse_fraction(flag: &str, text: &str) -> anyhow::Result<f64> {
    let t = text.trim();
    let v = match t.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().map(|x| x / 100.0),
        None => t.parse::<f64>(),
    };
    match v {
        Ok(x) if x.is_finite() && (0.0..=4.0).contains(&x) => Ok(x),
        _ => bail!(
            "invalid --{flag} '{text}': expected a fraction such as 0.25 or a percent such as 25%"
        ),
    }
}

/// `serve`'s lane limits; a speech model is the audio lane itself.
fn render_lanes(plan: &Plan) -> String {
    if plan.lanes.lane == "audio" {
        format!(
            "headroom serve audio lane (this model): max_inflight = {} (whole {}-token sequences the KV pool holds)\n",
            plan.lanes.audio_max_inflight,
            thousands(plan.max_model_len)
        )
    } else {
        format!(
            "headroom serve lanes: text max_inflight = {}, max_queue = {}; audio max_inflight = {}\n",
            plan.lanes.text_max_inflight, plan.lanes.text_max_queue, plan.lanes.audio_max_inflight
        )
    }
}

/// The right-sizing lines: the pool for the bound, and what it leaves the co-tenants.
fn render_sizing(plan: &Plan) -> String {
    let mut out = String::new();
    if plan.sizing_mode == "right_sized" {
        let _ = writeln!(
            out,
            "right-sized: --kv-cache-memory {} ({:.2} GiB) = {} sequences × {} tokens in whole blocks + {:.0} % slack for prefix caching (--kv-slack; --fill for the largest safe utilization)",
            plan.kv_cache_memory_bytes,
            gib(plan.kv_cache_memory_bytes),
            plan.max_num_seqs
                .min(plan.target.as_ref().map_or(u64::MAX, |t| t.concurrency)),
            thousands(plan.max_model_len),
            plan.kv_slack * 100.0
        );
    }
    let reserved = plan.reservations.iter().map(|r| r.bytes).sum::<u64>();
    let _ = writeln!(
        out,
        "headroom for {}: {:.2} GiB left beside vLLM ({:.2} GiB reserved, {:.2} GiB spare)",
        if plan.lanes.lane == "audio" {
            "other tenants"
        } else {
            "audio"
        },
        gib(plan.headroom_bytes),
        gib(reserved),
        gib(plan.headroom_bytes.saturating_sub(reserved))
    );
    out
}

pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    let req = request(&args)?;
    if args.engine == Engine::Llamacpp {
        return super::plan_llamacpp::run(&args, &req);
    }
    if args.llamacpp.any_given() {
        bail!(
            "--ctx-size, --parallel, --n-gpu-layers and the other llama.cpp flags need --engine llamacpp"
        );
    }
    let resolved = resolve_model(&args.model, &Env::from_process())?;
    let plan = make_plan(&resolved.spec, &req)?;
    let layout = super::plan_layout::layout(&plan, &args.layout)?;
    match args.format {
        Format::Json => println!(
            "{}",
            serde_json::to_string_pretty(&super::plan_layout::json_with_layout(
                &plan,
                layout.as_ref()
            )?)?
        ),
        Format::Shell => match &layout {
            Some(l) => println!("{}", l.launch_lines.join("\n")),
            None => println!("{}", command_line(&plan)),
        },
        Format::Table => {
            print!("{}", render_table(&plan));
            if let Some(l) = &layout {
                print!("{}", super::plan_layout::render_layout(&plan, l));
            }
        }
    }
    if plan.fits {
        Ok(ExitCode::SUCCESS)
    } else {
        if args.format != Format::Table {
            eprintln!(
                "headroom: does not fit: {:.2} GiB short",
                gib(plan.shortfall_bytes)
            );
        }
        Ok(ExitCode::from(EXIT_DOES_NOT_FIT))
    }
}

fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@+,".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// `vllm serve MODEL FLAGS...`, quoted for a POSIX shell.
pub fn command_line(plan: &Plan) -> String {
    let mut parts = vec![
        "vllm".to_string(),
        "serve".to_string(),
        shell_quote(&plan.model),
    ];
    parts.extend(plan.vllm_args.iter().map(|a| shell_quote(a)));
    parts.join(" ")
}

fn share(bytes: u64, total: u64) -> String {
    format!("{:.1}%", bytes as f64 * 100.0 / total as f64)
}

/// The human-readable report.
pub fn render_table(plan: &Plan) -> String {
    let total = plan.gpu_total_bytes;
    let mut out = String::new();
    let gpu = match &plan.gpu_name {
        Some(name) => format!("{name} ({:.2} GiB visible to CUDA)", gib(total)),
        None => format!("{:.2} GiB GPU", gib(total)),
    };
    let _ = writeln!(out, "headroom plan: {} on {gpu}", plan.model);
    // Catalog sources carry long provenance notes; the JSON output keeps them whole.
    let source = plan
        .model_source
        .split(" (")
        .take(2)
        .collect::<Vec<_>>()
        .join(" (");
    let source = if source.len() < plan.model_source.len() {
        format!("{source}…)")
    } else {
        source
    };
    let _ = writeln!(out, "model: {source}");
    let _ = writeln!(
        out,
        "vLLM budget: {:.2} × {:.2} GiB = {:.2} GiB ({}), KV {} B/token ({} KV cache){}",
        plan.gpu_memory_utilization,
        gib(total),
        gib(plan.requested_bytes),
        plan.utilization_source.replace('_', " "),
        thousands(plan.kv_bytes_per_token),
        plan.kv_cache_dtype,
        if plan.tensor_parallel_size > 1 {
            format!(", per rank of {}", plan.tensor_parallel_size)
        } else {
            String::new()
        }
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "{:<28} {:>8} {:>7}  why", "component", "GiB", "card");
    for c in &plan.components {
        let _ = writeln!(
            out,
            "{:<28} {:>8.2} {:>7}  {}",
            c.name,
            gib(c.bytes),
            share(c.bytes, total),
            c.why
        );
    }
    let _ = writeln!(
        out,
        "{:<28} {:>8.2} {:>7}  vLLM's footprint + co-tenants",
        "device peak",
        gib(plan.device_peak_bytes + plan.safety_margin_bytes),
        share(plan.device_peak_bytes + plan.safety_margin_bytes, total)
    );
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "KV cache: {} tokens in {} blocks of {}; maximum concurrency for {} tokens per request: {:.2}x",
        thousands(plan.kv_cache_tokens),
        thousands(plan.num_blocks),
        plan.block_size,
        thousands(plan.max_model_len),
        plan.max_concurrency
    );
    let _ = writeln!(
        out,
        "largest safe --gpu-memory-utilization {:.2}; equivalent --kv-cache-memory {} ({:.2} GiB)",
        plan.largest_safe_gpu_memory_utilization,
        plan.kv_cache_memory_bytes,
        gib(plan.kv_cache_memory_bytes)
    );
    out.push_str(&render_sizing(plan));
    if let Some(a) = &plan.audio {
        let _ = writeln!(
            out,
            "audio: {:.1} tokens/s ({:.0}/min); {} tokens hold {:.1} min of audio per sequence",
            a.tokens_per_second,
            a.tokens_per_minute,
            thousands(plan.max_model_len),
            a.minutes_per_sequence
        );
        if let (Some(m), Some(t), Some(al), Some(n)) = (
            a.requested_minutes,
            a.audio_tokens,
            a.transcript_tokens_allowance,
            a.max_model_len_needed,
        ) {
            let _ = writeln!(
                out,
                "audio: {m} min = {} audio tokens + {} transcript tokens (estimate) + prompt → --max-model-len {}",
                thousands(t),
                thousands(al),
                n
            );
        }
    }
    if let Some(t) = &plan.target {
        let _ = writeln!(
            out,
            "target: {} sequences of {} tokens need {:.2} GiB of KV and {:.2} GiB of the card: {}",
            t.concurrency,
            thousands(t.max_model_len),
            gib(t.kv_cache_bytes_needed),
            gib(t.memory_needed_bytes),
            if t.fits { "fits" } else { "does not fit" }
        );
    }
    let _ = writeln!(out);
    match &plan.failure {
        None if plan.fits => {
            let _ = writeln!(out, "verdict: fits");
        }
        None => {
            let _ = writeln!(
                out,
                "verdict: DOES NOT FIT the target, {:.2} GiB short",
                gib(plan.shortfall_bytes)
            );
        }
        Some(f) => {
            let _ = writeln!(
                out,
                "verdict: DOES NOT FIT, {:.2} GiB short. vLLM would say:\n  {}",
                gib(plan.shortfall_bytes),
                f.message()
            );
        }
    }
    if !plan.options.is_empty() {
        let _ = writeln!(out, "options:");
        for o in &plan.options {
            let _ = writeln!(
                out,
                "  {:<20} {:<44} needs {:>7.2} GiB, {} × {} tokens{}  [{}]",
                o.option,
                o.description,
                gib(o.memory_needed_bytes),
                o.concurrency,
                thousands(o.max_model_len),
                if o.fits { ", fits" } else { ", does not fit" },
                o.vllm_args.join(" ")
            );
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{}", command_line(plan));
    out.push_str(&render_lanes(plan));
    for w in &plan.warnings {
        let _ = writeln!(out, "note: {w}");
    }
    out
}
