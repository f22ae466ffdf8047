//! `headroom doctor FILE|-`: reads an engine log (file or stdin), prints the findings most likely
//! first with their numbers, computed fix and evidence lines, and for a vLLM start-up the memory
//! breakdown it found. `--format json` prints `{"findings":[{cause,numbers,fix,evidence_lines}],…}`.

use std::fs::File;
use std::io::{self, BufReader, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use headroom_doctor::{Diagnosis, StartupReport};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// Log file to read, or `-` for standard input.
    pub log: PathBuf,
    /// Output format.
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
}

pub fn run(args: DoctorArgs) -> anyhow::Result<ExitCode> {
    let diagnosis = if args.log.as_os_str() == "-" {
        headroom_doctor::diagnose(io::stdin().lock()).context("reading standard input")?
    } else {
        let file =
            File::open(&args.log).with_context(|| format!("cannot open {}", args.log.display()))?;
        if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            anyhow::bail!("{} is a directory, not a log file", args.log.display());
        }
        headroom_doctor::diagnose(BufReader::with_capacity(1 << 16, file))
            .with_context(|| format!("reading {}", args.log.display()))?
    };
    let text = match args.format {
        Format::Json => json(&diagnosis)?,
        Format::Table => table(&diagnosis, &args.log.display().to_string()),
    };
    let mut out = io::stdout().lock();
    out.write_all(text.as_bytes())
        .context("writing the report")?;
    Ok(ExitCode::SUCCESS)
}

fn json(d: &Diagnosis) -> anyhow::Result<String> {
    let mut value = serde_json::to_value(d)?;
    if let Some(obj) = value.as_object_mut() {
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

fn table(d: &Diagnosis, source: &str) -> String {
    let mut s = String::new();
    let engine = d
        .engine
        .map(|e| format!("{e:?}"))
        .unwrap_or_else(|| "unknown".into());
    s.push_str(&format!(
        "headroom doctor: {source} — {} lines read, engine {engine}",
        d.lines_read
    ));
    if let Some(gpu) = &d.gpu_name {
        s.push_str(&format!(", GPU {gpu}"));
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
        s.push_str(&format!("\n{}. {}\n", i + 1, f.cause.as_str()));
        if !f.numbers.is_empty() {
            let nums: Vec<String> = f
                .numbers
                .iter()
                .map(|(k, v)| format!("{k}={}", trim(*v)))
                .collect();
            s.push_str(&format!("   numbers:  {}\n", nums.join("  ")));
        }
        s.push_str(&format!("   fix:      {}\n", f.fix));
        let lines: Vec<String> = f.evidence_lines.iter().map(u64::to_string).collect();
        s.push_str(&format!("   evidence: line {}\n", lines.join(", ")));
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
    s.push_str("  compare with `headroom plan` for the same model, utilization, max_model_len and TP to see the predicted figures\n");
    s
}
