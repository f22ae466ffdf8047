//! Upstream choice: which of a lane's upstreams takes an admitted request. The least loaded one
//! by the gateway's own in-flight count, then by the engine's reported queue, among those whose
//! engine metrics admit new work.

use std::collections::HashMap;

use tokio::time::Instant;

use crate::lane::LaneSpec;
use crate::pressure::EngineLoad;

/// Index of the upstream to use, or `None` when every upstream's engine is saturated (or its
/// metrics are stale and the lane fails closed).
pub(crate) fn choose(
    spec: &LaneSpec,
    inflight: &[usize],
    engine: &HashMap<String, EngineLoad>,
    now: Instant,
) -> Option<usize> {
    let candidates = (0..spec.upstreams.len()).filter(|&u| match &spec.engine {
        None => true,
        Some(limits) => limits.admits(engine.get(&spec.upstreams[u]), now),
    });
    let waiting = |u: usize| {
        engine
            .get(&spec.upstreams[u])
            .and_then(|l| l.waiting)
            .unwrap_or(0.0)
    };
    candidates.min_by(|&a, &b| {
        inflight[a]
            .cmp(&inflight[b])
            .then(waiting(a).total_cmp(&waiting(b)))
            .then(a.cmp(&b))
    })
}
