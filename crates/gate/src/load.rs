//! The box's load figure for a load balancer: one number in 0..1 (0 idle, 1 full) and the parts
//! it is made of, computed from a [`GateSnapshot`] alone. The balancer (HAProxy's agent check,
//! Envoy's ORCA header) uses it to send new work to the box with the most room; admission itself
//! stays with each box's gate.
//!
//! - **Lanes:** each lane's utilisation is `(in flight + queued) / (max_inflight + max_queue)`,
//!   and a lane that is yielding to busy audio counts as full (it admits nothing new now). The
//!   lanes' figure is their mean weighted by capacity (`max_inflight + max_queue`), so a large
//!   lane weighs more than a small one, and the busiest lane is kept as its own part.
//! - **Memory:** for each pool the ledger admits on, the share of the pool that is neither free
//!   (as last read) nor clear of outstanding reservations: `1 − (free − unseen reservations) /
//!   total`; the highest pool is the figure. A pool with no usable reading counts as full.
//! - **Audio busy:** any lane that others yield to has work in flight or queued.
//!
//! The box figure is the larger of the lanes' and the memory figure: a box whose lanes are idle
//! but whose memory is spoken for has no room either.

use serde::Serialize;

use crate::admission::GateSnapshot;

/// One lane's share of the figure.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LaneLoad {
    pub name: String,
    pub inflight: usize,
    pub queued: usize,
    /// `max_inflight + max_queue`: the lane's weight in the lanes' figure.
    pub capacity: usize,
    /// 0..1; 1 while the lane yields.
    pub utilization: f64,
    pub yielding: bool,
}

/// The box's load and its parts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoxLoad {
    /// `max(lanes, memory)`, in 0..1.
    pub figure: f64,
    /// Capacity-weighted mean utilisation of the lanes.
    pub lanes: f64,
    /// The busiest lane's utilisation.
    pub busiest_lane: f64,
    /// Memory pressure from the ledger (0 when no lane admits on memory).
    pub memory: f64,
    /// Whether a lane that others yield to (audio) has work.
    pub audio_busy: bool,
    /// Requests waiting in the gateway's queues, all lanes.
    pub queued: usize,
    /// Requests in flight, all lanes.
    pub inflight: usize,
    /// Whether the gate is draining (shutting down).
    pub draining: bool,
    pub parts: Vec<LaneLoad>,
}

impl BoxLoad {
    /// The figure as a weight for a balancer: 100 % for an idle box down to 1 % for a full one
    /// (never 0 %, which a balancer reads as "take this server out").
    pub fn weight_percent(&self) -> u32 {
        let w = ((1.0 - self.figure) * 100.0).round();
        w.clamp(1.0, 100.0) as u32
    }
}

fn clamp01(x: f64) -> f64 {
    if x.is_finite() {
        x.clamp(0.0, 1.0)
    } else {
        1.0
    }
}

