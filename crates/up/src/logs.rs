//! Where the backends' logs go. By default a private folder made fresh for the run under the
//! temporary directory: mode 0700, a name nobody can guess (so none can be planted ahead of it;
//! `mkdir` never follows a link either), removed when `up` stops cleanly unless `--keep-logs`
//! keeps it (kept after a failure, which names the log to read). `--log-dir DIR` names a folder
//! instead: made 0700 when it does not exist, and always kept. Each log file is created 0600 and
//! opened without following a symbolic link (`O_NOFOLLOW`), so a link planted in the folder
//! cannot make `up` write somewhere else.

use std::collections::hash_map::RandomState;
use std::fs::{self, DirBuilder, File, OpenOptions};
use std::hash::BuildHasher;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::UpError;

/// The run's log folder.
#[derive(Debug)]
pub struct LogDir {
    path: PathBuf,
    /// Made by `up` for this run (removed at a clean stop unless kept).
    made_for_run: bool,
    keep: bool,
}

impl LogDir {
    /// The folder `given` (made 0700 if missing), or a fresh private one; `keep` keeps a fresh
    /// one after a clean stop.
    pub fn create(given: Option<&Path>, keep: bool) -> Result<LogDir, UpError> {
        let io_err = |path: &Path, source| UpError::Io {
            what: format!("log folder {}", path.display()),
            source,
        };
        match given {
            Some(dir) => {
                if !dir.is_dir() {
                    DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(dir)
                        .map_err(|e| io_err(dir, e))?;
                }
                Ok(LogDir {
                    path: dir.to_path_buf(),
                    made_for_run: false,
                    keep: true,
                })
            }
            None => {
                let path = fresh_private_dir(&std::env::temp_dir())
                    .map_err(|e| io_err(&std::env::temp_dir(), e))?;
                Ok(LogDir {
                    path,
                    made_for_run: true,
                    keep,
                })
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The log file of backend `name`.
    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(format!("{name}.log"))
    }

    /// At a clean stop: removes the folder when `up` made it for this run and it is not kept.
    /// Returns the folder when it stays.
    pub fn finish(&self) -> Option<&Path> {
        if self.made_for_run && !self.keep && fs::remove_dir_all(&self.path).is_ok() {
            return None;
        }
        Some(&self.path)
    }
}

/// A new folder `headroom-up-XXXXXXXXXXXXXXXX` under `parent`, mode 0700, its name from the
/// process's random hasher keys (a folder that exists under the name, or a link, is never
/// used: `mkdir` fails on it and another name is tried).
fn fresh_private_dir(parent: &Path) -> io::Result<PathBuf> {
    let random = RandomState::new();
    let mut last = io::Error::other("no name tried");
    for attempt in 0..16u32 {
        let tag = random.hash_one((std::process::id(), attempt, std::time::SystemTime::now()));
        let path = parent.join(format!("headroom-up-{tag:016x}"));
        match DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => {
                // The umask only takes bits away; set the mode outright all the same.
                fs::set_permissions(&path, fs::Permissions::from_mode(0o700))?;
                return Ok(path);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Opens a backend's log for appending: created 0600 when missing, and refused (`ELOOP`) when
/// the name is a symbolic link.
pub fn open_log(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_default_folder_is_private_unpredictable_and_gone_after_a_clean_stop() {
        let a = LogDir::create(None, false).unwrap();
        let b = LogDir::create(None, false).unwrap();
        assert_ne!(a.path(), b.path());
        assert_eq!(mode(a.path()), 0o700);
        let name = a.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            !name.contains(&std::process::id().to_string()),
            "{name} is guessable from the PID"
        );
        let log = open_log(&a.file("tts")).unwrap();
        drop(log);
        assert_eq!(mode(&a.file("tts")), 0o600);
        assert_eq!(a.finish(), None);
        assert!(!a.path().exists());
        let kept = LogDir::create(None, true).unwrap();
        assert_eq!(kept.finish(), Some(kept.path()));
        assert!(kept.path().exists());
        fs::remove_dir_all(kept.path()).unwrap();
        assert_eq!(b.finish(), None);
    }

    #[test]
    fn a_link_planted_as_a_log_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("passwd");
        fs::write(&target, "root:x:0:0\n").unwrap();
        let logs = LogDir::create(Some(&dir.path().join("logs")), false).unwrap();
        assert_eq!(mode(logs.path()), 0o700, "made by up");
        std::os::unix::fs::symlink(&target, logs.file("tts")).unwrap();
        let e = open_log(&logs.file("tts")).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(rustix::io::Errno::LOOP.raw_os_error())
        );
        assert_eq!(fs::read_to_string(&target).unwrap(), "root:x:0:0\n");
        // A folder the user names is kept.
        assert_eq!(logs.finish(), Some(logs.path()));
    }
}
