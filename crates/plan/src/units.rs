//! Byte sizes as people type them (`24GiB`, `23.58GiB`, `24GB`, `24576MiB`, `25769803776`) and as
//! headroom prints them; durations as people type them (`500ms`, `30s`, `2m`, `1h`).

use thiserror::Error;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

#[derive(Debug, Error, PartialEq, Eq)]
#[error(
    "invalid size '{input}': {reason} (use e.g. 24GiB, 23.58GiB, 24GB, 24576MiB or plain bytes)"
)]
pub struct SizeError {
    pub input: String,
    pub reason: &'static str,
}

/// Parses a byte size. Binary suffixes (`KiB`, `MiB`, `GiB`, `TiB`, and the short `K`, `M`, `G`,
/// `T`) are powers of 1024; decimal suffixes (`KB`, `MB`, `GB`, `TB`) are powers of 1000.
pub fn parse_size(input: &str) -> Result<u64, SizeError> {
    let err = |reason| SizeError {
        input: input.to_string(),
        reason,
    };
    let text = input.trim();
    if text.is_empty() {
        return Err(err("empty"));
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let number = number.replace('_', "");
    if number.is_empty() {
        return Err(err("no number"));
    }
    let multiplier: f64 = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => KIB as f64,
        "m" | "mib" => MIB as f64,
        "g" | "gib" => GIB as f64,
        "t" | "tib" => (GIB * 1024) as f64,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(err("unknown unit")),
    };
    if number.matches('.').count() > 1 {
        return Err(err("malformed number"));
    }
    let value: f64 = number.parse().map_err(|_| err("malformed number"))?;
    if !value.is_finite() {
        return Err(err("malformed number"));
    }
    if multiplier == 1.0 && number.contains('.') {
        return Err(err("bytes must be a whole number"));
    }
    let bytes = value * multiplier;
    if bytes > u64::MAX as f64 / 2.0 {
        return Err(err("too large"));
    }
    Ok(bytes.round() as u64)
}

/// Which kind of unit a size was written with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeUnit {
    /// No unit at all: a plain number of bytes.
    Bare,
    /// An explicit `B`.
    Bytes,
    /// Powers of 1024 (`GiB`, `G`, ...).
    Binary,
    /// Powers of 1000 (`GB`, `MB`, ...).
    Decimal,
}

/// The unit `input` is written with (`None` when it is not a size [`parse_size`] reads).
pub fn size_unit(input: &str) -> Option<SizeUnit> {
    let text = input.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(text.len());
    match text[split..].trim().to_ascii_lowercase().as_str() {
        "" => Some(SizeUnit::Bare),
        "b" => Some(SizeUnit::Bytes),
        "k" | "kib" | "m" | "mib" | "g" | "gib" | "t" | "tib" => Some(SizeUnit::Binary),
        "kb" | "mb" | "gb" | "tb" => Some(SizeUnit::Decimal),
        _ => None,
    }
}

/// What a bare number (no unit) means in a duration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareNumber {
    Seconds,
    Milliseconds,
}

/// Parses `500ms`, `1.5s`, `2m` (or `2min`), `1h`, or a bare number in `bare` units. Zero is
/// allowed; callers that need a positive or bounded duration check that themselves.
pub fn parse_duration(text: &str, bare: BareNumber) -> Option<std::time::Duration> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().ok()?;
    let seconds = match (unit.trim(), bare) {
        ("", BareNumber::Seconds) | ("s", _) => value,
        ("", BareNumber::Milliseconds) | ("ms", _) => value / 1000.0,
        ("m" | "min", _) => value * 60.0,
        ("h", _) => value * 3600.0,
        _ => return None,
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return None;
    }
    std::time::Duration::try_from_secs_f64(seconds).ok()
}

/// Bytes as GiB with two decimals, the way vLLM logs them.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB as f64
}

/// Signed GiB (for shortfalls).
pub fn gib_signed(bytes: i128) -> f64 {
    bytes as f64 / GIB as f64
}

/// Rounds a fraction down to two decimals (utilizations must never be rounded up).
pub fn floor_2dp(x: f64) -> f64 {
    ((x * 100.0) + 1e-9).floor() / 100.0
}

/// `ceil(a / b)` for positive integers.
pub fn cdiv(a: u64, b: u64) -> u64 {
    a.div_ceil(b)
}

/// Formats an integer with thousands separators (`32,768`).
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_in_every_accepted_spelling() {
        assert_eq!(parse_size("24GiB"), Ok(24 * GIB));
        assert_eq!(parse_size("24gib"), Ok(24 * GIB));
        assert_eq!(parse_size("24G"), Ok(24 * GIB));
        assert_eq!(parse_size("24GB"), Ok(24_000_000_000));
        assert_eq!(parse_size("24576MiB"), Ok(24 * GIB));
        assert_eq!(parse_size("25769803776"), Ok(24 * GIB));
        assert_eq!(
            parse_size("23.58GiB"),
            Ok((23.58 * GIB as f64).round() as u64)
        );
        assert_eq!(parse_size(" 512 MiB "), Ok(512 * MIB));
    }

    #[test]
    fn malformed_sizes_are_rejected_with_the_input_named() {
        for bad in ["", "GiB", "24XB", "1.2.3GiB", "12.5", "-4GiB", "abc"] {
            let e = parse_size(bad).unwrap_err();
            assert_eq!(e.input, bad);
            assert!(e.to_string().contains("invalid size"));
        }
    }

    #[test]
    fn durations_in_every_accepted_spelling() {
        use std::time::Duration;
        let secs = |t| parse_duration(t, BareNumber::Seconds);
        assert_eq!(secs("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(secs("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(secs("2m"), Some(Duration::from_secs(120)));
        assert_eq!(secs("2 min"), Some(Duration::from_secs(120)));
        assert_eq!(secs("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(secs("7"), Some(Duration::from_secs(7)));
        assert_eq!(secs("0s"), Some(Duration::ZERO));
        assert_eq!(
            parse_duration("20", BareNumber::Milliseconds),
            Some(Duration::from_millis(20))
        );
        for bad in ["", "-1s", "fast", "3d", "1 fortnight", "1.2.3s"] {
            assert_eq!(secs(bad), None, "{bad}");
        }
    }

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(32768), "32,768");
        assert_eq!(thousands(1234567), "1,234,567");
    }

    #[test]
    fn size_units_are_told_apart() {
        assert_eq!(size_unit("3"), Some(SizeUnit::Bare));
        assert_eq!(size_unit("3B"), Some(SizeUnit::Bytes));
        assert_eq!(size_unit("24GiB"), Some(SizeUnit::Binary));
        assert_eq!(size_unit("24g"), Some(SizeUnit::Binary));
        assert_eq!(size_unit(" 24 GB"), Some(SizeUnit::Decimal));
        assert_eq!(size_unit("24 parsecs"), None);
    }

    #[test]
    fn utilization_is_never_rounded_up() {
        assert_eq!(floor_2dp(0.8399), 0.83);
        assert_eq!(floor_2dp(0.84), 0.84);
    }
}
