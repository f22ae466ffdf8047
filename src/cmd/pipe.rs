//! A closed standard output or error (`headroom plan … | head -c1`) ends the program quietly
//! instead of with a panic and a stack trace. Rust ignores SIGPIPE, so a write to a closed pipe
//! fails with `BrokenPipe`: [`emit`] treats that as "the reader has gone" for commands that keep
//! their own exit code, and a panic hook catches every other `print!` that hits a closed pipe.

use std::io::{self, Write};

/// Exit status when stdout closes under a command that cannot finish: 128 + SIGPIPE (13), what a
/// shell reports for a program ended by the signal.
pub const EXIT_PIPE_CLOSED: u8 = 141;

/// Writes `text` to stdout. A reader that went away is not an error (the caller keeps its own
/// exit code); any other write failure is.
pub fn emit(text: &str) -> io::Result<()> {
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// True when the error chain holds a broken-pipe I/O error.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<io::Error>()
            .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// `print!`/`eprint!` panic with "failed printing to stdout: Broken pipe"; this hook turns that
/// one panic into a quiet exit and leaves every other panic to the default hook.
pub fn install_broken_pipe_hook() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if payload.starts_with("failed printing to std") && payload.contains("Broken pipe") {
            std::process::exit(i32::from(EXIT_PIPE_CLOSED));
        }
        default(info);
    }));
}
