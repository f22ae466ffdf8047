//! The versions a backend runs (what the kept figures were measured with).

use crate::boxfile::{BackendConfig, Engine};

/// Package versions next to a backend's program (a virtualenv's `site-packages/*.dist-info`
/// whose name mentions the engine), else the program's path.
pub(crate) fn versions_seen(b: &BackendConfig) -> String {
    let keys: &[&str] = match b.engine {
        Engine::Whisper => &["whisper", "ctranslate2"],
        Engine::LlamaCpp => &["llama", "llm_"],
        Engine::Vllm => &["vllm", "torch-"],
        Engine::Other => &[],
    };
    let mut found = Vec::new();
    if let Some(bin) = b.command.parent() {
        let pattern = bin.join("../lib/python*/site-packages/*.dist-info");
        if let Ok(paths) = glob::glob(&pattern.display().to_string()) {
            for p in paths.flatten() {
                let name = p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let lower = name.to_ascii_lowercase();
                if keys.iter().any(|k| lower.contains(k)) {
                    found.push(name.trim_end_matches(".dist-info").to_string());
                }
            }
        }
    }
    found.sort();
    if found.is_empty() {
        b.command.display().to_string()
    } else {
        found.join(", ")
    }
}
