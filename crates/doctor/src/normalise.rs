//! What a log looks like once the way it was captured is taken away, so rules read the engine's
//! words and numbers, not the terminal's, the container's or the orchestrator's. Owns:
//! - colour codes: ESC sequences, and the `[1;36m` residue a paste leaves when it loses the ESC
//!   byte (also the `^[[`, `\u001b[`, `\x1b[` and `\033[` spellings);
//! - carriage returns inside a line (progress bars redraw with `\r`): each segment is read;
//! - messages a console hard-wrapped at its width: the width is learnt from the head of the log
//!   (no line is longer than it and many lines are exactly it) and the pieces are joined again;
//! - structured lines (Docker's json-file, journald's JSON, tracing/JSON loggers): the message
//!   field is read, with the short context fields (level, target, logger) in front of it;
//! - per-line prefixes (timestamps of the usual forms, Docker Compose `svc-1  | `, kubectl
//!   `[pod/…]`, syslog, Ray/vLLM process tags `(EngineCore_0 pid=1)`, rank tags `[rank1]:`,
//!   SGLang's `[time TP1]`, log levels, `[file.py:12]`): found on demand for the lines rules
//!   read, with the worker rank they carry.
//!
//! Letter case is left to the matching (`crate::text`), which ignores ASCII case everywhere.
//!
//! The scanners are written by hand rather than with a regex crate: they are a handful of fixed,
//! anchored shapes tried at the start of a line, and they run on every line of logs that can
//! reach tens of megabytes, where a byte scan costs less than a regex engine's set-up per line.

use std::borrow::Cow;

/// Physical lines kept to learn the console width before any line is read by the rules.
pub const HEAD_LINES: usize = 2000;
/// Bytes kept for the same purpose.
pub const HEAD_BYTES: usize = 1 << 20;
/// A message joined from wrapped pieces is cut at this length.
pub const MAX_JOINED: usize = 64 * 1024;
/// The narrowest console width considered (shorter "wrapped" lines are ordinary short lines).
const MIN_WIDTH: usize = 40;

/// Removes terminal colour and cursor codes.
pub fn strip_ansi(line: &str) -> Cow<'_, str> {
    let b = line.as_bytes();
    if memchr::memchr3(0x1b, b'[', b'^', b).is_none() && memchr::memchr(b'\\', b).is_none() {
        return Cow::Borrowed(line);
    }
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    let mut kept = 0;
    while i < b.len() {
        let skip = escape_len(&b[i..]);
        if skip > 0 {
            out.push_str(&line[kept..i]);
            i += skip;
            while !line.is_char_boundary(i) {
                i += 1;
            }
            kept = i;
        } else {
            i += 1;
        }
    }
    if kept == 0 {
        return Cow::Borrowed(line);
    }
    out.push_str(&line[kept..]);
    Cow::Owned(out)
}

/// Length of the colour/cursor code starting at `b[0]`, or 0.
fn escape_len(b: &[u8]) -> usize {
    match b[0] {
        0x1b => match b.get(1) {
            Some(b'[') => 2 + csi_body(&b[2..]).unwrap_or(0),
            Some(b']') => osc_len(b),
            Some(_) => 2,
            None => 1,
        },
        b'^' if b.starts_with(b"^[[") => 3 + csi_body(&b[3..]).unwrap_or(0),
        b'\\' => {
            for lead in [
                &b"\\u001b["[..],
                b"\\u001B[",
                b"\\x1b[",
                b"\\x1B[",
                b"\\033[",
                b"\\e[",
            ] {
                if b.starts_with(lead)
                    && let Some(n) = csi_body(&b[lead.len()..])
                {
                    return lead.len() + n;
                }
            }
            0
        }
        // What is left of an SGR code when the ESC byte was lost: `[0m`, `[1;36m`.
        b'[' => sgr_residue(&b[1..]).map_or(0, |n| n + 1),
        _ => 0,
    }
}

/// Parameter and final bytes of a CSI sequence (`1;36m`, `2K`, `?25l`).
fn csi_body(b: &[u8]) -> Option<usize> {
    for (i, c) in b.iter().enumerate().take(32) {
        match c {
            0x20..=0x3f => {}
            0x40..=0x7e => return Some(i + 1),
            _ => return None,
        }
    }
    None
}

/// `ESC ] … BEL` or `ESC ] … ESC \` (terminal titles, hyperlinks).
fn osc_len(b: &[u8]) -> usize {
    for i in 2..b.len().min(4096) {
        if b[i] == 0x07 {
            return i + 1;
        }
        if b[i] == 0x1b && b.get(i + 1) == Some(&b'\\') {
            return i + 2;
        }
    }
    2
}

