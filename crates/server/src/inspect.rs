//! Reading what a request is before admission: JSON validity and nesting depth, the model name,
//! streaming, output-token asks, an input-token estimate, and audio carried inside chat messages
//! (OpenAI `input_audio` parts and `audio_url` data URLs, as VibeVoice's vLLM plugin takes it).

use axum::http::StatusCode;
use serde_json::Value;

use crate::audio::{AudioProbe, base64_decode, probe};
use crate::error::ApiError;

/// Deepest JSON nesting accepted (serde_json's own limit is 128).
pub const MAX_JSON_DEPTH: usize = 64;

/// Characters per token in the stated input-token estimate used without a tokenizer.
pub const CHARS_PER_TOKEN: usize = 4;

/// Which JSON route a body was posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonRoute {
    Chat,
    Completions,
    Speech,
}

/// What the gateway learned from a JSON body.
#[derive(Debug, Clone)]
pub struct JsonRequest {
    pub value: Value,
    pub model: String,
    pub stream: bool,
    /// Seconds of audio inside chat messages, when any is carried.
    pub audio_seconds: Option<f64>,
    pub has_audio: bool,
    /// Estimated input tokens (characters / [`CHARS_PER_TOKEN`], rounded up, plus token ids).
    pub input_tokens_estimate: u64,
    /// The input texts (message contents, prompt, speech input) for exact counting.
    pub texts: Vec<String>,
    /// Input given as token ids (completions prompts), counted as is.
    pub token_ids: u64,
    /// The field carrying the output-token ask and its value.
    pub max_tokens: Option<(&'static str, u64)>,
}

/// Nesting depth of a JSON text, ignoring brackets inside strings. Stops counting past `limit`.
pub fn json_depth_exceeds(bytes: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

fn unsupported_audio(param: &str) -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "unsupported_audio",
        "the audio is not WAV, FLAC, MP3, OGG, MP4/M4A or WebM",
    )
    .with_param(Some(param))
}

/// Duration of one audio blob: `Ok(Some(s))` when read, `Ok(None)` for a recognised container
/// whose length is not in its header, `Err` (415) when it is not audio.
pub fn audio_seconds(data: &[u8], param: &str) -> Result<Option<f64>, ApiError> {
    match probe(data) {
        AudioProbe::Duration { seconds, .. } => Ok(Some(seconds)),
        AudioProbe::UnknownDuration { .. } => Ok(None),
        AudioProbe::NotAudio => Err(unsupported_audio(param)),
    }
}

fn chat_audio_blob(part: &Value) -> Option<Result<Vec<u8>, ApiError>> {
    let kind = part.get("type").and_then(Value::as_str)?;
    let encoded = match kind {
        "input_audio" => part
            .get("input_audio")
            .and_then(|a| a.get("data"))
            .and_then(Value::as_str)?,
        "audio_url" => {
            let url = part
                .get("audio_url")
                .and_then(|a| a.get("url"))
                .and_then(Value::as_str)?;
            // Only data URLs carry the audio inline; remote URLs are the engine's business.
            let rest = url.strip_prefix("data:")?;
            rest.split_once(";base64,")?.1
        }
        _ => return None,
    };
    Some(base64_decode(encoded).ok_or_else(|| {
        ApiError::bad_request(
            "invalid_audio_encoding",
            Some("messages"),
            "audio in a chat message is not valid base64",
        )
    }))
}

