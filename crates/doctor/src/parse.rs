//! Number and size parsing for log text: `19.77`, `75,840`, `270.00 MiB`, `0 bytes`, `14.9888 GB`.
//! Sizes come back in GiB. vLLM prints "GB" for values it computed as bytes / 2^30, so "GB" and
//! "MB" are read as GiB and MiB. Markers and units are matched without regard to ASCII case, and
//! a unit must end where the word ends (`8 blocks` is not 8 bytes).

use crate::text::{find, starts};

/// Bytes in a GiB.
pub const GIB_BYTES: f64 = 1024.0 * 1024.0 * 1024.0;
const MIB: f64 = 1.0 / 1024.0;
const KIB: f64 = 1.0 / (1024.0 * 1024.0);
const BYTE: f64 = 1.0 / (1024.0 * 1024.0 * 1024.0);

/// Parses a leading decimal number (commas as thousands separators allowed). Returns the value
/// and the bytes consumed.
pub fn leading_number(s: &str) -> Option<(f64, usize)> {
    let bytes = s.as_bytes();
    let mut end = 0;
    let mut digits = String::new();
    let mut seen_digit = false;
    let mut seen_dot = false;
    while end < bytes.len() {
        let c = bytes[end];
        match c {
            b'0'..=b'9' => {
                digits.push(c as char);
                seen_digit = true;
            }
            b',' if seen_digit
                && !seen_dot
                && bytes.get(end + 1).is_some_and(u8::is_ascii_digit) => {}
            b'.' if seen_digit
                && !seen_dot
                && bytes.get(end + 1).is_some_and(u8::is_ascii_digit) =>
            {
                digits.push('.');
                seen_dot = true;
            }
            _ => break,
        }
        end += 1;
        if digits.len() > 40 {
            return None;
        }
    }
    if !seen_digit {
        return None;
    }
    digits
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .map(|v| (v, end))
}

/// Parses a number followed by an optional space and a size unit; returns GiB.
pub fn leading_size(s: &str) -> Option<(f64, usize)> {
    let (value, mut used) = leading_number(s)?;
    let rest = &s[used..];
    let trimmed = rest.trim_start_matches(' ');
    used += rest.len() - trimmed.len();
    let units: [(&str, f64); 12] = [
        ("GiB", 1.0),
        ("MiB", MIB),
        ("KiB", KIB),
        ("TiB", 1024.0),
        ("GB", 1.0),
        ("MB", MIB),
        ("KB", KIB),
        ("bytes", BYTE),
        ("B", BYTE),
        ("G", 1.0),
        ("M", MIB),
        ("K", KIB),
    ];
    for (unit, scale) in units {
        let ends_word = !trimmed[unit.len().min(trimmed.len())..]
            .starts_with(|c: char| c.is_ascii_alphanumeric());
        if starts(trimmed, unit) && ends_word {
            return Some((value * scale, used + unit.len()));
        }
    }
    None
}

/// The number that follows the first `marker` in `line`.
pub fn number_after(line: &str, marker: &str) -> Option<f64> {
    let at = find(line, marker)? + marker.len();
    leading_number(line[at..].trim_start_matches(' ')).map(|(v, _)| v)
}

/// The whole number that follows the first `marker` in `line`.
pub fn int_after(line: &str, marker: &str) -> Option<u64> {
    number_after(line, marker)
        .filter(|v| *v >= 0.0 && v.fract() == 0.0 && *v < 1e18)
        .map(|v| v as u64)
}

/// The size (GiB) that follows the first `marker` in `line`.
pub fn size_after(line: &str, marker: &str) -> Option<f64> {
    let at = find(line, marker)? + marker.len();
    leading_size(line[at..].trim_start_matches(' ')).map(|(v, _)| v)
}

/// The value of `key=` in a logfmt-style line: `key="23.3 GiB"` or `key=479199232`. Quotes are
/// removed.
pub fn logfmt_value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let mut search = line;
    let mut offset = 0;
    loop {
        let at = find(search, key)?;
        let start = offset + at;
        let boundary = start == 0 || matches!(line.as_bytes()[start - 1], b' ' | b'\t');
        let after = start + key.len();
        if boundary && line[after..].starts_with('=') {
            let value = &line[after + 1..];
            return Some(if let Some(stripped) = value.strip_prefix('"') {
                &stripped[..stripped.find('"').unwrap_or(stripped.len())]
            } else {
                &value[..value.find([' ', '\t']).unwrap_or(value.len())]
            });
        }
        offset = start + key.len();
        search = &line[offset..];
    }
}

/// A logfmt size value (`"23.3 GiB"`, `"0 B"`, or plain bytes) in GiB.
pub fn logfmt_size(line: &str, key: &str) -> Option<f64> {
    let v = logfmt_value(line, key)?;
    match leading_size(v) {
        Some((gib, _)) => Some(gib),
        None => leading_number(v)
            .filter(|(_, used)| *used == v.len())
            .map(|(b, _)| b * BYTE),
    }
}

/// A bracketed list of sizes, `"[11.5 GiB 4.6 GiB]"`, in GiB.
pub fn size_list(value: &str) -> Vec<f64> {
    let inner = value.trim().trim_start_matches('[').trim_end_matches(']');
    let mut out = Vec::new();
    let mut rest = inner.trim_start();
    while !rest.is_empty() && out.len() < 64 {
        match leading_size(rest) {
            Some((v, used)) => {
                out.push(v);
                rest = rest[used..].trim_start();
            }
            None => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_with_separators_and_decimals() {
        assert_eq!(leading_number("75,840 tokens"), Some((75_840.0, 6)));
        assert_eq!(leading_number("19.77/22.05"), Some((19.77, 5)));
        assert_eq!(leading_number("5."), Some((5.0, 1)));
        assert_eq!(leading_number("x1"), None);
        assert_eq!(leading_number(""), None);
    }

    #[test]
    fn sizes_in_gib() {
        assert_eq!(leading_size("270.00 MiB. GPU").unwrap().0, 270.0 / 1024.0);
        assert_eq!(leading_size("0 bytes is free").unwrap().0, 0.0);
        assert_eq!(leading_size("14.9888 GB").unwrap().0, 14.9888);
        assert_eq!(leading_size("2.5GiB").unwrap().0, 2.5);
        assert!(leading_size("12 tokens").is_none());
        assert!(leading_size("8 blocks").is_none());
        assert!(leading_size("2 GPUs").is_none());
        assert_eq!(leading_size("2.00 GIB.").unwrap().0, 2.0);
        assert_eq!(leading_size("512 mib,").unwrap().0, 0.5);
        assert_eq!(leading_size("16G ").unwrap().0, 16.0);
    }

    #[test]
    fn markers_and_logfmt() {
        let line = r#"msg="gpu has too little" name="NVIDIA A30" total="23.5 GiB" minimum_memory=479199232 layer_size="484.5 MiB""#;
        assert_eq!(logfmt_value(line, "name"), Some("NVIDIA A30"));
        assert_eq!(logfmt_size(line, "total"), Some(23.5));
        assert!((logfmt_size(line, "minimum_memory").unwrap() - 0.446_289).abs() < 1e-5);
        assert_eq!(logfmt_value(line, "missing"), None);
        assert_eq!(size_list("[11.5 GiB 4.6 GiB]"), vec![11.5, 4.6]);
        assert_eq!(
            int_after("max seq len (29000) is", "max seq len ("),
            Some(29_000)
        );
    }
}
