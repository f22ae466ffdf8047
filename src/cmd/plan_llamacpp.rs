//! `headroom plan --engine llamacpp`: llama.cpp's flags (by their long names) → a
//! [`LlamaCppRequest`] → buffers per device, the `--n-gpu-layers` that fits the card beside its
//! co-tenants, and the fix when the asked one does not. Exit 3 when it does not fit.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{Context, bail};
use headroom_inspect::llamacpp::resolve_llamacpp;
use headroom_inspect::resolve::Env;
use headroom_plan::PlanRequest;
use headroom_plan::llamacpp::{
    FlashAttn, GgmlType, LlamaCppPlan, LlamaCppRequest, WeightType, fit_n_gpu_layers, largest_ctx,
    plan as llama_plan, try_plan,
};
use headroom_plan::units::{gib, thousands};
use serde::Serialize;

use super::EXIT_DOES_NOT_FIT;
use super::plan_args::{Format, LlamaCppArgs, PlanArgs};
use super::plan_paint::paint_table;

fn cache_type(flag: &str, value: Option<&str>) -> anyhow::Result<GgmlType> {
    let Some(v) = value else {
        return Ok(GgmlType::F16);
    };
    GgmlType::parse(v).with_context(|| {
        format!(
            "invalid --{flag} '{v}': use one of {}",
            GgmlType::ALL.map(|t| t.name()).join(", ")
        )
    })
}

/// The fix when the asked `--n-gpu-layers` does not fit.
#[derive(Debug, Clone, Serialize)]
pub struct Fix {
    pub n_gpu_layers: u64,
    pub gpu_bytes: u64,
    pub host_bytes: u64,
    /// The largest `--ctx-size` that keeps the asked `--n-gpu-layers` on the card, if any.
    pub ctx_size_for_asked_layers: Option<u64>,
    pub llama_server_args: Vec<String>,
}

/// What `--format json` prints.
#[derive(Debug, Clone, Serialize)]
pub struct LlamaCppReport {
    pub engine: &'static str,
    pub model: String,
    pub model_source: String,
    /// `exact` (GGUF tensor table) or `estimated` (shape × weight type).
    pub weights_origin: &'static str,
    pub gpu_name: Option<String>,
    pub gpu_total_bytes: u64,
    /// The card less co-tenants, other processes and the safety margin.
    pub gpu_budget_bytes: u64,
    pub reserved_bytes: u64,
    pub safety_margin_bytes: u64,
    /// `--n-gpu-layers` as asked (`null`: the most that fit).
    pub requested_n_gpu_layers: Option<u64>,
    /// Repeating layers; llama.cpp counts `n_layer + 1` offloadable ones (with the output).
    pub n_layer: u64,
    #[serde(flatten)]
    pub plan: LlamaCppPlan,
    /// The largest `--ctx-size` with these layers on the card.
    pub largest_ctx_size: Option<u64>,
    pub fits: bool,
    pub shortfall_bytes: u64,
    pub fix: Option<Fix>,
    pub llama_server_args: Vec<String>,
    pub warnings: Vec<String>,
}

