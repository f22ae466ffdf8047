//! The box's report as `/admin/box` shows it: the shared status every step updates, its first
//! state, and how flags are shown in it.

use std::sync::{Mutex, MutexGuard};

use headroom_server::admin_box::{BackendReport, BackendState, BoxProvider, BoxReport};

use crate::boxfile::BoxConfig;
use crate::flags::TextFlags;

/// The box's state as `/admin/box` shows it.
pub(crate) struct BoxStatus {
    pub(crate) report: Mutex<BoxReport>,
}

impl BoxStatus {
    pub(crate) fn lock(&self) -> MutexGuard<'_, BoxReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn update(&self, name: &str, f: impl FnOnce(&mut BackendReport)) {
        let mut report = self.lock();
        if let Some(b) = report.backends.iter_mut().find(|b| b.name == name) {
            f(b);
        }
    }
}

impl BoxProvider for BoxStatus {
    fn report(&self) -> BoxReport {
        self.lock().clone()
    }
}

pub(crate) fn initial_report(config: &BoxConfig, capacity: u64) -> BoxReport {
    BoxReport {
        probe: config.memory.probe.as_str().into(),
        capacity_bytes: capacity,
        margin_bytes: config.memory.margin,
        text_budget_bytes: 0,
        backends: config
            .backends
            .iter()
            .map(|b| BackendReport {
                name: b.name.clone(),
                role: b.role.as_str().into(),
                engine: b.engine.as_str().into(),
                pid: None,
                state: BackendState::Stopped,
                upstream: b.upstream(),
                resident_bytes: 0,
                peak_bytes: 0,
                current_bytes: 0,
                restarts: 0,
                start_failures: 0,
                last_exit: None,
                drifted: false,
                retry_after_ms: None,
                flags: Vec::new(),
                plan_check: None,
            })
            .collect(),
        enforce: None,
    }
}

/// The flags as `/admin/box` shows them: the arguments, then the environment as `KEY=VALUE`.
pub(crate) fn shown_flags(f: &TextFlags) -> Vec<String> {
    let mut shown = f.args.clone();
    shown.extend(f.env.iter().map(|(k, v)| format!("{k}={v}")));
    shown
}
