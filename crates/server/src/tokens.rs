//! Input-token counting with a model's own `tokenizer.json` (Hugging Face `tokenizers`), used for
//! a lane's `max_input_tokens` when the lane names a tokenizer; otherwise the gateway uses the
//! stated estimate in [`crate::body_facts::estimate_tokens`].

use std::path::Path;
use std::sync::Arc;

/// A `tokenizer.json` that could not be loaded: the file and the tokenizer library's reason.
#[derive(Debug, thiserror::Error)]
#[error("cannot load tokenizer {}: {source}", path.display())]
pub struct LoadError {
    pub path: std::path::PathBuf,
    #[source]
    pub source: tokenizers::Error,
}

/// A loaded tokenizer, cheap to clone.
#[derive(Clone)]
pub struct TokenCounter {
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for TokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCounter")
    }
}

impl TokenCounter {
    /// Loads a `tokenizer.json`; the error names the file and the reason.
    pub fn load(path: &Path) -> Result<TokenCounter, LoadError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|source| LoadError {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(TokenCounter {
            tokenizer: Arc::new(tokenizer),
        })
    }

    /// Tokens in the given texts, without special tokens or chat-template overhead.
    pub fn count(&self, texts: &[String]) -> Result<u64, String> {
        let mut total = 0u64;
        for t in texts {
            let enc = self
                .tokenizer
                .encode(t.as_str(), false)
                .map_err(|e| format!("tokenizer failed: {e}"))?;
            total += enc.len() as u64;
        }
        Ok(total)
    }
}

/// A word-level `tokenizer.json` splitting on whitespace and punctuation (tests and examples).
pub const TEST_TOKENIZER_JSON: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
  "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
  "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}
}"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_with_the_tokenizer_and_reports_bad_files() {
        let dir = std::env::temp_dir().join(format!("headroom-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, TEST_TOKENIZER_JSON).unwrap();
        let t = TokenCounter::load(&path).unwrap();
        assert_eq!(t.count(&["hello world, again".into()]).unwrap(), 4);
        assert_eq!(t.count(&["a b c".into(), "d".into()]).unwrap(), 4);
        std::fs::write(&path, "{not json").unwrap();
        let err = TokenCounter::load(&path).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