fn request(args: &LlamaCppArgs) -> anyhow::Result<(LlamaCppRequest, WeightType)> {
    let weight_type = WeightType::parse(&args.gguf_type).with_context(|| {
        format!(
            "invalid --gguf-type '{}': use one of {}",
            args.gguf_type,
            WeightType::ALL.map(|t| t.name()).join(", ")
        )
    })?;
    for (flag, v) in [
        ("ctx-size", args.ctx_size),
        ("parallel", args.parallel),
        ("batch-size", args.batch_size),
        ("ubatch-size", args.ubatch_size),
    ] {
        if v == Some(0) {
            bail!("invalid --{flag} 0: must be at least 1");
        }
    }
    let flash_attn = match args.flash_attn.as_deref().map(str::to_ascii_lowercase) {
        None => FlashAttn::Auto,
        Some(v) if v == "auto" => FlashAttn::Auto,
        Some(v) if v == "on" || v == "1" || v == "true" => FlashAttn::On,
        Some(v) if v == "off" || v == "0" || v == "false" => FlashAttn::Off,
        Some(v) => bail!("invalid --flash-attn '{v}': use on, off or auto"),
    };
    // The model is filled in by the caller.
    let mut req = LlamaCppRequest::new(headroom_plan::llamacpp::LlamaCppModel {
        name: String::new(),
        n_layer: 1,
        n_embd: 0,
        n_ff: 0,
        n_head: 1,
        n_head_kv: 1,
        head_dim_k: 0,
        head_dim_v: 0,
        n_vocab: 0,
        n_ctx_train: 0,
        n_swa: 0,
        n_swa_layers: 0,
        mla: false,
        layer_bytes: Vec::new(),
        token_embd_bytes: 0,
        output_bytes: 0,
        output_tied: false,
    });
    req.ctx_size = args.ctx_size.unwrap_or(0);
    req.parallel = args.parallel.unwrap_or(1);
    req.batch_size = args.batch_size.unwrap_or(req.batch_size);
    req.ubatch_size = args.ubatch_size.unwrap_or(req.ubatch_size);
    req.cache_type_k = cache_type("cache-type-k", args.cache_type_k.as_deref())?;
    req.cache_type_v = cache_type("cache-type-v", args.cache_type_v.as_deref())?;
    req.kv_unified = args.kv_unified;
    req.n_gpu_layers = args.n_gpu_layers;
    req.flash_attn = flash_attn;
    req.no_kv_offload = args.no_kv_offload;
    req.swa_full = args.swa_full;
    Ok((req, weight_type))
}

/// llama-server's flags for a plan.
fn server_args(req: &LlamaCppRequest, p: &LlamaCppPlan) -> Vec<String> {
    let mut a = vec![
        "--ctx-size".to_string(),
        p.n_ctx.to_string(),
        "--parallel".to_string(),
        req.parallel.to_string(),
        "--n-gpu-layers".to_string(),
        p.n_gpu_layers.to_string(),
    ];
    if req.batch_size != headroom_plan::llamacpp::DEFAULT_BATCH {
        a.extend(["--batch-size".to_string(), req.batch_size.to_string()]);
    }
    if req.ubatch_size != headroom_plan::llamacpp::DEFAULT_UBATCH {
        a.extend(["--ubatch-size".to_string(), req.ubatch_size.to_string()]);
    }
    if req.cache_type_k != GgmlType::F16 {
        a.extend(["--cache-type-k".into(), req.cache_type_k.name().into()]);
    }
    if req.cache_type_v != GgmlType::F16 {
        a.extend(["--cache-type-v".into(), req.cache_type_v.name().into()]);
    }
    if req.kv_unified {
        a.push("--kv-unified".into());
    }
    match req.flash_attn {
        FlashAttn::Auto => {}
        FlashAttn::On => a.extend(["--flash-attn".into(), "on".into()]),
        FlashAttn::Off => a.extend(["--flash-attn".into(), "off".into()]),
    }
    if req.no_kv_offload {
        a.push("--no-kv-offload".into());
    }
    if req.swa_full {
        a.push("--swa-full".into());
    }
    a
}

