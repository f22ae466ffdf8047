//! `headroom doctor FILE|-`: reads an engine log (file or stdin), prints the findings most likely
//! first with their numbers, computed fix and evidence lines, and for a vLLM start-up the memory
//! breakdown it found. `--format json` prints `{"findings":[{cause,numbers,fix,evidence_lines}],…}`.
//! Exit status: 0 nothing found, 1 a problem found (the first finding is the cause), 2 bad input
//! (a file that cannot be read, a model that cannot be resolved).

use std::fs::File;
use std::io::{self, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use headroom_doctor::{Diagnosis, StartupReport};
use headroom_plan::advice::{BreakdownDelta, GIB, MemoryBreakdown, compare_breakdowns};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Log file to read, or `-` for standard input.
    #[arg(required_unless_present = "metrics")]
    pub log: Option<PathBuf>,
    /// Live diagnosis instead of a log: a headroom gateway's, vLLM's or llama.cpp's /metrics
    /// address, read twice `--interval` apart (repeat for several servers).
    #[arg(long = "metrics", value_name = "URL", conflicts_with = "log")]
    pub metrics: Vec<String>,
    /// With --metrics: time between the two readings.
    #[arg(long, default_value = "10s", value_parser = super::doctor_live::parse_interval, requires = "metrics")]
    pub interval: std::time::Duration,
    /// With --metrics: Bearer key for servers that require one.
    #[arg(long, env = "HEADROOM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// Output of `headroom plan --format json` for the same model and settings; the vLLM
    /// figures found in the log are compared with it line by line.
    #[arg(long, value_name = "PLAN_JSON", conflicts_with = "model")]
    pub compare_plan: Option<PathBuf>,
    /// Plan this model with the settings the log shows (GPU total, utilization, max_model_len,
    /// tensor parallelism) and compare the log's figures with the prediction.
    #[arg(long)]
    pub model: Option<String>,
    /// With --model: vLLM's --max-num-batched-tokens when the log does not show it.
    #[arg(long)]
    pub max_num_batched_tokens: Option<u64>,
    /// With --model: vLLM's --max-num-seqs when the log does not show it.
    #[arg(long)]
    pub max_num_seqs: Option<u64>,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    if !args.metrics.is_empty() {
        return super::doctor_live::run(
            &args.metrics,
            args.interval,
            args.api_key.as_deref(),
            args.format == Format::Json,
        );
    }
    let Some(log) = args.log.clone() else {
        anyhow::bail!("give a log file (or `-`), or --metrics URL");
    };
    let log_path = log;
    let diagnosis = if log_path.as_os_str() == "-" {
        read_log(
            headroom_doctor::diagnose(io::stdin().lock()),
            "standard input",
        )?
    } else {
        let file =
            File::open(&log_path).with_context(|| format!("cannot open {}", log_path.display()))?;
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            anyhow::bail!("{} is a directory, not a log file", log_path.display());
        }
        read_log(
            headroom_doctor::diagnose(BufReader::with_capacity(1 << 16, file)),
            &log_path.display().to_string(),
        )?
    };
    let (comparison, plan_note) = compare(&diagnosis, &args)?;
    let checks = fix_checks(&diagnosis, &args)?;
    let text = match args.format {
        Format::Json => json(
            &diagnosis,
            comparison.as_deref(),
            plan_note.as_deref(),
            &checks,
        )?,
        Format::Table => {
            let mut t = table(
                &diagnosis,
                &log_path.display().to_string(),
                &checks,
                Paint::for_stdout(),
            );
            if let Some(rows) = &comparison {
                t.push_str(&comparison_table(rows));
            }
            if let Some(note) = &plan_note {
                t.push_str(&format!("\nnote: {note}\n"));
            }
            t
        }
    };
    super::pipe::emit(&text).context("writing the report")?;
    Ok(exit_code(&diagnosis))
}

/// ANSI styling for the table, on when `--color always` asks for it or `--color auto` writes to a
/// terminal (and `NO_COLOR` is unset); JSON is never styled.
#[derive(Debug, Clone, Copy)]
pub(super) struct Paint(bool);

impl Paint {
    pub(super) fn for_stdout() -> Paint {
        use std::io::IsTerminal;
        Paint(match super::ColorWhen::from_args(std::env::args_os()) {
            super::ColorWhen::Always => true,
            super::ColorWhen::Never => false,
            super::ColorWhen::Auto => std::io::stdout().is_terminal(),
        })
    }

