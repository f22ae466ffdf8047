//! The lane's request-shape limits, in order: body size, input tokens (counted with the lane's
//! tokenizer off the async threads, or estimated), speech input characters, audio length, and
//! output tokens when the lane rejects rather than lowers an over-large ask; and the audio
//! seconds admission counts where the header did not give them (unknown durations, speech).

use axum::http::StatusCode;

use super::body::too_large;
use super::{Facts, Lane, Route};
use crate::body_facts::CHARS_PER_TOKEN;
use crate::config::OutputTokensMode;
use crate::error::{ApiError, ErrorCode};

/// Applies every limit of `lane` to the request.
pub(super) async fn check(
    lane: Lane<'_>,
    route: Route,
    seen: &Facts<'_>,
    body_len: usize,
) -> Result<(), ApiError> {
    body_size(lane, body_len)?;
    input_tokens(lane, seen).await?;
    speech_chars(lane, seen)?;
    audio_length(lane, seen)?;
    output_tokens(lane, route, seen)
}

fn body_size(lane: Lane<'_>, body_len: usize) -> Result<(), ApiError> {
    if body_len as u64 > lane.config.max_body_bytes {
        return Err(too_large(lane.config.max_body_bytes));
    }
    Ok(())
}

async fn input_tokens(lane: Lane<'_>, seen: &Facts<'_>) -> Result<(), ApiError> {
    let Some(max) = lane.config.max_input_tokens else {
        return Ok(());
    };
    let estimated = || {
        (
            seen.input_tokens,
            format!("estimated as characters / {CHARS_PER_TOKEN}"),
        )
    };
    let (tokens, how) = match &lane.config.tokenizer {
        Some(counter) => {
            let counter = counter.clone();
            let texts: Vec<String> = seen.texts.iter().map(|t| t.to_string()).collect();
            let counted = tokio::task::spawn_blocking(move || counter.count(&texts))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r);
            match counted {
                Ok(n) => (
                    n + seen.token_ids,
                    "counted with the lane's tokenizer".to_string(),
                ),
                Err(_) => estimated(),
            }
        }
        None => estimated(),
    };
    if tokens > max {
        return Err(ApiError::bad_request(
            ErrorCode::InputTooLong,
            Some(seen.input_param),
            format!("input is {tokens} tokens ({how}), over this lane's limit of {max}"),
        ));
    }
    Ok(())
}

fn speech_chars(lane: Lane<'_>, seen: &Facts<'_>) -> Result<(), ApiError> {
    match (lane.config.max_input_chars, seen.speech) {
        (Some(max), Some(ask)) if ask.chars > max => Err(ApiError::bad_request(
            ErrorCode::InputTooLong,
            Some("input"),
            format!(
                "input is {} characters, over this lane's limit of {max}",
                ask.chars
            ),
        )),
        _ => Ok(()),
    }
}

/// A speech request costs the audio it makes: its characters times the lane's
/// `speech_seconds_per_char`, at its `speed`. Admission counts these seconds as it counts an
/// upload's (memory per audio second), so a long narration needs more than a short reply.
pub(super) fn speech_seconds(lane: Lane<'_>, seen: &mut Facts<'_>) {
    if let Some(ask) = seen.speech {
        seen.audio_seconds =
            Some(ask.chars as f64 * lane.config.speech_seconds_per_char / ask.speed);
    }
}

fn audio_length(lane: Lane<'_>, seen: &Facts<'_>) -> Result<(), ApiError> {
    let Some(max) = lane.config.max_audio_seconds else {
        return Ok(());
    };
    if !seen.has_audio {
        return Ok(());
    }
    match seen.audio_seconds {
        Some(secs) if secs > max => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::AudioTooLong,
            format!("audio is {secs:.1} s long, over this lane's limit of {max} s"),
        )
        .with_param(Some(seen.audio_param))),
        // A container whose length cannot be read is admitted as the longest clip the lane
        // allows (see [`assume_unknown_duration`]), never as 0 s.
        Some(_) | None => Ok(()),
    }
}

/// For a lane with `max_audio_seconds`, audio whose duration is unknown counts as that many
/// seconds (so GPU memory per audio second and the cost estimate are never under-counted).
/// Returns whether the duration was assumed.
pub(super) fn assume_unknown_duration(lane: Lane<'_>, seen: &mut Facts<'_>) -> bool {
    match lane.config.max_audio_seconds {
        Some(max) if seen.has_audio && seen.audio_seconds.is_none() => {
            seen.audio_seconds = Some(max);
            true
        }
        _ => false,
    }
}

/// In `reject` mode, an ask over the lane's output-token cap is refused (`cap` mode rewrites it).
fn output_tokens(lane: Lane<'_>, route: Route, seen: &Facts<'_>) -> Result<(), ApiError> {
    let Some(cap) = lane.config.max_output_tokens.filter(|_| seen.json) else {
        return Ok(());
    };
    if !matches!(route, Route::Chat | Route::Completions)
        || lane.config.output_tokens_mode != OutputTokensMode::Reject
    {
        return Ok(());
    }
    match seen.max_tokens {
        Some((field, n)) if n > cap => Err(ApiError::bad_request(
            ErrorCode::MaxTokensTooLarge,
            Some(field),
            format!("`{field}` is {n}, over this lane's limit of {cap}"),
        )),
        _ => Ok(()),
    }
}
