//! Rewriting the body before it goes upstream: in `cap` mode, an output-token ask over the lane's
//! cap is lowered to it, and a request without one gets the cap added. Anything else is forwarded
//! byte for byte, without building the body into a JSON tree.

use bytes::Bytes;
use serde_json::{Value, json};

use super::{Facts, Lane, Route};
use crate::config::OutputTokensMode;

/// The body to send upstream.
pub(super) fn output_tokens(lane: Lane<'_>, route: Route, seen: &Facts<'_>, body: Bytes) -> Bytes {
    let Some(cap) = lane.config.max_output_tokens.filter(|_| seen.json) else {
        return body;
    };
    if !matches!(route, Route::Chat | Route::Completions)
        || lane.config.output_tokens_mode != OutputTokensMode::Cap
    {
        return body;
    }
    let field = match seen.max_tokens {
        Some((field, n)) if n > cap => field,
        None => "max_tokens",
        Some(_) => return body,
    };
    // Only here is the body built into a tree; validation already parsed it, so this succeeds.
    let Ok(mut v) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    v[field] = json!(cap);
    Bytes::from(v.to_string())
}
