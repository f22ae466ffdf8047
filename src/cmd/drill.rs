//! `headroom drill`: flags → `headroom-drill`'s options → one night against a box → the report's
//! files and an exit code (0 every verdict holds, 1 one does not, each named; 2 bad input).
//! `--compare A B` prints two reports side by side. The hidden `drill-co-tenant` subcommand is
//! the co-tenant process a night's fault starts inside the pool.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use headroom_drill::report::{Expect, Report};
use headroom_drill::{DrillOptions, Without};
use headroom_plan::units::{BareNumber, parse_duration};

#[derive(Debug, clap::Args)]
pub struct DrillArgs {
    /// Box file (TOML, as for `headroom up`).
    #[arg(long = "box", value_name = "FILE", required_unless_present = "compare")]
    pub box_file: Option<PathBuf>,
    /// Night file (examples/night.toml; docs/drill.md).
    #[arg(long, value_name = "FILE", required_unless_present = "compare")]
    pub scenario: Option<PathBuf>,
    /// Length of the night (`4m`, `1h`): the file's shares of the night scale with it.
    #[arg(long, value_name = "DURATION", default_value = "1h")]
    pub duration: String,
    /// Folder for report.json, report.md, timeline.svg, requests.jsonl and the logs.
    #[arg(long, value_name = "DIR", required_unless_present = "compare")]
    pub report: Option<PathBuf>,
    /// Start the box's engines by hand as this file says (a fixed share for the text engine,
    /// clients straight to the engines) instead of under `headroom up`.
    #[arg(long, value_name = "FILE")]
    pub hand_set: Option<PathBuf>,
    /// What the night must show: `hold` (every verdict; default under up) or `page` (an OOM
    /// kill, audio p99 above 3× idle, or lost requests; default for --hand-set).
    #[arg(long, value_enum)]
    pub expect: Option<ExpectArg>,
    /// Switch off a part of headroom in the box under up, to see the verdicts fail.
    #[arg(long, value_enum)]
    pub without: Vec<WithoutArg>,
    /// More arguments for `headroom up` (repeat the flag for each).
    #[arg(long = "up-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub up_args: Vec<String>,
    /// API key for the gateway (default: the box file's first `api_keys`).
    #[arg(long, env = "HEADROOM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests per stream in the idle measurement (default: the night file's `[idle] requests`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub idle_requests: Option<u32>,
    /// Longest wait for the box to be ready (up measures its backends first).
    #[arg(long, value_name = "DURATION", default_value = "15m")]
    pub ready_timeout: String,
    /// Print two reports (report.json files or their folders) side by side as Markdown.
    #[arg(long, num_args = 2, value_names = ["A", "B"], conflicts_with_all = ["box_file", "hand_set"])]
    pub compare: Option<Vec<PathBuf>>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum ExpectArg {
    Hold,
    Page,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum WithoutArg {
    /// Audio lanes admit without a memory need.
    Admission,
    /// The text engine sized to the memory free with audio at rest, not leaving room for its
    /// peaks.
    Sizing,
}

/// The co-tenant: holds memory for a while, then exits.
#[derive(Debug, clap::Args)]
pub struct CoTenantArgs {
    #[arg(long)]
    pub bytes: u64,
    #[arg(long)]
    pub seconds: f64,
}

pub fn co_tenant(args: CoTenantArgs) -> anyhow::Result<ExitCode> {
    let hold = Duration::try_from_secs_f64(args.seconds).context("--seconds")?;
    headroom_drill::faults::hold_memory(args.bytes, hold);
    Ok(ExitCode::SUCCESS)
}

fn duration(flag: &str, text: &str) -> anyhow::Result<Duration> {
    parse_duration(text, BareNumber::Seconds)
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} `{text}`: give a duration like 4m or 1h"))
}

fn load_report(path: &std::path::Path) -> anyhow::Result<serde_json::Value> {
    let file = if path.is_dir() {
        path.join("report.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("cannot read {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a drill report", file.display()))
}

pub fn run(args: DrillArgs) -> anyhow::Result<ExitCode> {
    if let Some(pair) = &args.compare {
        let a = load_report(&pair[0])?;
        let b = load_report(&pair[1])?;
        print!("{}", headroom_drill::report::side_by_side_json(&a, &b));
        return Ok(ExitCode::SUCCESS);
    }
    let (Some(box_path), Some(scenario_path), Some(report_dir)) =
        (args.box_file, args.scenario, args.report)
    else {
        anyhow::bail!("--box, --scenario and --report are required");
    };
    let opts = DrillOptions {
        box_path,
        scenario_path,
        duration: duration("--duration", &args.duration)?,
        report_dir,
        hand_set: args.hand_set,
        expect: args.expect.map(|e| match e {
            ExpectArg::Hold => Expect::Hold,
            ExpectArg::Page => Expect::Page,
        }),
        exe: std::env::current_exe().context("cannot find the headroom binary itself")?,
        up_args: args.up_args,
        api_key: args.api_key,
        idle_requests: args.idle_requests,
        without: args
            .without
            .iter()
            .map(|w| match w {
                WithoutArg::Admission => Without::Admission,
                WithoutArg::Sizing => Without::Sizing,
            })
            .collect(),
        ready_timeout: duration("--ready-timeout", &args.ready_timeout)?,
        progress: Arc::new(|line: &str| eprintln!("{line}")),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let (cancel_tx, cancel) = tokio::sync::watch::channel(false);
    let outcome = runtime.block_on(async move {
        let interrupt = async {
            stop_signal().await;
            eprintln!(
                "drill: interrupted: the night ends after this round (again to stop at once)"
            );
            let _ = cancel_tx.send(true);
            stop_signal().await;
        };
        tokio::select! {
            r = headroom_drill::run(opts, cancel) => Some(r),
            _ = interrupt => None,
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(10));
    let outcome = match outcome {
        Some(o) => o,
        None => {
            eprintln!("headroom drill: stopped at once; no report written");
            return Ok(ExitCode::from(130));
        }
    };
    match outcome {
        Ok(done) => {
            print_summary(&done.report);
            for f in &done.files {
                eprintln!("drill: wrote {}", f.display());
            }
            Ok(if done.report.passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        Err(e) => {
            eprintln!(
                "headroom drill: {}",
                e.to_string()
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            );
            Ok(ExitCode::from(e.exit_code()))
        }
    }
}

/// Ctrl-C or SIGTERM (`timeout`, a service manager).
async fn stop_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

fn print_summary(r: &Report) {
    for v in &r.verdicts {
        println!(
            "{} {}: {}",
            if v.holds { "holds " } else { "BROKEN" },
            v.name,
            v.detail
        );
    }
    println!(
        "{}: {}",
        r.mode.as_str(),
        match (r.expect, r.passed) {
            (Expect::Hold, true) => "every verdict holds".to_string(),
            (Expect::Hold, false) => format!(
                "broken: {}",
                r.verdicts
                    .iter()
                    .filter(|v| !v.holds)
                    .map(|v| v.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            (Expect::Page, true) =>
                "the page shows (OOM kill, audio p99 above 3x idle, or lost requests)".into(),
            (Expect::Page, false) =>
                "the page did NOT show: no OOM kill, no lost request, audio p99 within 3x idle"
                    .into(),
        }
    );
}
