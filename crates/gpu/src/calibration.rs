//! The calibration file: what `headroom up` measured about a box, kept beside the box file so the
//! next `up` can start from it, `plan --reserve-from FILE` can read it instead of a guessed
//! profile, and `serve`'s memory ledger can keep what it learned per lane.
//!
//! One JSON object (`docs/up.md` describes every field); readers ignore fields they do not know,
//! so fields may be added but never renamed:
//!
//! ```text
//! {"format":1,"date":"2026-12-01T09:00:00Z","probe":"host","capacity_bytes":8589934592,
//!  "versions":{"whisper":"faster-whisper-server 0.0.3"},
//!  "backends":{"whisper":{"role":"audio","engine":"whisper","idle_bytes":81000000,
//!    "resident_bytes":312000000,"peak_bytes":356000000,"peak_per_audio_second_bytes":1200000.0,
//!    "warmup_runs":3,"date":"2026-12-01T09:00:00Z"}},
//!  "learned":{"stt":{"bytes_per_job":44000000,"bytes_per_audio_second":1200000.0,"samples":12,
//!    "between_jobs":true}}}
//! ```
//!
//! An audio backend's figures are kept from its warm-up: `idle_bytes` before its first job,
//! `resident_bytes` the level it keeps between jobs, `peak_bytes` the highest. A job's need is
//! `peak − resident` however the figures were obtained; a start that skips the warm-up keeps
//! them as they are (it has nothing measured the same way to replace them with).

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// The version of the layout below; bumped only if a field changes meaning.
pub const CALIBRATION_FORMAT: u32 = 1;

/// Everything measured about one box.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    #[serde(default = "default_format")]
    pub format: u32,
    /// When the file was last written, RFC 3339 in UTC.
    pub date: String,
    /// The memory probe the figures were read with: `"host"` or `"nvml"`.
    #[serde(default)]
    pub probe: String,
    /// The pool's capacity when the figures were taken.
    #[serde(default)]
    pub capacity_bytes: u64,
    /// Versions seen, by backend name (a package version, an engine's self-report).
    #[serde(default)]
    pub versions: BTreeMap<String, String>,
    /// Measured footprints, by backend name.
    #[serde(default)]
    pub backends: BTreeMap<String, BackendCalibration>,
    /// What the gateway's ledger learned, by lane.
    #[serde(default)]
    pub learned: BTreeMap<String, LearnedLane>,
    /// Whether text slows each audio backend's job, by audio backend.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub contention: BTreeMap<String, ContentionFigures>,
}

/// An audio backend's job timed alone and beside the text lane's streaming generations (the
/// text engine started with `text_flags`), kept so a start with the same figures and flags skips
/// it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContentionFigures {
    pub alone_seconds: f64,
    pub with_text_seconds: f64,
    /// The longest gap between two tokens of the generation while the job ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text_step_seconds: Option<f64>,
    /// The text engine's flags when measured.
    pub text_flags: Vec<String>,
    /// Generations streamed beside the job (the text lane's sequences); files from before this
    /// field measured beside one.
    #[serde(default = "one_generation")]
    pub generations: u64,
    /// How `with_text_seconds` was taken: `"slowest of three beside prompts read"` (the slowest
    /// of three rounds, each beside requests that read prompts and write answers); `"median"` was the
    /// middle round beside decode-only generations and files from before this field kept the
    /// fastest of two (`"fastest"`): both are measured again.
    #[serde(default = "fastest")]
    pub with_text_of_rounds: String,
    #[serde(default)]
    pub date: String,
}

fn fastest() -> String {
    "fastest".into()
}

fn one_generation() -> u64 {
    1
}

fn default_format() -> u32 {
    CALIBRATION_FORMAT
}

/// One backend's measured footprint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendCalibration {
    /// `audio` or `text`.
    pub role: String,
    /// `vllm`, `llamacpp`, `whisper` or `other`.
    pub engine: String,
    /// Steady memory after start-up, before the first job (audio backends measured by a
    /// warm-up; absent in files of older versions, whose figures are measured again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_bytes: Option<u64>,
    /// Steady memory after the warm-up: the level the backend keeps between jobs.
    pub resident_bytes: u64,
    /// The highest memory seen during the warm-up.
    pub peak_bytes: u64,
    /// `(peak − resident) / audio seconds` of the warm-up job, where the job has a duration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_per_audio_second_bytes: Option<f64>,
    /// A speech backend: seconds of speech per input character at speed 1, from the audio its
    /// warm-up job answered with (the speech lane's `speech_seconds_per_char`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speech_seconds_per_char: Option<f64>,
    /// How many warm-up jobs the figures come from.
    #[serde(default)]
    pub warmup_runs: u32,
    /// When this backend was measured, RFC 3339 in UTC.
    #[serde(default)]
    pub date: String,
}

