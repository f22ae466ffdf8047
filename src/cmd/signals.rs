//! The signals the long-running commands (`serve`, `up`) answer. SIGTERM and SIGINT (Ctrl-C)
//! stop them: `serve` drains, `up` stops the gateway, then the text engine, then the audio
//! backends in order. SIGHUP is logged and ignored: the configuration is read once at start (a
//! closed terminal or a stray reload must not take the box down; restart to apply a change).
//! SIGPIPE is ignored (the Rust runtime sets that before `main`) and every line they log goes
//! through [`headroom_server::stderr::line`], so a closed stderr drops lines instead of ending
//! the process before its drain.

use tokio::signal::unix::{Signal, SignalKind, signal};

/// The handlers, installed before the work starts so a signal during start-up is not the
/// default action (SIGHUP's is to end the process).
pub struct Signals {
    term: Signal,
    int: Signal,
    hup: Signal,
}

impl Signals {
    /// Installs the handlers. Needs the runtime's context (inside `Runtime::enter` or a task).
    pub fn install() -> std::io::Result<Signals> {
        Ok(Signals {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
            hup: signal(SignalKind::hangup())?,
        })
    }

    /// Resolves at SIGTERM or SIGINT; each SIGHUP before that is logged (`who`: the command's
    /// log prefix) and ignored.
    pub async fn stop_requested(mut self, who: &str) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => headroom_server::stderr::line(&format!(
                    "{who}: SIGHUP ignored (the configuration is read at start only; restart to apply a change; SIGTERM stops)"
                )),
            }
        }
    }
}
