//! A small `multipart/form-data` reader over a body already held in memory (under the lane's
//! body cap): finds each part's name, filename and byte range so the gateway can read the model
//! field and the audio header, then forwards the original bytes untouched. Hand-written because
//! the gateway needs each part's byte *range* inside the original body (to forward it as is),
//! which streaming readers such as `multer` do not give; part headers follow RFC 7578 §4.2 and
//! RFC 2183/6266 parameter syntax (quoted strings may hold `;` and `\"`).

use std::ops::Range;

/// One form part: its name, optional filename, and where its content lies in the body.
#[derive(Debug, Clone, PartialEq)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Range<usize>,
}

/// Most parts read from one form (OpenAI's audio forms have about ten).
pub const MAX_PARTS: usize = 256;

/// Why a body is not usable multipart.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MultipartError {
    #[error("Content-Type is multipart/form-data but has no boundary")]
    NoBoundary,
    #[error("multipart body is malformed: {0}")]
    Malformed(&'static str),
}

/// The boundary of a `multipart/form-data; boundary=...` content type; `None` for other types.
pub(crate) fn boundary(content_type: &str) -> Option<Result<String, MultipartError>> {
    let mut pieces = content_type.split(';');
    let mime = pieces.next()?.trim();
    if !mime.eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    for p in pieces {
        let p = p.trim();
        if let Some((k, v)) = p.split_once('=')
            && k.trim().eq_ignore_ascii_case("boundary")
        {
            let v = v.trim().trim_matches('"');
            if v.is_empty() || v.len() > 200 {
                return Some(Err(MultipartError::NoBoundary));
            }
            return Some(Ok(v.to_string()));
        }
    }
    Some(Err(MultipartError::NoBoundary))
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    if needle.is_empty() || from > hay.len() {
        return None;
    }
    hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| i + from)
}

/// Splits `body` into parts. Requires the closing boundary.
pub fn parse(body: &[u8], boundary: &str) -> Result<Vec<Part>, MultipartError> {
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let mut at =
        find(body, delimiter, 0).ok_or(MultipartError::Malformed("no opening boundary"))?;
    let mut parts = Vec::new();
    loop {
        at += delimiter.len();
        if body[at..].starts_with(b"--") {
            return Ok(parts);
        }
        // Skip transport padding and the line break after the boundary.
        while at < body.len() && (body[at] == b' ' || body[at] == b'\t') {
            at += 1;
        }
        if !body[at..].starts_with(b"\r\n") {
            return Err(MultipartError::Malformed(
                "boundary not followed by a line break",
            ));
        }
        at += 2;
        let headers_end = find(body, b"\r\n\r\n", at)
            .ok_or(MultipartError::Malformed("part headers never end"))?;
        let headers = std::str::from_utf8(&body[at..headers_end])
            .map_err(|_| MultipartError::Malformed("part headers are not UTF-8"))?;
        let mut name = None;
        let mut filename = None;
        let mut content_type = None;
        for line in headers.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else {
                return Err(MultipartError::Malformed("part header without a colon"));
            };
            if k.trim().eq_ignore_ascii_case("content-disposition") {
                for (pk, pv) in disposition_params(v)? {
                    match pk.to_ascii_lowercase().as_str() {
                        "name" => name = Some(pv),
                        "filename" => filename = Some(pv),
                        _ => {}
                    }
                }
            } else if k.trim().eq_ignore_ascii_case("content-type") {
                content_type = Some(v.trim().to_string());
            }
        }
        if parts.len() >= MAX_PARTS {
            return Err(MultipartError::Malformed("more than 256 parts"));
        }
        let data_start = headers_end + 4;
        let mut closing = b"\r\n".to_vec();
        closing.extend_from_slice(delimiter);
        let data_end = find(body, &closing, data_start)
            .ok_or(MultipartError::Malformed("part never closed by a boundary"))?;
        parts.push(Part {
            name: name.ok_or(MultipartError::Malformed("part without a name"))?,
            filename,
            content_type,
            data: data_start..data_end,
        });
        at = data_end + 2;
    }
}

