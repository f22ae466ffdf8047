//! The sample file: one JSON object per line, one line per GPU per sampler tick. The sampler
//! writes it; `bench`, `soak` and `top --replay` read it. The format is described in
//! `docs/sample-format.md`; readers ignore fields they do not know, so fields may be added but
//! never renamed.
//!
//! ```text
//! {"ts_ms":1795000000000,"gpu":0,"used_bytes":8589934592,"free_bytes":16106127360,"total_bytes":25769803776,"reserved_bytes":314572800,"processes":[{"pid":4242,"name":"python3","used_bytes":8273461248}]}
//! ```

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::probe::{DeviceSnapshot, ProcessMemory};

/// One GPU at one sampler tick: one line of a sample file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sample {
    /// Wall-clock time of the tick, milliseconds since the Unix epoch.
    pub ts_ms: u64,
    /// Device index as NVML numbers it.
    pub gpu: u32,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// Device memory size; 0 in files that did not record it (then `used + free` is the best guess).
    #[serde(default)]
    pub total_bytes: u64,
    /// Memory the driver reserves for itself (included in `used_bytes`); 0 when not reported.
    #[serde(default)]
    pub reserved_bytes: u64,
    /// Device name, written only on the first tick of each GPU to keep lines short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization_percent: Option<u32>,
    #[serde(default)]
    pub processes: Vec<ProcessMemory>,
}

impl Sample {
    /// The sample for one device at `ts_ms`.
    pub fn from_device(ts_ms: u64, device: &DeviceSnapshot) -> Self {
        Sample {
            ts_ms,
            gpu: device.index,
            used_bytes: device.used_bytes,
            free_bytes: device.free_bytes,
            total_bytes: device.total_bytes,
            reserved_bytes: device.reserved_bytes,
            name: None,
            utilization_percent: device.utilization_percent,
            processes: device.processes.clone(),
        }
    }

    /// Device size, falling back to `used + free` for files without `total_bytes`.
    pub fn total(&self) -> u64 {
        if self.total_bytes > 0 {
            self.total_bytes
        } else {
            self.used_bytes.saturating_add(self.free_bytes)
        }
    }

    /// The memory figure floors are taken from: `used` minus the driver's reservation.
    pub fn used_without_reserved(&self) -> u64 {
        self.used_bytes.saturating_sub(self.reserved_bytes)
    }

    /// Memory held by `pid` on this GPU (0 when the process is not listed).
    pub fn process_used_bytes(&self, pid: u32) -> u64 {
        self.processes
            .iter()
            .filter(|p| p.pid == pid)
            .map(|p| p.used_bytes)
            .sum()
    }

    /// The sample as one JSON line without the newline.
    pub fn to_json_line(&self) -> String {
        // Serializing plain integers, strings and vectors cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What [`floor`] measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorOf {
    /// The whole device: `used - reserved`.
    Device,
    /// One process's memory.
    Process(u32),
}

/// The lowest memory seen on `gpu` with `from_ms <= ts_ms < to_ms`: the idle floor of a quiet gap
/// between rounds. `None` when no sample falls in the window.
pub fn floor(samples: &[Sample], gpu: u32, from_ms: u64, to_ms: u64, of: FloorOf) -> Option<u64> {
    samples
        .iter()
        .filter(|s| s.gpu == gpu && s.ts_ms >= from_ms && s.ts_ms < to_ms)
        .map(|s| match of {
            FloorOf::Device => s.used_without_reserved(),
            FloorOf::Process(pid) => s.process_used_bytes(pid),
        })
        .min()
}

/// The highest `used_bytes` seen on `gpu` in `[from_ms, to_ms)`.
pub fn peak(samples: &[Sample], gpu: u32, from_ms: u64, to_ms: u64) -> Option<u64> {
    samples
        .iter()
        .filter(|s| s.gpu == gpu && s.ts_ms >= from_ms && s.ts_ms < to_ms)
        .map(|s| s.used_bytes)
        .max()
}

/// Why a sample file could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SampleFileError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a sample line: {message}")]
    BadLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("{path}: no samples in the file")]
    Empty { path: PathBuf },
}

/// Appends samples to a file as JSON lines. Lines reach the file when [`SampleWriter::flush`] runs
/// (the sampler flushes a few times a second and when it stops).
#[derive(Debug)]
pub struct SampleWriter {
    path: PathBuf,
    out: BufWriter<File>,
    named: Vec<u32>,
}