    fn wrap(self, code: &str, text: &str) -> String {
        if self.0 {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    /// The cause (bold red) or a secondary finding (yellow).
    pub(super) fn cause(self, text: &str, first: bool) -> String {
        self.wrap(if first { "1;31" } else { "33" }, text)
    }

    /// A label in front of the fix (bold green).
    pub(super) fn fix(self, text: &str) -> String {
        self.wrap("1;32", text)
    }

    /// Less important text (dim).
    pub(super) fn dim(self, text: &str) -> String {
        self.wrap("2", text)
    }
}

/// The diagnosis, or one line saying why `source` could not be read (input that is not text is
/// named as such: an executable or an archive given by mistake is not a log).
fn read_log(
    result: Result<Diagnosis, headroom_doctor::DoctorError>,
    source: &str,
) -> anyhow::Result<Diagnosis> {
    match result {
        Ok(d) => Ok(d),
        Err(headroom_doctor::DoctorError::NotText(why)) => anyhow::bail!(
            "{source} is not a text log: {why}; `headroom doctor` reads an engine's log (a file, or `-` for standard input)"
        ),
        Err(e) => Err(anyhow::Error::new(e).context(format!("reading {source}"))),
    }
}

/// With `--model`: each finding's vLLM flag change planned again (see [`super::replan`]).
fn fix_checks(d: &Diagnosis, args: &DoctorArgs) -> anyhow::Result<Vec<Option<String>>> {
    let Some(model) = &args.model else {
        return Ok(Vec::new());
    };
    let spec = headroom_inspect::resolve::resolve_model(
        model,
        &headroom_inspect::resolve::Env::from_process(),
    )?
    .spec;
    Ok(super::replan::checks(d, &spec, model))
}

/// 0 when nothing was found, 1 when the log shows a problem.
fn exit_code(d: &Diagnosis) -> ExitCode {
    if d.findings.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The comparison with a plan, when asked for and the log has figures; otherwise a note saying
/// why there is none. The findings are never dropped for it.
fn compare(
    d: &Diagnosis,
    args: &DoctorArgs,
) -> anyhow::Result<(Option<Vec<BreakdownDelta>>, Option<String>)> {
    let plan = match (&args.compare_plan, &args.model) {
        (Some(path), _) => read_plan(path)?,
        (None, Some(model)) => {
            super::check_model_path(model)?;
            match plan_for_log(d, model, args)? {
                Ok(plan) => plan,
                Err(why) => return Ok((None, Some(why))),
            }
        }
        (None, None) => return Ok((None, None)),
    };
    match plan_comparison(d, &plan) {
        Ok(rows) => Ok((Some(rows), options_note(&plan))),
        Err(why) => Ok((None, Some(why))),
    }
}

/// With `--model`: the plan's verified options (each re-planned with its flags), one line.
fn options_note(plan: &serde_json::Value) -> Option<String> {
    let options = plan["options"].as_array().filter(|o| !o.is_empty())?;
    let lines: Vec<String> = options
        .iter()
        .map(|o| {
            let args: Vec<&str> = o["vllm_args"]
                .as_array()
                .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            format!(
                "{} [{}]",
                o["option"].as_str().unwrap_or("?"),
                args.join(" ")
            )
        })
        .collect();
    Some(format!(
        "flag changes planned again with the log's settings, each fits: {}",
        lines.join("; ")
    ))
}

fn json(
    d: &Diagnosis,
    comparison: Option<&[BreakdownDelta]>,
    plan_note: Option<&str>,
    checks: &[Option<String>],
) -> anyhow::Result<String> {
    let mut value = serde_json::to_value(d)?;
    if let Some(findings) = value["findings"].as_array_mut() {
        for (i, f) in findings.iter_mut().enumerate() {
            if let Some(Some(check)) = checks.get(i) {
                f["fix_replanned"] = check.as_str().into();
            }
            f["role"] = if i == 0 { "cause" } else { "secondary" }.into();
            if let Some(why) = d.secondary_reason(i) {
                f["secondary_because"] = why.into();
            }
        }
    }
    if let Some(obj) = value.as_object_mut() {
        if let Some(rows) = comparison {
            obj.insert("plan_comparison".into(), serde_json::to_value(rows)?);
        }
        if let Some(note) = plan_note {
            obj.insert("plan_comparison_note".into(), note.into());
        }
        obj.insert(
            "verdict".into(),
            serde_json::Value::String(d.verdict().into()),
        );
        let unrecognised: Vec<serde_json::Value> = d
            .unrecognised_lines
            .iter()
            .map(|(n, l)| serde_json::json!({"line": n, "text": l}))
            .collect();
        obj.insert(
            "unrecognised_lines".into(),
            serde_json::Value::Array(unrecognised),
        );
    }
    let mut s = serde_json::to_string_pretty(&value)?;
    s.push('\n');
    Ok(s)
}

fn table(d: &Diagnosis, source: &str, checks: &[Option<String>], paint: Paint) -> String {
    let mut s = String::new();
    let engine = d
        .engine
        .map(|e| e.as_str().to_owned())
        .unwrap_or_else(|| "unknown".into());
    s.push_str(&format!(
        "headroom doctor: {source} — {} lines read, engine {engine}",
        d.lines_read
    ));
    if let Some(gpu) = &d.gpu_name {
        s.push_str(&format!(", GPU {gpu}"));
    }
    if let Some(p) = d.platform {
        s.push_str(&format!(", platform {}", p.as_str()));
    }
    if d.truncated_lines > 0 {
        s.push_str(&format!(
            " ({} over-long lines truncated)",
            d.truncated_lines
        ));
    }
    s.push('\n');
    if d.findings.is_empty() {
        s.push_str("no memory problem recognised\n");
        if !d.unrecognised_lines.is_empty() {
            s.push_str("error-looking lines read but not understood:\n");
            for (n, line) in &d.unrecognised_lines {
                s.push_str(&format!("  {n:>6}: {line}\n"));
            }
        }
    }
    for (i, f) in d.findings.iter().enumerate() {
        s.push_str(&format!(
            "\n{}\n",
            paint.cause(&format!("{}. {}", i + 1, f.cause.as_str()), i == 0)
        ));
        if let Some(why) = d.secondary_reason(i) {
            s.push_str(&format!("   {}\n", paint.dim(&why)));
        }
        if !f.numbers.is_empty() {
            let nums: Vec<String> = f
                .numbers
                .iter()
                .map(|(k, v)| format!("{k}={}", trim(*v)))
                .collect();
            s.push_str(&format!("   numbers:  {}\n", nums.join("  ")));
        }
        s.push_str(&format!("   {}      {}\n", paint.fix("fix:"), f.fix));
        if let Some(Some(check)) = checks.get(i) {
            s.push_str(&format!("   checked:  {check}\n"));
        }
        let lines: Vec<String> = f.evidence_lines.iter().map(u64::to_string).collect();
        s.push_str(&format!(
            "   {}\n",
            paint.dim(&format!("evidence: line {}", lines.join(", ")))
        ));
    }
    if let Some(startup) = &d.startup {
        s.push_str(&breakdown(startup));
    }
    s
}

fn trim(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v:.4}").trim_end_matches('0').to_owned()
    }
}

fn breakdown(r: &StartupReport) -> String {
    let b = &r.breakdown;
    let mut s = String::from("\nvLLM memory breakdown found in the log (per GPU):\n");
    let mut row = |label: &str, value: Option<String>| {
        if let Some(v) = value {
            s.push_str(&format!("  {label:<30}{v}\n"));
        }
    };
    let g = |v: Option<f64>| v.map(|v| format!("{v:.2} GiB"));
    row("total", g(b.total_gib));
    row(
        "gpu_memory_utilization",
        b.utilization.map(|u| format!("{u:.2}")),
    );
    row("budget (total × util)", g(b.budget_gib));
    row("weights", g(b.weights_gib));
    row("activation peak", g(b.activation_peak_gib));
    row("non-torch", g(b.non_torch_gib));
    row("CUDA graphs", g(b.cuda_graph_gib));
    row("CUDA graphs (estimated)", g(r.cuda_graph_estimate_gib));
    row("KV cache", g(b.kv_cache_gib));
    row("KV tokens", b.kv_tokens.map(|t| t.to_string()));
    row("GPU blocks", b.gpu_blocks.map(|t| t.to_string()));
    row("max_model_len", b.max_model_len.map(|t| t.to_string()));
    row(
        "max concurrency",
        b.max_concurrency.map(|c| format!("{c:.2}x")),
    );
    row("outside the budget", g(r.outside_budget_gib));
    row(
        "KV bytes per token (derived)",
        r.kv_bytes_per_token.map(|v| format!("{v:.0}")),
    );
    row(
        "concurrency (recomputed)",
        r.concurrency_check.map(|c| format!("{c:.2}x")),
    );
    row(
        "tensor parallel",
        r.tensor_parallel_size.map(|t| t.to_string()),
    );
    row(
        "pipeline parallel",
        r.pipeline_parallel_size.map(|t| t.to_string()),
    );
    if let (Some(reported), Some(check)) = (b.max_concurrency, r.concurrency_check)
        && (reported - check).abs() > 0.05 * reported.max(0.01)
    {
        s.push_str(&format!(
            "  note: vLLM reported {reported:.2}x but full-attention arithmetic gives {check:.2}x: \
             the model has hybrid, sliding-window or MLA layers, or a block size other than {}\n",
            r.block_size.unwrap_or(16)
        ));
    }
    let lines: Vec<String> = r.evidence_lines.iter().map(u64::to_string).collect();
    s.push_str(&format!("  evidence: line {}\n", lines.join(", ")));
    s.push_str("  to compare with a prediction: `headroom doctor LOG --model M` (plans M with the log's total, utilization, max_model_len and TP), or `--compare-plan plan.json`\n");
    s
}

/// Reads `headroom plan --format json` (its stable fields) into a breakdown and lines it up with
/// the figures the log gave.
fn read_plan(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the plan {}", path.display()))?;
    let plan: serde_json::Value = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not the JSON `headroom plan --format json` prints",
            path.display()
        )
    })?;
    if !plan.is_object() {
        anyhow::bail!(
            "{} is not a JSON object from `headroom plan --format json`",
            path.display()
        );
    }
    Ok(plan)
}