/// Plans llama.cpp for `args`; `base` carries the card, co-tenants and margin parsed for vLLM.
pub fn report(args: &PlanArgs, base: &PlanRequest) -> anyhow::Result<LlamaCppReport> {
    let (mut req, weight_type) = request(&args.llamacpp)?;
    let src = resolve_llamacpp(args.model(), &Env::from_process(), weight_type)?;
    req.model = src.model.clone();
    try_plan(&req).map_err(|e| anyhow::anyhow!("{e}"))?;
    let co_tenants = base.other_used_bytes + base.reservations.iter().map(|r| r.bytes).sum::<u64>();
    let budget = base
        .gpu_total_bytes
        .saturating_sub(co_tenants + base.safety_margin_bytes);

    let mut warnings = Vec::new();
    let asked = req.n_gpu_layers;
    if asked.is_none() {
        req.n_gpu_layers = Some(fit_n_gpu_layers(&req, budget));
    }
    let p = llama_plan(&req);
    let fits = p.gpu_bytes <= budget;
    let fix = (!fits).then(|| {
        let n = fit_n_gpu_layers(&req, budget);
        let mut r = req.clone();
        r.n_gpu_layers = Some(n);
        let fp = llama_plan(&r);
        Fix {
            n_gpu_layers: n,
            gpu_bytes: fp.gpu_bytes,
            host_bytes: fp.host_bytes,
            ctx_size_for_asked_layers: largest_ctx(&req, budget),
            llama_server_args: server_args(&r, &fp),
        }
    });
    if p.gpu_layers < req.model.n_layer {
        warnings.push(format!(
            "{} of {} layers stay on the CPU: their weights ({:.2} GiB, memory-mapped) and KV ({:.2} GiB) live in host RAM and run at CPU speed",
            req.model.n_layer - p.gpu_layers,
            req.model.n_layer,
            gib(p.weights_host_bytes),
            gib(p.kv_cache_host_bytes)
        ));
    }
    if p.n_ctx_seq > req.model.n_ctx_train && req.model.n_ctx_train > 0 {
        warnings.push(format!(
            "{} cells per sequence exceed the model's training context of {}",
            thousands(p.n_ctx_seq),
            thousands(req.model.n_ctx_train)
        ));
    }
    if !src.exact {
        warnings.push(format!(
            "not a local GGUF file: weights estimated as a uniform {} GGUF; pass the .gguf path for exact figures",
            weight_type.name()
        ));
    }
    Ok(LlamaCppReport {
        engine: "llamacpp",
        model: args.model().to_string(),
        model_source: src.source,
        weights_origin: if src.exact { "exact" } else { "estimated" },
        gpu_name: base.gpu_name.clone(),
        gpu_total_bytes: base.gpu_total_bytes,
        gpu_budget_bytes: budget,
        reserved_bytes: co_tenants,
        safety_margin_bytes: base.safety_margin_bytes,
        requested_n_gpu_layers: asked,
        n_layer: req.model.n_layer,
        largest_ctx_size: (p.n_gpu_layers > 0)
            .then(|| largest_ctx(&req, budget))
            .flatten(),
        fits,
        shortfall_bytes: p.gpu_bytes.saturating_sub(budget),
        fix,
        llama_server_args: server_args(&req, &p),
        plan: p,
        warnings,
    })
}

pub fn run(args: &PlanArgs, base: &PlanRequest) -> anyhow::Result<ExitCode> {
    let r = report(args, base)?;
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&r)?),
        Format::Shell => println!("{}", command_line(&r, &r.llama_server_args)),
        Format::Table => print!("{}", paint_table(&render_table(&r))),
    }
    if r.fits {
        Ok(ExitCode::SUCCESS)
    } else {
        if args.format != Format::Table {
            eprintln!(
                "headroom: does not fit: {:.2} GiB short on the GPU",
                gib(r.shortfall_bytes)
            );
        }
        Ok(ExitCode::from(EXIT_DOES_NOT_FIT))
    }
}

fn command_line(r: &LlamaCppReport, args: &[String]) -> String {
    let model = if r.weights_origin == "exact" {
        r.model.clone()
    } else {
        format!("{}.gguf", r.model.rsplit('/').next().unwrap_or(&r.model))
    };
    let mut parts = vec!["llama-server".to_string(), "--model".to_string(), model];
    parts.extend(args.iter().cloned());
    parts.join(" ")
}

