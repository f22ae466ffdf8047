//! `headroom plan`: raw flags → a validated [`PlanRequest`] and model spec → `headroom-plan` →
//! a table, JSON, or a shell line. Exit 3 when the plan does not fit.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context, bail};
use headroom_inspect::catalog::{find_gpu, find_profile, reserve_profiles};
use headroom_plan::units::{GIB, MIB, SizeUnit, gib, parse_size, size_unit, thousands};
use headroom_plan::{
    Dtype, KvCacheDtype, Plan, PlanRequest, QuantScheme, Reservation, plan as make_plan,
};

use super::EXIT_DOES_NOT_FIT;
use super::pipe::emit;
use super::plan_args::{Engine, Format, ListWhat, PlanArgs};
use super::plan_paint::paint_table;

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

/// A size flag that must carry a unit: a bare number below 1 MiB is an error (`--reserve a=3`
/// is three bytes, never what was meant); a bare byte count above that is taken as written.
/// Decimal units are read as written and said so on stderr.
fn parse_flag_size(flag: &str, text: &str) -> anyhow::Result<u64> {
    parse_sized(flag, text, text)
}

/// [`parse_flag_size`] for a size that is part of a longer value (`NAME=SIZE`): errors show `whole`.
fn parse_sized(flag: &str, whole: &str, text: &str) -> anyhow::Result<u64> {
    let bytes = parse_size(text).with_context(|| format!("invalid {flag} '{whole}'"))?;
    match size_unit(text) {
        Some(SizeUnit::Bare) if bytes < MIB => bail!(
            "invalid {flag} '{whole}': {n} alone would be {n} bytes; a size this small needs a unit, e.g. {n}GiB or {n}MiB",
            n = text.trim()
        ),
        Some(SizeUnit::Decimal) => note_decimal(flag, text, bytes),
        _ => {}
    }
    Ok(bytes)
}

/// Says how a decimal size was read (`24GB` is 24 × 10⁹ bytes, 22.35 GiB).
fn note_decimal(flag: &str, text: &str, bytes: u64) {
    eprintln!(
        "headroom: note: {flag} '{}' read as {} bytes ({:.2} GiB); GB is 10^9 bytes, GiB is 2^30",
        text.trim(),
        thousands(bytes),
        gib(bytes)
    );
}

/// Cards sold as "24 GB" have 24 GiB: a whole number of decimal GB is probably that figure.
fn warn_marketing_size(text: &str, bytes: u64) {
    let whole_gb = bytes.is_multiple_of(1_000_000_000);
    if size_unit(text) == Some(SizeUnit::Decimal) && whole_gb {
        let n = bytes / 1_000_000_000;
        eprintln!(
            "headroom: warning: --gpu '{}' looks like the figure a card is sold with; such cards have {n} GiB ({} bytes): write --gpu {n}GiB, or the card's name (headroom plan --list gpus)",
            text.trim(),
            thousands(n * GIB)
        );
    }
}