/// Parses and checks a JSON body for `route`.
pub fn parse_json(route: JsonRoute, bytes: &[u8]) -> Result<JsonRequest, ApiError> {
    if json_depth_exceeds(bytes, MAX_JSON_DEPTH) {
        return Err(ApiError::bad_request(
            "json_too_deep",
            None,
            format!("JSON nesting deeper than {MAX_JSON_DEPTH} levels"),
        ));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(
            "invalid_json",
            None,
            format!("request body is not valid JSON: {e}"),
        )
    })?;
    let Some(obj) = value.as_object() else {
        return Err(ApiError::bad_request(
            "invalid_json",
            None,
            "request body must be a JSON object",
        ));
    };
    let model = match obj.get("model") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(Value::String(_)) | None | Some(Value::Null) => {
            return Err(ApiError::bad_request(
                "missing_model",
                Some("model"),
                "`model` is required",
            ));
        }
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_type",
                "`model` must be a string",
            )
            .with_param(Some("model")));
        }
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_type",
                "`stream` must be a boolean",
            )
            .with_param(Some("stream")));
        }
    };
    let mut max_tokens = None;
    for field in ["max_tokens", "max_completion_tokens"] {
        match obj.get(field) {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => max_tokens = Some((field, n)),
                _ => {
                    return Err(ApiError::bad_request(
                        "invalid_value",
                        Some(field),
                        format!("`{field}` must be a positive integer"),
                    ));
                }
            },
        }
    }
    let mut texts: Vec<String> = Vec::new();
    let mut token_ids = 0u64;
    let mut audio_total: Option<f64> = None;
    let mut has_audio = false;
    match route {
        JsonRoute::Chat => {
            let messages = match obj.get("messages") {
                Some(Value::Array(m)) => m,
                None => {
                    return Err(ApiError::bad_request(
                        "missing_field",
                        Some("messages"),
                        "`messages` is required",
                    ));
                }
                Some(_) => {
                    return Err(ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "invalid_type",
                        "`messages` must be an array",
                    )
                    .with_param(Some("messages")));
                }
            };
            check_messages(messages)?;
            for m in messages {
                match m.get("content") {
                    Some(Value::String(s)) => texts.push(s.clone()),
                    Some(Value::Array(parts)) => {
                        for part in parts {
                            if let Some(t) = part.get("text").and_then(Value::as_str) {
                                texts.push(t.to_string());
                            }
                            if let Some(blob) = chat_audio_blob(part) {
                                has_audio = true;
                                if let Some(s) = audio_seconds(&blob?, "messages")? {
                                    *audio_total.get_or_insert(0.0) += s;
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        JsonRoute::Completions => match obj.get("prompt") {
            Some(Value::String(s)) => texts.push(s.clone()),
            Some(Value::Array(items)) => {
                for i in items {
                    if let Some(s) = i.as_str() {
                        texts.push(s.to_string());
                    } else {
                        // Token-id prompts: count the ids themselves.
                        token_ids += i.as_array().map(|a| a.len()).unwrap_or(1) as u64;
                    }
                }
            }
            _ => {}
        },
        JsonRoute::Speech => match obj.get("input") {
            Some(Value::String(s)) => texts.push(s.clone()),
            _ => {
                return Err(ApiError::bad_request(
                    "missing_field",
                    Some("input"),
                    "`input` (the text to speak) is required",
                ));
            }
        },
    }
    Ok(JsonRequest {
        model,
        stream,
        audio_seconds: audio_total,
        has_audio,
        input_tokens_estimate: estimate_tokens(&texts) + token_ids,
        texts,
        token_ids,
        max_tokens,
        value,
    })
}

/// Roles the chat API knows (OpenAI's `ChatCompletionMessageParam` union).
pub const CHAT_ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

/// Rejects message shapes the OpenAI API rejects (400 `invalid_request_error`), before they are
/// forwarded: an empty list, a message that is not an object, a missing or unknown role, content
/// that is neither a string nor a list of typed parts (null only where a role may omit it).
pub fn check_messages(messages: &[Value]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            "invalid_value",
            Some("messages"),
            "`messages` must hold at least one message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ApiError::bad_request(
                "invalid_type",
                Some(&format!("messages[{i}]")),
                format!("`messages[{i}]` must be an object"),
            ));
        };
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            None | Some(Value::Null) => {
                return Err(ApiError::bad_request(
                    "missing_field",
                    Some(&format!("messages[{i}].role")),
                    format!("`messages[{i}].role` is required"),
                ));
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_type",
                    Some(&format!("messages[{i}].role")),
                    format!("`messages[{i}].role` must be a string"),
                ));
            }
        };
        if !CHAT_ROLES.contains(&role) {
            return Err(ApiError::bad_request(
                "invalid_value",
                Some(&format!("messages[{i}].role")),
                format!(
                    "`messages[{i}].role` is `{}`; it must be one of {}",
                    role.chars().take(40).collect::<String>(),
                    CHAT_ROLES.join(", ")
                ),
            ));
        }
        let content_param = format!("messages[{i}].content");
        match obj.get("content") {
            Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let typed = part
                        .as_object()
                        .and_then(|p| p.get("type"))
                        .is_some_and(Value::is_string);
                    if !typed {
                        return Err(ApiError::bad_request(
                            "invalid_type",
                            Some(&format!("{content_param}[{j}]")),
                            format!("`{content_param}[{j}]` must be an object with a `type`"),
                        ));
                    }
                }
            }
            // The assistant may omit content when it calls tools; so may the legacy function role.
            None | Some(Value::Null) if matches!(role, "assistant" | "function") => {}
            None | Some(Value::Null) => {
                return Err(ApiError::bad_request(
                    "missing_field",
                    Some(&content_param),
                    format!("`{content_param}` is required for the `{role}` role"),
                ));
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "invalid_type",
                    Some(&content_param),
                    format!("`{content_param}` must be a string or a list of content parts"),
                ));
            }
        }
    }
    Ok(())
}

