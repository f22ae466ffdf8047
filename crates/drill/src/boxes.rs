//! The box the night runs against, under `up` or set up by hand, seen the same way: where each
//! stream's requests go, each backend's PID now, the pool's usage and limit, the OOM kills counted
//! inside it, and where a co-tenant joins the pool.

use std::path::PathBuf;
use std::sync::Arc;

use headroom_up::boxfile::{BackendConfig, BoxConfig, Engine, Role};
use serde::Serialize;

use crate::handset::HandSetBox;
use crate::limit::MemoryLimit;
use crate::scenario::{Stream, StreamKind};
use crate::upbox::UpBox;

/// Which box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    Up,
    HandSet,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Up => "up",
            Mode::HandSet => "hand-set",
        }
    }
}

/// One backend now.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BackendNow {
    pub name: String,
    pub role: &'static str,
    pub pid: Option<u32>,
}

/// The box now.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct View {
    pub backends: Vec<BackendNow>,
    /// Bytes charged to the pool's memory cgroup.
    pub pool_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub oom_kills: Option<u64>,
    /// Where a process is written to join the pool.
    pub procs_file: Option<PathBuf>,
}

/// The running box.
#[derive(Debug)]
pub enum Running {
    Up(UpBox),
    HandSet(HandSetBox),
}

fn role_str(r: Role) -> &'static str {
    match r {
        Role::Audio => "audio",
        Role::Text => "text",
    }
}

impl Running {
    pub fn mode(&self) -> Mode {
        match self {
            Running::Up(_) => Mode::Up,
            Running::HandSet(_) => Mode::HandSet,
        }
    }

    /// `up`'s PID (its supervisor and gateway are one process); none for a box set up by hand.
    pub fn supervisor_pid(&self) -> Option<u32> {
        match self {
            Running::Up(u) => Some(u.pid),
            Running::HandSet(_) => None,
        }
    }

    /// Where requests for `backend` go: the gateway, or the engine itself.
    pub fn base_for(&self, backend: &BackendConfig) -> String {
        match self {
            Running::Up(u) => u.gateway.clone(),
            Running::HandSet(h) => h
                .upstream(&backend.name)
                .map(str::to_string)
                .unwrap_or_else(|| backend.upstream()),
        }
    }

    pub async fn view(&self) -> View {
        match self {
            Running::HandSet(h) => {
                let limit: &Arc<dyn MemoryLimit> = h.limit();
                View {
                    backends: h
                        .backends()
                        .into_iter()
                        .map(|(name, role, pid)| BackendNow {
                            name,
                            role: role_str(role),
                            pid,
                        })
                        .collect(),
                    pool_bytes: limit.usage_bytes().ok(),
                    limit_bytes: Some(limit.limit_bytes()),
                    oom_kills: limit.oom_kills().ok(),
                    procs_file: Some(limit.procs_file()),
                }
            }
            Running::Up(u) => {
                let Ok(a) = u.admin().await else {
                    return View::default();
                };
                let oom_kills = match a.oom_kills {
                    Some(k) => Some(k),
                    None => u.metrics_oom_kills().await,
                };
                View {
                    backends: a
                        .backends
                        .iter()
                        .map(|b| BackendNow {
                            name: b.name.clone(),
                            role: if b.role == "text" { "text" } else { "audio" },
                            pid: b
                                .pid
                                .filter(|_| b.state != "restarting" && b.state != "failed"),
                        })
                        .collect(),
                    pool_bytes: a.usage_bytes,
                    limit_bytes: a.limit_bytes,
                    oom_kills,
                    procs_file: a.cgroup.as_ref().map(|d| d.join("cgroup.procs")),
                }
            }
        }
    }
}

/// The box backend that serves `stream`: the one it names, else the first whose route fits.
pub fn backend_for<'a>(
    config: &'a BoxConfig,
    stream: &Stream,
) -> Result<&'a BackendConfig, String> {
    if let Some(name) = &stream.backend {
        return config
            .backends
            .iter()
            .find(|b| &b.name == name)
            .ok_or_else(|| {
                format!(
                    "stream `{}` names backend `{name}`, which the box does not have",
                    stream.name
                )
            });
    }
    let serves = |b: &BackendConfig| match stream.kind {
        StreamKind::Chat => b.role == Role::Text,
        StreamKind::Transcription => {
            b.role == Role::Audio
                && (b.engine == Engine::Whisper
                    || b.warmup
                        .as_ref()
                        .is_some_and(|w| w.path.contains("transcriptions")))
        }
        StreamKind::Speech => {
            b.role == Role::Audio
                && b.engine != Engine::Whisper
                && b.warmup.as_ref().is_none_or(|w| w.path.contains("speech"))
        }
    };
    config.backends.iter().find(|b| serves(b)).ok_or_else(|| {
        format!(
            "stream `{}` sends {} requests, and the box has no backend for them (name one with `backend`)",
            stream.name,
            stream.kind.as_str()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Night;
    use std::path::Path;

    const BOX: &str = r#"
[memory]
probe = "host"
capacity = "1GiB"
[[backends]]
name = "whisper"
role = "audio"
engine = "whisper"
command = "x"
port = 19681
[[backends]]
name = "tts"
role = "audio"
command = "z"
port = 19682
[backends.warmup]
path = "/v1/audio/speech"
json = '{"input":"hi"}'
[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "y"
port = 19680
model = "m.gguf"
[serve]
listen = "127.0.0.1:19690"
"#;

    #[test]
    fn each_kind_finds_its_backend() {
        let b = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let night = Night::parse(
            r#"
name = "n"
[[stream]]
name = "a"
kind = "transcription"
clip = "c.wav"
per_minute = 1
[[stream]]
name = "b"
kind = "speech"
per_minute = 1
[[stream]]
name = "c"
kind = "chat"
per_minute = 1
[[stream]]
name = "d"
kind = "chat"
backend = "nope"
per_minute = 1
"#,
            Path::new("/"),
        )
        .unwrap();
        let names: Vec<Result<&str, String>> = night
            .streams
            .iter()
            .map(|s| backend_for(&b, s).map(|x| x.name.as_str()))
            .collect();
        assert_eq!(names[0], Ok("whisper"));
        assert_eq!(names[1], Ok("tts"));
        assert_eq!(names[2], Ok("llm"));
        assert!(names[3].as_ref().unwrap_err().contains("nope"));
        let no_tts = BoxConfig::parse(
            &BOX.replace(
                "name = \"tts\"\nrole = \"audio\"",
                "name = \"tts\"\nrole = \"audio\"\nengine = \"whisper\"",
            ),
            Path::new("/"),
        )
        .unwrap();
        let e = backend_for(&no_tts, &night.streams[1]).unwrap_err();
        assert!(e.contains("no backend"), "{e}");
    }
}
