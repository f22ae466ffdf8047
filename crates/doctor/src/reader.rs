//! Streaming line reader: one pass over any `BufRead`, memory bounded by one line buffer. Lines
//! longer than the cap are truncated (the rest is skipped without being stored), invalid UTF-8 is
//! replaced, and a trailing `\r` is dropped. Input that is not text (a NUL byte in its first
//! 64 KiB: an executable, an archive, UTF-16) is refused with [`NotText`] instead of being read.

use std::borrow::Cow;
use std::io::{self, BufRead};

/// Longest line kept, in bytes; longer lines are cut here.
pub const MAX_LINE_BYTES: usize = 16 * 1024;
/// Bytes at the start of the input checked for binary content.
pub const TEXT_CHECK_BYTES: u64 = 64 * 1024;

/// The input is not text: it holds a NUL byte near its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct NotText {
    /// Offset of the first NUL byte.
    pub offset: u64,
    /// The bytes look like UTF-16 text (a byte-order mark, or NULs between ASCII letters).
    pub utf16: bool,
}

impl NotText {
    fn describe(&self) -> String {
        if self.utf16 {
            "it is UTF-16 text, not UTF-8 (convert it first: `iconv -f UTF-16 -t UTF-8`)".to_owned()
        } else {
            format!("binary data (a NUL byte at offset {})", self.offset)
        }
    }

    /// The `NotText` inside an I/O error from [`LineReader::next_line`], if that is what it is.
    pub fn from_io(err: &io::Error) -> Option<NotText> {
        err.get_ref()
            .and_then(|e| e.downcast_ref::<NotText>())
            .copied()
    }
}

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
            if self.bytes < TEXT_CHECK_BYTES {
                let head = &available[..available
                    .len()
                    .min((TEXT_CHECK_BYTES - self.bytes) as usize)];
                if let Some(at) = memchr::memchr(0, head) {
                    let utf16 = self.bytes == 0 && looks_like_utf16(head);
                    let offset = self.bytes + at as u64;
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        NotText { offset, utf16 },
                    ));
                }
            }
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

/// A byte-order mark, or ASCII letters with NULs between them (`l\0o\0g\0`).
fn looks_like_utf16(head: &[u8]) -> bool {
    if head.starts_with(&[0xff, 0xfe]) || head.starts_with(&[0xfe, 0xff]) {
        return true;
    }
    let pairs = head.len().min(256) / 2;
    pairs >= 4
        && (0..pairs).all(|i| {
            let (a, b) = (head[2 * i], head[2 * i + 1]);
            (b == 0 && (a == 0 || a.is_ascii())) || (a == 0 && b.is_ascii())
        })
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
    fn binary_and_utf16_input_is_refused() {
        let mut elf = b"\x7fELF\x02\x01\x01\x00\x00\x00 rest\n".to_vec();
        elf.extend_from_slice(b"more text\n");
        let err = LineReader::new(&elf[..]).next_line().unwrap_err();
        let nt = NotText::from_io(&err).expect("not text");
        assert_eq!(
            nt,
            NotText {
                offset: 7,
                utf16: false
            }
        );
        let utf16: Vec<u8> = "\u{feff}INFO log line\n"
            .encode_utf16()
            .flat_map(u16::to_le_bytes)
            .collect();
        let err = LineReader::new(&utf16[..]).next_line().unwrap_err();
        assert!(NotText::from_io(&err).unwrap().utf16);
        // A NUL after the checked head is read as text (a crash can pad a log with NULs).
        let mut late = vec![b'a'; TEXT_CHECK_BYTES as usize];
        late.extend_from_slice(b"\x00\n");
        let mut r = LineReader::new(&late[..]);
        assert!(r.next_line().unwrap().is_some());
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