/// Per-lane figures learned from real traffic by the gateway's memory ledger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LearnedLane {
    /// Memory one job of the lane adds at its peak.
    pub bytes_per_job: u64,
    /// For audio lanes: memory per second of audio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes_per_audio_second: Option<f64>,
    /// How many jobs the figures come from.
    pub samples: u64,
    /// Measured above the level the backend keeps between jobs (false in files of older
    /// versions, which measured above the level before each job, counting what a backend keeps
    /// after its first job twice: such figures are not read back).
    #[serde(default)]
    pub between_jobs: bool,
}

/// Why a calibration file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CalibrationError {
    #[error("calibration file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("calibration file {path} is not valid: {source}")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error(
        "calibration file {path} has format {found}; this headroom reads format {CALIBRATION_FORMAT}"
    )]
    Format { path: PathBuf, found: u32 },
}

impl Calibration {
    /// An empty calibration dated now.
    pub fn new(probe: &str, capacity_bytes: u64) -> Self {
        Calibration {
            format: CALIBRATION_FORMAT,
            date: now_rfc3339(),
            probe: probe.to_string(),
            capacity_bytes,
            versions: BTreeMap::new(),
            backends: BTreeMap::new(),
            learned: BTreeMap::new(),
            contention: BTreeMap::new(),
        }
    }

    /// Reads and checks a calibration file.
    pub fn load(path: &Path) -> Result<Self, CalibrationError> {
        let text = fs::read_to_string(path).map_err(|source| CalibrationError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Reads a calibration file if there is one: `Ok(None)` when it does not exist.
    pub fn load_if_present(path: &Path) -> Result<Option<Self>, CalibrationError> {
        match fs::metadata(path) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(None),
            _ => Self::load(path).map(Some),
        }
    }

    fn parse(text: &str, path: &Path) -> Result<Self, CalibrationError> {
        let calibration: Calibration =
            serde_json::from_str(text).map_err(|source| CalibrationError::Parse {
                path: path.to_path_buf(),
                source,
            })?;
        if calibration.format != CALIBRATION_FORMAT {
            return Err(CalibrationError::Format {
                path: path.to_path_buf(),
                found: calibration.format,
            });
        }
        Ok(calibration)
    }

    /// Writes the file (pretty JSON) through a temporary file and a rename, so a reader never
    /// sees half a file, and a failure (a full disk, a path that is a folder) leaves neither
    /// half a file nor the temporary one. Sets `date` to now.
    pub fn save(&mut self, path: &Path) -> Result<(), CalibrationError> {
        self.date = now_rfc3339();
        // Serializing maps of plain numbers and strings cannot fail.
        let text = serde_json::to_string_pretty(self).unwrap_or_default() + "\n";
        write_replacing(path, text.as_bytes(), |file, bytes| file.write_all(bytes)).map_err(
            |source| CalibrationError::Io {
                path: path.to_path_buf(),
                source,
            },
        )
    }

    /// Records one backend's figures (dated now).
    pub fn set_backend(&mut self, name: &str, mut figures: BackendCalibration) {
        figures.date = now_rfc3339();
        self.backends.insert(name.to_string(), figures);
    }

    /// The sum of the audio backends' peaks: what `plan --reserve-from` reserves.
    pub fn audio_peak_bytes(&self) -> u64 {
        self.backends
            .values()
            .filter(|b| b.role == "audio")
            .map(|b| b.peak_bytes)
            .sum()
    }
}

/// Writes `bytes` (with `write`) to `PATH.tmp`, created afresh (a link planted under that name
/// is removed, not followed), then renames it over `path`. When a step fails the temporary file
/// is removed: a disk that fills up mid-write leaves no empty `.tmp` behind.
fn write_replacing(
    path: &Path,
    bytes: &[u8],
    write: impl FnOnce(&mut fs::File, &[u8]) -> io::Result<()>,
) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = fs::remove_file(&tmp);
    let written = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .and_then(|mut file| write(&mut file, bytes))
        .and_then(|()| fs::rename(&tmp, path));
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

/// The calibration file that belongs to a box file: `box.toml` → `box.calibration.json` in the
/// same folder.
pub fn calibration_path_for(box_file: &Path) -> PathBuf {
    let stem = box_file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "box".to_string());
    box_file.with_file_name(format!("{stem}.calibration.json"))
}

