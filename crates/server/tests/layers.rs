//! The one-way layers of `crates/server/src`: every module sits in one layer of [`LAYERS`], and a
//! module may name (`crate::…`) only modules of its own layer or of layers below it. The test
//! reads every `.rs` file under `src`, collects its `crate::` references (in `use` lines, with
//! their `{…}` groups, and in paths in code; comments are skipped) and fails naming the file,
//! the line and each upward edge. `super::` stays inside a module's own directory: always allowed.
//!
//! Run on its own: `cargo test -p headroom-server --test layers`.

use std::path::{Path, PathBuf};

/// The layers, bottom (0) to top: module path prefix → layer. A module not listed fails the
/// test (add it here when you add it).
const LAYERS: &[(&str, u8)] = &[
    // 0 — leaves: no `crate::` module above them; names, types and helpers everything uses.
    ("admin_box", 0),
    ("audio", 0),
    ("body_memory", 0),
    ("closed", 0),
    ("error", 0),
    ("headers", 0),
    ("multipart", 0),
    ("retry_watch", 0),
    ("start_error", 0),
    ("stderr", 0),
    ("tokens", 0),
    // 1 — config: what the user wrote, validated into plain settings (`config::lane`,
    // `config::memory`, `config::balancer`, …); no live objects, no environment reads.
    ("config", 1),
    // 2 — services the request path and the surface use: the upstream client, request-body
    // facts, telemetry, engine scraping, memory pools and feed, engine pausing.
    ("body_facts", 2),
    // the live configuration built once from the settings (tokenizers loaded, header values).
    ("live_config", 2),
    ("memory_feed", 2),
    ("pause", 2),
    ("pools", 2),
    ("scrape", 2),
    ("telemetry", 2),
    ("upstream", 2),
    // 3 — core: what the request path reads (`Core`).
    ("core_state", 3),
    // 4 — the request path.
    ("proxy", 4),
    ("request", 4),
    // 5 — the surface: its state, the edge checks, the router and the routes it adds (health,
    // readiness, admin, metrics, status page), the load balancer's signals.
    ("admin", 5),
    ("balancer", 5),
    ("edge", 5),
    ("health", 5),
    ("metrics", 5),
    ("readiness", 5),
    ("router", 5),
    ("state", 5),
    ("ui", 5),
    // 6 — the listener.
    ("listen", 6),
    // 7 — lib.rs (the crate root, module path ""): only assembles.
    ("", 7),
];

/// The layer of a module path (`request::admit`), by its longest listed prefix.
fn layer_of(module: &str) -> Option<u8> {
    LAYERS
        .iter()
        .filter(|(prefix, _)| {
            module == *prefix
                || prefix.is_empty()
                || module
                    .strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with("::"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map(|(_, layer)| *layer)
}

/// The module path of a file under `src` (`request/mod.rs` → `request`, `lib.rs` → ``).
fn module_of(relative: &Path) -> String {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts.join("::")
}

/// Every module a source text names through `crate::`, with the line it is named on. A group
/// (`use crate::{a, b::{c}}`) names each of its top-level members.
fn crate_references(source: &str) -> Vec<(usize, String)> {
    let code: String = source
        .lines()
        .map(|line| match line.trim_start().starts_with("//") {
            true => "",
            false => line.split(" // ").next().unwrap_or(""),
        })
        .collect::<Vec<_>>()
        .join("\n");
    let line_at = |offset: usize| code[..offset].matches('\n').count() + 1;
    let mut out = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `headroom_crate::`, `$crate::` stays out by its `$` below
        }
        if before == Some('$') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut member_start = 0;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        push_first_segment(&group[member_start..i], at, &line_at, &mut out);
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        push_first_segment(&group[member_start..i], at, &line_at, &mut out);
                        member_start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            push_first_segment(rest, at, &line_at, &mut out);
        }
    }
    out
}

/// The first path segment of `path` (a module, or a name lib.rs re-exports), when there is one.
fn push_first_segment(
    path: &str,
    at: usize,
    line_at: &dyn Fn(usize) -> usize,
    out: &mut Vec<(usize, String)>,
) {
    let segment: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    if !segment.is_empty() && segment != "self" {
        out.push((line_at(at), segment));
    }
}

/// Why `module`'s source breaks the layers: one line per upward edge (`file:line: from → to`).
fn upward_edges(file: &str, module: &str, source: &str) -> Vec<String> {
    let Some(from) = layer_of(module) else {
        return vec![format!(
            "{file}: module `{module}` is in no layer of LAYERS"
        )];
    };
    let family = module.split("::").next().unwrap_or("");
    let mut out = Vec::new();
    for (line, target) in crate_references(source) {
        // A name the crate root re-exports (`crate::ApiError`) is lib.rs's: the top layer.
        let to = if target.starts_with(char::is_uppercase) {
            layer_of("")
        } else {
            layer_of(&target)
        };
        let allowed = target == family || to.is_some_and(|to| to <= from);
        if !allowed {
            let to = to.map_or("no layer".to_string(), |l| format!("layer {l}"));
            out.push(format!(
                "{file}:{line}: `{module}` (layer {from}) names `crate::{target}` ({to})"
            ));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_names_a_layer_above_its_own() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    assert!(files.len() > 20, "found only {files:?}");
    let mut broken = Vec::new();
    for path in &files {
        let relative = path.strip_prefix(&src).expect("under src");
        let source = std::fs::read_to_string(path).expect("read a source file");
        let file = format!("crates/server/src/{}", relative.display());
        broken.extend(upward_edges(&file, &module_of(relative), &source));
    }
    assert!(
        broken.is_empty(),
        "upward imports (see LAYERS in crates/server/tests/layers.rs):\n{}",
        broken.join("\n")
    );
}

#[test]
fn the_checker_flags_an_upward_import() {
    let source = "//! a leaf\n\
                  use crate::{error::ApiError, headers};\n\
                  // crate::listen in a comment is no import\n\
                  use crate::{audio, request::{Reply, Route}};\n\
                  fn f() { crate::state::Shared::default(); }\n";
    let edges = upward_edges("src/headers.rs", "headers", source);
    assert_eq!(edges.len(), 2, "{edges:?}");
    assert!(edges[0].starts_with("src/headers.rs:4:"), "{edges:?}");
    assert!(edges[0].contains("`crate::request` (layer 4)"), "{edges:?}");
    assert!(edges[1].starts_with("src/headers.rs:5:"), "{edges:?}");
    assert!(edges[1].contains("`crate::state`"), "{edges:?}");
    // The same references from the top are all downward.
    assert!(upward_edges("src/lib.rs", "", source).is_empty());
    // A file of a module directory names its own family freely.
    let inside = "use crate::request::Route;\nuse super::lane;\n";
    assert!(upward_edges("src/request/body.rs", "request::body", inside).is_empty());
    // Config (what the user wrote) may not reach the live objects built from it, nor the surface.
    let config = "use crate::live_config::ServeConfig;\nuse crate::balancer::Signals;\n";
    assert_eq!(
        upward_edges("src/config/lane.rs", "config::lane", config).len(),
        2
    );
}
