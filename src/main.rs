//! The `headroom` binary: parses flags, turns them into validated settings, calls one library crate
//! and maps the outcome to an exit code (0 ok, 2 bad input or unusable environment, 3 does not fit;
//! `doctor`: 1 when it found a memory problem). A closed standard output (`| head`) is not an
//! error: `plan` and `doctor` stop writing and keep their exit code, every other command stops
//! quietly with exit 141, what a shell reports for a program ended by SIGPIPE.

mod cmd;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};

/// `--version`: the crate version, the commit and the date of the built-in catalog.
const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("HEADROOM_COMMIT"),
    ", catalog ",
    env!("HEADROOM_CATALOG_DATE"),
    ")"
);

/// mimalloc instead of the system allocator: the gateway allocates and frees small buffers (headers,
/// bodies, futures) on every request across worker threads, where glibc's malloc showed up as about
/// a fifth of `serve`'s CPU time in a perf profile (malloc, _int_free, malloc_consolidate).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps a GPU shared by voice models and a text LLM out of OOM and out of queueing collapse.
#[derive(Debug, Parser)]
#[command(name = "headroom", version = LONG_VERSION, about)]
pub struct Cli {
    /// When to colour output: auto (a terminal, and NO_COLOR unset), always, never.
    #[arg(long, global = true, value_enum, default_value_t = cmd::ColorWhen::Auto)]
    color: cmd::ColorWhen,
    #[command(subcommand)]
    command: cmd::Command,
}

fn main() -> ExitCode {
    cmd::pipe::install_broken_pipe_hook();
    let when = cmd::ColorWhen::from_args(std::env::args_os());
    cmd::set_color(when);
    let matches = match Cli::command().color(when.clap_choice()).try_get_matches() {
        Ok(m) => m,
        Err(err) => return cmd::report_clap_error(err),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(err) => return cmd::report_clap_error(err),
    };
    let result = match cli.command {
        cmd::Command::Completions(args) => cmd::shell::completions(&args, Cli::command()),
        cmd::Command::Man(args) => cmd::shell::man(&args, Cli::command()),
        other => cmd::run(other),
    };
    match result {
        Ok(code) => code,
        Err(err) if cmd::pipe::is_broken_pipe(&err) => ExitCode::from(cmd::pipe::EXIT_PIPE_CLOSED),
        Err(err) => {
            eprintln!("headroom: {}", cmd::one_line(&err));
            ExitCode::from(cmd::EXIT_BAD_INPUT)
        }
    }
}
