//! Parsing of single values the configuration writes as text: durations, byte sizes, the
//! `listen` address and upstream URLs.

use std::net::SocketAddr;
use std::time::Duration;

use super::error::{ConfigError, key_err};

/// Parses `500ms`, `5s`, `2m` (and a bare number of seconds).
pub fn parse_duration(text: &str) -> Option<Duration> {
    headroom_plan::units::parse_duration(text, headroom_plan::units::BareNumber::Seconds)
}

/// Parses a byte size: an integer, or a string like `25MiB`, `512KiB`, `2GiB`, `10MB` (the same
/// spellings `headroom plan` takes).
pub fn parse_bytes(value: &toml::Value) -> Option<u64> {
    match value {
        toml::Value::Integer(i) if *i >= 0 => Some(*i as u64),
        toml::Value::String(s) => headroom_plan::units::parse_size(s).ok(),
        _ => None,
    }
}

pub(super) const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// `listen`: an IP address and a port; `localhost:PORT` means 127.0.0.1:PORT.
pub(super) fn parse_listen(text: &str) -> Result<SocketAddr, ConfigError> {
    let t = text.trim();
    let local = t
        .strip_prefix("localhost:")
        .map(|port| format!("127.0.0.1:{port}"));
    if let Ok(addr) = local.as_deref().unwrap_or(t).parse::<SocketAddr>() {
        return Ok(addr);
    }
    let instead = match t.rsplit_once(':') {
        Some(("", port)) => format!(
            "write \"127.0.0.1:{port}\" (this machine only) or \"0.0.0.0:{port}\" (every interface, API keys required)"
        ),
        Some((_, port)) if port.parse::<u16>().is_ok() => format!(
            "a host name other than localhost is not an address; write its IP address, e.g. \"127.0.0.1:{port}\" or \"0.0.0.0:{port}\""
        ),
        _ => "write an IP address and a port, e.g. \"127.0.0.1:8080\" (localhost:8080 is accepted)"
            .to_string(),
    };
    Err(key_err(
        "listen",
        format!("`{t}` is not HOST:PORT: {instead}"),
    ))
}

/// An upstream as `http://HOST:PORT`. A trailing `/v1` (the OpenAI base URL people copy) is
/// dropped with a note, since the gateway forwards the request's own `/v1/...` path.
pub(super) fn upstream_url(u: &str) -> Result<(String, Option<String>), String> {
    let t = u.trim().trim_end_matches('/');
    if let Some(rest) = t.strip_prefix("https://") {
        return Err(format!(
            "`{u}`: https upstreams are not supported; the gateway talks plain HTTP to engines on this machine or a private network (TLS belongs in front of the gateway). Write http://{} if the engine also listens on plain HTTP",
            rest.split('/').next().unwrap_or(rest)
        ));
    }
    let Some(rest) = t.strip_prefix("http://") else {
        let host = t.split("://").last().unwrap_or(t);
        return Err(format!(
            "`{u}` has no http:// scheme: write \"http://{}\"",
            host.split('/').next().unwrap_or(host)
        ));
    };
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(format!(
            "`{u}` names no host: write http://HOST:PORT, e.g. \"http://127.0.0.1:8000\""
        ));
    }
    match path {
        "" => Ok((format!("http://{host}"), None)),
        "v1" => Ok((
            format!("http://{host}"),
            Some(format!(
                "`{u}`: the trailing /v1 was dropped (the gateway forwards each request's own /v1/... path); write \"http://{host}\" to silence this"
            )),
        )),
        _ => Err(format!(
            "`{u}` has a path (/{path}): write the engine's address only, \"http://{host}\""
        )),
    }
}
