//! What `up` checks before anything starts, beyond the box file's own keys: the gateway
//! configuration it will derive, validated by `serve`'s own rules with placeholder figures (a
//! listener or an agent listener off loopback without API keys, a lane key `serve` refuses), and
//! the calibration file's place (not a folder, in a folder `up` can write to). `up --check` runs
//! them, and so does every start, before the first backend: a mistake there costs no bring-up.

use std::io;
use std::path::Path;

use crate::UpError;
use crate::boxfile::{BoxConfig, Role};
use crate::kept::calibration_file;
use crate::lanes::{LaneFigures, serve_config};

/// Every check; the first failure is the error.
pub fn before_start(config: &BoxConfig, box_path: &Path) -> Result<(), UpError> {
    check_serve(config)?;
    check_calibration_path(&calibration_file(config, box_path))
}

/// The `[serve]` table and its lane overrides, as the gateway will read them once the figures
/// are measured (these stand in for them: they decide none of what is checked).
fn check_serve(config: &BoxConfig) -> Result<(), UpError> {
    let figures: Vec<LaneFigures> = config
        .backends
        .iter()
        .map(|b| LaneFigures::new(&b.name, if b.role == Role::Audio { 1 << 20 } else { 0 }, 1))
        .collect();
    serve_config(config, &figures).map(|_| ())
}

/// The calibration file is written after the bring-up: a path that is a folder, or a folder
/// `up` cannot create a file in, is found now (by creating and removing a probe file beside it;
/// permissions alone say nothing to root or on a read-only mount).
pub(crate) fn check_calibration_path(path: &Path) -> Result<(), UpError> {
    let bad = |message: String| UpError::Config {
        key: "memory.calibration".into(),
        message,
    };
    if path.is_dir() {
        return Err(bad(format!(
            "{} is a folder; name the file the figures are kept in (default: beside the box file)",
            path.display()
        )));
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let probe = parent.join(format!(".{name}.{}.check", std::process::id()));
    let created = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe);
    match created {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(bad(format!(
            "cannot write beside {} ({}): {}",
            path.display(),
            parent.display(),
            describe(&e)
        ))),
    }
}

fn describe(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "no such folder".into(),
        io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
[serve]
listen = "127.0.0.1:20000"
"#;

    fn parsed(text: &str) -> BoxConfig {
        BoxConfig::parse(text, Path::new("/")).unwrap()
    }

    #[test]
    fn a_listener_off_loopback_without_keys_is_refused_before_anything_starts() {
        let dir = tempfile::tempdir().unwrap();
        let box_path = dir.path().join("box.toml");
        before_start(&parsed(BOX), &box_path).unwrap();
        let open = BOX.replace("127.0.0.1:20000", "0.0.0.0:20000");
        let e = before_start(&parsed(&open), &box_path).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("API keys are required"), "{e}");
        let keyed = open.replace("[serve]", "[serve]\napi_keys = [\"k\"]");
        before_start(&parsed(&keyed), &box_path).unwrap();
    }

    #[test]
    fn a_calibration_path_that_is_a_folder_or_unwritable_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("box.calibration.json");
        std::fs::create_dir(&folder).unwrap();
        let e = check_calibration_path(&folder).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains("is a folder"), "{e}");
        let missing = dir.path().join("no/such/place/c.json");
        let e = check_calibration_path(&missing).unwrap_err();
        assert!(e.to_string().contains("no such folder"), "{e}");
        // Under a file: not writable even for root.
        let file = dir.path().join("f");
        std::fs::write(&file, "").unwrap();
        assert!(check_calibration_path(&file.join("c.json")).is_err());
        let fine = dir.path().join("c.json");
        check_calibration_path(&fine).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(left.len(), 2, "the probe file was removed");
    }
}
