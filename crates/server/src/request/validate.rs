//! Validation: the body, by content type, into the [`Facts`] the later steps need: JSON routes
//! through [`crate::body_facts`], audio uploads through the multipart reader and the audio duration probe.

use std::borrow::Cow;

use axum::http::StatusCode;

use super::{Facts, Route};
use crate::body_facts::{audio_seconds, parse_json};
use crate::error::{ApiError, ErrorCode};
use crate::multipart;

/// Reads the request's facts, or the 4xx that explains why the body is not acceptable. `ctype`:
/// the body's `content-type` as sent.
pub(super) fn inspect<'a>(
    route: Route,
    ctype: &str,
    body: &'a [u8],
) -> Result<Facts<'a>, ApiError> {
    match route.json() {
        Some(json_route) => inspect_json(route, json_route, ctype, body),
        None => inspect_upload(route, ctype, body),
    }
}

fn inspect_json<'a>(
    route: Route,
    json_route: crate::body_facts::JsonRoute,
    ctype: &str,
    body: &'a [u8],
) -> Result<Facts<'a>, ApiError> {
    let mime = ctype.split(';').next().unwrap_or("").trim();
    if !mime.eq_ignore_ascii_case("application/json") {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
            format!("{} takes application/json, not `{mime}`", route.path()),
        ));
    }
    let r = parse_json(json_route, body)?;
    let input_param = match route {
        Route::Chat => "messages",
        Route::Completions => "prompt",
        _ => "input",
    };
    Ok(Facts {
        model: Some(r.model),
        stream: r.stream,
        has_audio: r.has_audio,
        audio_seconds: r.audio_seconds,
        input_tokens: r.input_tokens_estimate,
        texts: r.texts,
        token_ids: r.token_ids,
        max_tokens: r.max_tokens,
        speech: r.speech,
        json: true,
        audio_param: "messages",
        input_param,
    })
}

fn inspect_upload(route: Route, ctype: &str, body: &[u8]) -> Result<Facts<'static>, ApiError> {
    let boundary = match multipart::boundary(ctype) {
        None => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::UnsupportedMediaType,
                format!("{} takes multipart/form-data", route.path()),
            ));
        }
        Some(Err(e)) => {
            return Err(ApiError::bad_request(
                ErrorCode::InvalidMultipart,
                None,
                e.to_string(),
            ));
        }
        Some(Ok(b)) => b,
    };
    let parts = multipart::parse(body, &boundary)
        .map_err(|e| ApiError::bad_request(ErrorCode::InvalidMultipart, None, e.to_string()))?;
    let field = |name: &str| {
        parts
            .iter()
            .find(|p| p.name == name && p.filename.is_none())
            .map(|p| {
                String::from_utf8_lossy(&body[p.data.clone()])
                    .trim()
                    .to_string()
            })
    };
    let file = parts.iter().find(|p| p.name == "file").ok_or_else(|| {
        ApiError::bad_request(
            ErrorCode::MissingFile,
            Some("file"),
            "the form has no `file` part",
        )
    })?;
    let data = &body[file.data.clone()];
    if data.is_empty() {
        return Err(ApiError::bad_request(
            ErrorCode::MissingFile,
            Some("file"),
            "the `file` part is empty",
        ));
    }
    let seconds = audio_seconds(data, "file")?;
    Ok(Facts {
        model: field("model")
            .or_else(|| field("model_name"))
            .filter(|m| !m.is_empty())
            .map(Cow::Owned),
        stream: field("stream").is_some_and(|s| s == "true"),
        has_audio: true,
        audio_seconds: seconds,
        input_tokens: 0,
        texts: Vec::new(),
        token_ids: 0,
        max_tokens: None,
        speech: None,
        json: false,
        audio_param: "file",
        input_param: "prompt",
    })
}
