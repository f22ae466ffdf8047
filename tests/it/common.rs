//! What the integration tests share across modules: the one lock that runs the tests that
//! measure time or load the machine one at a time, and the scaffold of a gateway test.

use headroom_server::Running;

use crate::serve::{base, client, gateway};
use crate::serve_upstream::{self, Upstream};

/// The one "one at a time" lock of the test binary. Every test that measures latency or timing
/// (the gateway tests of `serve*`, `upstream_faults`, `scale_out`, `speech`, `doctor_live`), that
/// allocates hundreds of MiB or watches memory move (`memory`, `ui`'s memory view) or that drives
/// real load (`bench`) holds it for its whole run: beside one another on a 2-core CI machine they
/// would steal each other's CPU and memory and turn a timing bound into a coin toss.
///
/// It is a tokio mutex so that async tests hold it across `.await`
/// (`SERIAL.lock().await`); sync tests, which run outside any runtime, take it with
/// [`serial_blocking`]. It never poisons: a failed test does not fail the ones after it.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The guard of [`SERIAL`].
pub(crate) type Serial = tokio::sync::MutexGuard<'static, ()>;

/// [`SERIAL`] for a sync test (no runtime on its thread).
pub(crate) fn serial_blocking() -> Serial {
    SERIAL.blocking_lock()
}

/// The scaffold of a gateway test: [`SERIAL`] held, an in-process upstream ([`Upstream`]), the
/// gateway in-process on the config `config` writes for that upstream, a client and the gateway's
/// base URL, in that order. A test binds every part to a name (`_serial`, not `_`), so each lives
/// to the end of the test as it did when the test made them itself:
///
/// ```ignore
/// let (_serial, up, g, c, b) = rig(|up| text_lane(up, "max_inflight = 2")).await;
/// ```
pub(crate) async fn rig(
    config: impl FnOnce(&Upstream) -> String,
) -> (Serial, Upstream, Running, reqwest::Client, String) {
    let serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    let g = gateway(&config(&up)).await;
    let (c, b) = (client(), base(&g));
    (serial, up, g, c, b)
}

/// `toml` written to `headroom.toml` in a fresh temporary directory, for a test that starts the
/// real binary: the directory (keep it to the end of the test) and the file's path.
pub(crate) fn config_file(toml: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("headroom.toml");
    std::fs::write(&path, toml).unwrap();
    (dir, path)
}