/// `0m`, `1;36m`, `38;5;208m`: digits and semicolons (at least one digit) ending in `m`.
fn sgr_residue(b: &[u8]) -> Option<usize> {
    let mut digits = 0;
    for (i, c) in b.iter().enumerate().take(20) {
        match c {
            b'0'..=b'9' => digits += 1,
            b';' => {}
            b'm' if digits > 0 && digits <= 12 => return Some(i + 1),
            _ => return None,
        }
    }
    None
}

/// Visible width of a cleaned line, in characters (what a console counts when it wraps).
pub fn width(line: &str) -> usize {
    if line.is_ascii() {
        line.len()
    } else {
        line.chars().count()
    }
}

/// The console width a log was hard-wrapped at, learnt from its first lines: no line is longer
/// than it, and lines of exactly that width stand out (every long message leaves one or more),
/// where an unwrapped log has a single longest line or a smooth spread near its maximum.
pub fn learn_width<'a>(lines: impl IntoIterator<Item = &'a str>) -> Option<usize> {
    let mut widths: Vec<(usize, &str)> = lines
        .into_iter()
        .filter(|l| !drawn(l))
        .map(|l| (width(l), l))
        .filter(|(w, _)| *w >= MIN_WIDTH)
        .collect();
    let max = widths.iter().map(|(w, _)| *w).max()?;
    widths.retain(|(w, _)| *w + 8 >= max);
    let mut at_max: Vec<&str> = widths
        .iter()
        .filter(|(w, _)| *w == max)
        .map(|(_, l)| *l)
        .collect();
    at_max.sort_unstable();
    at_max.dedup();
    let mut near: Vec<&str> = widths
        .iter()
        .filter(|(w, _)| *w < max)
        .map(|(_, l)| *l)
        .collect();
    near.sort_unstable();
    near.dedup();
    let spike = if CONSOLE_WIDTHS.contains(&max) {
        at_max.len() >= near.len()
    } else {
        at_max.len() > near.len()
    };
    (at_max.len() >= 2 && spike).then_some(max)
}

/// Console widths people run terminals at (and the defaults of terminal emulators and CI log
/// viewers); a line exactly this wide followed by one that does not open a new record is taken
/// as wrapped even when the log is too short to learn its width from.
const CONSOLE_WIDTHS: [usize; 6] = [80, 100, 120, 132, 160, 200];

/// True when `line` opens a new log record rather than continuing a wrapped one: it starts with a
/// per-line prefix, indentation (tracebacks: two spaces or a tab; one space is where a wrap fell
/// between words), a traceback header, or an exception name.
fn opens_record(line: &str) -> bool {
    if line.is_empty() || line.starts_with("  ") || line.starts_with('\t') {
        return true;
    }
    if prefix(line).body > usize::from(line.starts_with(' ')) {
        return true;
    }
    if line.starts_with("Traceback") || line.starts_with("During handling") {
        return true;
    }
    // `RuntimeError: …`, `torch.OutOfMemoryError: …`, `ValueError: …`
    let head = line.split(':').next().unwrap_or("");
    let name = head.rsplit('.').next().unwrap_or("");
    head.len() < line.len()
        && !head.contains(' ')
        && ["Error", "Exception", "Warning", "Interrupt", "Exit"]
            .iter()
            .any(|s| name.ends_with(s))
}

/// Table rows, rules and boxes (`| … |`, `+---+`, `=====`, `│ … │`) are drawn to one width on
/// purpose, and structured lines (`{…}`) are whole records; they say nothing about wrapping and
/// are never joined.
fn drawn(line: &str) -> bool {
    let t = line.trim();
    match (t.chars().next(), t.chars().last()) {
        (Some(a), Some(z)) => {
            a == z && !a.is_alphanumeric()
                || (a == '{' && z == '}')
                || matches!(z, '|' | '+' | '│' | '║' | '┃' | '╗' | '┐' | '╝' | '┘' | '┤')
        }
        _ => false,
    }
}

/// Joins the pieces of messages a console wrapped: a piece exactly as wide as the console
/// continues on the next line. The width is the one learnt from the log's head; without one, a
/// piece exactly as wide as a usual console ([`CONSOLE_WIDTHS`]) continues on the next line when
/// that line does not open a new record. Each joined message keeps its first line's number.
#[derive(Debug, Default)]
pub struct Joiner {
    width: Option<usize>,
    /// The message being joined, and how its last piece ended.
    pending: Option<(u64, String, Cut)>,
}

/// How a piece of a wrapped message ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// At the console's learnt width (mid-word: the next piece follows without a space).
    Width,
    /// At a usual console width, a guess the next line must confirm by not opening a record.
    GuessedWidth,
    /// At a word a sentence cannot end on ("… total capacity of"), the way a person or a
    /// formatter wraps at word boundaries: the next piece follows after a space.
    Word,
}

