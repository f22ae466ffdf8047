//! What every step of a run shares ([`Ctx`]: the box, the options, the meter, the status, the
//! logs, the cgroup), the run's clock and its stop flag.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::sync::watch;

use crate::boxfile::BoxConfig;
use crate::budget::mib;
use crate::cgroup::{BoxCgroup, Exit};
use crate::logs::LogDir;
use crate::meter::Meter;
use crate::options::UpOptions;
use crate::pause::SignalPauses;
use crate::report::BoxStatus;

/// Resolves once the stop flag is set (and never when its sender is gone without setting it).
pub(crate) async fn stopped(rx: &mut watch::Receiver<bool>) {
    if rx.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Milliseconds since the Unix epoch: the sampler's clock.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What every step of a run shares.
pub(crate) struct Ctx {
    pub(crate) config: BoxConfig,
    pub(crate) opts: UpOptions,
    pub(crate) meter: Meter,
    pub(crate) status: Arc<BoxStatus>,
    pub(crate) client: reqwest::Client,
    pub(crate) logs: LogDir,
    pub(crate) started_ms: u64,
    /// The memory cgroup every backend runs in (`[memory] enforce`).
    pub(crate) enforced: Option<BoxCgroup>,
    /// The backends the gateway wants paused by signal now (a restart starts them paused).
    pub(crate) pauses: Arc<SignalPauses>,
}

impl Ctx {
    pub(crate) fn say(&self, line: &str) {
        (self.opts.progress)(line);
    }

    pub(crate) fn log_path(&self, name: &str) -> PathBuf {
        self.logs.file(name)
    }

    /// A clean stop: the run's private log folder goes unless kept.
    pub(crate) fn finish_logs(&self) {
        match self.logs.finish() {
            None => self.say("up: backend logs removed (--keep-logs or --log-dir keeps them)"),
            Some(dir) => self.say(&format!("up: backend logs kept in {}", dir.display())),
        }
    }

    /// How a backend that exited during start-up ended: named as an OOM kill where the box's
    /// cgroup counted one.
    pub(crate) fn how_it_ended(&self, status: std::process::ExitStatus) -> String {
        match self.enforced.as_ref().map(|c| c.judge_exit(Some(status))) {
            Some(Exit::OomKilled) => format!(
                "was killed by the kernel's OOM killer (the box's memory cgroup reached its limit of {})",
                mib(self.meter.capacity)
            ),
            _ => format!("exited ({status})"),
        }
    }
}
