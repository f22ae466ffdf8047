//! `headroom up`: reads the box file, runs `headroom-up`'s supervisor until SIGTERM or Ctrl-C
//! (SIGHUP is ignored, a closed stderr only drops lines: [`super::signals`]), prints its progress
//! lines on stderr, and maps its errors to exit codes (2 bad input or environment, 3 the box does
//! not fit, 1 a backend that failed while starting).

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use headroom_server::stderr::line;
use headroom_up::boxfile::Overrides;
use headroom_up::example::EXAMPLE_BOX;
use headroom_up::{BoxConfig, HandSized, UpOptions};

use super::signals::Signals;

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
    /// Folder for the backends' logs, kept after the stop (default: a fresh private folder
    /// under the temporary directory, removed at a clean stop).
    #[arg(long, value_name = "DIR")]
    pub log_dir: Option<PathBuf>,
    /// Keep the default log folder after a clean stop.
    #[arg(long)]
    pub keep_logs: bool,
    /// Validate the box file, the gateway configuration it derives, the calibration path and
    /// every path the box names (programs, warm-up files, models), and exit without starting
    /// anything.
    #[arg(long)]
    pub check: bool,
    /// Serve the gateway on this address instead of the box file's `[serve] listen`.
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<std::net::SocketAddr>,
    /// Move the backends' ports: backend k of the file (from 0) listens on N + k, and its
    /// `{port}` and upstream follow.
    #[arg(long, value_name = "N")]
    pub port_base: Option<u16>,
    /// Enforce the capacity as if the box file said `[memory] enforce = true`: every backend
    /// runs in one memory cgroup limited to it (host pool only; needs a writable memory cgroup).
    #[arg(long)]
    pub enforce: bool,
    /// Sizing switched off: start the text engine with these arguments (one string, split on
    /// white space; "" for the engine's defaults) instead of the flags up computes for it
    /// (`headroom drill --without sizing`; never for a real box).
    #[arg(long, hide = true, value_name = "ARGS", allow_hyphen_values = true)]
    pub text_sized_by_hand: Option<String>,
    /// With --text-sized-by-hand: an environment variable for the text engine (repeatable).
    #[arg(long, hide = true, value_name = "KEY=VALUE", value_parser = env_pair, requires = "text_sized_by_hand")]
    pub text_sized_by_hand_env: Vec<(String, String)>,
}

/// `KEY=VALUE`.
fn env_pair(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("`{s}` is not KEY=VALUE")),
    }
}

pub fn run(args: UpArgs) -> anyhow::Result<ExitCode> {
    if args.print_example_config {
        print!("{EXAMPLE_BOX}");
        return Ok(ExitCode::SUCCESS);
    }
    let path = args.config.context("--config FILE is required")?;
    let overrides = Overrides {
        listen: args.listen,
        port_base: args.port_base,
        enforce: args.enforce,
    };
    let config = match BoxConfig::load_with(&path, overrides) {
        Ok(c) => c,
        Err(e) => return Ok(fail(&e)),
    };
    if args.check {
        if let Err(e) = headroom_up::checks::before_start(&config, &path)
            .and_then(|()| headroom_up::supervisor::check_paths(&config))
        {
            return Ok(fail(&e));
        }
        let ports: Vec<String> = config
            .backends
            .iter()
            .map(|b| format!("{} {}", b.name, b.port))
            .collect();
        println!(
            "box file {} is valid: {} backend(s) ({}), gateway on {}; paths from {}",
            path.display(),
            config.backends.len(),
            ports.join(", "),
            config.serve.listen,
            config.dir.display()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let options = UpOptions {
        box_path: path,
        recalibrate: args.recalibrate,
        log_dir: args.log_dir,
        keep_logs: args.keep_logs,
        text_sized_by_hand: args.text_sized_by_hand.map(|a| HandSized {
            args: a.split_whitespace().map(str::to_string).collect(),
            env: args.text_sized_by_hand_env,
        }),
        progress: Arc::new(line),
    };
    // The gateway `up` runs holds a socket per client and per upstream connection.
    super::serve::raise_open_file_limit("up");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let signals = {
        let _in_runtime = runtime.enter();
        Signals::install().context("cannot install the signal handlers")?
    };
    let stop = async move {
        signals.stop_requested("up").await;
        line("up: shutting down: gateway first, then the text engine, then the audio backends");
    };
    let outcome = runtime.block_on(headroom_up::run(config, options, stop));
    // Backends' process groups are stopped inside `run`; the runtime's leftovers go here.
    runtime.shutdown_timeout(std::time::Duration::from_secs(5));
    match outcome {
        Ok(()) => {
            line("up: stopped");
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Ok(fail(&e)),
    }
}

fn fail(e: &headroom_up::UpError) -> ExitCode {
    let text = e.to_string();
    let parts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    line(&format!("headroom up: {}", parts.join(" ")));
    ExitCode::from(e.exit_code())
}