impl SampleWriter {
    /// Opens `path` for appending, creating it if needed.
    pub fn append(path: &Path) -> Result<Self, SampleFileError> {
        let file = File::options()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| SampleFileError::Io {
                path: path.to_path_buf(),
                source,
            })?;
        Ok(SampleWriter {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(64 * 1024, file),
            named: Vec::new(),
        })
    }

    /// Writes one line. The device name is added the first time each GPU is written.
    pub fn write(&mut self, sample: &Sample, device_name: &str) -> Result<(), SampleFileError> {
        let result = if sample.name.is_none() && !self.named.contains(&sample.gpu) {
            self.named.push(sample.gpu);
            let mut named = sample.clone();
            named.name = Some(device_name.to_string());
            serde_json::to_writer(&mut self.out, &named).map_err(std::io::Error::from)
        } else {
            serde_json::to_writer(&mut self.out, sample).map_err(std::io::Error::from)
        };
        result
            .and_then(|()| self.out.write_all(b"\n"))
            .map_err(|source| self.io(source))
    }

    /// Pushes buffered lines to the file.
    pub fn flush(&mut self) -> Result<(), SampleFileError> {
        self.out.flush().map_err(|source| self.io(source))
    }

    fn io(&self, source: std::io::Error) -> SampleFileError {
        SampleFileError::Io {
            path: self.path.clone(),
            source,
        }
    }
}

/// Reads a whole sample file. Blank lines are skipped; any other line that is not a sample is an
/// error naming the line. A file with no samples is an error too.
pub fn read_samples(path: &Path) -> Result<Vec<Sample>, SampleFileError> {
    let file = File::open(path).map_err(|source| SampleFileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let samples = parse_samples(file, path)?;
    if samples.is_empty() {
        return Err(SampleFileError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(samples)
}

/// Parses sample lines from any reader; `path` only names the source in errors.
pub fn parse_samples(input: impl Read, path: &Path) -> Result<Vec<Sample>, SampleFileError> {
    let mut samples = Vec::new();
    for (i, line) in BufReader::new(input).lines().enumerate() {
        let line = line.map_err(|source| SampleFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        let sample: Sample = serde_json::from_str(text).map_err(|e| SampleFileError::BadLine {
            path: path.to_path_buf(),
            line: i + 1,
            message: e.to_string(),
        })?;
        samples.push(sample);
    }
    Ok(samples)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ts_ms: u64, gpu: u32, used: u64) -> Sample {
        let mut device = DeviceSnapshot::with_memory(gpu, 1000, used);
        device.processes.push(ProcessMemory {
            pid: 9,
            name: "llm".into(),
            used_bytes: used / 2,
        });
        Sample::from_device(ts_ms, &device)
    }

    #[test]
    fn written_file_reads_back_identically_with_names_on_first_lines() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.jsonl");
        let written = vec![sample(1, 0, 10), sample(1, 1, 20), sample(2, 0, 30)];
        let mut writer = SampleWriter::append(&path).expect("open");
        for s in &written {
            writer.write(s, &format!("card{}", s.gpu)).expect("write");
        }
        writer.flush().expect("flush");
        let read = read_samples(&path).expect("read");
        assert_eq!(read.len(), 3);
        assert_eq!(read[0].name.as_deref(), Some("card0"));
        assert_eq!(read[1].name.as_deref(), Some("card1"));
        assert_eq!(read[2].name, None);
        let unnamed: Vec<Sample> = read
            .into_iter()
            .map(|mut s| {
                s.name = None;
                s
            })
            .collect();
        assert_eq!(unnamed, written);
    }

    #[test]
    fn minimal_lines_and_unknown_fields_are_accepted() {
        let text = "{\"ts_ms\":5,\"gpu\":0,\"used_bytes\":7,\"free_bytes\":3,\"processes\":[],\"future\":1}\n\n";
        let samples = parse_samples(text.as_bytes(), Path::new("x")).expect("parse");
        assert_eq!(samples.len(), 1);
        assert_eq!(samples[0].total(), 10, "total falls back to used + free");
    }

    #[test]
    fn a_bad_line_is_named_by_number() {
        let text = "{\"ts_ms\":5,\"gpu\":0,\"used_bytes\":7,\"free_bytes\":3}\nnot json\n";
        let err = parse_samples(text.as_bytes(), Path::new("rec.jsonl")).unwrap_err();
        let message = err.to_string();
        assert!(
            message.starts_with("rec.jsonl:2: not a sample line"),
            "{message}"
        );
    }

    #[test]
    fn an_empty_file_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty.jsonl");
        std::fs::write(&path, "\n").expect("write");
        assert!(matches!(
            read_samples(&path),
            Err(SampleFileError::Empty { .. })
        ));
    }

    #[test]
    fn floor_and_peak_look_only_inside_the_window_and_gpu() {
        let samples = vec![
            sample(0, 0, 500),
            sample(10, 0, 300),
            sample(20, 0, 400),
            sample(20, 1, 100),
            sample(30, 0, 200),
        ];
        assert_eq!(floor(&samples, 0, 5, 30, FloorOf::Device), Some(300));
        assert_eq!(floor(&samples, 0, 5, 30, FloorOf::Process(9)), Some(150));
        assert_eq!(floor(&samples, 0, 100, 200, FloorOf::Device), None);
        assert_eq!(peak(&samples, 0, 0, 30), Some(500));
        assert_eq!(peak(&samples, 1, 0, 30), Some(100));
    }
}
