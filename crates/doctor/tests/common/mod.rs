//! What the crate's tests over the fixture corpus share: every log under tests/data/logs, by name.

use std::path::{Path, PathBuf};

/// The directory of the fixture logs.
pub fn logs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/logs")
}

/// Every fixture log as (file name, text), sorted by name.
pub fn fixtures() -> Vec<(String, String)> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(logs_dir())
        .expect("tests/data/logs")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 50, "only {} fixtures", paths.len());
    paths
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let text = String::from_utf8_lossy(&std::fs::read(&p).unwrap()).into_owned();
            (name, text)
        })
        .collect()
}
