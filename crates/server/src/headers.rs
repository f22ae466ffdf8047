//! Every HTTP header name the gateway itself reads or writes, in one place: the `x-headroom-*`
//! fields a client may send or gets back, Retry-After in its two forms, and the ORCA load report.

/// The prefix of the gateway's own fields; a client's never cross to the upstream, and an
/// upstream's give way to the gateway's on the way back.
pub(crate) const OWN_PREFIX: &str = "x-headroom-";
/// A client may send it to shorten its own deadline (milliseconds).
pub(crate) const TIMEOUT: &str = "x-headroom-timeout-ms";
/// The lane a request wants; on a response, the lane that served it.
pub(crate) const LANE: &str = "x-headroom-lane";
/// Names a client when it has no `Authorization` (for early-retry accounting).
pub(crate) const CLIENT: &str = "x-headroom-client";
/// Marks a fallback answer (the rule-based cleanup).
pub(crate) const FALLBACK: &str = "x-headroom-fallback";
/// How long the request waited in its lane's queue (milliseconds).
pub(crate) const QUEUE_WAIT: &str = "x-headroom-queue-wait-ms";
/// How long a preempted request waited for its upstream to settle (milliseconds).
pub(crate) const PREEMPT_SETTLE: &str = "x-headroom-preempt-settle-ms";
/// The audio length the gateway measured or estimated (seconds).
pub(crate) const AUDIO_DURATION: &str = "x-headroom-audio-duration";
/// Retry-After in whole seconds (RFC 9110).
pub(crate) const RETRY_AFTER: &str = "retry-after";
/// Retry-After in milliseconds (OpenAI's clients read it).
pub(crate) const RETRY_AFTER_MS: &str = "retry-after-ms";
/// The response header Envoy reads ORCA load reports from.
pub(crate) const ORCA: &str = "endpoint-load-metrics";
