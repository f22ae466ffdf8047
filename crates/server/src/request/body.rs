//! Reading the request body: no more than the largest cap that could apply (each lane checks its
//! own cap later), refused early when `content-length` already says it is too big, and bounded in
//! time so a slow upload cannot hold the connection longer than the request could run.

use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use bytes::Bytes;

use super::lane::Targets;
use crate::error::ApiError;

/// 413 naming the limit.
pub(super) fn too_large(limit: u64) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("request body is larger than this lane's limit of {limit} bytes"),
    )
}

/// Reads the whole body under the widest cap and deadline of the candidate lanes.
pub(super) async fn read(
    body: Body,
    headers: &HeaderMap,
    targets: &Targets<'_>,
) -> Result<Bytes, ApiError> {
    let read_cap = targets.widest(|l| l.max_body_bytes);
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > read_cap
    {
        return Err(too_large(read_cap).closing());
    }
    let read_deadline = targets.widest(|l| l.spec.request_timeout);
    let read = axum::body::to_bytes(body, read_cap.min(usize::MAX as u64) as usize);
    tokio::time::timeout(read_deadline, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                "the request body did not arrive in time",
            )
            .closing()
        })?
        .map_err(|e| {
            let text = e.to_string();
            if text.contains("length limit") {
                too_large(read_cap).closing()
            } else {
                ApiError::bad_request(
                    "body_read_error",
                    None,
                    "the request body could not be read",
                )
                .closing()
            }
        })
}
