//! How `up` runs: the options the command line gives it.

use std::path::PathBuf;
use std::sync::Arc;

/// How `up` runs.
#[derive(Clone)]
pub struct UpOptions {
    /// The box file (the calibration file sits beside it).
    pub box_path: PathBuf,
    /// Measure again even when a calibration file exists.
    pub recalibrate: bool,
    /// Where backend logs go (default: a `NAME.log` per backend in a fresh private folder
    /// under the temporary directory, removed at a clean stop unless `keep_logs`).
    pub log_dir: Option<PathBuf>,
    /// Keep the default log folder after a clean stop.
    pub keep_logs: bool,
    /// Size the text engine to what the pool has free with the audio backends at rest, the way
    /// one sizes an engine from the free memory one sees, instead of leaving room for their
    /// peaks; an audio lane that could never admit a job beside it is a warning, not a refusal.
    /// For `headroom drill --without sizing`, which shows what the sizing prevents.
    pub text_at_rest: bool,
    /// Receives one line per step, as it happens.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}
