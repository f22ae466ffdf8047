//! The `[balancer]` table: signals for a load balancer in front of several boxes (HAProxy's
//! agent listener, Envoy's ORCA header, the refresh interval, the lane-full status).

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use super::error::{ConfigError, key_err};

/// The `[balancer]` table as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BalancerTable {
    agent_listen: Option<String>,
    load_header: Option<bool>,
    interval: Option<String>,
    overload_status: Option<u16>,
}

/// The `[balancer]` table after validation.
#[derive(Debug, Clone, PartialEq)]
pub struct BalancerConfig {
    /// Where HAProxy's agent check connects (off when `None`).
    pub agent_listen: Option<SocketAddr>,
    /// Whether responses carry the ORCA `endpoint-load-metrics` header.
    pub load_header: bool,
    /// How often the load figure and the lanes' readiness are refreshed.
    pub interval: Duration,
    /// The status of a lane-full refusal: 429 (default), or 503 for a balancer that retries
    /// 503 on another box but cannot retry 429 (HAProxy 2.6's `retry-on`).
    pub overload_status: axum::http::StatusCode,
}

impl Default for BalancerConfig {
    fn default() -> Self {
        BalancerConfig {
            agent_listen: None,
            load_header: false,
            interval: Duration::from_millis(500),
            overload_status: axum::http::StatusCode::TOO_MANY_REQUESTS,
        }
    }
}

impl BalancerTable {
    pub(crate) fn validate(self) -> Result<BalancerConfig, ConfigError> {
        let agent_listen = match &self.agent_listen {
            None => None,
            Some(text) => Some(text.parse::<SocketAddr>().map_err(|_| {
                key_err(
                    "balancer.agent_listen",
                    format!("`{text}` is not HOST:PORT (e.g. \"127.0.0.1:9101\")"),
                )
            })?),
        };
        let interval = match &self.interval {
            None => BalancerConfig::default().interval,
            Some(text) => headroom_plan::units::parse_duration(
                text,
                headroom_plan::units::BareNumber::Seconds,
            )
            .filter(|d| *d >= Duration::from_millis(50) && *d <= Duration::from_secs(60))
            .ok_or_else(|| {
                key_err(
                    "balancer.interval",
                    format!("`{text}` is not a duration between 50ms and 60s"),
                )
            })?,
        };
        let overload_status = match self.overload_status {
            None | Some(429) => axum::http::StatusCode::TOO_MANY_REQUESTS,
            Some(503) => axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Some(other) => {
                return Err(key_err(
                    "balancer.overload_status",
                    format!("`{other}` is not 429 or 503"),
                ));
            }
        };
        Ok(BalancerConfig {
            agent_listen,
            load_header: self.load_header.unwrap_or(false),
            interval,
            overload_status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_name_the_key() {
        let bad = BalancerTable {
            agent_listen: Some("localhost".into()),
            ..BalancerTable::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("balancer.agent_listen"), "{e}");
        let bad = BalancerTable {
            interval: Some("5ms".into()),
            ..BalancerTable::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("balancer.interval"), "{e}");
        let bad = BalancerTable {
            overload_status: Some(500),
            ..BalancerTable::default()
        };
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains("balancer.overload_status"), "{e}");
    }
}
