//! The request's header fields the steps read: the lane and deadline a client asks for, who the
//! client is, the body's type and declared length, and whether it waits for `100 Continue`.
//! Found in one pass over the map, not one hashed look-up each; the first value of a field
//! counts, as `HeaderMap::get` gives it.

use axum::http::{HeaderMap, HeaderValue};

use crate::headers;

#[derive(Default)]
pub(super) struct Asked<'a> {
    /// `x-headroom-lane`.
    pub(super) lane: Option<&'a HeaderValue>,
    /// `x-headroom-timeout-ms`.
    pub(super) timeout: Option<&'a HeaderValue>,
    pub(super) authorization: Option<&'a HeaderValue>,
    /// `x-headroom-client`.
    pub(super) client: Option<&'a HeaderValue>,
    pub(super) content_type: Option<&'a HeaderValue>,
    pub(super) content_length: Option<&'a HeaderValue>,
    pub(super) expect: Option<&'a HeaderValue>,
}

impl<'a> Asked<'a> {
    pub(super) fn of(headers: &'a HeaderMap) -> Asked<'a> {
        let mut asked = Asked::default();
        for (name, value) in headers {
            let slot = match name.as_str() {
                "content-type" => &mut asked.content_type,
                "content-length" => &mut asked.content_length,
                "authorization" => &mut asked.authorization,
                "expect" => &mut asked.expect,
                headers::LANE => &mut asked.lane,
                headers::TIMEOUT => &mut asked.timeout,
                headers::CLIENT => &mut asked.client,
                _ => continue,
            };
            slot.get_or_insert(value);
        }
        asked
    }

    /// The body's media type as sent (empty when there is none, or it is not text).
    pub(super) fn content_type(&self) -> &'a str {
        self.content_type
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    /// Whether the client waits for `100 Continue` before it sends the body.
    pub(super) fn expects_continue(&self) -> bool {
        self.expect
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
    }

    /// Who the client is, for the early-retry watch: its key, else its own id.
    pub(super) fn client_id(&self) -> Option<&'a HeaderValue> {
        self.authorization.or(self.client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_value_of_each_field_is_found_whatever_the_case_sent() {
        let mut h = HeaderMap::new();
        h.append("Content-Type", HeaderValue::from_static("application/json"));
        h.append("X-Headroom-Lane", HeaderValue::from_static("a"));
        h.append("x-headroom-lane", HeaderValue::from_static("b"));
        h.append("x-headroom-client", HeaderValue::from_static("me"));
        h.append("x-other", HeaderValue::from_static("z"));
        let asked = Asked::of(&h);
        assert_eq!(asked.content_type(), "application/json");
        assert_eq!(asked.lane.unwrap(), "a");
        assert_eq!(asked.client_id().unwrap(), "me");
        assert!(asked.timeout.is_none() && asked.content_length.is_none());
        h.insert("authorization", HeaderValue::from_static("Bearer k"));
        assert_eq!(Asked::of(&h).client_id().unwrap(), "Bearer k");
    }
}
