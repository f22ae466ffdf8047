//! Reading what a request is before admission: JSON validity and nesting depth, the model name,
//! streaming, output-token asks, an input-token estimate, and audio carried inside chat messages
//! (OpenAI `input_audio` parts and `audio_url` data URLs, as VibeVoice's vLLM plugin takes it).
//!
//! Named `body_facts` (it was `inspect`) so it does not read as the `headroom-inspect` crate,
//! which inspects models (what `--model` names), not request bodies.

use std::borrow::Cow;
use std::marker::PhantomData;

use axum::http::StatusCode;
use serde_json::Value;

use crate::audio::{AudioProbe, base64_decode, probe};
use crate::error::{ApiError, ErrorCode};

/// Deepest JSON nesting accepted (serde_json's own limit is 128).
pub(crate) const MAX_JSON_DEPTH: usize = 64;

/// Characters per token in the stated input-token estimate used without a tokenizer.
pub(crate) const CHARS_PER_TOKEN: usize = 4;

/// Which JSON route a body was posted to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JsonRoute {
    Chat,
    Completions,
    Speech,
}

/// What the gateway learned from a JSON body (its texts borrowed from the body where they hold
/// no escapes).
#[derive(Debug, Clone)]
pub struct JsonRequest<'a> {
    pub model: Cow<'a, str>,
    pub stream: bool,
    /// Seconds of audio inside chat messages, when any is carried.
    pub audio_seconds: Option<f64>,
    pub has_audio: bool,
    /// Estimated input tokens (characters / [`CHARS_PER_TOKEN`], rounded up, plus token ids).
    pub input_tokens_estimate: u64,
    /// The input texts (message contents, prompt, speech input) for exact counting.
    pub texts: Vec<Cow<'a, str>>,
    /// Input given as token ids (completions prompts), counted as is.
    pub token_ids: u64,
    /// The field carrying the output-token ask and its value.
    pub max_tokens: Option<(&'static str, u64)>,
    /// A speech request's ask: what its cost is computed from.
    pub speech: Option<SpeechAsk>,
}

/// What a speech request asks for: its input's length in characters (Unicode scalar values, as
/// OpenAI counts its 4,096-character limit) and the speaking rate (`speed`, 1.0 when absent).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeechAsk {
    pub chars: u64,
    pub speed: f64,
}

/// The `speed` range OpenAI's speech API takes.
pub(crate) const SPEECH_SPEED_RANGE: std::ops::RangeInclusive<f64> = 0.25..=4.0;

fn speech_ask(input: &str, speed: Option<&Value>) -> Result<SpeechAsk, ApiError> {
    let chars = input.chars().count() as u64;
    if input.trim().is_empty() {
        return Err(ApiError::bad_request(
            ErrorCode::MissingField,
            Some("input"),
            "`input` (the text to speak) is empty",
        ));
    }
    let speed = match speed {
        None | Some(Value::Null) => 1.0,
        Some(v) => match v.as_f64() {
            Some(x) if SPEECH_SPEED_RANGE.contains(&x) => x,
            _ => {
                return Err(ApiError::bad_request(
                    ErrorCode::InvalidValue,
                    Some("speed"),
                    "`speed` must be a number from 0.25 to 4.0",
                ));
            }
        },
    };
    Ok(SpeechAsk { chars, speed })
}

/// The fields admission reads from a JSON body, and nothing else: every other field (tools,
/// sampling settings, names, ...) is skipped by the parser without being built into a tree, and
/// of each message only `content` is kept. The body itself is forwarded as received; a tree is
/// built only where a body is rewritten. A later duplicate key wins, as in a full parse.
#[derive(Default)]
struct Fields<'de> {
    model: Option<Text<'de>>,
    stream: Option<Value>,
    max_tokens: Option<Value>,
    max_completion_tokens: Option<Value>,
    messages: Option<Messages<'de>>,
    prompt: Option<Value>,
    input: Option<Value>,
    speed: Option<Value>,
}

