//! The memory monitor: each backend's current memory into the report, and drift past its peak.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use headroom_server::admin_box::{BackendState, BoxProvider};

use crate::budget::mib;
use crate::ctx::Ctx;

/// Whether `now` is past the measured `peak` by more than `margin` (a fraction of the peak).
/// A backend never measured (peak 0) never drifts.
pub(crate) fn drifted(now: u64, peak: u64, margin: f64) -> bool {
    peak > 0 && now as f64 > peak as f64 * (1.0 + margin)
}

/// Every 250 ms: each backend's current memory into the report, and a log line the first time
/// one grows past its measured peak by more than the drift margin.
pub(crate) async fn monitor(ctx: Arc<Ctx>) {
    let mut reported: BTreeMap<String, bool> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        if let Some(c) = &ctx.enforced {
            ctx.status.lock().enforce = c.report();
        }
        let rows: Vec<(String, Option<u32>, u64, BackendState)> = ctx
            .status
            .report()
            .backends
            .iter()
            .map(|b| (b.name.clone(), b.pid, b.peak_bytes, b.state))
            .collect();
        for (name, pid, peak, state) in rows {
            let Some(pid) = pid else { continue };
            let now = ctx.meter.now_bytes(pid);
            let drifted =
                state == BackendState::Ready && drifted(now, peak, ctx.config.drift_margin);
            if drifted && !reported.get(&name).copied().unwrap_or(false) {
                ctx.say(&format!(
                    "up: [{name}] warning: memory {} is past its measured peak {} by more than {:.0} %: the measured residency drifted",
                    mib(now),
                    mib(peak),
                    ctx.config.drift_margin * 100.0
                ));
                reported.insert(name.clone(), true);
            }
            ctx.status.update(&name, |r| {
                r.current_bytes = now;
                if drifted {
                    r.drifted = true;
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::drifted;

    const MIB: u64 = 1024 * 1024;

    #[test]
    fn drift_is_growth_past_the_peak_by_more_than_the_margin() {
        // Peak 200 MiB, margin 10 %: 220 MiB is the line.
        assert!(!drifted(150 * MIB, 200 * MIB, 0.1));
        assert!(!drifted(220 * MIB, 200 * MIB, 0.1));
        assert!(drifted(221 * MIB, 200 * MIB, 0.1));
        assert!(drifted(201 * MIB, 200 * MIB, 0.0));
        assert!(!drifted(900 * MIB, 0, 0.1), "never measured");
    }
}
