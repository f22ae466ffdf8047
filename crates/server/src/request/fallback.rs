//! The rule-based cleanup answer a lane's policy may give instead of the LLM's when the lane
//! refuses (`fallback`), in the chat completion's shape, streamed or not.

use std::sync::atomic::Ordering;

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use headroom_gate::clean_transcript;
use serde_json::{Value, json};

use crate::body_facts::last_user_text;
use crate::core_state::Core;

/// The `model` of a fallback answer: the rule-based cleanup, not the requested LLM.
pub(super) const FALLBACK_MODEL: &str = "headroom-rule-based-cleanup";

/// The rule-based cleanup answer given instead of the LLM's when a lane's policy falls back.
pub(crate) fn fallback_response(
    s: &Core,
    lane_index: usize,
    request: &Value,
    stream: bool,
) -> Response {
    s.telemetry.fallback(lane_index);
    s.telemetry.lane_outcome(lane_index, "fallback");
    let lane = s.telemetry.lane_name(lane_index);
    let text = clean_transcript(&last_user_text(request));
    // The answer names what produced it, never the LLM the client asked for.
    let model = FALLBACK_MODEL;
    let id = format!(
        "chatcmpl-headroom-{}",
        s.fallback_ids.fetch_add(1, Ordering::Relaxed)
    );
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let completion_tokens = text
        .chars()
        .count()
        .div_ceil(crate::body_facts::CHARS_PER_TOKEN);
    let mut response = if stream {
        let chunk = |delta: Value, finish: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            })
        };
        let events = [
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": text}), Value::Null),
            chunk(json!({}), json!("stop")),
        ];
        let mut body = String::new();
        for e in events {
            body.push_str(&format!("data: {e}\n\n"));
        }
        body.push_str("data: [DONE]\n\n");
        let mut r = Response::new(Body::from(body));
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        r.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    } else {
        axum::Json(json!({
            "id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": completion_tokens, "total_tokens": completion_tokens}
        }))
        .into_response()
    };
    response.headers_mut().insert(
        crate::headers::FALLBACK,
        HeaderValue::from_static("rule-based-cleanup"),
    );
    response.headers_mut().insert(
        crate::headers::LANE,
        HeaderValue::from_str(lane).unwrap_or(HeaderValue::from_static("?")),
    );
    response
}