/// Words no log sentence ends on: a line ending in one was wrapped at a word boundary.
const DANGLING: [&str; 13] = [
    " of", " to", " is", " and", " with", " the", " a", " an", " than", " for", " by", " from", ",",
];

fn ends_dangling(line: &str) -> bool {
    let t = line.trim_end();
    DANGLING.iter().any(|d| crate::text::ends(t, d))
}

/// The part of a continuation line to append: when both the message's first line and this line
/// carry a per-line prefix (a collector prefixed every physical line), only the text after it.
fn continuation<'a>(first: &str, next: &'a str) -> &'a str {
    let has_prefix = |l: &str| prefix(l).body > l.len() - l.trim_start().len();
    let p = prefix(next).body;
    if has_prefix(next) && has_prefix(first) {
        &next[p..]
    } else {
        next
    }
}

fn indentation(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

impl Joiner {
    pub fn new(width: Option<usize>) -> Self {
        Joiner {
            width,
            pending: None,
        }
    }

    /// How `line` ends if it is a piece of a wrapped message, `None` when it is whole.
    fn cut(&self, line: &str) -> Option<Cut> {
        if drawn(line) {
            return None;
        }
        let w = width(line);
        let at_width = match self.width {
            Some(learnt) => (w == learnt).then_some(Cut::Width),
            None => CONSOLE_WIDTHS.contains(&w).then_some(Cut::GuessedWidth),
        };
        at_width.or_else(|| ends_dangling(line).then_some(Cut::Word))
    }

    /// True when `next` continues the pending message that ended with `cut`.
    fn continues(cut: Cut, first: &str, next: &str) -> bool {
        match cut {
            Cut::Width => true,
            Cut::GuessedWidth => !opens_record(next),
            // A word-boundary wrap continues on a line that opens no record, or on one indented
            // like the message's first line (a quoted block).
            Cut::Word => {
                let body = continuation(first, next);
                let first_body = continuation(next, first);
                !body.trim().is_empty()
                    && (!opens_record(body)
                        || (!indentation(body).is_empty()
                            && indentation(body) == indentation(first_body)))
            }
        }
    }

    /// Takes the next physical line; calls `emit` with each finished logical line.
    pub fn push(&mut self, line_no: u64, line: &str, emit: &mut impl FnMut(u64, &str)) {
        if let Some((first, mut text, cut)) = self.pending.take() {
            if Self::continues(cut, &text, line) {
                let piece = continuation(&text, line);
                if text.len() + piece.len() <= MAX_JOINED {
                    if cut == Cut::Word {
                        text.truncate(text.trim_end().len());
                        text.push(' ');
                        text.push_str(piece.trim_start());
                    } else {
                        text.push_str(piece);
                    }
                }
                match self.cut(line) {
                    Some(c) => self.pending = Some((first, text, c)),
                    None => emit(first, &text),
                }
                return;
            }
            emit(first, &text);
        }
        match self.cut(line) {
            Some(c) => self.pending = Some((line_no, line.to_owned(), c)),
            None => emit(line_no, line),
        }
    }

    /// Emits a message still waiting for its continuation at the end of the log.
    pub fn finish(&mut self, emit: &mut impl FnMut(u64, &str)) {
        if let Some((n, text, _)) = self.pending.take() {
            emit(n, &text);
        }
    }
}

/// What one physical line of the log holds once captured colour is gone: the line itself, or for
/// a structured (JSON) line its message, one piece per line the message embeds. Wrapped messages
/// are joined after this, so a message a collector wrapped into JSON lines is joined too.
pub fn physical(line: &str, out: &mut Vec<String>) {
    let clean = strip_ansi(line);
    match json_message(&clean) {
        Some(msg) => {
            for piece in msg.split('\n') {
                let piece = piece.trim_end_matches('\r');
                if !piece.trim().is_empty() {
                    out.push(strip_ansi(piece).into_owned());
                }
            }
        }
        None => out.push(clean.into_owned()),
    }
}

/// Splits a logical line into what rules read: the segments between carriage returns (progress
/// bars redraw a line with them).
pub fn pieces(line: &str, emit: &mut impl FnMut(&str)) {
    for segment in line.split('\r') {
        if segment.trim().is_empty() && line.contains('\r') {
            continue;
        }
        emit(segment);
    }
}

/// Keys that hold the message of a structured log line, most specific first.
const MESSAGE_KEYS: [&str; 6] = ["message", "msg", "MESSAGE", "log", "textPayload", "text"];
/// Short fields kept in front of the message (they name the level and the engine).
const CONTEXT_KEYS: [&str; 7] = [
    "level",
    "levelname",
    "severity",
    "target",
    "logger",
    "name",
    "SYSLOG_IDENTIFIER",
];

/// The message of a JSON log line, with its context fields in front; `None` for other lines.
pub fn json_message(line: &str) -> Option<String> {
    let t = line.trim();
    if !(t.starts_with('{') && t.ends_with('}')) || t.len() > 256 * 1024 {
        return None;
    }
    let value: serde_json::Value = serde_json::from_str(t).ok()?;
    let obj = value.as_object()?;
    let text_of = |o: &serde_json::Map<String, serde_json::Value>| {
        MESSAGE_KEYS
            .iter()
            .find_map(|k| o.get(*k).and_then(|v| v.as_str()).map(str::to_owned))
    };
    let message = text_of(obj).or_else(|| {
        ["fields", "jsonPayload", "record"]
            .iter()
            .find_map(|k| obj.get(*k).and_then(|v| v.as_object()).and_then(text_of))
    })?;
    let mut out = String::new();
    for key in CONTEXT_KEYS {
        if let Some(v) = obj.get(key).and_then(|v| v.as_str())
            && v.len() <= 80
            && !v.contains('\n')
        {
            out.push_str(v);
            out.push(' ');
        }
    }
    out.push_str(message.trim_end_matches('\n'));
    Some(out)
}

/// Where a line's message starts once per-line prefixes are set aside, and the worker rank the
/// prefixes name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Prefix {
    pub body: usize,
    pub rank: Option<u64>,
    /// The stage of a multi-stage (omni) stack: `[Stage-1]`.
    pub stage: Option<u64>,
}

