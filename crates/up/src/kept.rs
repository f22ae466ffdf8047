//! Figures kept from an earlier start (the calibration file): whether they still describe an
//! audio backend started now, so its measuring warm-up can be skipped. They do while the backend
//! is the same (the packages next to its program), starts the same way (its steady memory before
//! any job, read now, is the kept one within a tolerance) and runs one job the same way (after one
//! warm-up job, which also spares the first real request the backend's cold start, it peaks no
//! higher than the kept peak and settles at the kept level between jobs, within the tolerance).
//! Otherwise `up` measures again, and the new figures replace the kept ones; a start that uses
//! them keeps them as they are. Pure: the figures and readings are handed in.

use std::path::{Path, PathBuf};

use headroom_gpu::calibration::{BackendCalibration, calibration_path_for};

use crate::boxfile::BoxConfig;

use crate::budget::mib;

/// The box's calibration file: `[memory] calibration`, else beside the box file.
pub fn calibration_file(config: &BoxConfig, box_path: &Path) -> PathBuf {
    config
        .memory
        .calibration
        .clone()
        .unwrap_or_else(|| calibration_path_for(box_path))
}

/// How far the level before any job may move between starts (shared pages divided among more
/// or fewer processes, a Python import cached or not) and still be the same backend: 10 % of the
/// kept level or 16 MiB, whichever is larger.
const IDLE_TOLERANCE_FRACTION: f64 = 0.10;
const IDLE_TOLERANCE_BYTES: u64 = 16 * 1024 * 1024;

/// `Ok` when `kept` describes the backend now (its packages `version_now`, steady at `idle_now`
/// before any job); else why it is measured again, as the progress line says it.
pub fn kept_figures_apply(
    kept: &BackendCalibration,
    kept_version: Option<&str>,
    version_now: &str,
    idle_now: u64,
) -> Result<(), String> {
    let Some(kept_idle) = kept.idle_bytes else {
        return Err(
            "the kept figures come from an older version, which did not keep the level before the first job"
                .into(),
        );
    };
    if kept.peak_bytes < kept.resident_bytes || kept.warmup_runs == 0 {
        return Err(format!(
            "the kept figures were not measured by a warm-up (peak {}, resident {}, {} runs)",
            mib(kept.peak_bytes),
            mib(kept.resident_bytes),
            kept.warmup_runs
        ));
    }
    if let Some(kept_version) = kept_version
        && kept_version != version_now
    {
        return Err(format!(
            "its packages changed ({kept_version} when measured, {version_now} now)"
        ));
    }
    let tolerance = tolerance(kept_idle);
    if idle_now.abs_diff(kept_idle) > tolerance {
        return Err(format!(
            "it holds {} before any job now, {} when measured (more than {} apart)",
            mib(idle_now),
            mib(kept_idle),
            mib(tolerance)
        ));
    }
    Ok(())
}

/// How far a level may move between starts and still be the same: 10 % or 16 MiB.
pub(crate) fn tolerance(level: u64) -> u64 {
    ((level as f64 * IDLE_TOLERANCE_FRACTION) as u64).max(IDLE_TOLERANCE_BYTES)
}

/// `Ok` when one warm-up job run now agrees with `kept`: it peaked at `peak_seen`, no more than
/// the kept peak (within the tolerance), and the backend settled at `level_after`, the kept level
/// between jobs (within the tolerance). Else why it is measured again.
pub fn one_job_agrees(
    kept: &BackendCalibration,
    level_after: u64,
    peak_seen: u64,
) -> Result<(), String> {
    let (resident, peak) = (kept.resident_bytes, kept.peak_bytes);
    if level_after.abs_diff(resident) > tolerance(resident) {
        return Err(format!(
            "after one job it holds {}, {} when measured (more than {} apart)",
            mib(level_after),
            mib(resident),
            mib(tolerance(resident))
        ));
    }
    if peak_seen > peak + tolerance(peak) {
        return Err(format!(
            "one job peaked at {}, above the kept peak {} by more than {}",
            mib(peak_seen),
            mib(peak),
            mib(tolerance(peak))
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    /// Whisper tiny.en on the CPU box: 78 MiB before its first job, 193 MiB after the warm-up
    /// (its allocator keeps the buffers), 269 MiB at the peak.
    fn whisper() -> BackendCalibration {
        BackendCalibration {
            role: "audio".into(),
            engine: "whisper".into(),
            idle_bytes: Some(78 * MIB),
            resident_bytes: 193 * MIB,
            peak_bytes: 269 * MIB,
            peak_per_audio_second_bytes: None,
            speech_seconds_per_char: None,
            warmup_runs: 3,
            date: String::new(),
        }
    }

    #[test]
    fn the_same_backend_starting_the_same_way_uses_its_kept_figures() {
        let v = "faster_whisper-1.2.1";
        assert_eq!(kept_figures_apply(&whisper(), Some(v), v, 78 * MIB), Ok(()));
        // Within the tolerance: 16 MiB (above 10 % of 78 MiB) either way.
        assert!(kept_figures_apply(&whisper(), Some(v), v, 94 * MIB).is_ok());
        assert!(kept_figures_apply(&whisper(), Some(v), v, 62 * MIB).is_ok());
        // A file without versions (written by hand) does not stop it.
        assert!(kept_figures_apply(&whisper(), None, v, 78 * MIB).is_ok());
    }

    #[test]
    fn one_job_must_settle_at_the_kept_level_and_stay_under_the_kept_peak() {
        assert_eq!(one_job_agrees(&whisper(), 195 * MIB, 262 * MIB), Ok(()));
        // A lower peak than the three-run warm-up saw is the same backend.
        assert!(one_job_agrees(&whisper(), 190 * MIB, 230 * MIB).is_ok());
        let kept_more = one_job_agrees(&whisper(), 240 * MIB, 262 * MIB).unwrap_err();
        assert!(
            kept_more.contains("after one job it holds 240.0 MiB"),
            "{kept_more}"
        );
        let higher = one_job_agrees(&whisper(), 195 * MIB, 300 * MIB).unwrap_err();
        assert!(higher.contains("peaked at 300.0 MiB"), "{higher}");
    }

    #[test]
    fn another_backend_or_another_start_is_measured_again_and_says_why() {
        let v = "faster_whisper-1.2.1";
        let moved = kept_figures_apply(&whisper(), Some(v), v, 95 * MIB).unwrap_err();
        assert!(
            moved.contains("95.0 MiB before any job now, 78.0 MiB"),
            "{moved}"
        );
        let upgraded =
            kept_figures_apply(&whisper(), Some(v), "faster_whisper-1.3.0", 78 * MIB).unwrap_err();
        assert!(upgraded.contains("packages changed"), "{upgraded}");
        // Files of older versions kept no level before the first job (and their later starts
        // wrote that level over the resident one): nothing in them can be trusted.
        let old = BackendCalibration {
            idle_bytes: None,
            ..whisper()
        };
        assert!(
            kept_figures_apply(&old, Some(v), v, 78 * MIB)
                .unwrap_err()
                .contains("older version")
        );
        let broken = BackendCalibration {
            peak_bytes: 100 * MIB,
            ..whisper()
        };
        assert!(kept_figures_apply(&broken, Some(v), v, 78 * MIB).is_err());
    }
}
