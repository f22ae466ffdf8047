//! The upstreams' `GET /health`, asked in the background every [`CHECK_INTERVAL`] and kept for
//! `/readyz`, so a probe of the gateway (a load balancer may send several a second) never turns
//! into a call to each upstream.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::Notify;

use crate::live_config::ServeConfig;
use crate::state::AppState;

/// How often each upstream's `/health` is asked.
pub(crate) const CHECK_INTERVAL: Duration = Duration::from_millis(500);
/// How long one answer may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The last answers, by upstream in [`upstream_list_of`]'s order (`None` before the
/// first round: nothing is known yet).
pub(crate) struct HealthCache {
    count: usize,
    statuses: Mutex<Option<Vec<Option<u16>>>>,
    checked: Notify,
}

impl HealthCache {
    pub(crate) fn new(upstreams: Vec<String>) -> HealthCache {
        HealthCache {
            count: upstreams.len(),
            statuses: Mutex::new(None),
            checked: Notify::new(),
        }
    }

    fn set(&self, statuses: Vec<Option<u16>>) {
        *self.statuses.lock().unwrap_or_else(|e| e.into_inner()) = Some(statuses);
        self.checked.notify_waiters();
    }

    fn get(&self) -> Option<Vec<Option<u16>>> {
        self.statuses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The last answers; before the first round ends (just after start), waits for it (at most
    /// one check's timeout), and counts every upstream unreachable if it has not ended by then.
    pub(crate) async fn statuses(&self) -> Vec<Option<u16>> {
        let checked = self.checked.notified();
        let mut checked = std::pin::pin!(checked);
        checked.as_mut().enable();
        if let Some(s) = self.get() {
            return s;
        }
        let _ = tokio::time::timeout(CHECK_TIMEOUT, checked).await;
        self.get().unwrap_or_else(|| vec![None; self.count])
    }
}

/// Asks every upstream's `/health` every [`CHECK_INTERVAL`], forever (the gateway aborts it).
pub(crate) async fn check_loop(s: std::sync::Arc<AppState>) {
    let upstreams = upstream_list_of(&s.core.config);
    let mut tick = tokio::time::interval(CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let statuses = probe_upstreams(&s.core.client, &upstreams, CHECK_TIMEOUT).await;
        s.health.set(statuses);
    }
}

/// Every distinct upstream of the configuration, in the order lanes name them.
pub(crate) fn upstream_list_of(config: &ServeConfig) -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    for l in &config.lanes {
        for u in &l.spec.upstreams {
            if !all.contains(u) {
                all.push(u.clone());
            }
        }
    }
    all
}

/// Each upstream's `GET /health` (any HTTP status means the process is up) within `timeout`,
/// in the order of [`upstream_list_of`].
pub(crate) async fn probe_upstreams(
    client: &reqwest::Client,
    upstreams: &[String],
    timeout: Duration,
) -> Vec<Option<u16>> {
    let checks = upstreams.iter().map(|u| {
        let client = client.clone();
        let url = format!("{u}/health");
        async move {
            tokio::time::timeout(timeout, client.get(url).send())
                .await
                .ok()
                .and_then(Result::ok)
                .map(|r| r.status().as_u16())
        }
    });
    futures_util::future::join_all(checks).await
}
