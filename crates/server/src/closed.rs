//! Why the gateway closed a client connection itself: the listener decides it, telemetry counts
//! it (the `reason` label of [`crate::telemetry::CONNECTIONS_CLOSED_TOTAL`]).

/// Why the gateway closed a client connection itself; the `reason` label of
/// [`crate::telemetry::CONNECTIONS_CLOSED_TOTAL`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Closed {
    /// The request head did not arrive within `client_header_timeout`.
    HeaderTimeout,
    /// The connection stood idle for `keepalive_timeout`.
    IdleTimeout,
    /// A write to the client made no progress for `send_timeout`.
    SendTimeout,
    /// The response's deadline passed while the client was slow to read it.
    Deadline,
    /// Closed, idle, to make room at the open-file limit.
    Shed,
}

impl Closed {
    pub(crate) const ALL: [Closed; 5] = [
        Closed::HeaderTimeout,
        Closed::IdleTimeout,
        Closed::SendTimeout,
        Closed::Deadline,
        Closed::Shed,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
            Closed::SendTimeout => "send_timeout",
            Closed::Deadline => "deadline",
            Closed::Shed => "shed",
        }
    }
}
