//! Streaming line reader: one pass over any `BufRead`, memory bounded by one line buffer. Lines
//! longer than the cap are truncated (the rest is skipped without being stored), invalid UTF-8 is
//! replaced, and a trailing `\r` is dropped.

use std::borrow::Cow;
use std::io::{self, BufRead};

/// Longest line kept, in bytes; longer lines are cut here.
pub const MAX_LINE_BYTES: usize = 16 * 1024;

pub struct LineReader<R> {
    inner: R,
    buf: Vec<u8>,
    cap: usize,
    line_no: u64,
    truncated: u64,
    bytes: u64,
}

impl<R: BufRead> LineReader<R> {
    pub fn new(inner: R) -> Self {
        Self::with_cap(inner, MAX_LINE_BYTES)
    }

    pub fn with_cap(inner: R, cap: usize) -> Self {
        LineReader {
            inner,
            buf: Vec::with_capacity(256),
            cap: cap.max(1),
            line_no: 0,
            truncated: 0,
            bytes: 0,
        }
    }

    /// Reads the next line; `None` at end of input. The returned text borrows the reader's buffer.
    pub fn next_line(&mut self) -> io::Result<Option<(u64, Cow<'_, str>)>> {
        self.buf.clear();
        let mut got_any = false;
        let mut cut = false;
        loop {
            let available = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if available.is_empty() {
                break;
            }
            got_any = true;
            let (chunk, used, done) = match memchr::memchr(b'\n', available) {
                Some(i) => (&available[..i], i + 1, true),
                None => (available, available.len(), false),
            };
            let room = self.cap - self.buf.len();
            if chunk.len() > room {
                cut = true;
            }
            self.buf.extend_from_slice(&chunk[..chunk.len().min(room)]);
            self.inner.consume(used);
            self.bytes += used as u64;
            if done {
                break;
            }
        }
        if !got_any {
            return Ok(None);
        }
        if cut {
            self.truncated += 1;
        }
        if self.buf.last() == Some(&b'\r') {
            self.buf.pop();
        }
        self.line_no += 1;
        let text = match std::str::from_utf8(&self.buf) {
            Ok(s) => Cow::Borrowed(s),
            Err(_) => String::from_utf8_lossy(&self.buf),
        };
        Ok(Some((self.line_no, text)))
    }

    /// Lines returned so far.
    pub fn lines_read(&self) -> u64 {
        self.line_no
    }

    /// Lines that were longer than the cap.
    pub fn truncated_lines(&self) -> u64 {
        self.truncated
    }

    /// Bytes consumed from the input.
    pub fn bytes_read(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(input: &[u8], cap: usize) -> (Vec<String>, u64) {
        let mut r = LineReader::with_cap(input, cap);
        let mut out = Vec::new();
        while let Some((_, l)) = r.next_line().unwrap() {
            out.push(l.into_owned());
        }
        (out, r.truncated_lines())
    }

    #[test]
    fn splits_lines_and_drops_carriage_returns() {
        let (lines, t) = all(b"a\r\nbb\n\nccc", 100);
        assert_eq!(lines, vec!["a", "bb", "", "ccc"]);
        assert_eq!(t, 0);
    }

    #[test]
    fn truncates_long_lines_and_keeps_going() {
        let mut input = vec![b'x'; 1000];
        input.extend_from_slice(b"\nnext\n");
        let (lines, t) = all(&input, 10);
        assert_eq!(lines, vec!["xxxxxxxxxx", "next"]);
        assert_eq!(t, 1);
    }

    #[test]
    fn replaces_invalid_utf8() {
        let (lines, _) = all(b"ok \xff\xfe end\n", 100);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("ok "));
        assert!(lines[0].ends_with(" end"));
    }

    #[test]
    fn small_buffers_still_split_correctly() {
        let data = b"first line\nsecond line\nthird";
        let reader = std::io::BufReader::with_capacity(3, &data[..]);
        let mut r = LineReader::with_cap(reader, 5);
        let mut out = Vec::new();
        while let Some((n, l)) = r.next_line().unwrap() {
            out.push((n, l.into_owned()));
        }
        assert_eq!(
            out,
            vec![
                (1, "first".into()),
                (2, "secon".into()),
                (3, "third".into())
            ]
        );
        assert_eq!(r.truncated_lines(), 2);
        assert_eq!(r.bytes_read(), data.len() as u64);
    }
}
