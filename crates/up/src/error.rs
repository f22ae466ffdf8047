//! Why `up` stops with an error, and the exit code each reason gives.

/// Why `up` stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpError {
    #[error("box file is not valid TOML: {0}")]
    Toml(String),
    #[error("box file {0}")]
    Memory(String),
    #[error("box file `{key}`: {message}")]
    Config { key: String, message: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("backend `{backend}`: cannot start `{command}`: {reason}")]
    Spawn {
        backend: String,
        command: String,
        reason: String,
    },
    #[error("backend `{backend}`: port {port} on 127.0.0.1 is already in use ({reason})")]
    PortTaken {
        backend: String,
        port: u16,
        reason: String,
    },
    #[error("model: {0}")]
    Model(#[from] headroom_inspect::InspectError),
    #[error("memory probe: {0}")]
    Probe(#[from] ProbeFailure),
    #[error("[memory] enforce: {0}")]
    Enforce(String),
    #[error("backend `{backend}` {what}")]
    Backend { backend: String, what: String },
    #[error("{0}")]
    DoesNotFit(String),
    #[error("gateway: {0}")]
    Serve(#[from] GatewayFailure),
}

impl UpError {
    /// The process exit code: 2 bad input or unusable environment, 3 the box does not fit,
    /// 1 a backend that failed while starting or measuring.
    pub fn exit_code(&self) -> u8 {
        match self {
            UpError::DoesNotFit(_) => 3,
            UpError::Backend { .. } | UpError::Serve(_) => 1,
            _ => 2,
        }
    }
}

/// Why the memory pool could not be read: its probe, its sampler, or (on the host pool without a
/// capacity) the host's memory size.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeFailure {
    #[error("cannot read /proc/meminfo: {0}")]
    MemInfo(#[source] std::io::Error),
    #[error(transparent)]
    Probe(#[from] headroom_gpu::ProbeError),
    #[error(transparent)]
    Sampler(#[from] headroom_gpu::SamplerError),
}

/// Why the gateway could not be built or stopped serving: the gateway's own error, its HTTP
/// client's, or its listener's address.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayFailure {
    #[error(transparent)]
    Serve(#[from] headroom_server::ServeError),
    #[error(transparent)]
    Client(#[from] reqwest::Error),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use headroom_gpu::ProbeError;
    use headroom_inspect::InspectError;
    use headroom_server::ServeError;

    use super::{GatewayFailure, ProbeFailure, UpError};

    #[test]
    fn a_probe_failure_reads_as_before_and_keeps_its_cause() {
        let e = UpError::from(ProbeFailure::from(ProbeError::NoSuchDevice(3)));
        assert_eq!(e.to_string(), "memory probe: no GPU with index 3");
        assert_eq!(e.exit_code(), 2);
        let cause = e.source().expect("a cause");
        assert!(matches!(
            cause.downcast_ref::<ProbeFailure>(),
            Some(ProbeFailure::Probe(ProbeError::NoSuchDevice(3)))
        ));

        let e = UpError::Probe(ProbeFailure::MemInfo(std::io::Error::other("gone")));
        assert_eq!(
            e.to_string(),
            "memory probe: cannot read /proc/meminfo: gone"
        );
        let io = e.source().and_then(|c| c.source()).expect("the io error");
        assert_eq!(io.to_string(), "gone");
    }

    #[test]
    fn a_model_failure_reads_as_before_and_keeps_inspects_error() {
        let e = UpError::from(InspectError::NothingToRead { path: "/m".into() });
        assert_eq!(
            e.to_string(),
            "model: /m holds no config.json, *.safetensors or *.gguf to describe a model"
        );
        assert!(matches!(
            e.source().and_then(|c| c.downcast_ref::<InspectError>()),
            Some(InspectError::NothingToRead { .. })
        ));
    }

    #[test]
    fn a_gateway_failure_reads_as_before_exits_1_and_keeps_the_serve_error() {
        let bind = ServeError::Bind {
            addr: "127.0.0.1:9".parse().unwrap(),
            source: std::io::Error::other("in use"),
        };
        let e = UpError::Serve(bind.into());
        assert_eq!(
            e.to_string(),
            "gateway: cannot listen on 127.0.0.1:9: in use"
        );
        assert_eq!(e.exit_code(), 1);
        assert!(matches!(
            e.source().and_then(|c| c.downcast_ref::<GatewayFailure>()),
            Some(GatewayFailure::Serve(ServeError::Bind { .. }))
        ));
        let e = UpError::Serve(GatewayFailure::Io(std::io::Error::other("closed")));
        assert_eq!(e.to_string(), "gateway: closed");
    }
}