/// Finds the per-line prefixes at the start of `line` (any number, any order).
pub fn prefix(line: &str) -> Prefix {
    let b = line.as_bytes();
    let mut pos = skip_spaces(b, 0);
    let mut rank = None;
    let mut stage = None;
    for _ in 0..10 {
        let rest = &line[pos..];
        if let Some((n, id)) = stage_tag(rest.as_bytes()) {
            stage = stage.or(Some(id));
            pos = skip_separator(b, pos + n);
            continue;
        }
        if let Some(q) = rest.strip_prefix("> ") {
            pos += rest.len() - q.len();
            continue;
        }
        let found = iso_timestamp(rest.as_bytes())
            .or_else(|| short_timestamp(rest.as_bytes()))
            .or_else(|| syslog(rest.as_bytes()))
            .or_else(|| glog(rest.as_bytes()))
            .or_else(|| level(rest.as_bytes()))
            .or_else(|| logger_name(rest.as_bytes()))
            .map(|n| (n, None))
            .or_else(|| bracketed(rest))
            .or_else(|| process_tag(rest))
            .or_else(|| compose(rest.as_bytes()).map(|n| (n, None)));
        let Some((n, r)) = found else { break };
        rank = rank.or(r);
        pos += n;
        pos = skip_separator(b, pos);
    }
    Prefix {
        body: pos,
        rank,
        stage,
    }
}

/// `[Stage-1]` (vLLM-Omni's stage tag) → its id.
fn stage_tag(b: &[u8]) -> Option<(usize, u64)> {
    let rest = b.strip_prefix(b"[Stage-")?;
    let n = rest.iter().take_while(|c| c.is_ascii_digit()).count();
    (n > 0 && rest.get(n) == Some(&b']'))
        .then(|| std::str::from_utf8(&rest[..n]).ok()?.parse().ok())
        .flatten()
        .map(|id| (7 + n + 1, id))
}

fn skip_spaces(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    i
}

/// Spaces, then one `|`, `-` or `:` standing between spaces (or before the end), then spaces.
/// A `|` that opens a table row (the line also ends with one) is the row's, not a separator.
fn skip_separator(b: &[u8], pos: usize) -> usize {
    let i = skip_spaces(b, pos);
    let table_row = b.len() > i + 1 && b[i] == b'|' && b.trim_ascii_end().ends_with(b"|");
    if i < b.len()
        && !table_row
        && matches!(b[i], b'|' | b'-' | b':')
        && (i > pos || b[i] == b':')
        && (i + 1 == b.len() || b[i + 1] == b' ')
    {
        return skip_spaces(b, i + 1);
    }
    i
}

fn digits(b: &[u8], at: usize, n: usize) -> bool {
    b.len() >= at + n && b[at..at + n].iter().all(u8::is_ascii_digit)
}

