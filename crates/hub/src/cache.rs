//! The Hugging Face cache layout, written: `models--ORG--NAME/blobs/<etag>` holds each file's
//! bytes once, `snapshots/<commit>/<file>` links to its blob, `refs/<revision>` names the commit.
//! Safetensors headers go to `blobs/<etag>.headroom-header`, linked from
//! `snapshots/<commit>/<shard>.headroom-header`, never under the shard's own name (see the crate
//! docs). Files are written to a temporary name and renamed, so a reader never sees half a file.

use std::path::{Path, PathBuf};

use crate::HubError;

/// Suffix of a stored safetensors header (first `8 + n` bytes of the shard, nothing more);
/// `headroom-inspect` reads it by the same name.
pub const HEADER_SUFFIX: &str = headroom_inspect::safetensors::HEADER_ONLY_SUFFIX;

/// A sharded checkpoint's index.
pub const INDEX: &str = "model.safetensors.index.json";

/// One repository's folder in the cache, at one commit.
pub struct Layout {
    repo_dir: PathBuf,
    commit: String,
}

fn io(path: &Path, e: std::io::Error) -> HubError {
    HubError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    }
}

impl Layout {
    pub fn new(cache_dir: &Path, repo: &str, commit: &str) -> Layout {
        Layout {
            repo_dir: cache_dir.join(format!("models--{}", repo.replace('/', "--"))),
            commit: commit.to_string(),
        }
    }

    pub fn snapshot_dir(&self) -> PathBuf {
        self.repo_dir.join("snapshots").join(&self.commit)
    }

    /// A whole file (`config.json`, the index): `blobs/<etag>` and its snapshot link.
    pub fn store_file(&self, name: &str, etag: &str, bytes: &[u8]) -> Result<(), HubError> {
        self.store(name, etag, bytes)
    }

    /// A shard's header: `blobs/<etag>.headroom-header` and `snapshots/<commit>/<shard>.headroom-header`.
    pub fn store_header(&self, shard: &str, etag: &str, bytes: &[u8]) -> Result<(), HubError> {
        self.store(
            &format!("{shard}{HEADER_SUFFIX}"),
            &format!("{etag}{HEADER_SUFFIX}"),
            bytes,
        )
    }

    /// `refs/<revision>` → the commit.
    pub fn store_ref(&self, revision: &str) -> Result<(), HubError> {
        let path = self.repo_dir.join("refs").join(revision);
        write_atomically(&path, self.commit.as_bytes())
    }

    fn store(&self, name: &str, blob_name: &str, bytes: &[u8]) -> Result<(), HubError> {
        let blob = self.repo_dir.join("blobs").join(blob_name);
        write_atomically(&blob, bytes)?;
        let link = self.snapshot_dir().join(name);
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, e))?;
        }
        // The link is relative, as huggingface_hub makes it: up from snapshots/<commit>/<dirs>.
        let depth = Path::new(name).components().count() + 1;
        let mut target = PathBuf::new();
        for _ in 0..depth {
            target.push("..");
        }
        target.push("blobs");
        target.push(blob_name);
        let _ = std::fs::remove_file(&link);
        link_or_copy(&target, &blob, &link)
    }
}

#[cfg(unix)]
fn link_or_copy(target: &Path, _blob: &Path, link: &Path) -> Result<(), HubError> {
    std::os::unix::fs::symlink(target, link).map_err(|e| io(link, e))
}

/// Without symlinks the snapshot holds a copy, as huggingface_hub does on such systems.
#[cfg(not(unix))]
fn link_or_copy(_target: &Path, blob: &Path, link: &Path) -> Result<(), HubError> {
    std::fs::copy(blob, link)
        .map(|_| ())
        .map_err(|e| io(link, e))
}

fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
    let tmp = path.with_extension(format!("incomplete.{}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_go_to_blobs_and_snapshots_link_to_them() {
        let tmp = tempfile::tempdir().unwrap();
        let l = Layout::new(tmp.path(), "org/name", "abc123");
        l.store_file("config.json", "e1", b"{}").unwrap();
        l.store_header("model.safetensors", "sha256x", b"header")
            .unwrap();
        l.store_ref("main").unwrap();
        let repo = tmp.path().join("models--org--name");
        assert_eq!(std::fs::read(repo.join("blobs/e1")).unwrap(), b"{}");
        let snap = repo.join("snapshots/abc123");
        assert_eq!(std::fs::read(snap.join("config.json")).unwrap(), b"{}");
        assert_eq!(
            std::fs::read_link(snap.join("config.json")).unwrap(),
            PathBuf::from("../../blobs/e1")
        );
        assert_eq!(
            std::fs::read(snap.join("model.safetensors.headroom-header")).unwrap(),
            b"header"
        );
        // Nothing carries the shard's own name or its etag.
        assert!(!snap.join("model.safetensors").exists());
        assert!(!repo.join("blobs/sha256x").exists());
        assert_eq!(
            std::fs::read_to_string(repo.join("refs/main")).unwrap(),
            "abc123"
        );
    }
}
