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
    /// Receives one line per step, as it happens.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}
