//! OpenAI's error shape `{"error":{"message","type","param","code"}}`, the one place HTTP status
//! codes are chosen for gate refusals, and the conversion of upstream errors in other shapes.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use headroom_gate::{RejectReason, Rejection};
use serde_json::{Value, json};

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
    pub code: String,
    pub retry_after: Option<Duration>,
    /// Ask the client to close the connection (the request body was left unread).
    pub close: bool,
    /// A gate refusal answered 429 (the lane is full): `[balancer] overload_status` may turn
    /// it into a 503 for a balancer that can only retry 503 (see [`ApiError::with_overload_status`]).
    pub lane_full: bool,
}

/// Marks a response made from a lane-full refusal, carrying the error to answer it again with
/// another status (`[balancer] overload_status`).
#[derive(Debug, Clone)]
pub(crate) struct LaneFull(pub ApiError);

impl ApiError {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: code.as_str().to_string(),
            retry_after: None,
            close: false,
            lane_full: false,
        }
    }

    /// Marks the answer as given before the request body was read, so the connection closes.
    pub fn closing(mut self) -> ApiError {
        self.close = true;
        self
    }

    pub fn bad_request(
        code: ErrorCode,
        param: Option<&str>,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, message).with_param(param)
    }

    pub fn with_param(mut self, param: Option<&str>) -> ApiError {
        self.param = param.map(String::from);
        self
    }

    /// OpenAI's `type` for a status.
    pub fn error_type(status: StatusCode) -> &'static str {
        match status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": Self::error_type(self.status),
                "param": self.param,
                "code": self.code,
            }
        })
    }

    /// The error as one SSE event, for failures after a stream has started.
    pub fn sse_event(&self) -> String {
        format!("data: {}\n\n", self.body())
    }

    /// A gate refusal: 429 for a full queue or saturation, 503 when the queue wait ran out, the
    /// gateway is shutting down, or a memory need cannot be met by waiting (no admitted job's
    /// end would make room). All carry Retry-After. A request held for memory until its queue
    /// wait ran out says so, with the memory code and figures.
    pub fn from_rejection(r: &Rejection) -> ApiError {
        let never = r.memory.as_ref().is_some_and(|m| m.never_fits());
        let status = match r.reason {
            RejectReason::QueueTimeout | RejectReason::ShuttingDown => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ if r.queued_for.is_some() || never => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::TOO_MANY_REQUESTS,
        };
        let mut message = format!("lane `{}`: {}", r.lane, r.reason.describe());
        if let (Some(waited), Some(_)) = (r.queued_for, &r.memory) {
            message.push_str(&format!(
                "; it waited {:.1} s in the queue for memory",
                waited.as_secs_f64()
            ));
        }
        if let Some(m) = &r.memory {
            message.push_str(&memory_figures(m));
        }
        ApiError {
            status,
            message,
            param: None,
            code: ErrorCode::of_rejection(r.reason).as_str().to_string(),
            retry_after: Some(r.retry_after),
            close: false,
            lane_full: status == StatusCode::TOO_MANY_REQUESTS,
        }
    }

    /// A lane-full refusal answered with `status` instead of 429 (503 behind a balancer that
    /// retries 503 on another box but not 429, like HAProxy 2.6). Code, message and
    /// Retry-After stay; any other error is returned unchanged.
    pub fn with_overload_status(mut self, status: StatusCode) -> ApiError {
        if self.lane_full {
            self.status = status;
        }
        self
    }

    /// A running request stopped because a lane it yields to admitted work.
    pub fn preempted(lane: &str) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Preempted,
            format!(
                "lane `{lane}` stopped this request to make room for higher-priority work; retry shortly"
            ),
        );
        e.retry_after = Some(Duration::from_secs(1));
        e
    }

    /// A request still in flight when the gateway's `shutdown_grace` ran out.
    pub fn cut() -> ApiError {
        let mut e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::ShuttingDown,
            "the gateway is shutting down and its shutdown_grace ran out before this request finished; retry",
        )
        .closing();
        e.retry_after = Some(Duration::from_secs(1));
        e
    }

    pub fn deadline(lane: &str, timeout: Duration) -> ApiError {
        ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::Deadline,
            format!(
                "lane `{lane}`: the request did not finish within its deadline of {} ms",
                timeout.as_millis()
            ),
        )
    }
}