/// Runs `headroom plan` for `model` with the settings the log shows. The outer error is bad
/// input (a model that cannot be resolved); the inner one says why this log has nothing to
/// compare.
fn plan_for_log(
    d: &Diagnosis,
    model: &str,
    args: &DoctorArgs,
) -> anyhow::Result<Result<serde_json::Value, String>> {
    let Some(startup) = &d.startup else {
        return Ok(Err(format!(
            "the log has no vLLM memory figures, so there is nothing to compare with a plan of {model}; the findings above stand"
        )));
    };
    let b = &startup.breakdown;
    let Some(total) = b.total_gib else {
        return Ok(Err("the log does not give the GPU's total memory; run `headroom plan` yourself and pass --compare-plan".into()));
    };
    let spec = headroom_inspect::resolve::resolve_model(
        model,
        &headroom_inspect::resolve::Env::from_process(),
    )?
    .spec;
    let mut req = headroom_plan::PlanRequest::new((total * GIB).round() as u64);
    req.gpu_memory_utilization = b.utilization;
    req.max_model_len = b.max_model_len;
    req.max_num_batched_tokens = args.max_num_batched_tokens;
    req.max_num_seqs = args.max_num_seqs;
    if let Some(tp) = startup.tensor_parallel_size {
        req.tensor_parallel_size = tp;
    }
    if let Some(bs) = startup.block_size {
        req.block_size = bs;
    }
    let plan = headroom_plan::plan(&spec, &req)?;
    Ok(Ok(serde_json::to_value(plan)?))
}

