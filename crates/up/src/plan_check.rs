//! The start-up check against the plan: the engine's start-up log and measured memory compared
//! with the planned figures.

use crate::boxfile::BackendConfig;
use crate::budget::mib;
use crate::ctx::Ctx;
use crate::flags::TextFlags;
use crate::process::Group;

/// [`plan_check`], with its warnings and the measured-against-planned line logged.
pub(crate) fn checked_against_plan(
    ctx: &Ctx,
    b: &BackendConfig,
    f: &TextFlags,
    group: &Group,
    resident: u64,
    peak: u64,
) -> serde_json::Value {
    let check = plan_check(ctx, b, f, group, resident);
    for w in check["warnings"].as_array().into_iter().flatten() {
        ctx.say(&format!(
            "up: [{}] warning: {}",
            b.name,
            w.as_str().unwrap_or("")
        ));
    }
    ctx.say(&format!(
        "up: [{}] resident {} (planned {}), peak {}",
        b.name,
        mib(resident),
        mib(f.expected.total_bytes),
        mib(peak)
    ));
    check
}

/// Compares the plan with what the engine's start-up log says (through doctor's reader) and
/// with the memory measured; a difference above 10 % is a warning naming both figures.
pub(crate) fn plan_check(
    ctx: &Ctx,
    t: &BackendConfig,
    f: &TextFlags,
    group: &Group,
    resident: u64,
) -> serde_json::Value {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let mut warnings = Vec::new();
    let mut compare = |what: &str, planned: f64, seen: f64, unit: &str| {
        if planned > 0.0 && (seen - planned).abs() / planned > 0.10 {
            warnings.push(format!(
                "{what}: the plan says {planned:.0}{unit}, {seen:.0}{unit} seen ({:+.0} %)",
                (seen / planned - 1.0) * 100.0
            ));
        }
    };
    let log = std::fs::File::open(&group.log)
        .ok()
        .and_then(|file| headroom_doctor::diagnose(std::io::BufReader::new(file)).ok());
    let startup = log.as_ref().and_then(|d| d.startup.clone());
    let mut from_log = serde_json::Map::new();
    if let Some(s) = &startup {
        let b = &s.breakdown;
        if let Some(kv) = b.kv_cache_gib {
            from_log.insert("kv_cache_bytes".into(), ((kv * GIB) as u64).into());
            compare(
                "KV cache",
                f.expected.kv_cache_bytes as f64 / 1048576.0,
                kv * 1024.0,
                " MiB",
            );
        }
        if let Some(tokens) = b.kv_tokens {
            from_log.insert("kv_tokens".into(), tokens.into());
            compare("KV tokens", f.expected.kv_tokens as f64, tokens as f64, "");
        }
        if let Some(w) = b.weights_gib {
            from_log.insert("weights_bytes".into(), ((w * GIB) as u64).into());
            compare(
                "weights",
                f.expected.weights_bytes as f64 / 1048576.0,
                w * 1024.0,
                " MiB",
            );
        }
    }
    compare(
        "memory after start-up",
        f.expected.total_bytes as f64 / 1048576.0,
        resident as f64 / 1048576.0,
        " MiB",
    );
    if startup.is_none() {
        let _ = ctx;
        warnings.push(format!(
            "its start-up log ({}) shows no memory figures doctor reads; only the measured memory was compared",
            t.name
        ));
    }
    serde_json::json!({
        "planned": f.expected,
        "log": from_log,
        "measured_resident_bytes": resident,
        "warnings": warnings,
    })
}