/// `hh:mm:ss` with optional `.fff`/`,fff` at `at`; the length, or `None`.
fn clock(b: &[u8], at: usize) -> Option<usize> {
    if !(digits(b, at, 2) && b.get(at + 2) == Some(&b':') && digits(b, at + 3, 2)) {
        return None;
    }
    let mut i = at + 5;
    if b.get(i) == Some(&b':') && digits(b, i + 1, 2) {
        i += 3;
        if matches!(b.get(i), Some(b'.' | b',')) && digits(b, i + 1, 1) {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
        }
    }
    Some(i - at)
}

/// `2025-11-03T10:21:44.123Z`, `2025-11-03 10:21:44,123`, `2025/11/03 10:21:44 +0000`.
fn iso_timestamp(b: &[u8]) -> Option<usize> {
    if !(digits(b, 0, 4)
        && matches!(b.get(4), Some(b'-' | b'/'))
        && digits(b, 5, 2)
        && b.get(7) == b.get(4)
        && digits(b, 8, 2))
    {
        return None;
    }
    let mut i = 10;
    if matches!(b.get(i), Some(b'T' | b' ')) {
        if let Some(n) = clock(b, i + 1) {
            i += 1 + n;
        } else if b.get(i) == Some(&b'T') {
            return None;
        }
    }
    i = zone(b, i);
    boundary(b, i)
}

/// `Z`, `+00:00`, `-0700`, ` UTC` after a clock.
fn zone(b: &[u8], i: usize) -> usize {
    match b.get(i) {
        Some(b'Z') => i + 1,
        Some(b'+' | b'-') if digits(b, i + 1, 2) => {
            let j = i + 3;
            if b.get(j) == Some(&b':') && digits(b, j + 1, 2) {
                j + 3
            } else if digits(b, j, 2) {
                j + 2
            } else {
                j
            }
        }
        Some(b' ') if b[i..].starts_with(b" UTC") => i + 4,
        _ => i,
    }
}

/// The prefix ends at `i` only if a space, a separator or the end follows.
fn boundary(b: &[u8], i: usize) -> Option<usize> {
    match b.get(i) {
        None | Some(b' ' | b'\t' | b'|' | b']' | b':') => Some(i),
        _ => None,
    }
}

/// `03-13 12:34:56` (vLLM), `12:34:56.789` (a clock alone).
fn short_timestamp(b: &[u8]) -> Option<usize> {
    if digits(b, 0, 2) && b.get(2) == Some(&b'-') && digits(b, 3, 2) && b.get(5) == Some(&b' ') {
        let n = clock(b, 6)?;
        return boundary(b, 6 + n);
    }
    let n = clock(b, 0)?;
    (n >= 8).then_some(n).and_then(|n| boundary(b, n))
}

/// `Jan 02 03:04:05 host proc[123]: ` (syslog, journalctl's default output).
fn syslog(b: &[u8]) -> Option<usize> {
    const MONTHS: [&[u8]; 12] = [
        b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov",
        b"Dec",
    ];
    if b.len() < 16 || !MONTHS.iter().any(|m| b.starts_with(m)) || b[3] != b' ' {
        return None;
    }
    let day = if b[4] == b' ' { 5 } else { 4 };
    if !digits(b, day, if day == 5 { 1 } else { 2 }) {
        return None;
    }
    // The clock starts at column 7 whether the day is padded with a space or a zero.
    let at = 7;
    let n = clock(b, at)?;
    let mut i = at + n;
    // host, then `proc[pid]:`
    for _ in 0..2 {
        if b.get(i) != Some(&b' ') {
            return Some(i);
        }
        let start = i + 1;
        let mut j = start;
        while j < b.len() && b[j] != b' ' && j - start < 96 {
            j += 1;
        }
        if j > start && b[j - 1] == b':' {
            return Some(j);
        }
        i = j;
    }
    Some(at + n)
}

/// glog: `I0101 12:00:00.123456  1234 file.cc:12] `.
fn glog(b: &[u8]) -> Option<usize> {
    if !(matches!(b.first(), Some(b'I' | b'W' | b'E' | b'F'))
        && digits(b, 1, 4)
        && b.get(5) == Some(&b' '))
    {
        return None;
    }
    let n = clock(b, 6)?;
    let close = memchr::memchr(b']', &b[6 + n..])?;
    (close < 80).then_some(6 + n + close + 1)
}

