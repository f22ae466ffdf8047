//! Lane choice: which lanes serve the route (and the one a client names with `x-headroom-lane`)
//! before the body is read, and the lane for the request once its facts are known.

use axum::http::{HeaderValue, StatusCode};

use super::{Facts, Lane, Route};
use crate::error::{ApiError, ErrorCode};
use crate::headers::LANE as LANE_HEADER;
use crate::live_config::{LaneConfig, ServeConfig};

/// The lanes that serve a route, and the one the client named, if any.
pub(super) struct Targets<'a> {
    pub(super) lanes: Vec<(usize, &'a LaneConfig)>,
    pub(super) named: Option<usize>,
}

/// Lanes serving `route`; 404 when none does, 400 when the client names one that does not.
pub(super) fn candidates<'a>(
    config: &'a ServeConfig,
    route: Route,
    asked: Option<&HeaderValue>,
) -> Result<Targets<'a>, ApiError> {
    let lanes: Vec<(usize, &LaneConfig)> = config
        .lanes
        .iter()
        .enumerate()
        .filter(|(_, l)| l.paths.iter().any(|p| p == route.path()))
        .collect();
    if lanes.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::UnknownRoute,
            format!("no lane serves {}", route.path()),
        )
        .closing());
    }
    let named = match asked {
        None => None,
        Some(v) => {
            let name = v.to_str().unwrap_or("");
            match lanes.iter().find(|(_, l)| l.spec.name == name) {
                Some((i, _)) => Some(*i),
                None => {
                    return Err(ApiError::bad_request(
                        ErrorCode::UnknownLane,
                        Some(LANE_HEADER),
                        format!("no lane named `{name}` serves {}", route.path()),
                    )
                    .closing());
                }
            }
        }
    };
    Ok(Targets { lanes, named })
}

impl Targets<'_> {
    /// The largest value of a lane setting that could apply: the named lane's, or the maximum over
    /// the candidates.
    pub(super) fn widest<T: Ord + Default + Copy>(&self, get: impl Fn(&LaneConfig) -> T) -> T {
        match self.named {
            Some(i) => self
                .lanes
                .iter()
                .find(|(j, _)| *j == i)
                .map(|(_, l)| get(l))
                .unwrap_or_default(),
            None => self
                .lanes
                .iter()
                .map(|(_, l)| get(l))
                .max()
                .unwrap_or_default(),
        }
    }
}

fn model_matches(patterns: &[String], model: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => model.starts_with(prefix),
        None => p == model,
    })
}

/// Picks the lane for a request, after the body has been read.
pub(super) fn choose<'a>(
    targets: &Targets<'a>,
    route: Route,
    seen: &Facts<'_>,
) -> Result<Lane<'a>, ApiError> {
    let lanes = &targets.lanes;
    let lane = |&(index, config): &(usize, &'a LaneConfig)| Lane { index, config };
    if let Some(i) = targets.named {
        return Ok(lanes
            .iter()
            .find(|(j, _)| *j == i)
            .map(lane)
            .expect("named lane was checked"));
    }
    if route == Route::Chat
        && seen.has_audio
        && let Some(l) = lanes.iter().find(|(_, l)| l.chat_audio)
    {
        return Ok(lane(l));
    }
    if let Some(model) = &seen.model
        && let Some(l) = lanes.iter().find(|(_, l)| model_matches(&l.models, model))
    {
        return Ok(lane(l));
    }
    lanes
        .iter()
        .find(|(_, l)| l.models.is_empty() && !(l.chat_audio && !seen.has_audio && lanes.len() > 1))
        .or_else(|| lanes.iter().find(|(_, l)| l.models.is_empty()))
        .map(lane)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                ErrorCode::ModelNotFound,
                format!(
                    "no lane serves model `{}` on {}",
                    seen.model.as_deref().unwrap_or(""),
                    route.path()
                ),
            )
            .with_param(Some("model"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_patterns() {
        let p = vec!["whisper-*".to_string(), "exact".to_string()];
        assert!(model_matches(&p, "whisper-large-v3"));
        assert!(model_matches(&p, "exact"));
        assert!(!model_matches(&p, "exactly"));
    }
}