/// The figures of a memory refusal, in words and in bytes.
fn memory_figures(m: &headroom_gate::MemoryShortfall) -> String {
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    match m.free_bytes {
        None => format!(
            " (device {}: no current memory reading, the probe failed or is late; need_bytes={} margin_bytes={})",
            m.device, m.need_bytes, m.margin_bytes
        ),
        Some(free) => {
            let never = match m.ceiling_bytes.filter(|_| m.never_fits()) {
                Some(c) => format!(
                    ", and at most {:.0} MiB would be free once every admitted job has ended: it cannot be admitted until memory outside the lanes' jobs is given back",
                    mib(c)
                ),
                None => String::new(),
            };
            format!(
                " (device {}: {:.0} MiB free, {:.0} MiB reserved by admitted jobs not yet in the reading, this job needs {:.0} MiB + {:.0} MiB margin{never}; free_bytes={} reserved_bytes={} need_bytes={} margin_bytes={}{})",
                m.device,
                mib(free),
                mib(m.reserved_bytes),
                mib(m.need_bytes),
                mib(m.margin_bytes),
                free,
                m.reserved_bytes,
                m.need_bytes,
                m.margin_bytes,
                m.ceiling_bytes
                    .map(|c| format!(" ceiling_bytes={c}"))
                    .unwrap_or_default()
            )
        }
    }
}

/// Retry-After in whole seconds (at least 1) and retry-after-ms (at least 1).
pub(crate) fn retry_after_values(d: Duration) -> (u64, u64) {
    let ms = (d.as_millis() as u64).max(1);
    (ms.div_ceil(1000).max(1), ms)
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.lane_full {
            response.extensions_mut().insert(LaneFull(self.clone()));
        }
        if let Some(d) = self.retry_after {
            let (secs, ms) = retry_after_values(d);
            let headers = response.headers_mut();
            headers.insert(crate::headers::RETRY_AFTER, HeaderValue::from(secs));
            headers.insert(crate::headers::RETRY_AFTER_MS, HeaderValue::from(ms));
        }
        if self.close {
            response.headers_mut().insert(
                axum::http::header::CONNECTION,
                HeaderValue::from_static("close"),
            );
        }
        response
    }
}

/// Every `code` the gateway itself answers with: its own refusals and errors, and the gate's
/// refusals ([`ErrorCode::of_rejection`]). An upstream's error keeps the upstream's own code
/// (a string), so [`ApiError::code`] stays a string; metric labels take a code only from the
/// gateway's own ([`code_label`]): an upstream's codes count as `other`, so an upstream cannot
/// grow `/metrics` without bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    AudioTooLong,
    BackendUnavailable,
    BodyMemoryFull,
    BodyReadError,
    BodyTimeout,
    BodyTooLarge,
    Deadline,
    HeadersTooLarge,
    InputTooLong,
    InvalidApiKey,
    InvalidAudioEncoding,
    InvalidJson,
    InvalidMultipart,
    InvalidType,
    InvalidValue,
    JsonTooDeep,
    MaxTokensTooLarge,
    MethodNotAllowed,
    MissingField,
    MissingFile,
    MissingHost,
    MissingModel,
    ModelNotFound,
    Preempted,
    ShuttingDown,
    UnknownLane,
    UnknownRoute,
    UnsupportedAudio,
    UnsupportedMediaType,
    UpstreamError,
    UpstreamStreamError,
    UpstreamUnreachable,
    // The gate's refusals (`headroom_gate::RejectReason::code`; `shutting_down` is above).
    LaneQueueFull,
    LaneSaturated,
    GpuMemory,
    HostMemory,
    EngineSaturated,
    LaneYielding,
    DeviceSaturated,
    QueueTimeout,
}

impl ErrorCode {
    /// The gateway's own codes (not the gate's): the ones metric labels keep.
    pub const OWN: [ErrorCode; 32] = [
        ErrorCode::AudioTooLong,
        ErrorCode::BackendUnavailable,
        ErrorCode::BodyMemoryFull,
        ErrorCode::BodyReadError,
        ErrorCode::BodyTimeout,
        ErrorCode::BodyTooLarge,
        ErrorCode::Deadline,
        ErrorCode::HeadersTooLarge,
        ErrorCode::InputTooLong,
        ErrorCode::InvalidApiKey,
        ErrorCode::InvalidAudioEncoding,
        ErrorCode::InvalidJson,
        ErrorCode::InvalidMultipart,
        ErrorCode::InvalidType,
        ErrorCode::InvalidValue,
        ErrorCode::JsonTooDeep,
        ErrorCode::MaxTokensTooLarge,
        ErrorCode::MethodNotAllowed,
        ErrorCode::MissingField,
        ErrorCode::MissingFile,
        ErrorCode::MissingHost,
        ErrorCode::MissingModel,
        ErrorCode::ModelNotFound,
        ErrorCode::Preempted,
        ErrorCode::ShuttingDown,
        ErrorCode::UnknownLane,
        ErrorCode::UnknownRoute,
        ErrorCode::UnsupportedAudio,
        ErrorCode::UnsupportedMediaType,
        ErrorCode::UpstreamError,
        ErrorCode::UpstreamStreamError,
        ErrorCode::UpstreamUnreachable,
    ];