/// The stated estimate used without a tokenizer: characters / [`CHARS_PER_TOKEN`], rounded up.
pub fn estimate_tokens(texts: &[String]) -> u64 {
    let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    chars.div_ceil(CHARS_PER_TOKEN) as u64
}

/// The text the cleanup fallback works on: the last user message's text.
pub fn last_user_text(value: &Value) -> String {
    let Some(messages) = value.get("messages").and_then(Value::as_array) else {
        return String::new();
    };
    let Some(last) = messages
        .iter()
        .rev()
        .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
    else {
        return String::new();
    };
    match last.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audio::fixtures;

    fn b64(data: &[u8]) -> String {
        const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for chunk in data.chunks(3) {
            let n = chunk.iter().fold(0u32, |a, b| (a << 8) | *b as u32) << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    #[test]
    fn depth_ignores_brackets_in_strings() {
        assert!(!json_depth_exceeds(br#"{"a":"[[[[[[[[[[[["}"#, 3));
        assert!(json_depth_exceeds(b"[[[[", 3));
        assert!(!json_depth_exceeds(br#"{"a":"\"[[[["}"#, 2));
    }

    #[test]
    fn chat_audio_is_found_and_timed() {
        let wav = fixtures::wav(3.0, 8000, 1);
        let body = serde_json::json!({
            "model": "vibevoice",
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "transcribe"},
                {"type": "input_audio", "input_audio": {"data": b64(&wav), "format": "wav"}},
                {"type": "audio_url", "audio_url": {"url": format!("data:audio/wav;base64,{}", b64(&wav))}}
            ]}]
        });
        let r = parse_json(JsonRoute::Chat, body.to_string().as_bytes()).unwrap();
        assert!(r.has_audio);
        assert_eq!(r.audio_seconds, Some(6.0));
        let bad = serde_json::json!({
            "model": "m",
            "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": b64(b"not audio at all"), "format": "wav"}}
            ]}]
        });
        let e = parse_json(JsonRoute::Chat, bad.to_string().as_bytes()).unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }

    #[test]
    fn message_shapes_the_openai_api_rejects_are_400() {
        let cases = [
            (r#"[]"#, "invalid_value", "messages"),
            (r#"["hi"]"#, "invalid_type", "messages[0]"),
            (r#"[{"content":"hi"}]"#, "missing_field", "messages[0].role"),
            (
                r#"[{"role":"wizard","content":"hi"}]"#,
                "invalid_value",
                "messages[0].role",
            ),
            (
                r#"[{"role":7,"content":"hi"}]"#,
                "invalid_type",
                "messages[0].role",
            ),
            (
                r#"[{"role":"user","content":42}]"#,
                "invalid_type",
                "messages[0].content",
            ),
            (
                r#"[{"role":"user","content":{"text":"hi"}}]"#,
                "invalid_type",
                "messages[0].content",
            ),
            (
                r#"[{"role":"user","content":"a"},{"role":"user","content":["x"]}]"#,
                "invalid_type",
                "messages[1].content[0]",
            ),
            (
                r#"[{"role":"user"}]"#,
                "missing_field",
                "messages[0].content",
            ),
        ];
        for (messages, code, param) in cases {
            let body = format!(r#"{{"model":"m","messages":{messages}}}"#);
            let e = parse_json(JsonRoute::Chat, body.as_bytes()).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{messages}");
            assert_eq!(
                (e.code.as_str(), e.param.as_deref()),
                (code, Some(param)),
                "{messages}"
            );
            assert_eq!(e.body()["error"]["type"], "invalid_request_error");
        }
        let ok = r#"{"model":"m","messages":[{"role":"developer","content":"x"},{"role":"assistant","content":null,"tool_calls":[]},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        assert!(parse_json(JsonRoute::Chat, ok.as_bytes()).is_ok());
    }

    #[test]
    fn estimates_tokens_and_reads_limits() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"abcdefgh"}],"max_tokens":5,"stream":true}"#;
        let r = parse_json(JsonRoute::Chat, body).unwrap();
        assert_eq!(r.input_tokens_estimate, 2);
        assert_eq!(r.max_tokens, Some(("max_tokens", 5)));
        assert!(r.stream);
        assert_eq!(last_user_text(&r.value), "abcdefgh");
    }
}
