//! The `headroom` binary: parses flags, turns them into validated settings, calls one library crate
//! and maps the outcome to an exit code (0 ok, 2 bad input or unusable environment, 3 does not fit).

mod cmd;

use std::process::ExitCode;

use clap::Parser;

/// mimalloc instead of the system allocator: the gateway allocates and frees small buffers (headers,
/// bodies, futures) on every request across worker threads, where glibc's malloc showed up as about
/// a fifth of `serve`'s CPU time in a perf profile (malloc, _int_free, malloc_consolidate).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Keeps a GPU shared by voice models and a text LLM out of OOM and out of queueing collapse.
#[derive(Debug, Parser)]
#[command(name = "headroom", version, about)]
struct Cli {
    #[command(subcommand)]
    command: cmd::Command,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return cmd::report_clap_error(err),
    };
    match cmd::run(cli.command) {
        Ok(code) => code,
        Err(err) => {
            eprintln!("headroom: {}", cmd::one_line(&err));
            ExitCode::from(cmd::EXIT_BAD_INPUT)
        }
    }
}
