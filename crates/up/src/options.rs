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
    /// Start the text engine with its own arguments only: none of the flags `up` computes from
    /// the budget (context, sequences, llama.cpp's prompt cache off, vLLM's memory share), so the
    /// engine sizes itself by its defaults, as one started without sizing it does; an audio lane
    /// that could never admit a job beside it is a warning, not a refusal. For `headroom drill
    /// --without sizing`, which shows what the sizing prevents.
    pub text_engine_defaults: bool,
    /// Receives one line per step, as it happens.
    pub progress: Arc<dyn Fn(&str) + Send + Sync>,
}