/// The human-readable report.
pub fn render_table(r: &LlamaCppReport) -> String {
    let p = &r.plan;
    let mut out = String::new();
    let gpu = match &r.gpu_name {
        Some(n) => format!("{n} ({:.2} GiB)", gib(r.gpu_total_bytes)),
        None => format!("{:.2} GiB GPU", gib(r.gpu_total_bytes)),
    };
    let _ = writeln!(out, "headroom plan (llama.cpp): {} on {gpu}", r.model);
    // Catalog sources carry long provenance notes; the JSON output keeps them whole.
    let source = match r.model_source.split_once(" (") {
        Some((head, _)) if r.model_source.len() > 100 => format!("{head} (…)"),
        _ => r.model_source.clone(),
    };
    let _ = writeln!(out, "model: {source} (weights {})", r.weights_origin);
    let _ = writeln!(
        out,
        "context: --ctx-size {} = {} stream(s) × {} cells; batch {}/{} (ubatch); flash attention {}; offloaded {}/{} layers to the GPU (output layer {})",
        thousands(p.n_ctx),
        p.n_stream,
        thousands(p.n_ctx_seq),
        p.n_batch,
        p.n_ubatch,
        if p.flash_attn { "on" } else { "off" },
        p.n_gpu_layers,
        r.n_layer + 1,
        if p.output_on_gpu {
            "on the GPU"
        } else {
            "on the CPU"
        }
    );
    let _ = writeln!(out);
    let _ = writeln!(out, "{:<22} {:>10} {:>10}", "buffer", "GPU GiB", "host GiB");
    for (name, g, h) in [
        ("weights", p.weights_gpu_bytes, p.weights_host_bytes),
        ("KV cache", p.kv_cache_gpu_bytes, p.kv_cache_host_bytes),
        (
            "compute buffer",
            p.compute_buffer_gpu_bytes,
            p.compute_buffer_host_bytes,
        ),
        ("output (logits)", 0, p.output_buffer_bytes),
    ] {
        let _ = writeln!(out, "{name:<22} {:>10.2} {:>10.2}", gib(g), gib(h));
    }
    let _ = writeln!(
        out,
        "{:<22} {:>10.2} {:>10.2}",
        "total",
        gib(p.gpu_bytes),
        gib(p.host_bytes)
    );
    let _ = writeln!(
        out,
        "GPU budget: {:.2} GiB ({:.2} GiB card − {:.2} GiB co-tenants − {:.2} GiB margin)",
        gib(r.gpu_budget_bytes),
        gib(r.gpu_total_bytes),
        gib(r.reserved_bytes),
        gib(r.safety_margin_bytes)
    );
    if let Some(c) = r.largest_ctx_size {
        let _ = writeln!(
            out,
            "largest --ctx-size with these layers: {}",
            thousands(c)
        );
    }
    let _ = writeln!(out);
    if r.fits {
        let _ = writeln!(out, "verdict: fits");
    } else {
        let _ = writeln!(
            out,
            "verdict: DOES NOT FIT, {:.2} GiB short on the GPU",
            gib(r.shortfall_bytes)
        );
    }
    if let Some(f) = &r.fix {
        let _ = writeln!(
            out,
            "fix: --n-gpu-layers {} fits ({:.2} GiB on the GPU, {:.2} GiB host)",
            f.n_gpu_layers,
            gib(f.gpu_bytes),
            gib(f.host_bytes)
        );
        match f.ctx_size_for_asked_layers {
            Some(c) => {
                let _ = writeln!(
                    out,
                    "fix: or keep --n-gpu-layers {} with --ctx-size {}",
                    p.n_gpu_layers,
                    thousands(c)
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "fix: --n-gpu-layers {} does not fit at any context",
                    p.n_gpu_layers
                );
            }
        }
        let _ = writeln!(out, "  {}", command_line(r, &f.llama_server_args));
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "{}", command_line(r, &r.llama_server_args));
    for w in &r.warnings {
        let _ = writeln!(out, "note: {w}");
    }
    out
}