    /// The `code` string the client reads.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::AudioTooLong => "audio_too_long",
            ErrorCode::BackendUnavailable => "backend_unavailable",
            ErrorCode::BodyMemoryFull => "body_memory_full",
            ErrorCode::BodyReadError => "body_read_error",
            ErrorCode::BodyTimeout => "body_timeout",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::Deadline => "deadline",
            ErrorCode::HeadersTooLarge => "headers_too_large",
            ErrorCode::InputTooLong => "input_too_long",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::InvalidAudioEncoding => "invalid_audio_encoding",
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidMultipart => "invalid_multipart",
            ErrorCode::InvalidType => "invalid_type",
            ErrorCode::InvalidValue => "invalid_value",
            ErrorCode::JsonTooDeep => "json_too_deep",
            ErrorCode::MaxTokensTooLarge => "max_tokens_too_large",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::MissingField => "missing_field",
            ErrorCode::MissingFile => "missing_file",
            ErrorCode::MissingHost => "missing_host",
            ErrorCode::MissingModel => "missing_model",
            ErrorCode::ModelNotFound => "model_not_found",
            ErrorCode::Preempted => "preempted",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::UnknownLane => "unknown_lane",
            ErrorCode::UnknownRoute => "unknown_route",
            ErrorCode::UnsupportedAudio => "unsupported_audio",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::UpstreamError => "upstream_error",
            ErrorCode::UpstreamStreamError => "upstream_stream_error",
            ErrorCode::UpstreamUnreachable => "upstream_unreachable",
            ErrorCode::LaneQueueFull => "lane_queue_full",
            ErrorCode::LaneSaturated => "lane_saturated",
            ErrorCode::GpuMemory => "gpu_memory",
            ErrorCode::HostMemory => "host_memory",
            ErrorCode::EngineSaturated => "engine_saturated",
            ErrorCode::LaneYielding => "lane_yielding",
            ErrorCode::DeviceSaturated => "device_saturated",
            ErrorCode::QueueTimeout => "queue_timeout",
        }
    }

    /// The gateway's own code spelled `code`, if it is one.
    pub fn own(code: &str) -> Option<ErrorCode> {
        ErrorCode::OWN.into_iter().find(|c| c.as_str() == code)
    }

    /// The code of a gate refusal.
    pub fn of_rejection(reason: RejectReason) -> ErrorCode {
        match reason {
            RejectReason::QueueFull => ErrorCode::LaneQueueFull,
            RejectReason::Saturated => ErrorCode::LaneSaturated,
            RejectReason::GpuMemory => ErrorCode::GpuMemory,
            RejectReason::HostMemory => ErrorCode::HostMemory,
            RejectReason::EngineSaturated => ErrorCode::EngineSaturated,
            RejectReason::Yielding => ErrorCode::LaneYielding,
            RejectReason::DeviceSaturated => ErrorCode::DeviceSaturated,
            RejectReason::QueueTimeout => ErrorCode::QueueTimeout,
            RejectReason::ShuttingDown => ErrorCode::ShuttingDown,
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `code` as a metric label: itself when it is one of the gateway's own, else `other`.
pub(crate) fn code_label(code: &str) -> &'static str {
    ErrorCode::own(code).map_or("other", ErrorCode::as_str)
}

/// Turns an upstream error body of any shape into OpenAI's, keeping the upstream status.
pub(crate) fn from_upstream(status: StatusCode, body: &[u8]) -> ApiError {
    let text = String::from_utf8_lossy(body);
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let pick = |v: &Value| -> Option<(String, Option<String>, Option<String>)> {
        let e = v.get("error")?;
        match e {
            Value::String(s) => Some((s.clone(), None, None)),
            Value::Object(_) => {
                let message = e.get("message").and_then(Value::as_str)?.to_string();
                let param = e.get("param").and_then(Value::as_str).map(String::from);
                let code = match e.get("code") {
                    Some(Value::String(s)) => Some(s.clone()),
                    _ => e.get("type").and_then(Value::as_str).map(String::from),
                };
                Some((message, param, code))
            }
            _ => None,
        }
    };
    let (message, param, code) = match &parsed {
        Some(v) => pick(v)
            .or_else(|| {
                let detail = v.get("detail")?;
                pick(detail).or_else(|| {
                    Some((
                        match detail {
                            Value::String(s) => s.clone(),
                            other => other.to_string(),
                        },
                        None,
                        None,
                    ))
                })
            })
            .unwrap_or_else(|| (truncate(&v.to_string()), None, None)),
        None => (truncate(text.trim()), None, None),
    };
    let message = if message.is_empty() {
        format!(
            "upstream answered {} {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        )
    } else {
        message
    };
    ApiError {
        status,
        message,
        param,
        code: code.unwrap_or_else(|| ErrorCode::UpstreamError.as_str().to_string()),
        retry_after: None,
        close: false,
        lane_full: false,
    }
}

/// The Retry-After of an upstream's refusal passed on to the client: a 429 or 503 always carries
/// one (an engine that is loading its model answers 503 without it: llama.cpp's "Loading model"),
/// the upstream's own delay in seconds where it gave one, within [1 s, 10 min], else 1 s (an
/// HTTP-date is not followed). Other statuses carry none: they are not worth a retry as they are.
pub(crate) fn upstream_retry_after(status: StatusCode, sent: Option<&[u8]>) -> Option<Duration> {
    const DEFAULT: Duration = Duration::from_secs(1);
    const MAX: Duration = Duration::from_secs(600);
    if status != StatusCode::TOO_MANY_REQUESTS && status != StatusCode::SERVICE_UNAVAILABLE {
        return None;
    }
    let secs = sent
        .and_then(|v| std::str::from_utf8(v).ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    Some(secs.map_or(DEFAULT, |s| Duration::from_secs(s).clamp(DEFAULT, MAX)))
}

fn truncate(s: &str) -> String {
    const MAX: usize = 1000;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refusal(reason: RejectReason) -> Rejection {
        Rejection {
            lane: "text".into(),
            reason,
            retry_after: Duration::from_millis(2500),
            fallback: false,
            memory: None,
            queued_for: None,
        }
    }

    #[test]
    fn overload_status_turns_only_lane_full_refusals_into_503() {
        let full = ApiError::from_rejection(&refusal(RejectReason::QueueFull));
        assert_eq!(full.status, StatusCode::TOO_MANY_REQUESTS);
        let r = full
            .with_overload_status(StatusCode::SERVICE_UNAVAILABLE)
            .into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()["retry-after"], "3");
        assert_eq!(r.headers()["retry-after-ms"], "2500");
        // A queue timeout is a 503 already; an upstream's own 429 is not the gate's to change.
        let timeout = ApiError::from_rejection(&refusal(RejectReason::QueueTimeout));
        assert!(!timeout.lane_full);
        let upstream = from_upstream(StatusCode::TOO_MANY_REQUESTS, b"{}");
        assert_eq!(
            upstream
                .with_overload_status(StatusCode::SERVICE_UNAVAILABLE)
                .status,
            StatusCode::TOO_MANY_REQUESTS
        );
        // The body follows the status: a 503 is a server_error to OpenAI's client.
        let e = ApiError::from_rejection(&refusal(RejectReason::Saturated))
            .with_overload_status(StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.body()["error"]["type"], "server_error");
        assert_eq!(e.body()["error"]["code"], "lane_saturated");
    }

    #[test]
    fn memory_refusals_say_memory_whether_at_once_after_waiting_or_never() {
        let mib = 1024 * 1024;
        let shortfall = |free: u64, ceiling: u64| headroom_gate::MemoryShortfall {
            device: 0,
            free_bytes: Some(free * mib),
            reserved_bytes: 0,
            need_bytes: 182 * mib,
            margin_bytes: 128 * mib,
            ceiling_bytes: Some(ceiling * mib),
        };
        let memory = |free, ceiling, queued_for| Rejection {
            memory: Some(shortfall(free, ceiling)),
            queued_for,
            ..refusal(RejectReason::HostMemory)
        };
        // Does not fit now, would once a running job ends, the lane does not queue: 429.
        let now = ApiError::from_rejection(&memory(222, 400, None));
        assert_eq!(now.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(now.code, "host_memory");
        // Held for memory until its queue wait ran out: 503, still the memory code and figures.
        let waited = ApiError::from_rejection(&memory(222, 400, Some(Duration::from_secs(30))));
        assert_eq!(waited.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(waited.code, "host_memory");
        assert!(
            waited
                .message
                .contains("waited 30.0 s in the queue for memory")
                && waited.message.contains("need_bytes=190840832")
                && !waited.message.contains("waited in the queue too long"),
            "{}",
            waited.message
        );
        // No admitted job's end can make room: 503 at once, saying so.
        let never = ApiError::from_rejection(&memory(222, 222, None));
        assert_eq!(never.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            never
                .message
                .contains("at most 222 MiB would be free once every admitted job has ended"),
            "{}",
            never.message
        );
        assert!(!never.lane_full, "a balancer must not retry it as overload");
    }

    #[test]
    fn upstream_errors_of_other_shapes_become_openai_shape() {
        let fastapi = from_upstream(
            StatusCode::UNPROCESSABLE_ENTITY,
            br#"{"detail":"bad file"}"#,
        );
        assert_eq!(fastapi.status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(fastapi.message, "bad file");
        let wrapped = from_upstream(
            StatusCode::BAD_REQUEST,
            br#"{"detail":{"error":{"message":"no audio","type":"invalid_request_error"}}}"#,
        );
        assert_eq!(wrapped.message, "no audio");
        let plain = from_upstream(StatusCode::INTERNAL_SERVER_ERROR, b"Internal Server Error");
        assert_eq!(plain.message, "Internal Server Error");
        assert_eq!(plain.body()["error"]["type"], "server_error");
        let llama = from_upstream(
            StatusCode::BAD_REQUEST,
            br#"{"error":{"code":400,"message":"too long","type":"exceed_context_size_error"}}"#,
        );
        assert_eq!(llama.message, "too long");
        assert_eq!(llama.code, "exceed_context_size_error");
        let empty = from_upstream(StatusCode::BAD_GATEWAY, b"");
        assert!(empty.message.contains("502"));
        let tgi = from_upstream(
            StatusCode::TOO_MANY_REQUESTS,
            br#"{"error":"Model is overloaded","error_type":"overloaded"}"#,
        );
        assert_eq!(tgi.message, "Model is overloaded");
    }

    #[test]
    fn only_the_gateways_own_codes_become_metric_labels() {
        assert_eq!(code_label("body_too_large"), "body_too_large");
        let upstream = from_upstream(
            StatusCode::BAD_REQUEST,
            br#"{"error":{"message":"x","code":"an_engine_code_7"}}"#,
        );
        assert_eq!(
            upstream.code, "an_engine_code_7",
            "the client still reads it"
        );
        assert_eq!(code_label(&upstream.code), "other");
        // Every code the docs' table names is one of ours.
        let docs = include_str!("../../../docs/serve.md");
        for line in docs
            .lines()
            .filter(|l| l.starts_with("| ") && l.contains(" | `"))
        {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            if let Some(code) = cells.get(3).and_then(|c| c.strip_prefix('`')) {
                for code in code.split(['`', '/', ' ']).filter(|c| !c.is_empty()) {
                    if code.chars().all(|c| c.is_ascii_lowercase() || c == '_') && code != "code" {
                        assert!(
                            ErrorCode::own(code).is_some(),
                            "{code} is missing from ErrorCode"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn gate_refusal_codes_are_the_gates_own() {
        use RejectReason::*;
        for r in [
            QueueFull,
            Saturated,
            GpuMemory,
            HostMemory,
            EngineSaturated,
            Yielding,
            DeviceSaturated,
            QueueTimeout,
            ShuttingDown,
        ] {
            assert_eq!(ErrorCode::of_rejection(r).as_str(), r.code());
        }
    }

    #[test]
    fn an_upstream_429_or_503_is_passed_on_with_a_retry_after() {
        let ra = |status: u16, sent: Option<&str>| {
            upstream_retry_after(
                StatusCode::from_u16(status).unwrap(),
                sent.map(str::as_bytes),
            )
        };
        // llama.cpp's "Loading model" 503 has none: the gateway's floor.
        assert_eq!(ra(503, None), Some(Duration::from_secs(1)));
        assert_eq!(ra(429, Some("7")), Some(Duration::from_secs(7)));
        assert_eq!(ra(503, Some(" 0 ")), Some(Duration::from_secs(1)));
        assert_eq!(ra(503, Some("86400")), Some(Duration::from_secs(600)));
        assert_eq!(
            ra(503, Some("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::from_secs(1))
        );
        assert_eq!(ra(500, Some("5")), None);
        assert_eq!(ra(400, None), None);
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_values(Duration::from_millis(1)), (1, 1));
        assert_eq!(retry_after_values(Duration::from_millis(1500)), (2, 1500));
        assert_eq!(retry_after_values(Duration::ZERO), (1, 1));
    }
}