fn parse_reserve(text: &str) -> anyhow::Result<Reservation> {
    if let Some((name, size)) = text.split_once('=') {
        let name = name.trim();
        if name.is_empty() {
            bail!("invalid --reserve '{text}': expected NAME=SIZE or a profile name");
        }
        let bytes = parse_sized("--reserve", text, size)?;
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

/// Every `--reserve`; two with one name are an error (they would be summed without a word).
fn reservations(flags: &[String]) -> anyhow::Result<Vec<Reservation>> {
    let mut out: Vec<Reservation> = Vec::new();
    for text in flags {
        let r = parse_reserve(text)?;
        if out.iter().any(|o| o.name.eq_ignore_ascii_case(&r.name)) {
            bail!(
                "--reserve '{}' is given twice: one --reserve per tenant (give the total once, or two names)",
                r.name
            );
        }
        out.push(r);
    }
    Ok(out)
}

/// One reservation per audio backend of a calibration file, at its measured peak; with a warning
/// when the figures are host memory (`probe: host`, a CPU-only box) rather than GPU memory.
fn reservations_from(path: &std::path::Path) -> anyhow::Result<(Vec<Reservation>, Option<String>)> {
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
    let note = calibration.probe.eq_ignore_ascii_case("host").then(|| {
        format!(
            "--reserve-from {}: these figures were measured with probe: host, the host memory (RSS/PSS) of the backends' processes on a box without a GPU probe, not GPU memory; they are reserved as written, but the same backends on a GPU hold a different amount: measure them with `headroom up` on the GPU box",
            path.display()
        )
    });
    Ok((reservations, note))
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

/// Catalog GPUs whose name or alias contains `gpu` (vendor words and punctuation ignored).
fn gpus_containing(gpu: &str) -> Vec<&'static headroom_inspect::catalog::CatalogGpu> {
    let norm = |s: &str| {
        headroom_inspect::catalog::normalize(s)
            .replace("nvidia", "")
            .replace("geforce", "")
    };
    let key = norm(gpu);
    if key.is_empty() || key.chars().all(|c| c.is_ascii_digit()) && size_unit(gpu).is_some() {
        return Vec::new();
    }
    headroom_inspect::catalog::gpus()
        .iter()
        .filter(|g| {
            std::iter::once(&g.name)
                .chain(g.aliases.iter())
                .any(|n| norm(n).contains(&key))
        })
        .collect()
}

/// `--gpu`: a catalog name first ("3090" is a card, not 3,090 bytes), then a name that matches
/// one card only (several: an error naming them), else a size.
fn gpu_from_flag(gpu: &str) -> anyhow::Result<(Option<String>, u64)> {
    if let Some(g) = find_gpu(gpu) {
        return Ok((Some(g.name.clone()), g.cuda_visible_bytes()));
    }
    if parse_size(gpu).is_err() {
        match gpus_containing(gpu).as_slice() {
            [one] => return Ok((Some(one.name.clone()), one.cuda_visible_bytes())),
            [] => {}
            many => bail!(
                "ambiguous --gpu '{gpu}': it matches {}; name one of them",
                many.iter()
                    .map(|g| g.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
    match parse_size(gpu) {
        Ok(bytes) if bytes >= GIB => {
            if size_unit(gpu) == Some(SizeUnit::Decimal) {
                note_decimal("--gpu", gpu, bytes);
                warn_marketing_size(gpu, bytes);
            }
            Ok((None, bytes))
        }
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

/// vLLM reads `VLLM_ALLOW_LONG_MAX_MODEL_LEN` as true for `1` or `true` (any case).
fn allow_long_max_model_len() -> bool {
    std::env::var("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
}

/// Turns raw flags into a request, with warnings about what it was given; every malformed value
/// is an error naming its flag.
fn request(args: &PlanArgs) -> anyhow::Result<(PlanRequest, Vec<String>)> {
    let mut notes = Vec::new();
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
        .map(|t| parse_flag_size("--kv-cache-memory", t))
        .transpose()?;
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
    req.reservations = reservations(&args.reserve)?;
    if let Some(path) = &args.reserve_from {
        let (reserved, note) = reservations_from(path)?;
        req.reservations.extend(reserved);
        notes.extend(note);
    }
    req.other_used_bytes = args
        .other_used
        .as_deref()
        .map(|t| parse_flag_size("--other-used", t))
        .transpose()?
        .or(live_other_used)
        .unwrap_or(0);
    req.safety_margin_bytes = parse_flag_size("--safety-margin", &args.safety_margin)?;
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
    req.allow_long_max_model_len = allow_long_max_model_len();
    Ok((req, notes))
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

impl PlanArgs {
    /// `--model` (clap requires it unless `--list` is given).
    pub fn model(&self) -> &str {
        self.model.as_deref().unwrap_or_default()
    }
}

/// Long flags of `plan` given more than once in `argv` (the words after `plan`), each with the
/// values in the order given; clap keeps the last. Repeatable flags (`--reserve`) and flags
/// without a value are left out.
pub fn repeated_flags(argv: &[String]) -> Vec<(String, Vec<String>)> {
    use clap::{ArgAction, Args as _};
    let cmd = PlanArgs::augment_args(clap::Command::new("plan"));
    let start = argv.iter().position(|a| a == "plan").map_or(0, |i| i + 1);
    let mut seen: Vec<(String, Vec<String>)> = Vec::new();
    let mut words = argv[start.min(argv.len())..].iter();
    while let Some(word) = words.next() {
        if word == "--" {
            break;
        }
        let Some(flag) = word.strip_prefix("--") else {
            continue;
        };
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let Some(arg) = cmd.get_arguments().find(|a| {
            a.get_long() == Some(name) || a.get_all_aliases().is_some_and(|al| al.contains(&name))
        }) else {
            continue;
        };
        if !matches!(arg.get_action(), ArgAction::Set) {
            continue;
        }
        let value = match inline {
            Some(v) => v,
            None => words.next().cloned().unwrap_or_default(),
        };
        let long = arg.get_long().unwrap_or(name).to_string();
        match seen.iter_mut().find(|(f, _)| *f == long) {
            Some((_, values)) => values.push(value),
            None => seen.push((long, vec![value])),
        }
    }
    seen.retain(|(_, values)| values.len() > 1);
    seen
}

/// One note per flag given more than once.
fn note_repeated_flags() {
    let argv: Vec<String> = std::env::args_os()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    for (flag, values) in repeated_flags(&argv) {
        eprintln!(
            "headroom: note: --{flag} is given {} times ({}); the last one, {}, is used",
            values.len(),
            values.join(", "),
            values.last().map(String::as_str).unwrap_or_default()
        );
    }
}

pub fn run(args: PlanArgs) -> anyhow::Result<ExitCode> {
    if let Some(what) = args.list {
        emit(&catalog_list(what)).context("writing the list")?;
        return Ok(ExitCode::SUCCESS);
    }
    note_repeated_flags();
    let (req, notes) = request(&args)?;
    for n in &notes {
        eprintln!("headroom: warning: {n}");
    }
    super::check_model_path(args.model())?;
    if args.engine == Engine::Llamacpp {
        return super::plan_llamacpp::run(&args, &req);
    }
    if args.llamacpp.any_given() {
        bail!(
            "--ctx-size, --parallel, --n-gpu-layers and the other llama.cpp flags need --engine llamacpp"
        );
    }
    let resolved = super::plan_hub::resolve(args.model())?;
    let mut plan = make_plan(&resolved.spec, &req)?;
    plan.warnings.extend(notes);
    let layout = super::plan_layout::layout(&plan, &args.layout)?;
    let text = match args.format {
        Format::Json => format!(
            "{}\n",
            serde_json::to_string_pretty(&super::plan_layout::json_with_layout(
                &plan,
                layout.as_ref()
            )?)?
        ),
        // Nothing runnable for a plan that does not fit: `$(headroom plan … --format shell)`
        // must not start a server that fails.
        Format::Shell if !plan.fits => String::new(),
        Format::Shell => match &layout {
            Some(l) => format!("{}\n", l.launch_lines.join("\n")),
            None => format!("{}\n", command_line(&plan)),
        },
        Format::Table => {
            let mut t = render_table(&plan);
            if let Some(l) = &layout {
                t.push_str(&super::plan_layout::render_layout(&plan, l));
            }
            paint_table(&t)
        }
    };
    emit(&text).context("writing the plan")?;
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
        _ if !plan.refused.is_empty() => {
            let _ = writeln!(
                out,
                "verdict: vLLM REFUSES these settings before it allocates anything:"
            );
            for r in &plan.refused {
                let _ = writeln!(out, "  {r}");
            }
        }
        None if plan.fits && !plan.gives_up.is_empty() => {
            let _ = writeln!(
                out,
                "verdict: SHORT OF WHAT WAS ASKED: {}; these settings fit the card",
                plan.gives_up.join("; ")
            );
        }
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
        let _ = writeln!(
            out,
            "options (each planned again with the change applied; all fit; those that keep what was asked first, then the fewest GPUs, the least quality cost, the least memory):"
        );
        for o in &plan.options {
            let card = if o.gpus > 1 {
                format!(
                    "{:.2} GiB on each of {} GPUs",
                    gib(o.memory_needed_bytes),
                    o.gpus
                )
            } else {
                format!("{:.2} GiB of the card", gib(o.memory_needed_bytes))
            };
            let _ = writeln!(
                out,
                "  {}: {}\n      re-planned: utilization {:.2}, {card}, {} × {} tokens  [{}]",
                o.option,
                o.description,
                o.gpu_memory_utilization,
                o.concurrency,
                thousands(o.max_model_len),
                o.headroom_args.join(" ")
            );
        }
    } else if !plan.fits {
        let _ = writeln!(
            out,
            "options: none found (utilization, context, sequences, fp8 KV, quantized weights and TP tried)"
        );
    }
    let _ = writeln!(out);
    if plan.fits {
        let _ = writeln!(out, "{}", command_line(plan));
    } else {
        let _ = writeln!(
            out,
            "nothing to run: this plan does not fit; add one option's flags above and plan again"
        );
    }
    out.push_str(&render_lanes(plan));
    for w in &plan.warnings {
        let _ = writeln!(out, "note: {w}");
    }
    out
}

/// `--list models|gpus|reserves`: one entry per line, name first, then what it is.
fn catalog_list(what: ListWhat) -> String {
    let mut out = String::new();
    match what {
        ListWhat::Models => {
            for m in headroom_inspect::catalog::models() {
                let kind = m.kind.as_deref().unwrap_or("text");
                let _ = writeln!(out, "{:<48} {kind}", m.id);
            }
        }
        ListWhat::Gpus => {
            for g in headroom_inspect::catalog::gpus() {
                let _ = writeln!(
                    out,
                    "{:<40} {:>7.2} GiB visible to CUDA",
                    g.name,
                    gib(g.cuda_visible_bytes())
                );
            }
        }
        ListWhat::Reserves => {
            for p in reserve_profiles() {
                let _ = writeln!(out, "{:<28} {:>6.2} GiB  {}", p.name, gib(p.bytes), p.stack);
            }
        }
    }
    out
}
