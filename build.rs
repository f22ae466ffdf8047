//! Build script: stamps `--version` with the commit it was built from and the date of the
//! built-in catalog. Both come from git when the source is a git checkout; a source tarball
//! (no git, or no repository) falls back to `HEADROOM_COMMIT` / `HEADROOM_CATALOG_DATE` from the
//! environment, then to "unknown", so `cargo build` never needs git or the network.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!text.is_empty()).then_some(text)
}

fn stamp(env_name: &str, from_git: impl FnOnce() -> Option<String>) -> String {
    std::env::var(env_name)
        .ok()
        .filter(|v| !v.trim().is_empty())
        .or_else(from_git)
        .unwrap_or_else(|| "unknown".to_string())
}

/// Files whose change means a new commit: HEAD, the branch ref it names, packed refs.
fn watch_git() {
    let mut paths = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(head_ref) = git(&["symbolic-ref", "-q", "HEAD"]) {
        paths.push(head_ref);
    }
    for p in paths {
        if let Some(path) = git(&["rev-parse", "--git-path", &p])
            && std::path::Path::new(&path).exists()
        {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}

fn main() {
    let commit = stamp("HEADROOM_COMMIT", || {
        git(&["rev-parse", "--short=12", "HEAD"])
    });
    let catalog = stamp("HEADROOM_CATALOG_DATE", || {
        git(&["log", "-1", "--format=%cs", "--", "crates/inspect/data"])
    });
    println!("cargo:rustc-env=HEADROOM_COMMIT={commit}");
    println!("cargo:rustc-env=HEADROOM_CATALOG_DATE={catalog}");
    println!("cargo:rerun-if-env-changed=HEADROOM_COMMIT");
    println!("cargo:rerun-if-env-changed=HEADROOM_CATALOG_DATE");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=crates/inspect/data");
    watch_git();
}
