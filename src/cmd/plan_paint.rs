//! Colours for `headroom plan`'s tables (vLLM's and llama.cpp's).

/// Whether `plan`'s table is coloured: `--color always`, or `auto` (the default) on a terminal
/// with NO_COLOR unset.
fn color_wanted() -> bool {
    use std::io::IsTerminal as _;
    match super::ColorWhen::from_args(std::env::args_os()) {
        super::ColorWhen::Always => true,
        super::ColorWhen::Never => false,
        super::ColorWhen::Auto => std::io::stdout().is_terminal(),
    }
}

/// The table with ANSI colours when they are wanted (see [`color_wanted`]).
pub fn paint_table(text: &str) -> String {
    if color_wanted() {
        paint(text)
    } else {
        text.to_string()
    }
}

/// Colours a rendered table line by line: the verdict green (fits), red (does not fit, refused)
/// or yellow (short of what was asked); notes yellow; the title, headings and the command lines
/// to run in bold.
pub fn paint(text: &str) -> String {
    const BOLD: &str = "\x1b[1m";
    const RED: &str = "\x1b[1;31m";
    const GREEN: &str = "\x1b[1;32m";
    const YELLOW: &str = "\x1b[33m";
    const RESET: &str = "\x1b[0m";
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.split_inclusive('\n') {
        let (body, end) = match line.strip_suffix('\n') {
            Some(b) => (b, "\n"),
            None => (line, ""),
        };
        let style = if body.starts_with("verdict: fits") {
            Some(GREEN)
        } else if body.starts_with("verdict: DOES NOT FIT")
            || body.starts_with("verdict: vLLM REFUSES")
        {
            Some(RED)
        } else if body.starts_with("verdict: SHORT") || body.starts_with("note:") {
            Some(YELLOW)
        } else if body.starts_with("headroom plan")
            || body.starts_with("vllm serve ")
            || body.starts_with("llama-server ")
            || body.starts_with("  CUDA_VISIBLE_DEVICES=")
            || body.starts_with("options")
            || body.starts_with("component ")
            || body.starts_with("buffer ")
        {
            Some(BOLD)
        } else {
            None
        };
        match style {
            Some(s) if !body.is_empty() => {
                out.push_str(s);
                out.push_str(body);
                out.push_str(RESET);
            }
            _ => out.push_str(body),
        }
        out.push_str(end);
    }
    out
}