/// The `key=value` parameters after the disposition type of a Content-Disposition value. Values
/// are tokens or quoted strings; a quoted string runs to its closing quote whatever it holds
/// (`;`, `=`, spaces) and `\` escapes the next character.
fn disposition_params(value: &str) -> Result<Vec<(String, String)>, MultipartError> {
    let bad = MultipartError::Malformed("Content-Disposition parameters are malformed");
    let mut out = Vec::new();
    let mut rest = match value.split_once(';') {
        Some((_, r)) => r,
        None => return Ok(out),
    };
    loop {
        rest = rest.trim_start_matches([' ', '\t']);
        if rest.is_empty() {
            return Ok(out);
        }
        let eq = rest.find('=').ok_or(bad.clone())?;
        let key = rest[..eq].trim();
        if key.is_empty() || key.contains([';', '"']) {
            return Err(bad);
        }
        rest = rest[eq + 1..].trim_start_matches([' ', '\t']);
        let mut val = String::new();
        if let Some(quoted) = rest.strip_prefix('"') {
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => val.push(chars.next().ok_or(bad.clone())?.1),
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => val.push(c),
                }
            }
            rest = &quoted[end.ok_or(bad.clone())?..];
            rest = rest.trim_start_matches([' ', '\t']);
        } else {
            let end = rest.find(';').unwrap_or(rest.len());
            val.push_str(rest[..end].trim());
            rest = &rest[end..];
        }
        out.push((key.to_string(), val));
        match rest.strip_prefix(';') {
            Some(r) => rest = r,
            None if rest.is_empty() => return Ok(out),
            None => return Err(bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(boundary: &str) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n").as_bytes());
        b.extend_from_slice(format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n").as_bytes());
        b.extend_from_slice(b"RIFF\r\n--not-the-boundary\0\xff");
        b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        b
    }

    #[test]
    fn splits_parts_and_keeps_binary_content() {
        let body = form("XyZ");
        let parts = parse(&body, "XyZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].name, "model");
        assert_eq!(&body[parts[0].data.clone()], b"whisper-1");
        assert_eq!(parts[1].filename.as_deref(), Some("a.wav"));
        assert_eq!(parts[1].content_type.as_deref(), Some("audio/wav"));
        assert_eq!(
            &body[parts[1].data.clone()],
            b"RIFF\r\n--not-the-boundary\0\xff"
        );
    }

    #[test]
    fn quoted_parameters_keep_semicolons_quotes_and_spaces() {
        let body = b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a;b \\\"c\\\".wav\"\r\n\r\nRIFF\r\n--B\r\ncontent-disposition: form-data;name=model\r\n\r\nw\r\n--B--\r\n";
        let parts = parse(body, "B").unwrap();
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("a;b \"c\".wav"));
        assert_eq!(parts[1].name, "model");
        assert_eq!(&body[parts[1].data.clone()], b"w");
        // `filename="x;name=evil"` must not rename the part.
        let sneaky = b"--B\r\nContent-Disposition: form-data; filename=\"x; name=evil\"; name=\"file\"\r\n\r\nz\r\n--B--\r\n";
        let parts = parse(sneaky, "B").unwrap();
        assert_eq!(parts[0].name, "file");
        assert_eq!(parts[0].filename.as_deref(), Some("x; name=evil"));
        let unterminated =
            b"--B\r\nContent-Disposition: form-data; name=\"file\r\n\r\nz\r\n--B--\r\n";
        assert!(parse(unterminated, "B").is_err());
    }

    #[test]
    fn broken_bodies_are_errors_not_panics() {
        let body = form("XyZ");
        for cut in 0..body.len() - 4 {
            assert!(parse(&body[..cut], "XyZ").is_err(), "cut at {cut}");
        }
        assert!(parse(b"garbage", "XyZ").is_err());
        assert!(parse(&body, "other").is_err());
    }

    #[test]
    fn reads_the_boundary() {
        assert_eq!(
            boundary("multipart/form-data; boundary=abc"),
            Some(Ok("abc".into()))
        );
        assert_eq!(
            boundary("multipart/form-data; boundary=\"a b\""),
            Some(Ok("a b".into()))
        );
        assert_eq!(
            boundary("multipart/form-data"),
            Some(Err(MultipartError::NoBoundary))
        );
        assert_eq!(boundary("application/json"), None);
    }
}
