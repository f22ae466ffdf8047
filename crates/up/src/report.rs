//! The box's report as `/admin/box` shows it: the shared status every step updates, its first
//! state, and how flags are shown in it.

use std::sync::{Mutex, MutexGuard};

use headroom_server::admin_box::{BackendReport, BackendState, BoxProvider, BoxReport};

use crate::boxfile::BoxConfig;
use crate::flags::TextFlags;

/// The box's state as `/admin/box` shows it.
pub(crate) struct BoxStatus {
    pub(crate) report: Mutex<BoxReport>,
}

impl BoxStatus {
    pub(crate) fn lock(&self) -> MutexGuard<'_, BoxReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn update(&self, name: &str, f: impl FnOnce(&mut BackendReport)) {
        let mut report = self.lock();
        if let Some(b) = report.backends.iter_mut().find(|b| b.name == name) {
            f(b);
        }
    }
}

impl BoxProvider for BoxStatus {
    fn report(&self) -> BoxReport {
        self.lock().clone()
    }
}

/// The report before anything starts: every backend stopped, nothing measured.
pub(crate) fn initial_report(config: &BoxConfig, capacity: u64) -> BoxReport {
    BoxReport {
        probe: config.memory.probe.as_str().into(),
        capacity_bytes: capacity,
        margin_bytes: config.memory.margin,
        text_budget_bytes: 0,
        backends: config
            .backends
            .iter()
            .map(|b| BackendReport {
                name: b.name.clone(),
                role: b.role.as_str().into(),
                engine: b.engine.as_str().into(),
                pid: None,
                state: BackendState::Stopped,
                upstream: b.upstream(),
                resident_bytes: 0,
                peak_bytes: 0,
                current_bytes: 0,
                restarts: 0,
                start_failures: 0,
                last_exit: None,
                drifted: false,
                retry_after_ms: None,
                flags: Vec::new(),
                plan_check: None,
            })
            .collect(),
        enforce: None,
    }
}

/// The flags as `/admin/box` shows them: the arguments, then the environment as `KEY=VALUE`.
pub(crate) fn shown_flags(f: &TextFlags) -> Vec<String> {
    let mut shown = f.args.clone();
    shown.extend(f.env.iter().map(|(k, v)| format!("{k}={v}")));
    shown
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Mutex;

    use headroom_server::admin_box::{BackendState, BoxProvider};

    use super::{BoxStatus, initial_report, shown_flags};
    use crate::boxfile::BoxConfig;
    use crate::flags::{Expected, TextFlags};

    const BOX: &str = r#"
[memory]
probe = "host"
capacity = "4GiB"
[[backends]]
name = "stt"
role = "audio"
engine = "whisper"
command = "x"
port = 20081
[[backends]]
name = "llm"
role = "text"
engine = "llamacpp"
command = "y"
port = 20080
model = "m.gguf"
[serve]
listen = "127.0.0.1:20000"
"#;

    #[test]
    fn the_first_report_lists_every_backend_stopped_and_unmeasured() {
        let config = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let r = initial_report(&config, 1234);
        assert_eq!(r.probe, "host");
        assert_eq!(r.capacity_bytes, 1234);
        assert_eq!(r.text_budget_bytes, 0);
        assert!(r.enforce.is_none());
        let rows: Vec<_> = r
            .backends
            .iter()
            .map(|b| {
                (
                    b.name.as_str(),
                    b.role.as_str(),
                    b.engine.as_str(),
                    b.upstream.as_str(),
                )
            })
            .collect();
        assert_eq!(
            rows,
            [
                ("stt", "audio", "whisper", "http://127.0.0.1:20081"),
                ("llm", "text", "llamacpp", "http://127.0.0.1:20080"),
            ]
        );
        for b in &r.backends {
            assert_eq!(b.state, BackendState::Stopped);
            assert_eq!((b.pid, b.peak_bytes, b.restarts), (None, 0, 0));
            assert!(b.flags.is_empty() && b.plan_check.is_none());
        }
    }

    #[test]
    fn an_update_changes_the_named_backend_only() {
        let config = BoxConfig::parse(BOX, Path::new("/")).unwrap();
        let status = BoxStatus {
            report: Mutex::new(initial_report(&config, 1)),
        };
        status.update("llm", |b| {
            b.pid = Some(42);
            b.state = BackendState::Ready;
        });
        status.update("nobody", |b| b.restarts = 9);
        let r = status.report();
        assert_eq!(r.backends[1].pid, Some(42));
        assert_eq!(r.backends[1].state, BackendState::Ready);
        assert_eq!(r.backends[0].pid, None);
        assert!(r.backends.iter().all(|b| b.restarts == 0));
    }

    #[test]
    fn flags_are_shown_as_arguments_then_the_environment() {
        let f = TextFlags {
            args: vec!["--ctx-size".into(), "8192".into()],
            env: vec![("VLLM_CPU_KVCACHE_SPACE".into(), "2".into())],
            sequences: 2,
            context_per_sequence: 4096,
            expected: Expected {
                weights_bytes: 0,
                kv_cache_bytes: 0,
                kv_tokens: 0,
                total_bytes: 0,
            },
        };
        assert_eq!(
            shown_flags(&f),
            ["--ctx-size", "8192", "VLLM_CPU_KVCACHE_SPACE=2"]
        );
    }
}
