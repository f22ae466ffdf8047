//! Safetensors headers, read without the tensor data: an 8-byte little-endian header length, then
//! that many bytes of JSON naming each tensor's dtype, shape and byte range. Sharded checkpoints
//! list their shards in `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::InspectError;

/// Headers larger than this are refused (the safetensors format's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Suffix of a shard's header kept without its tensors (`model.safetensors.headroom-header`: the
/// first `8 + n` bytes of the shard, as `headroom-hub` reads them from the Hub). Named so that no
/// `*.safetensors` glob, vLLM or huggingface_hub takes it for the shard; only the header is read
/// from it, as from a whole shard.
pub const HEADER_ONLY_SUFFIX: &str = ".headroom-header";

/// The shard `name` in `dir`, or the header kept of it.
fn shard_or_header(dir: &Path, name: &str) -> Option<PathBuf> {
    let whole = dir.join(name);
    if whole.is_file() {
        return Some(whole);
    }
    let header = dir.join(format!("{name}{HEADER_ONLY_SUFFIX}"));
    header.is_file().then_some(header)
}

/// What one file's header says.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeaderSummary {
    pub tensors: u64,
    /// Sum of every tensor's byte range.
    pub tensor_bytes: u64,
    /// Bytes per dtype name (`BF16`, `F32`, `I32`, ...).
    pub bytes_by_dtype: BTreeMap<String, u64>,
    /// Bytes the reader consumed: 8 + the header length, never tensor data.
    pub bytes_read: u64,
}

impl HeaderSummary {
    /// The dtype holding the most bytes.
    pub fn dominant_dtype(&self) -> Option<&str> {
        self.bytes_by_dtype
            .iter()
            .max_by_key(|(_, b)| **b)
            .map(|(d, _)| d.as_str())
    }

    fn add(&mut self, other: &HeaderSummary) {
        self.tensors += other.tensors;
        self.tensor_bytes += other.tensor_bytes;
        self.bytes_read += other.bytes_read;
        for (d, b) in &other.bytes_by_dtype {
            *self.bytes_by_dtype.entry(d.clone()).or_default() += b;
        }
    }
}

#[derive(Deserialize)]
struct TensorEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Bits per element of a safetensors dtype.
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" | "C64" => 64,
        "F32" | "I32" | "U32" => 32,
        "F16" | "BF16" | "I16" | "U16" => 16,
        "F8_E4M3" | "F8_E5M2" | "F8_E8M0" | "I8" | "U8" | "BOOL" => 8,
        "F6_E2M3" | "F6_E3M2" => 6,
        "F4" => 4,
        _ => return None,
    })
}

/// Reads one header from `reader`, consuming exactly `8 + n` bytes.
pub fn read_header(mut reader: impl Read, file: &str) -> Result<HeaderSummary, InspectError> {
    let malformed = |reason: String| InspectError::Malformed {
        file: file.to_string(),
        reason,
    };
    let mut len = [0u8; 8];
    reader
        .read_exact(&mut len)
        .map_err(|_| malformed("shorter than the 8-byte safetensors header length".into()))?;
    let n = u64::from_le_bytes(len);
    if n == 0 || n > MAX_HEADER_BYTES {
        return Err(malformed(format!(
            "header length {n} is outside 1..={MAX_HEADER_BYTES}: not a safetensors file"
        )));
    }
    // The buffer grows with the bytes that actually arrive: a length field alone never makes
    // this allocate (the cap above bounds what a real header may take).
    let mut header = Vec::new();
    let got = (&mut reader)
        .take(n)
        .read_to_end(&mut header)
        .map_err(|_| malformed(format!("header declares {n} bytes but cannot be read")))?;
    if got as u64 != n {
        return Err(malformed(format!(
            "header declares {n} bytes but the file ends sooner"
        )));
    }
    let json: BTreeMap<String, Value> = serde_json::from_slice(&header)
        .map_err(|e| malformed(format!("header is not valid JSON: {e}")))?;
    let mut summary = HeaderSummary {
        bytes_read: 8 + n,
        ..HeaderSummary::default()
    };
    for (name, value) in json {
        if name == "__metadata__" {
            continue;
        }
        let t: TensorEntry = serde_json::from_value(value)
            .map_err(|e| malformed(format!("tensor '{name}': {e}")))?;
        let [start, end] = t.data_offsets;
        if end < start {
            return Err(malformed(format!("tensor '{name}' ends before it starts")));
        }
        let bytes = end - start;
        if let Some(bits) = dtype_bits(&t.dtype) {
            let elements: u64 = t.shape.iter().product();
            let expected = (elements * bits).div_ceil(8);
            if expected != bytes {
                return Err(malformed(format!(
                    "tensor '{name}' declares {bytes} bytes but {:?} {} needs {expected}",
                    t.shape, t.dtype
                )));
            }
        }
        summary.tensors += 1;
        summary.tensor_bytes += bytes;
        *summary.bytes_by_dtype.entry(t.dtype).or_default() += bytes;
    }
    Ok(summary)
}

