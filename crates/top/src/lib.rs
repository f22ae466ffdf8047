//! headroom-top: the `headroom top` screen. [`TopState`] is the view model, fed with samples (live
//! from the sampler or from a replayed sample file) and with the lanes a running `headroom serve`
//! reports; [`render()`] draws it into any ratatui backend, so tests draw into `TestBackend`.
//! No I/O here: the binary owns the terminal, the probe and the HTTP fetch.

pub mod lanes;
pub mod render;
pub mod state;

pub use lanes::{Lane, parse_lanes};
pub use render::{draw, gpu_rows_needed, render};
pub use state::{HISTORY_WINDOW_MS, LanesView, SortKey, TopState};
