//! Subcommand dispatch and the exit-code conventions every subcommand shares.

pub mod bench;
pub mod doctor;
pub mod doctor_live;
pub mod drill;
pub mod gateway;
pub mod pipe;
pub mod plan;
pub mod plan_args;
pub mod plan_hub;
pub mod plan_layout;
pub mod plan_llamacpp;
pub mod plan_paint;
pub mod replan;
pub mod serve;
pub mod shell;
pub mod signals;
pub mod soak;
pub mod top;
pub mod up;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

/// Bad input or an unusable environment.
pub const EXIT_BAD_INPUT: u8 = 2;
/// A plan that does not fit the card.
pub const EXIT_DOES_NOT_FIT: u8 = 3;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Predict GPU memory the way vLLM spends it and print flags that fit.
    Plan(Box<plan_args::PlanArgs>),
    /// Drive load at an OpenAI-compatible endpoint; measure TTFT, ITL, E2E and GPU memory.
    Bench(bench::BenchArgs),
    /// Repeat a bench workload in rounds and judge whether memory or throughput drifts.
    Soak(soak::SoakArgs),
    /// Run the OpenAI-compatible gateway with audio and text lanes.
    Serve(serve::ServeArgs),
    /// Start the audio backends, measure what they hold, give the text engine the rest, serve.
    Up(up::UpArgs),
    /// Live view of GPU memory per process, with gateway lanes; --once for scripts, --replay for recordings.
    Top(top::TopArgs),
    /// Read an engine log (or live /metrics with --metrics), name what is wrong and compute the fix.
    Doctor(doctor::DoctorArgs),
    /// Run a night of mixed voice and text load with faults against a box; report and judge it.
    Drill(Box<drill::DrillArgs>),
    /// The co-tenant process of a drill's fault (holds memory, then exits).
    #[command(name = "drill-co-tenant", hide = true)]
    DrillCoTenant(drill::CoTenantArgs),
    /// Print a shell completion script: `source <(headroom completions bash)`.
    Completions(shell::CompletionsArgs),
    /// Print the manual page (roff), generated from these very flags: `headroom man | man -l -`.
    Man(shell::ManArgs),
}

/// `--color`: when output may carry colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ColorWhen {
    Auto,
    Always,
    Never,
}

impl ColorWhen {
    /// Reads `--color` from the raw arguments before clap runs (clap's own messages need it),
    /// then `NO_COLOR` (https://no-color.org: set and not empty means no colour).
    pub fn from_args(args: impl IntoIterator<Item = std::ffi::OsString>) -> ColorWhen {
        let args: Vec<String> = args
            .into_iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let mut given = None;
        for (i, a) in args.iter().enumerate() {
            let value = match a.strip_prefix("--color") {
                Some("") => args.get(i + 1).map(String::as_str),
                Some(rest) => rest.strip_prefix('='),
                None => None,
            };
            if let Some(v) =
                value.and_then(|v| <ColorWhen as clap::ValueEnum>::from_str(v, true).ok())
            {
                given = Some(v);
            }
        }
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        match given {
            Some(w) => w,
            None if no_color => ColorWhen::Never,
            None => ColorWhen::Auto,
        }
    }

    pub fn clap_choice(self) -> clap::ColorChoice {
        match self {
            ColorWhen::Auto => clap::ColorChoice::Auto,
            ColorWhen::Always => clap::ColorChoice::Always,
            ColorWhen::Never => clap::ColorChoice::Never,
        }
    }
}

static COLOR_OFF: AtomicBool = AtomicBool::new(false);

/// Records the colour choice for commands that draw (`top`).
pub fn set_color(when: ColorWhen) {
    COLOR_OFF.store(when == ColorWhen::Never, Ordering::Relaxed);
}

/// False after `--color never` or with `NO_COLOR` set.
pub fn color_enabled() -> bool {
    !COLOR_OFF.load(Ordering::Relaxed)
}

pub fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Plan(args) => plan::run(*args),
        Command::Serve(args) => serve::run(args),
        Command::Up(args) => up::run(args),
        Command::Top(args) => top::run(args),
        Command::Doctor(args) => doctor::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Soak(args) => soak::run(args),
        Command::Drill(args) => drill::run(*args),
        Command::DrillCoTenant(args) => drill::co_tenant(args),
        Command::Completions(_) | Command::Man(_) => {
            unreachable!("main answers completions and man: they need the whole command")
        }
    }
}

/// `--model` written as a path (`./dir`, `/x`, `~/x`, a `.gguf` or `.json` file) that does not
/// exist: say so, rather than "unknown model" with catalog names.
pub fn check_model_path(model: &str) -> anyhow::Result<()> {
    let m = model.trim();
    let looks_like_path = m.starts_with(['/', '.', '~'])
        || m.contains('\\')
        || [".gguf", ".json", ".safetensors"]
            .iter()
            .any(|ext| m.to_ascii_lowercase().ends_with(ext))
        || m.matches('/').count() > 1;
    if looks_like_path && !std::path::Path::new(m).exists() {
        anyhow::bail!("--model '{m}': no such file or directory");
    }
    Ok(())
}

/// Flattens an error chain into one readable line.
pub fn one_line(err: &anyhow::Error) -> String {
    let text = format!("{err:#}");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Help and version go to stdout with exit 0; every other parse error is one line and exit 2.
pub fn report_clap_error(err: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match err.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = err.print();
            if err.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                ExitCode::from(EXIT_BAD_INPUT)
            } else {
                ExitCode::SUCCESS
            }
        }
        _ => {
            let rendered = err.render().to_string();
            // The message is the first paragraph; usage and tips follow a blank line.
            let first = rendered
                .lines()
                .map(str::trim)
                .skip_while(|l| l.is_empty())
                .take_while(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ");
            let first = first.trim_start_matches("error: ");
            eprintln!("headroom: {first}{} (see --help)", clap_tips(&rendered));
            ExitCode::from(EXIT_BAD_INPUT)
        }
    }
}

/// clap's "tip:" lines (`a similar argument exists: '--gpu-memory-utilization'`), joined so the
/// one-line error keeps its suggestion.
fn clap_tips(rendered: &str) -> String {
    rendered
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("tip:"))
        .map(|t| format!("; {}", t.trim()))
        .collect()
}