/// Reads the header of one `.safetensors` file.
pub fn read_file_header(path: &Path) -> Result<HeaderSummary, InspectError> {
    let file = File::open(path).map_err(|e| InspectError::io(path, e))?;
    read_header(file, &path.display().to_string())
}

/// What a sharded checkpoint's index says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardIndex {
    pub total_size: Option<u64>,
    pub shards: Vec<String>,
}

/// Parses `model.safetensors.index.json`.
pub fn read_index(path: &Path) -> Result<ShardIndex, InspectError> {
    let text = std::fs::read_to_string(path).map_err(|e| InspectError::io(path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| InspectError::Malformed {
        file: path.display().to_string(),
        reason: format!("not valid JSON: {e}"),
    })?;
    let total_size = v
        .pointer("/metadata/total_size")
        .and_then(|t| t.as_u64().or_else(|| t.as_f64().map(|f| f as u64)));
    let mut shards: Vec<String> = v
        .get("weight_map")
        .and_then(Value::as_object)
        .map(|m| {
            m.values()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    Ok(ShardIndex { total_size, shards })
}

/// Weight bytes of every safetensors file in `dir`, from headers (all shards present) or from the
/// index's `total_size`. `None` when the directory holds no safetensors.
pub fn weights_in_dir(dir: &Path) -> Result<Option<(HeaderSummary, bool)>, InspectError> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf>;
    let mut index_total = None;
    if index.is_file() {
        let idx = read_index(&index)?;
        index_total = idx.total_size;
        let found: Vec<Option<PathBuf>> =
            idx.shards.iter().map(|s| shard_or_header(dir, s)).collect();
        files = found.iter().flatten().cloned().collect();
        if found.iter().any(Option::is_none) {
            return Ok(index_total.map(|t| {
                (
                    HeaderSummary {
                        tensor_bytes: t,
                        ..HeaderSummary::default()
                    },
                    false,
                )
            }));
        }
    } else {
        let entries = std::fs::read_dir(dir).map_err(|e| InspectError::io(dir, e))?;
        let mut names: Vec<String> = entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(String::from))
            .filter_map(|n| {
                n.strip_suffix(HEADER_ONLY_SUFFIX)
                    .map(String::from)
                    .or(Some(n))
                    .filter(|n| n.ends_with(".safetensors"))
            })
            .collect();
        names.sort();
        names.dedup();
        files = names
            .iter()
            .filter_map(|n| shard_or_header(dir, n))
            .collect();
    }
    if files.is_empty() {
        return Ok(None);
    }
    let mut total = HeaderSummary::default();
    for f in &files {
        total.add(&read_file_header(f)?);
    }
    let _ = index_total;
    Ok(Some((total, true)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_bytes(json: &str) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v
    }

    #[test]
    fn sums_tensor_bytes_by_dtype() {
        let json = r#"{"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[4,8],"data_offsets":[0,64]},"b":{"dtype":"F32","shape":[2],"data_offsets":[64,72]}}"#;
        let mut data = header_bytes(json);
        data.extend_from_slice(&[0u8; 72]);
        let s = read_header(&data[..], "t.safetensors").unwrap();
        assert_eq!(s.tensors, 2);
        assert_eq!(s.tensor_bytes, 72);
        assert_eq!(s.dominant_dtype(), Some("BF16"));
        assert_eq!(s.bytes_read, 8 + json.len() as u64);
    }

    #[test]
    fn inconsistent_or_truncated_headers_are_errors() {
        let bad_size = r#"{"a":{"dtype":"BF16","shape":[4,8],"data_offsets":[0,63]}}"#;
        assert!(read_header(&header_bytes(bad_size)[..], "x").is_err());
        let mut short = header_bytes(r#"{"a":1}"#);
        short.truncate(10);
        assert!(read_header(&short[..], "x").is_err());
        assert!(read_header(&b"\xff\xff\xff\xff\xff\xff\xff\xff"[..], "x").is_err());
        assert!(read_header(&header_bytes("not json")[..], "x").is_err());
    }

    #[test]
    fn header_only_files_stand_for_their_shards_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let a = r#"{"a":{"dtype":"BF16","shape":[1024,1024],"data_offsets":[0,2097152]}}"#;
        let b = r#"{"b":{"dtype":"F32","shape":[256],"data_offsets":[0,1024]}}"#;
        // One shard whole (its data a hole), one as the header the Hub reader keeps.
        let whole = dir.path().join("m-1.safetensors");
        std::fs::write(&whole, header_bytes(a)).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&whole)
            .unwrap()
            .set_len(8 + a.len() as u64 + 2_097_152)
            .unwrap();
        std::fs::write(
            dir.path()
                .join(format!("m-2.safetensors{HEADER_ONLY_SUFFIX}")),
            header_bytes(b),
        )
        .unwrap();
        let (sum, from_headers) = weights_in_dir(dir.path()).unwrap().unwrap();
        assert!(from_headers);
        assert_eq!(sum.tensor_bytes, 2_097_152 + 1024);
        assert_eq!(sum.tensors, 2);
        // With an index naming them, the same.
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            r#"{"weight_map":{"a":"m-1.safetensors","b":"m-2.safetensors"}}"#,
        )
        .unwrap();
        let (sum, _) = weights_in_dir(dir.path()).unwrap().unwrap();
        assert_eq!(sum.tensor_bytes, 2_097_152 + 1024);
        // A header file is never taken for a shard by name.
        assert!(!format!("m-2.safetensors{HEADER_ONLY_SUFFIX}").ends_with(".safetensors"));
    }

    /// Bytes this process has read through read(2) so far (Linux `/proc/self/io` `rchar`).
    fn bytes_read_by_process() -> Option<u64> {
        let io = std::fs::read_to_string("/proc/self/io").ok()?;
        io.lines()
            .find_map(|l| l.strip_prefix("rchar: "))
            .and_then(|v| v.trim().parse().ok())
    }

    #[test]
    fn a_sparse_sharded_checkpoint_is_summed_without_reading_tensor_data() {
        let dir = tempfile::tempdir().unwrap();
        let mut declared = 0;
        let mut shards = Vec::new();
        for i in 0..3u64 {
            let rows = 1u64 << 18;
            let bytes = rows * 4096 * 2;
            let json = format!(
                r#"{{"w{i}":{{"dtype":"BF16","shape":[{rows},4096],"data_offsets":[0,{bytes}]}}}}"#
            );
            let name = format!("model-0000{i}-of-00003.safetensors");
            let path = dir.path().join(&name);
            let f = std::fs::File::create(&path).unwrap();
            use std::io::Write;
            (&f).write_all(&header_bytes(&json)).unwrap();
            f.set_len(8 + json.len() as u64 + bytes).unwrap();
            declared += bytes;
            shards.push(format!(r#""w{i}":"{name}""#));
        }
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            format!(r#"{{"weight_map":{{{}}}}}"#, shards.join(",")),
        )
        .unwrap();
        assert_eq!(declared, 6 << 30);
        let before = bytes_read_by_process();
        let (summary, from_headers) = weights_in_dir(dir.path()).unwrap().unwrap();
        let after = bytes_read_by_process();
        assert!(from_headers);
        assert_eq!(summary.tensor_bytes, declared);
        assert_eq!(summary.tensors, 3);
        if let (Some(b), Some(a)) = (before, after) {
            // 6 GiB declared; well under a MiB read (other tests in this process read a little too).
            assert!(a - b < 1 << 20, "read {} bytes", a - b);
        }
    }
}
