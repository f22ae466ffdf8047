//! Which refused clients come back before their Retry-After: for clients the gateway can tell
//! apart (a Bearer key, or an `x-headroom-client` header), it remembers until when each was told
//! to wait, per lane, and counts requests that arrive earlier (`headroom_early_retries_total`),
//! so `headroom doctor --metrics` can say when Retry-After is ignored. Memory is bounded: at
//! most [`MAX_CLIENTS`] entries, expired ones dropped first. Only a hash of the identity is kept.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use axum::http::HeaderValue;
use tokio::time::Instant;

/// Entries kept at most.
pub(crate) const MAX_CLIENTS: usize = 4096;
/// Refusal deadlines by (lane, client hash).
#[derive(Debug, Default)]
pub(crate) struct RetryWatch {
    until: Mutex<HashMap<(String, u64), Instant>>,
}

/// A hash of the client's identity (its `Authorization`, else its [`crate::headers::CLIENT`]), when the
/// request carries one.
pub(crate) fn client_of(id: Option<&HeaderValue>) -> Option<u64> {
    let bytes = id?.as_bytes();
    if bytes.is_empty() {
        return None;
    }
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    Some(h.finish())
}

impl RetryWatch {
    /// Remembers that `client` was told to retry on `lane` after `retry_after`.
    pub(crate) fn refused(&self, lane: &str, client: u64, retry_after: Duration, now: Instant) {
        let Ok(mut map) = self.until.lock() else {
            return;
        };
        if map.len() >= MAX_CLIENTS {
            map.retain(|_, t| *t > now);
            if map.len() >= MAX_CLIENTS {
                return;
            }
        }
        map.insert((lane.to_owned(), client), now + retry_after);
    }

    /// True when `client` comes back to `lane` before the Retry-After it was given (the entry
    /// is consumed either way once looked at after its deadline).
    pub(crate) fn arrives_early(&self, lane: &str, client: u64, now: Instant) -> bool {
        let Ok(mut map) = self.until.lock() else {
            return false;
        };
        let key = (lane.to_owned(), client);
        match map.get(&key) {
            Some(t) if *t > now => true,
            Some(_) => {
                map.remove(&key);
                false
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn early_and_late_returns() {
        let w = RetryWatch::default();
        let now = Instant::now();
        w.refused("text", 7, Duration::from_secs(2), now);
        assert!(w.arrives_early("text", 7, now + Duration::from_millis(500)));
        assert!(!w.arrives_early("audio", 7, now));
        assert!(!w.arrives_early("text", 8, now));
        assert!(!w.arrives_early("text", 7, now + Duration::from_secs(3)));
        assert_eq!(client_of(None), None);
        assert_eq!(client_of(Some(&HeaderValue::from_static(""))), None);
        let a = client_of(Some(&HeaderValue::from_static("a")));
        assert!(a.is_some() && a != client_of(Some(&HeaderValue::from_static("b"))));
    }
}
