//! `headroom up`: reads the box file, runs `headroom-up`'s supervisor until SIGTERM or Ctrl-C,
//! prints its progress lines on stderr, and maps its errors to exit codes (2 bad input or
//! environment, 3 the box does not fit, 1 a backend that failed while starting).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use headroom_up::example::EXAMPLE_BOX;
use headroom_up::{BoxConfig, UpOptions};

#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// Box file (TOML). See --print-example-config and docs/up.md.
    #[arg(
        long,
        value_name = "FILE",
        required_unless_present = "print_example_config"
    )]
    pub config: Option<PathBuf>,
    /// Print a commented example box file with every key and exit.
    #[arg(long)]
    pub print_example_config: bool,
    /// Measure the audio backends again even when the calibration file beside the box file has
    /// their figures.
    #[arg(long)]
    pub recalibrate: bool,
    /// Folder for the backends' logs (default: a fresh folder under the temporary directory).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Validate the box file and exit without starting anything.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: UpArgs) -> anyhow::Result<ExitCode> {
    if args.print_example_config {
        print!("{EXAMPLE_BOX}");
        return Ok(ExitCode::SUCCESS);
    }
    let path = args.config.context("--config FILE is required")?;
    let config = match BoxConfig::load(&path) {
        Ok(c) => c,
        Err(e) => return Ok(fail(&e)),
    };
    if args.check {
        println!(
            "box file {} is valid: {} backend(s)",
            path.display(),
            config.backends.len()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let options = UpOptions {
        box_path: path,
        recalibrate: args.recalibrate,
        log_dir: args.log_dir,
        progress: Arc::new(|line: &str| {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(err, "{line}");
        }),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let outcome = runtime.block_on(headroom_up::run(config, options, shutdown_signal()));
    // Backends' process groups are stopped inside `run`; the runtime's leftovers go here.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match outcome {
        Ok(()) => {
            eprintln!("up: stopped");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Ok(fail(&e)),
    }
}

fn fail(e: &headroom_up::UpError) -> ExitCode {
    let text = e.to_string();
    let line: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    eprintln!("headroom up: {}", line.join(" "));
    ExitCode::from(e.exit_code())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("up: shutting down: gateway first, then the text engine, then the audio backends");
}