/// Log-level words written in capitals (`INFO`, `ERROR:`, `W`arnings are words, not letters).
fn level(b: &[u8]) -> Option<usize> {
    const LEVELS: [&[u8]; 10] = [
        b"CRITICAL",
        b"WARNING",
        b"NOTICE",
        b"DEBUG",
        b"ERROR",
        b"FATAL",
        b"TRACE",
        b"INFO",
        b"WARN",
        b"ERR",
    ];
    let word = LEVELS.iter().find(|l| b.starts_with(l))?;
    let i = word.len();
    match b.get(i) {
        Some(b':') => {
            // `ERROR:root:message`: the logger name goes with the level.
            let mut j = i + 1;
            while j < b.len()
                && j - i < 64
                && (b[j].is_ascii_alphanumeric() || matches!(b[j], b'_' | b'.'))
            {
                j += 1;
            }
            Some(if j > i + 1 && b.get(j) == Some(&b':') {
                j + 1
            } else {
                i + 1
            })
        }
        None | Some(b' ' | b'\t' | b']') => Some(i),
        _ => None,
    }
}

/// A logger's name in Python's usual layouts: `server - ERROR - ` (`%(name)s - %(levelname)s`)
/// and `root:` after `ERROR:` (`logging.basicConfig`'s `LEVEL:name:message`).
fn logger_name(b: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i < b.len() && i < 64 && (b[i].is_ascii_alphanumeric() || matches!(b[i], b'_' | b'.')) {
        i += 1;
    }
    if i == 0 {
        return None;
    }
    if b[i..].starts_with(b" - ") && level(&b[i + 3..]).is_some() {
        return Some(i);
    }
    None
}

/// `[…]` holding a time, a rank, a level, a pod, a `file.py:12` location or an MPI rank; the
/// rank it names, if any.
fn bracketed(s: &str) -> Option<(usize, Option<u64>)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'[') {
        return None;
    }
    let close = memchr::memchr(b']', &b[..b.len().min(120)])?;
    let inner = &s[1..close];
    let lower = inner.to_ascii_lowercase();
    let has_clock = (0..inner.len()).any(|i| clock(inner.as_bytes(), i).is_some_and(|n| n >= 5));
    let rank = rank_in(&lower);
    let file_loc = !inner.contains(' ')
        && inner.rsplit_once(':').is_some_and(|(f, l)| {
            f.contains('.') && !l.is_empty() && l.bytes().all(|c| c.is_ascii_digit())
        });
    let is_level = level(inner.as_bytes()).is_some_and(|n| n == inner.len());
    let pod = lower.starts_with("pod/");
    let mpi = inner.split_once(',').is_some_and(|(a, r)| {
        !a.is_empty()
            && a.bytes().all(|c| c.is_ascii_digit())
            && r.bytes().all(|c| c.is_ascii_digit())
    });
    let default_rank = lower
        .strip_prefix("default")
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()));
    if !(has_clock || rank.is_some() || file_loc || is_level || pod || mpi || default_rank) {
        return None;
    }
    let mut end = close + 1;
    // `[rank1]:`, `[1,0]<stderr>:`, `[default0]:`
    for tail in [&b"<stderr>:"[..], b"<stdout>:", b":"] {
        if b[end..].starts_with(tail) {
            end += tail.len();
            break;
        }
    }
    let rank = rank.or_else(|| {
        default_rank
            .then(|| lower["default".len()..].parse().ok())
            .flatten()
    });
    Some((end, rank))
}

/// `rank3`, `rank 3`, `rank=3`, SGLang's `TP3` / `tp3`, in a prefix's text (lower case).
fn rank_in(lower: &str) -> Option<u64> {
    for key in ["rank=", "rank ", "rank", "tp"] {
        let mut from = 0;
        while let Some(at) = lower[from..].find(key) {
            let start = from + at;
            let after = &lower[start + key.len()..];
            let ok_before = start == 0 || !lower.as_bytes()[start - 1].is_ascii_alphanumeric();
            let n: String = after.chars().take_while(char::is_ascii_digit).collect();
            if ok_before && !n.is_empty() && n.len() <= 5 {
                return n.parse().ok();
            }
            from = start + key.len();
        }
    }
    None
}

/// Ray / vLLM process tags: `(EngineCore_0 pid=123)`, `(RayWorkerWrapper pid=3, ip=10.0.0.1)`,
/// `(VllmWorker rank=1 pid=7)`, `(Worker_PP1_TP3 pid=9)`, `(raylet)`; the rank it names.
fn process_tag(s: &str) -> Option<(usize, Option<u64>)> {
    let b = s.as_bytes();
    if b.first() != Some(&b'(') {
        return None;
    }
    let close = memchr::memchr(b')', &b[..b.len().min(160)])?;
    let inner = &s[1..close];
    let mut words = inner.split([' ', ',']).filter(|w| !w.is_empty());
    let name = words.next()?;
    let name_ok = name
        .bytes()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.' | b'='));
    let pairs: Vec<&str> = words.collect();
    let keyed = pairs.iter().all(|w| w.contains('=')) && (name.contains('=') || !pairs.is_empty());
    let known = ["raylet", "gcs_server", "autoscaler", "monitor", "dashboard"].contains(&name);
    if !name_ok || !(keyed || known) {
        return None;
    }
    let lower = inner.to_ascii_lowercase();
    let rank = rank_in(&lower).or_else(|| worker_tp_rank(name));
    Some((close + 1, rank))
}