/// Now as RFC 3339 in UTC, e.g. `2026-12-01T09:00:00Z`.
pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// `at` as RFC 3339 in UTC, whole seconds.
pub fn rfc3339(at: SystemTime) -> String {
    let at = time::OffsetDateTime::from(at).replace_nanosecond(0);
    at.ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Calibration {
        let mut c = Calibration::new("host", 8 << 30);
        c.versions
            .insert("whisper".into(), "faster-whisper-server 0.0.3".into());
        c.set_backend(
            "whisper",
            BackendCalibration {
                role: "audio".into(),
                engine: "whisper".into(),
                idle_bytes: Some(80 << 20),
                resident_bytes: 300 << 20,
                peak_bytes: 360 << 20,
                peak_per_audio_second_bytes: Some(1.5e6),
                speech_seconds_per_char: None,
                warmup_runs: 3,
                date: String::new(),
            },
        );
        c.set_backend(
            "tts",
            BackendCalibration {
                role: "audio".into(),
                engine: "other".into(),
                idle_bytes: None,
                resident_bytes: 100 << 20,
                peak_bytes: 140 << 20,
                peak_per_audio_second_bytes: None,
                speech_seconds_per_char: None,
                warmup_runs: 1,
                date: String::new(),
            },
        );
        c.set_backend(
            "llm",
            BackendCalibration {
                role: "text".into(),
                engine: "llamacpp".into(),
                idle_bytes: None,
                resident_bytes: 900 << 20,
                peak_bytes: 950 << 20,
                peak_per_audio_second_bytes: None,
                speech_seconds_per_char: None,
                warmup_runs: 0,
                date: String::new(),
            },
        );
        c.learned.insert(
            "stt".into(),
            LearnedLane {
                bytes_per_job: 40 << 20,
                bytes_per_audio_second: Some(1.2e6),
                samples: 12,
                between_jobs: true,
            },
        );
        c
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("box.calibration.json");
        let mut c = sample();
        c.save(&path).unwrap();
        let back = Calibration::load(&path).unwrap();
        assert_eq!(back, c);
        assert!(!dir.path().join("box.calibration.json.tmp").exists());
    }

    #[test]
    fn a_save_that_fails_leaves_no_temporary_file_behind() {
        let dir = tempfile::tempdir().unwrap();
        // A calibration path that is a folder: the temporary file is written, the rename fails.
        let path = dir.path().join("box.calibration.json");
        std::fs::create_dir(&path).unwrap();
        let err = sample().save(&path).unwrap_err();
        assert!(matches!(err, CalibrationError::Io { .. }), "{err}");
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["box.calibration.json"], "left behind: {left:?}");
    }

    #[test]
    fn a_write_that_fails_midway_removes_its_temporary_file_and_keeps_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("box.calibration.json");
        std::fs::write(&path, "old").unwrap();
        // A disk that fills up after one byte.
        let full = |file: &mut fs::File, bytes: &[u8]| {
            file.write_all(&bytes[..1])?;
            Err(io::Error::from(io::ErrorKind::StorageFull))
        };
        let e = write_replacing(&path, b"new figures", full).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::StorageFull);
        assert!(!dir.path().join("box.calibration.json.tmp").exists());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        // A link planted under the temporary name is replaced, not written through.
        let elsewhere = dir.path().join("elsewhere");
        std::fs::write(&elsewhere, "untouched").unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir.path().join("box.calibration.json.tmp"))
            .unwrap();
        write_replacing(&path, b"new", |f, b| f.write_all(b)).unwrap();
        assert_eq!(std::fs::read_to_string(&elsewhere).unwrap(), "untouched");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
    }

    #[test]
    fn audio_peaks_sum_only_audio_backends() {
        assert_eq!(sample().audio_peak_bytes(), (360 + 140) << 20);
    }

    #[test]
    fn unknown_fields_are_ignored_and_missing_maps_default() {
        let path = Path::new("x.json");
        let c = Calibration::parse(
            r#"{"format":1,"date":"2026-12-01T09:00:00Z","extra":true}"#,
            path,
        )
        .unwrap();
        assert!(c.backends.is_empty() && c.learned.is_empty());
    }

    #[test]
    fn another_format_is_refused() {
        let err = Calibration::parse(r#"{"format":2,"date":""}"#, Path::new("x.json")).unwrap_err();
        assert!(matches!(err, CalibrationError::Format { found: 2, .. }));
    }

    #[test]
    fn a_missing_file_is_none_and_a_broken_one_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.json");
        assert!(Calibration::load_if_present(&missing).unwrap().is_none());
        let broken = dir.path().join("broken.json");
        fs::write(&broken, "{").unwrap();
        let err = Calibration::load_if_present(&broken).unwrap_err();
        assert!(err.to_string().contains("broken.json"), "{err}");
    }

    #[test]
    fn the_path_sits_beside_the_box_file() {
        assert_eq!(
            calibration_path_for(Path::new("/etc/box/cpu-box.up.toml")),
            PathBuf::from("/etc/box/cpu-box.up.calibration.json")
        );
    }

    #[test]
    fn dates_are_rfc3339_utc() {
        let at = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_796_115_600);
        assert_eq!(rfc3339(at), "2026-12-01T09:00:00Z");
    }
}