/// The visits of a JSON value of a kind a visitor below does not read: the value is consumed
/// (arrays and objects skipped by the parser, nothing built) and `$out` stands for it.
/// `scalars`: booleans and numbers; `text`: strings and null; `seq` / `map`: arrays / objects.
macro_rules! visit_as {
    (scalars => $out:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($out)
        }
    };
    (text => $out:expr) => {
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok($out)
        }
    };
    (seq<$de:lifetime> => $out:expr) => {
        fn visit_seq<A: serde::de::SeqAccess<$de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
            Ok($out)
        }
    };
    (map<$de:lifetime> => $out:expr) => {
        fn visit_map<A: serde::de::MapAccess<$de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            while map
                .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                .is_some()
            {}
            Ok($out)
        }
    };
}

/// A JSON value where text is expected (`model`, a message's `content`): the text (borrowed from
/// the body unless it holds escapes), a list (of content parts, each kept whole: the shape check
/// and the audio probe read them), `null`, or a value of another kind (skipped).
enum Text<'de> {
    Str(Cow<'de, str>),
    List(Vec<Value>),
    Null,
    Other,
}

impl<'de> serde::Deserialize<'de> for Text<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Text<'de>, D::Error> {
        struct V<'de>(PhantomData<&'de ()>);
        impl<'de> serde::de::Visitor<'de> for V<'de> {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text::Str(Cow::Borrowed(s)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text::Str(Cow::Owned(s.to_owned())))
            }
            fn visit_unit<E>(self) -> Result<Text<'de>, E> {
                Ok(Text::Null)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Text<'de>, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element::<Value>()? {
                    items.push(item);
                }
                Ok(Text::List(items))
            }
            visit_as!(scalars => Text::Other);
            visit_as!(map<'de> => Text::Other);
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// A key of a JSON object, matched as it is read: serde's `Cow<str>` always builds a `String`,
/// one allocation per key of every request.
struct Ident<K>(K);

impl<'de, K: for<'a> From<&'a str>> serde::Deserialize<'de> for Ident<K> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Ident<K>, D::Error> {
        struct V<K>(std::marker::PhantomData<K>);
        impl<'de, K: for<'a> From<&'a str>> serde::de::Visitor<'de> for V<K> {
            type Value = Ident<K>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a field name")
            }
            fn visit_str<E>(self, key: &str) -> Result<Ident<K>, E> {
                Ok(Ident(K::from(key)))
            }
        }
        d.deserialize_identifier(V(std::marker::PhantomData))
    }
}

/// The keys of a request body that admission reads.
enum FieldKey {
    Model,
    Stream,
    MaxTokens,
    MaxCompletionTokens,
    Messages,
    Prompt,
    Input,
    Speed,
    Other,
}

impl From<&str> for FieldKey {
    fn from(key: &str) -> FieldKey {
        match key {
            "model" => FieldKey::Model,
            "stream" => FieldKey::Stream,
            "max_tokens" => FieldKey::MaxTokens,
            "max_completion_tokens" => FieldKey::MaxCompletionTokens,
            "messages" => FieldKey::Messages,
            "prompt" => FieldKey::Prompt,
            "input" => FieldKey::Input,
            "speed" => FieldKey::Speed,
            _ => FieldKey::Other,
        }
    }
}

/// The keys of a chat message that admission reads.
enum MessageKey {
    Role,
    Content,
    Other,
}

impl From<&str> for MessageKey {
    fn from(key: &str) -> MessageKey {
        match key {
            "role" => MessageKey::Role,
            "content" => MessageKey::Content,
            _ => MessageKey::Other,
        }
    }
}