/// `Worker_TP3` → 3; `Worker_PP1_TP2` → stage and rank folded into one non-zero marker.
fn worker_tp_rank(name: &str) -> Option<u64> {
    let at = name.find("_TP")?;
    let n: String = name[at + 3..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    let tp: u64 = n.parse().ok()?;
    let pp = name
        .find("_PP")
        .and_then(|p| {
            name[p + 3..]
                .chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<u64>()
                .ok()
        })
        .unwrap_or(0);
    Some(tp + pp)
}

/// Docker Compose: `vllm-1  | `, `ollama_1 | `.
fn compose(b: &[u8]) -> Option<usize> {
    let first = *b.first()?;
    if !first.is_ascii_alphanumeric() {
        return None;
    }
    let mut i = 1;
    while i < b.len()
        && i < 64
        && (b[i].is_ascii_alphanumeric() || matches!(b[i], b'_' | b'-' | b'.'))
    {
        i += 1;
    }
    let name_end = i;
    if !b[..name_end].iter().any(u8::is_ascii_alphabetic) {
        return None;
    }
    let spaces = skip_spaces(b, i);
    if spaces == name_end || b.get(spaces) != Some(&b'|') {
        return None;
    }
    match b.get(spaces + 1) {
        None => Some(spaces + 1),
        Some(b' ') => Some(spaces + 2),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(line: &str) -> &str {
        &line[prefix(line).body..]
    }

    #[test]
    fn colour_codes_of_every_spelling_are_removed() {
        assert_eq!(
            strip_ansi("\x1b[1;36m(VllmWorker)\x1b[0m x"),
            "(VllmWorker) x"
        );
        assert_eq!(
            strip_ansi("[1;36m(VllmWorker rank=0 pid=1)[0;0m ERROR"),
            "(VllmWorker rank=0 pid=1) ERROR"
        );
        assert_eq!(strip_ansi("^[[31mred^[[0m"), "red");
        assert_eq!(strip_ansi("\\u001b[32mINFO\\u001b[0m"), "INFO");
        assert_eq!(strip_ansi("\x1b]0;title\x07text"), "text");
        // Brackets that are not colour codes stay.
        assert_eq!(strip_ansi("[rank0]: x [5 GiB]"), "[rank0]: x [5 GiB]");
        assert!(matches!(strip_ansi("plain"), Cow::Borrowed(_)));
    }

    #[test]
    fn prefixes_of_engines_and_orchestrators_are_set_aside() {
        assert_eq!(
            body("(EngineCore_0 pid=123) ERROR 03-13 12:00:01 [core.py:330] boom"),
            "boom"
        );
        assert_eq!(body("(RayWorkerWrapper pid=3164, ip=10.0.0.1) INFO x"), "x");
        assert_eq!(
            body("[rank1]: torch.OutOfMemoryError: x"),
            "torch.OutOfMemoryError: x"
        );
        assert_eq!(prefix("[rank1]: x").rank, Some(1));
        assert_eq!(
            body("vllm-1  | |   0  NVIDIA A10  |"),
            "|   0  NVIDIA A10  |"
        );
        assert_eq!(body("2025-11-03T10:21:44.123456789Z |  0 |"), "|  0 |");
        assert_eq!(body("[pod/engine-7d9f/engine] ERROR boom"), "boom");
        assert_eq!(body("Jan 02 03:04:05 box ollama[1234]: time=x"), "time=x");
        assert_eq!(
            body("[2025-06-01 10:00:00 TP3] Load weight end."),
            "Load weight end."
        );
        assert_eq!(prefix("[2025-06-01 10:00:00 TP3] x").rank, Some(3));
        assert_eq!(prefix("(VllmWorker rank=2 pid=7) ERROR x").rank, Some(2));
        assert_eq!(prefix("(Worker_TP1 pid=26348) INFO x").rank, Some(1));
        assert_eq!(
            body("2026-05-01 23:14:12.523 | (EngineCore pid=187) INFO 05-01 21:14:12 x"),
            "x"
        );
        assert_eq!(body("I0101 12:00:00.123456  1234 file.cc:12] msg"), "msg");
        assert_eq!(body("[1,0]<stderr>:RuntimeError"), "RuntimeError");
        assert_eq!(
            body("2025-11-03 10:21:44,123 - server - ERROR - | 0 x |"),
            "| 0 x |"
        );
        assert_eq!(body("ERROR:root:CUDA out of memory"), "CUDA out of memory");
        assert_eq!(
            body(
                "> 2026-09-02T20:18:44.0930119Z (EngineCore pid=1568) DEBUG 09-02 20:12:08 [v1/worker/gpu_worker.py:548] Initial"
            ),
            "Initial"
        );
        let p = prefix(
            "(Worker pid=2642) [Stage-1] INFO 02-26 07:43:01 [gpu_model_runner.py:4221] Model loading took 8.5 GiB",
        );
        assert_eq!(p.stage, Some(1));
        // Message text is not a prefix.
        assert_eq!(
            body("RuntimeError: CUDA out of memory"),
            "RuntimeError: CUDA out of memory"
        );
        assert_eq!(body("(most recent call last):"), "(most recent call last):");
        assert_eq!(body("|   0  NVIDIA A10  |"), "|   0  NVIDIA A10  |");
        assert_eq!(
            body("Traceback (most recent call last):"),
            "Traceback (most recent call last):"
        );
    }

    #[test]
    fn console_width_is_learnt_only_from_a_wrapped_head() {
        let long = "x".repeat(200);
        let wrapped: Vec<String> = [
            format!("{long}a"),
            format!("{}b", "y".repeat(150)),
            "short line".to_owned(),
        ]
        .iter()
        .flat_map(|l| {
            l.as_bytes()
                .chunks(80)
                .map(|c| String::from_utf8(c.to_vec()).unwrap())
                .collect::<Vec<_>>()
        })
        .collect();
        assert_eq!(learn_width(wrapped.iter().map(String::as_str)), Some(80));
        let plain = [
            long.as_str(),
            "a line of ordinary length that is not wrapped at all ok",
            "short",
        ];
        assert_eq!(learn_width(plain), None);
        let mut joined = Vec::new();
        let mut j = Joiner::new(Some(80));
        for (i, l) in wrapped.iter().enumerate() {
            j.push(i as u64 + 1, l, &mut |n, t| joined.push((n, t.to_owned())));
        }
        j.finish(&mut |n, t| joined.push((n, t.to_owned())));
        assert_eq!(joined.len(), 3);
        assert_eq!(joined[0], (1, format!("{long}a")));
        assert_eq!(joined[1].0, 4);
        assert_eq!(joined[2].1, "short line");
        // A person's wrap at a word boundary, in a quoted (indented) block.
        let quoted = [
            "    Tried to allocate 136.00 MiB. GPU 0 has a total capacity of 22.36 GiB of",
            "    which 120.88 MiB is free. ... If this problem persists, try setting",
            "    VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0",
        ];
        let mut out = Vec::new();
        let mut j = Joiner::new(None);
        for (i, l) in quoted.iter().enumerate() {
            j.push(i as u64 + 1, l, &mut |n, t| out.push((n, t.to_owned())));
        }
        j.finish(&mut |n, t| out.push((n, t.to_owned())));
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(
            out[0].1.contains("22.36 GiB of which 120.88 MiB is free"),
            "{out:?}"
        );
        // A traceback's lines are never joined by a trailing comma or word.
        let tb = [
            "Traceback (most recent call last):",
            "  File \"x.py\", line 1, in f",
            "    g(a,",
            "RuntimeError: boom",
        ];
        let mut out = Vec::new();
        let mut j = Joiner::new(None);
        for (i, l) in tb.iter().enumerate() {
            j.push(i as u64 + 1, l, &mut |n, t| out.push((n, t.to_owned())));
        }
        j.finish(&mut |n, t| out.push((n, t.to_owned())));
        assert_eq!(out.len(), 4, "{out:?}");
    }

    #[test]
    fn structured_lines_give_their_message() {
        let docker = r#"{"log":"torch.OutOfMemoryError: CUDA out of memory.\n","stream":"stderr","time":"2025-01-01T00:00:00Z"}"#;
        assert_eq!(
            json_message(docker).as_deref(),
            Some("torch.OutOfMemoryError: CUDA out of memory.")
        );
        let tgi = r#"{"timestamp":"2024","level":"ERROR","fields":{"message":"Method Warmup encountered an error."},"target":"text_generation_launcher"}"#;
        assert_eq!(
            json_message(tgi).as_deref(),
            Some("ERROR text_generation_launcher Method Warmup encountered an error.")
        );
        assert_eq!(json_message("{not json}"), None);
        let mut got = Vec::new();
        pieces("a\rb\rc", &mut |p| got.push(p.to_owned()));
        assert_eq!(got, ["a", "b", "c"]);
        let mut out = Vec::new();
        physical(r#"{"log":"line one\nline two\n"}"#, &mut out);
        assert_eq!(out, ["line one", "line two"]);
    }
}
