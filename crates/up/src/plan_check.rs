//! The start-up check against the plan: the engine's start-up log and measured memory compared
//! with the planned figures.

use headroom_doctor::MemoryBreakdown;

use crate::boxfile::BackendConfig;
use crate::budget::mib;
use crate::ctx::Ctx;
use crate::flags::{Expected, TextFlags};
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
    let check = plan_check(b, f, group, resident);
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
    t: &BackendConfig,
    f: &TextFlags,
    group: &Group,
    resident: u64,
) -> serde_json::Value {
    let log = std::fs::File::open(&group.log)
        .ok()
        .and_then(|file| headroom_doctor::diagnose(std::io::BufReader::new(file)).ok());
    let startup = log.as_ref().and_then(|d| d.startup.clone());
    compared_with_plan(
        &t.name,
        &f.expected,
        startup.as_ref().map(|s| &s.breakdown),
        resident,
    )
}

/// The plan's `expected` figures beside the start-up log's `seen` ones (none where the log shows
/// none doctor reads) and the `resident` memory measured: the check `/admin/box` shows, its
/// warnings those more than 10 % off.
pub(crate) fn compared_with_plan(
    name: &str,
    expected: &Expected,
    seen: Option<&MemoryBreakdown>,
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
    let mut from_log = serde_json::Map::new();
    if let Some(b) = seen {
        if let Some(kv) = b.kv_cache_gib {
            from_log.insert("kv_cache_bytes".into(), ((kv * GIB) as u64).into());
            compare(
                "KV cache",
                expected.kv_cache_bytes as f64 / 1048576.0,
                kv * 1024.0,
                " MiB",
            );
        }
        if let Some(tokens) = b.kv_tokens {
            from_log.insert("kv_tokens".into(), tokens.into());
            compare("KV tokens", expected.kv_tokens as f64, tokens as f64, "");
        }
        if let Some(w) = b.weights_gib {
            from_log.insert("weights_bytes".into(), ((w * GIB) as u64).into());
            compare(
                "weights",
                expected.weights_bytes as f64 / 1048576.0,
                w * 1024.0,
                " MiB",
            );
        }
    }
    compare(
        "memory after start-up",
        expected.total_bytes as f64 / 1048576.0,
        resident as f64 / 1048576.0,
        " MiB",
    );
    if seen.is_none() {
        warnings.push(format!(
            "its start-up log ({name}) shows no memory figures doctor reads; only the measured memory was compared"
        ));
    }
    serde_json::json!({
        "planned": expected,
        "log": from_log,
        "measured_resident_bytes": resident,
        "warnings": warnings,
    })
}

#[cfg(test)]
mod tests {
    use headroom_doctor::MemoryBreakdown;
    use serde_json::json;

    use super::compared_with_plan;
    use crate::flags::Expected;

    const MIB: u64 = 1024 * 1024;

    fn expected() -> Expected {
        Expected {
            weights_bytes: 1000 * MIB,
            kv_cache_bytes: 2048 * MIB,
            kv_tokens: 10_000,
            total_bytes: 4096 * MIB,
        }
    }

    #[test]
    fn a_log_figure_more_than_ten_percent_off_the_plan_is_a_warning() {
        let seen = MemoryBreakdown {
            kv_cache_gib: Some(2.5),
            kv_tokens: Some(10_500),
            ..MemoryBreakdown::default()
        };
        let check = compared_with_plan("text", &expected(), Some(&seen), 4096 * MIB);
        assert_eq!(
            check["warnings"],
            json!(["KV cache: the plan says 2048 MiB, 2560 MiB seen (+25 %)"])
        );
        assert_eq!(
            check["log"],
            json!({"kv_cache_bytes": 2_684_354_560u64, "kv_tokens": 10_500})
        );
        assert_eq!(check["measured_resident_bytes"], json!(4_294_967_296u64));
        assert_eq!(check["planned"]["kv_tokens"], json!(10_000));
    }

    #[test]
    fn without_log_figures_only_the_measured_memory_is_compared() {
        let check = compared_with_plan("text", &expected(), None, 3000 * MIB);
        assert_eq!(
            check["warnings"],
            json!([
                "memory after start-up: the plan says 4096 MiB, 3000 MiB seen (-27 %)",
                "its start-up log (text) shows no memory figures doctor reads; only the measured memory was compared"
            ])
        );
        assert_eq!(check["log"], json!({}));
    }
}