/// A message's `role` as read: one of [`CHAT_ROLES`] (no string is built for it), another
/// string (its first 40 characters, for the error), `null`, or another kind of value.
#[derive(Debug, PartialEq)]
enum Role {
    Known(&'static str),
    Unknown(String),
    Null,
    NotString,
}

impl<'de> serde::Deserialize<'de> for Role {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Role, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Role;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E>(self, role: &str) -> Result<Role, E> {
                Ok(match CHAT_ROLES.iter().find(|known| **known == role) {
                    Some(known) => Role::Known(known),
                    None => Role::Unknown(role.chars().take(40).collect()),
                })
            }
            fn visit_unit<E>(self) -> Result<Role, E> {
                Ok(Role::Null)
            }
            visit_as!(scalars => Role::NotString);
            visit_as!(seq<'de> => Role::NotString);
            visit_as!(map<'de> => Role::NotString);
        }
        d.deserialize_any(V)
    }
}

/// `messages`: an array (the content of each element that is an object), or anything else.
enum Messages<'de> {
    List(Vec<Content<'de>>),
    Other,
}

impl<'de> serde::Deserialize<'de> for Fields<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Fields<'de>, D::Error> {
        struct V<'de>(PhantomData<&'de ()>);
        impl<'de> serde::de::Visitor<'de> for V<'de> {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Fields<'de>, A::Error> {
                let mut out = Fields::default();
                while let Some(Ident(key)) = map.next_key::<Ident<FieldKey>>()? {
                    let slot = match key {
                        FieldKey::Model => {
                            out.model = Some(map.next_value::<Text<'de>>()?);
                            continue;
                        }
                        FieldKey::Stream => &mut out.stream,
                        FieldKey::MaxTokens => &mut out.max_tokens,
                        FieldKey::MaxCompletionTokens => &mut out.max_completion_tokens,
                        FieldKey::Prompt => &mut out.prompt,
                        FieldKey::Input => &mut out.input,
                        FieldKey::Speed => &mut out.speed,
                        FieldKey::Messages => {
                            out.messages = Some(map.next_value::<Messages>()?);
                            continue;
                        }
                        FieldKey::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                            continue;
                        }
                    };
                    *slot = Some(map.next_value()?);
                }
                Ok(out)
            }
        }
        d.deserialize_map(V(PhantomData))
    }
}

impl<'de> serde::Deserialize<'de> for Messages<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Messages<'de>, D::Error> {
        struct V<'de>(PhantomData<&'de ()>);
        impl<'de> serde::de::Visitor<'de> for V<'de> {
            type Value = Messages<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Messages<'de>, A::Error> {
                // serde_json gives no size hint; most chats hold a few messages.
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(4).min(256));
                while let Some(m) = seq.next_element::<Content<'de>>()? {
                    out.push(m);
                }
                Ok(Messages::List(out))
            }
            visit_as!(map<'de> => Messages::Other);
            visit_as!(scalars => Messages::Other);
            visit_as!(text => Messages::Other);
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// One element of `messages`: whether it is an object, and its `role` and `content` when it has
/// them (what the shape check and the token estimate need; the rest is skipped).
#[derive(Default)]
struct Content<'de> {
    object: bool,
    role: Option<Role>,
    content: Option<Text<'de>>,
}

impl<'de> serde::Deserialize<'de> for Content<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Content<'de>, D::Error> {
        struct V<'de>(PhantomData<&'de ()>);
        impl<'de> serde::de::Visitor<'de> for V<'de> {
            type Value = Content<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Content<'de>, A::Error> {
                let mut out = Content {
                    object: true,
                    ..Content::default()
                };
                while let Some(Ident(key)) = map.next_key::<Ident<MessageKey>>()? {
                    match key {
                        MessageKey::Content => {
                            out.content = Some(map.next_value::<Text<'de>>()?);
                        }
                        MessageKey::Role => out.role = Some(map.next_value::<Role>()?),
                        MessageKey::Other => {
                            map.next_value::<serde::de::IgnoredAny>()?;
                        }
                    }
                }
                Ok(out)
            }
            visit_as!(seq<'de> => Content::default());
            visit_as!(scalars => Content::default());
            visit_as!(text => Content::default());
        }
        d.deserialize_any(V(PhantomData))
    }
}

/// Nesting depth of a JSON text, ignoring brackets inside strings. Stops counting past `limit`.
pub(crate) fn json_depth_exceeds(bytes: &[u8], limit: usize) -> bool {
    // Nesting never exceeds the number of opening brackets: a body with few of them (nearly
    // every request) is cleared by this count, which the compiler vectorises, without the
    // byte-by-byte walk below.
    let opening = bytes.iter().filter(|&&b| b == b'[' || b == b'{').count();
    if opening <= limit {
        return false;
    }
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
        ErrorCode::UnsupportedAudio,
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
            ErrorCode::InvalidAudioEncoding,
            Some("messages"),
            "audio in a chat message is not valid base64",
        )
    }))
}

