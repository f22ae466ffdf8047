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
    /// Sizing switched off: the text engine starts with these arguments and environment
    /// (appended to its own) instead of the flags `up` computes from the budget, as a user who
    /// sizes it by hand starts it (`headroom drill --without sizing` gives the article's fixed
    /// share); an audio lane that could never admit a job beside it is then a warning, not a
    /// refusal. The gateway's lanes stay derived.
    pub text_sized_by_hand: Option<HandSized>,
    /// Receives one line per step, as it happens.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}

/// The text engine's flags as given by hand (sizing switched off).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HandSized {
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}
