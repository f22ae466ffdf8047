//! ASCII-case-insensitive search over log text. Engines write the same fact in different letter
//! case ("CUDA out of memory", "cuda out of memory", "OUT OF MEMORY", "GiB"/"GIB"), so every
//! marker the rules look for is matched without regard to ASCII case. Lowering ASCII letters
//! keeps byte offsets, so an offset found here slices the original line and names (models, GPUs)
//! keep the case the log wrote them in.

/// Byte offset of the first ASCII-case-insensitive occurrence of `needle` in `hay`.
pub fn find(hay: &str, needle: &str) -> Option<usize> {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    if n.is_empty() {
        return Some(0);
    }
    if n.len() > h.len() {
        return None;
    }
    let first = n[0].to_ascii_lowercase();
    let last_start = h.len() - n.len();
    let mut i = 0;
    while i <= last_start {
        // Jump to the next byte that can start a match (either case of the first byte).
        let rest = &h[i..=last_start];
        let hit = if first.is_ascii_alphabetic() {
            memchr::memchr2(first, first.to_ascii_uppercase(), rest)
        } else {
            memchr::memchr(first, rest)
        };
        let at = hit?;
        let start = i + at;
        if h[start..start + n.len()].eq_ignore_ascii_case(n) && hay.is_char_boundary(start) {
            return Some(start);
        }
        i = start + 1;
    }
    None
}

/// Byte offset of the last ASCII-case-insensitive occurrence of `needle` in `hay`.
pub fn rfind(hay: &str, needle: &str) -> Option<usize> {
    let (h, n) = (hay.as_bytes(), needle.as_bytes());
    if n.len() > h.len() {
        return None;
    }
    (0..=h.len() - n.len())
        .rev()
        .find(|&i| h[i..i + n.len()].eq_ignore_ascii_case(n) && hay.is_char_boundary(i))
}

/// True when `needle` occurs in `hay`, ignoring ASCII case.
pub fn has(hay: &str, needle: &str) -> bool {
    find(hay, needle).is_some()
}

/// True when `hay` starts with `prefix`, ignoring ASCII case.
pub fn starts(hay: &str, prefix: &str) -> bool {
    hay.len() >= prefix.len()
        && hay.as_bytes()[..prefix.len()].eq_ignore_ascii_case(prefix.as_bytes())
}

/// True when `hay` ends with `suffix`, ignoring ASCII case.
pub fn ends(hay: &str, suffix: &str) -> bool {
    hay.len() >= suffix.len()
        && hay.as_bytes()[hay.len() - suffix.len()..].eq_ignore_ascii_case(suffix.as_bytes())
}

/// `hay` without `prefix` (ASCII case ignored), or `None`.
pub fn strip_prefix<'a>(hay: &'a str, prefix: &str) -> Option<&'a str> {
    (starts(hay, prefix) && hay.is_char_boundary(prefix.len())).then(|| &hay[prefix.len()..])
}

/// `hay` without `suffix` (ASCII case ignored), or `None`.
pub fn strip_suffix<'a>(hay: &'a str, suffix: &str) -> Option<&'a str> {
    let cut = hay.len().checked_sub(suffix.len())?;
    (ends(hay, suffix) && hay.is_char_boundary(cut)).then(|| &hay[..cut])
}

/// The text after the first occurrence of `marker` (ASCII case ignored).
pub fn after<'a>(hay: &'a str, marker: &str) -> Option<&'a str> {
    find(hay, marker).map(|at| &hay[at + marker.len()..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_regardless_of_case_and_keeps_offsets() {
        assert_eq!(
            find("RuntimeError: CUDA out of memory", "cuda OUT"),
            Some(14)
        );
        assert_eq!(find("aaab", "AB"), Some(2));
        assert_eq!(find("abc", "abcd"), None);
        assert_eq!(find("x", ""), Some(0));
        assert_eq!(find("12.00 GIB", "gib"), Some(6));
        assert_eq!(rfind("GPU 0 gpu 1", "GPU "), Some(6));
        assert!(has("Tried To Allocate 2 MiB", "tried to allocate"));
        assert!(!has("tried to", "tried to allocate"));
        assert!(starts("|  0  NVIDIA", "|"));
        assert!(ends("took 4 GIB", "gib"));
        assert_eq!(strip_prefix("Some(4096)", "some("), Some("4096)"));
        assert_eq!(strip_suffix("958mib", "MiB"), Some("958"));
        assert_eq!(
            after("max seq len (29000)", "MAX SEQ LEN ("),
            Some("29000)")
        );
    }

    #[test]
    fn multibyte_text_is_never_split() {
        // 'é' is two bytes; a match may not start inside it.
        assert_eq!(find("éa", "a"), Some(2));
        assert_eq!(rfind("aé", "a"), Some(0));
        assert_eq!(find("──x──", "x"), Some(6));
    }
}
