//! Subcommand dispatch and the exit-code conventions every subcommand shares.

pub mod bench;
pub mod doctor;
pub mod plan;
pub mod plan_layout;
pub mod plan_llamacpp;
pub mod serve;
pub mod soak;
pub mod top;
pub mod up;

use std::process::ExitCode;

/// Bad input or an unusable environment.
pub const EXIT_BAD_INPUT: u8 = 2;
/// A plan that does not fit the card.
pub const EXIT_DOES_NOT_FIT: u8 = 3;

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Predict GPU memory the way vLLM spends it and print flags that fit.
    Plan(Box<plan::PlanArgs>),
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
    /// Read an engine log, name the memory limit that was crossed and compute the fix.
    Doctor(doctor::DoctorArgs),
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
    }
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
            eprintln!("headroom: {first} (see --help)");
            ExitCode::from(EXIT_BAD_INPUT)
        }
    }
}