/// The load figure of a gate at one instant. `yield_targets` names the lanes that other lanes
/// yield to (their work makes the box "audio busy").
pub fn box_load(snapshot: &GateSnapshot, yield_targets: &[String]) -> BoxLoad {
    let parts: Vec<LaneLoad> = snapshot
        .lanes
        .iter()
        .map(|l| {
            let capacity = l.max_inflight + l.max_queue;
            let used = (l.inflight + l.queued) as f64;
            let utilization = if l.yielding {
                1.0
            } else if capacity == 0 {
                0.0
            } else {
                clamp01(used / capacity as f64)
            };
            LaneLoad {
                name: l.name.clone(),
                inflight: l.inflight,
                queued: l.queued,
                capacity,
                utilization,
                yielding: l.yielding,
            }
        })
        .collect();
    let weight: usize = parts.iter().map(|p| p.capacity.max(1)).sum();
    let lanes = if weight == 0 {
        0.0
    } else {
        parts
            .iter()
            .map(|p| p.utilization * p.capacity.max(1) as f64)
            .sum::<f64>()
            / weight as f64
    };
    let busiest_lane = parts.iter().map(|p| p.utilization).fold(0.0, f64::max);
    let memory = snapshot
        .memory
        .iter()
        .map(|pool| match (pool.total_bytes, pool.free_bytes) {
            (Some(total), Some(free)) if total > 0 => {
                let clear = free.saturating_sub(pool.hidden_bytes) as f64;
                clamp01(1.0 - clear / total as f64)
            }
            _ => 1.0,
        })
        .fold(0.0, f64::max);
    let audio_busy = snapshot
        .lanes
        .iter()
        .filter(|l| yield_targets.iter().any(|t| t == &l.name))
        .any(|l| l.inflight + l.queued > 0);
    BoxLoad {
        figure: clamp01(lanes.max(memory)),
        lanes: clamp01(lanes),
        busiest_lane,
        memory,
        audio_busy,
        queued: parts.iter().map(|p| p.queued).sum(),
        inflight: parts.iter().map(|p| p.inflight).sum(),
        draining: snapshot.draining,
        parts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{LaneSnapshot, PoolSnapshot};
    use crate::lane::Policy;
    use crate::ledger::PoolKind;

    fn lane(name: &str, inflight: usize, queued: usize, max: usize, queue: usize) -> LaneSnapshot {
        LaneSnapshot {
            name: name.into(),
            inflight,
            queued,
            rejected: 0,
            max_inflight: max,
            max_queue: queue,
            priority: 0,
            policy: Policy::Queue,
            admitted: 0,
            completed: 0,
            queue_timeouts: 0,
            cancelled_in_queue: 0,
            mean_service_seconds: None,
            service_rate_per_second: None,
            yielding: false,
            held_by: None,
            upstreams: Vec::new(),
            memory: None,
            waiting_for: None,
        }
    }

    fn snapshot(lanes: Vec<LaneSnapshot>, memory: Vec<PoolSnapshot>) -> GateSnapshot {
        GateSnapshot {
            lanes,
            total_inflight: 0,
            max_inflight_total: None,
            draining: false,
            memory,
        }
    }

    #[test]
    fn lanes_weigh_by_capacity() {
        // text: 2 of 4 slots + 0 of 4 queue = 2/8; audio: 1 of 1 + 1 of 1 = 2/2.
        // Weighted: (0.25 × 8 + 1.0 × 2) / 10 = 0.4.
        let s = snapshot(
            vec![lane("text", 2, 0, 4, 4), lane("audio", 1, 1, 1, 1)],
            vec![],
        );
        let l = box_load(&s, &["audio".to_string()]);
        assert!((l.lanes - 0.4).abs() < 1e-9, "{l:?}");
        assert_eq!(l.busiest_lane, 1.0);
        assert!(l.audio_busy);
        assert_eq!(l.figure, l.lanes);
        // Weight 60 % for a 0.4 box, 1 % (never 0) for a full one.
        assert_eq!(l.weight_percent(), 60);
        let full = snapshot(vec![lane("text", 4, 4, 4, 4)], vec![]);
        assert_eq!(box_load(&full, &[]).weight_percent(), 1);
        let idle = snapshot(vec![lane("text", 0, 0, 4, 4)], vec![]);
        assert_eq!(box_load(&idle, &[]).weight_percent(), 100);
    }

    #[test]
    fn a_yielding_lane_counts_as_full() {
        let mut text = lane("text", 0, 0, 2, 0);
        text.yielding = true;
        let l = box_load(
            &snapshot(vec![text, lane("audio", 0, 0, 2, 0)], vec![]),
            &[],
        );
        // (1.0 × 2 + 0 × 2) / 4.
        assert!((l.lanes - 0.5).abs() < 1e-9, "{l:?}");
    }

    #[test]
    fn memory_counts_unseen_reservations_and_missing_readings() {
        let pool = |free: Option<u64>, hidden: u64| PoolSnapshot {
            device: 0,
            kind: PoolKind::Gpu,
            total_bytes: Some(100),
            free_bytes: free,
            reading_age_seconds: Some(0.1),
            reservations: 1,
            reserved_bytes: hidden,
            hidden_bytes: hidden,
        };
        let idle = vec![lane("audio", 0, 0, 4, 0)];
        // 40 free of 100, 10 of it promised to an admitted job not yet visible: 1 − 30/100.
        let l = box_load(&snapshot(idle.clone(), vec![pool(Some(40), 10)]), &[]);
        assert!((l.memory - 0.7).abs() < 1e-9, "{l:?}");
        assert_eq!(l.figure, l.memory, "memory dominates idle lanes");
        // No reading: no room can be promised.
        let l = box_load(&snapshot(idle, vec![pool(None, 0)]), &[]);
        assert_eq!(l.memory, 1.0);
    }
}
