//! Log lines on standard error that never end the process. `eprintln!` panics when the write
//! fails, and a closed stderr (the reader of a pipe gone, a terminal closed) then ends a gateway
//! mid-drain or a supervisor before it has stopped its backends; here the line is dropped and
//! the work goes on. (SIGPIPE itself is ignored: the Rust runtime sets that before `main`.)

use std::io::Write;

/// Writes `text` and a newline to stderr in one write; a failed write is ignored.
pub fn line(text: &str) {
    let mut out = String::with_capacity(text.len() + 1);
    out.push_str(text);
    out.push('\n');
    let _ = std::io::stderr().lock().write_all(out.as_bytes());
}