/// Parses and checks a JSON body for `route`.
pub fn parse_json(route: JsonRoute, bytes: &[u8]) -> Result<JsonRequest<'_>, ApiError> {
    if json_depth_exceeds(bytes, MAX_JSON_DEPTH) {
        return Err(ApiError::bad_request(
            ErrorCode::JsonTooDeep,
            None,
            format!("JSON nesting deeper than {MAX_JSON_DEPTH} levels"),
        ));
    }
    let fields: Fields<'_> = serde_json::from_slice(bytes).map_err(|e| {
        let message =
            if e.is_data() && bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
                "request body must be a JSON object".to_string()
            } else {
                format!("request body is not valid JSON: {e}")
            };
        ApiError::bad_request(ErrorCode::InvalidJson, None, message)
    })?;
    let model = match fields.model {
        Some(Text::Str(s)) if !s.trim().is_empty() => s,
        Some(Text::Str(_)) | None | Some(Text::Null) => {
            return Err(ApiError::bad_request(
                ErrorCode::MissingModel,
                Some("model"),
                "`model` is required",
            ));
        }
        Some(Text::List(_) | Text::Other) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidType,
                "`model` must be a string",
            )
            .with_param(Some("model")));
        }
    };
    let stream = match fields.stream {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => b,
        Some(_) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidType,
                "`stream` must be a boolean",
            )
            .with_param(Some("stream")));
        }
    };
    let mut max_tokens = None;
    for (field, value) in [
        ("max_tokens", &fields.max_tokens),
        ("max_completion_tokens", &fields.max_completion_tokens),
    ] {
        match value {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_u64() {
                Some(n) if n >= 1 => max_tokens = Some((field, n)),
                _ => {
                    return Err(ApiError::bad_request(
                        ErrorCode::InvalidValue,
                        Some(field),
                        format!("`{field}` must be a positive integer"),
                    ));
                }
            },
        }
    }
    let mut texts: Vec<Cow<'_, str>> = Vec::new();
    let mut token_ids = 0u64;
    let mut audio_total: Option<f64> = None;
    let mut has_audio = false;
    let mut speech = None;
    match route {
        JsonRoute::Chat => {
            let messages = match fields.messages {
                Some(Messages::List(m)) => m,
                None => {
                    return Err(ApiError::bad_request(
                        ErrorCode::MissingField,
                        Some("messages"),
                        "`messages` is required",
                    ));
                }
                Some(Messages::Other) => {
                    return Err(ApiError::new(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        ErrorCode::InvalidType,
                        "`messages` must be an array",
                    )
                    .with_param(Some("messages")));
                }
            };
            check_messages(&messages)?;
            for content in messages.into_iter().map(|m| m.content) {
                match content {
                    Some(Text::Str(s)) => texts.push(s),
                    Some(Text::List(parts)) => {
                        for part in &parts {
                            if let Some(t) = part.get("text").and_then(Value::as_str) {
                                texts.push(Cow::Owned(t.to_string()));
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
        JsonRoute::Completions => match fields.prompt {
            Some(Value::String(s)) => texts.push(Cow::Owned(s)),
            Some(Value::Array(items)) => {
                for i in &items {
                    if let Some(s) = i.as_str() {
                        texts.push(Cow::Owned(s.to_string()));
                    } else {
                        // Token-id prompts: count the ids themselves.
                        token_ids += i.as_array().map(|a| a.len()).unwrap_or(1) as u64;
                    }
                }
            }
            _ => {}
        },
        JsonRoute::Speech => match fields.input {
            Some(Value::String(s)) => {
                speech = Some(speech_ask(&s, fields.speed.as_ref())?);
                texts.push(Cow::Owned(s));
            }
            _ => {
                return Err(ApiError::bad_request(
                    ErrorCode::MissingField,
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
        speech,
    })
}

/// Roles the chat API knows (OpenAI's `ChatCompletionMessageParam` union).
pub(crate) const CHAT_ROLES: &[&str] = &[
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
fn check_messages(messages: &[Content<'_>]) -> Result<(), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_request(
            ErrorCode::InvalidValue,
            Some("messages"),
            "`messages` must hold at least one message",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        if !m.object {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidType,
                Some(&format!("messages[{i}]")),
                format!("`messages[{i}]` must be an object"),
            ));
        }
        let role = match &m.role {
            Some(Role::Known(r)) => *r,
            None | Some(Role::Null) => {
                return Err(ApiError::bad_request(
                    ErrorCode::MissingField,
                    Some(&format!("messages[{i}].role")),
                    format!("`messages[{i}].role` is required"),
                ));
            }
            Some(Role::NotString) => {
                return Err(ApiError::bad_request(
                    ErrorCode::InvalidType,
                    Some(&format!("messages[{i}].role")),
                    format!("`messages[{i}].role` must be a string"),
                ));
            }
            Some(Role::Unknown(role)) => {
                return Err(ApiError::bad_request(
                    ErrorCode::InvalidValue,
                    Some(&format!("messages[{i}].role")),
                    format!(
                        "`messages[{i}].role` is `{role}`; it must be one of {}",
                        CHAT_ROLES.join(", ")
                    ),
                ));
            }
        };
        // Named only in an error: formatted when one is returned.
        let content_param = || format!("messages[{i}].content");
        match &m.content {
            Some(Text::Str(_)) => {}
            Some(Text::List(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let typed = part
                        .as_object()
                        .and_then(|p| p.get("type"))
                        .is_some_and(Value::is_string);
                    if !typed {
                        return Err(ApiError::bad_request(
                            ErrorCode::InvalidType,
                            Some(&format!("{}[{j}]", content_param())),
                            format!("`{}[{j}]` must be an object with a `type`", content_param()),
                        ));
                    }
                }
            }
            // The assistant may omit content when it calls tools; so may the legacy function role.
            None | Some(Text::Null) if matches!(role, "assistant" | "function") => {}
            None | Some(Text::Null) => {
                return Err(ApiError::bad_request(
                    ErrorCode::MissingField,
                    Some(&content_param()),
                    format!("`{}` is required for the `{role}` role", content_param()),
                ));
            }
            Some(Text::Other) => {
                return Err(ApiError::bad_request(
                    ErrorCode::InvalidType,
                    Some(&content_param()),
                    format!(
                        "`{}` must be a string or a list of content parts",
                        content_param()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The stated estimate used without a tokenizer: characters / [`CHARS_PER_TOKEN`], rounded up.
pub(crate) fn estimate_tokens<T: AsRef<str>>(texts: &[T]) -> u64 {
    let chars: usize = texts.iter().map(|t| t.as_ref().chars().count()).sum();
    chars.div_ceil(CHARS_PER_TOKEN) as u64
}

/// The text the cleanup fallback works on: the last user message's text.
pub(crate) fn last_user_text(value: &Value) -> String {
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
        let text = body.to_string();
        let r = parse_json(JsonRoute::Chat, text.as_bytes()).unwrap();
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
    fn depth_counts_nesting_not_brackets() {
        // Many brackets side by side are shallow: the bracket count alone cannot refuse them.
        let wide = format!("[{}]", vec!["[]"; 200].join(","));
        assert!(!json_depth_exceeds(wide.as_bytes(), 3));
        let deep = format!("{}{}", "[".repeat(65), "]".repeat(65));
        assert!(json_depth_exceeds(deep.as_bytes(), 64));
        assert!(!json_depth_exceeds(deep.as_bytes(), 65));
        // Exactly at the count: the count clears it without the walk.
        let at = format!("{}{}", "[".repeat(64), "]".repeat(64));
        assert!(!json_depth_exceeds(at.as_bytes(), 64));
    }

    #[test]
    fn roles_are_read_whatever_their_json_shape() {
        let chat = |messages: &str| format!(r#"{{"model":"m","messages":{messages}}}"#);
        // An escaped role is the same role.
        assert!(
            parse_json(
                JsonRoute::Chat,
                chat(r#"[{"role":"us\u0065r","content":"hi"}]"#).as_bytes()
            )
            .is_ok()
        );
        // A later duplicate key wins, as in a full parse.
        assert!(
            parse_json(
                JsonRoute::Chat,
                chat(r#"[{"role":"wizard","role":"user","content":"hi"}]"#).as_bytes()
            )
            .is_ok()
        );
        for (messages, code) in [
            (r#"[{"role":null,"content":"hi"}]"#, "missing_field"),
            (r#"[{"role":["user"],"content":"hi"}]"#, "invalid_type"),
            (r#"[{"role":{"user":1},"content":"hi"}]"#, "invalid_type"),
            (r#"[{"role":true,"content":"hi"}]"#, "invalid_type"),
            (
                r#"[{"role":"user","role":"wizard","content":"hi"}]"#,
                "invalid_value",
            ),
        ] {
            let e = parse_json(JsonRoute::Chat, chat(messages).as_bytes()).unwrap_err();
            assert_eq!(
                (e.status, e.code.as_str()),
                (StatusCode::BAD_REQUEST, code),
                "{messages}"
            );
        }
        // The message names the unknown role, cut to 40 characters.
        let long = "w".repeat(100);
        let e = parse_json(
            JsonRoute::Chat,
            chat(&format!(r#"[{{"role":"{long}","content":"hi"}}]"#)).as_bytes(),
        )
        .unwrap_err();
        assert!(
            e.message.contains(&format!("`{}`", "w".repeat(40))),
            "{}",
            e.message
        );
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
        let value: Value = serde_json::from_slice(body).unwrap();
        assert_eq!(last_user_text(&value), "abcdefgh");
    }

    #[test]
    fn scan_reads_only_the_fields_it_needs_and_keeps_full_parse_answers() {
        // Unknown fields of any shape are skipped (in messages too); the last duplicate key wins,
        // as serde_json's tree keeps it. (Messages that are not objects are a 400: see
        // message_shapes_the_openai_api_rejects_are_400.)
        let body = br#"{"tools":[{"type":"function","function":{"name":"f","parameters":{"a":[1,{"b":null}]}}}],
            "model":"a","model":"b","temperature":0.5,"stream":false,
            "messages":[{"role":"user","name":"n","extra":[1,{"x":null}],"content":"hello"},{"role":"user","content":[{"type":"text","text":"yo"}]}]}"#;
        let r = parse_json(JsonRoute::Chat, body).unwrap();
        assert_eq!(r.model, "b");
        assert_eq!(r.texts, vec!["hello".to_string(), "yo".to_string()]);
        assert!(!r.stream);
        // Texts without escapes are read in place; an escaped one is unescaped into its own.
        assert!(matches!(&r.model, Cow::Borrowed(_)) && matches!(&r.texts[0], Cow::Borrowed(_)));
        let escaped = br#"{"model":"m\u0031","messages":[{"role":"user","content":"a\nb"}]}"#;
        let r = parse_json(JsonRoute::Chat, escaped).unwrap();
        assert_eq!((r.model.as_ref(), r.texts[0].as_ref()), ("m1", "a\nb"));
        let code = |b: &[u8]| parse_json(JsonRoute::Chat, b).unwrap_err();
        let e = code(b"[1,2]");
        assert_eq!(
            (e.code.as_str(), e.message.as_str()),
            ("invalid_json", "request body must be a JSON object")
        );
        assert_eq!(code(br#"{"model":"m","messages":"#).code, "invalid_json");
        let e = code(br#"{"model":"m","messages":null}"#);
        assert_eq!(
            (e.status, e.code.as_str()),
            (StatusCode::UNPROCESSABLE_ENTITY, "invalid_type")
        );
        let e = code(br#"{"model":"m","messages":{"role":"user"}}"#);
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(code(br#"{"messages":[]}"#).code, "missing_model");
        assert_eq!(
            code(br#"{"model":"m","stream":"yes","messages":[]}"#).code,
            "invalid_type"
        );
        assert_eq!(
            code(br#"{"model":"m","max_tokens":0,"messages":[]}"#).code,
            "invalid_value"
        );
    }
}