fn plan_comparison(d: &Diagnosis, plan: &serde_json::Value) -> Result<Vec<BreakdownDelta>, String> {
    let Some(startup) = &d.startup else {
        return Err(
            "the log has no vLLM memory figures to compare with the plan; the findings above stand"
                .into(),
        );
    };
    let predicted = breakdown_from_plan(plan);
    let mut rows = compare_breakdowns(&startup.breakdown, &predicted);
    if let (Some(m), Some(p)) = (
        startup.kv_bytes_per_token,
        plan["kv_bytes_per_token"].as_f64(),
    ) {
        rows.push(BreakdownDelta {
            item: "kv_bytes_per_token",
            measured: m,
            predicted: p,
            difference: p - m,
            relative: (m != 0.0).then(|| (p - m) / m),
        });
    }
    if rows.is_empty() {
        return Err("the plan and the log share no figure to compare".into());
    }
    Ok(rows)
}

/// Maps the plan's stable JSON fields (bytes) onto a breakdown in GiB.
fn breakdown_from_plan(plan: &serde_json::Value) -> MemoryBreakdown {
    let gib = |key: &str| plan[key].as_f64().map(|b| b / GIB);
    let count = |key: &str| plan[key].as_u64();
    MemoryBreakdown {
        total_gib: gib("gpu_total_bytes"),
        utilization: plan["gpu_memory_utilization"].as_f64(),
        budget_gib: gib("requested_bytes"),
        weights_gib: gib("weights_bytes"),
        activation_peak_gib: gib("activation_peak_bytes"),
        non_torch_gib: gib("non_torch_bytes"),
        cuda_graph_gib: gib("cuda_graph_bytes"),
        kv_cache_gib: gib("kv_cache_bytes"),
        kv_tokens: count("kv_cache_tokens"),
        gpu_blocks: count("num_blocks").or(match (count("kv_cache_tokens"), count("block_size")) {
            (Some(t), Some(b)) if b > 0 => Some(t / b),
            _ => None,
        }),
        max_model_len: count("max_model_len"),
        max_concurrency: plan["max_concurrency"].as_f64(),
    }
}

fn comparison_table(rows: &[BreakdownDelta]) -> String {
    let mut s = String::from("\nlog vs `headroom plan` (same settings):\n");
    s.push_str(&format!(
        "  {:<22}{:>14}{:>14}{:>14}{:>9}\n",
        "item", "log", "plan", "plan − log", "%"
    ));
    for r in rows {
        let pct = r
            .relative
            .map(|x| format!("{:+.1}", x * 100.0))
            .unwrap_or_else(|| "-".into());
        s.push_str(&format!(
            "  {:<22}{:>14.2}{:>14.2}{:>+14.2}{:>9}\n",
            r.item, r.measured, r.predicted, r.difference, pct
        ));
    }
    s
}
