//! What to send: request kinds, prompts (from a JSONL file or generated to a token length), audio
//! files from a folder, and the TOML scenario file that mixes several kinds with their own load.
//!
//! ```toml
//! # two chat streams in a closed loop plus one transcription every 10 s
//! [[request]]
//! name = "chat"
//! kind = "chat"          # chat | completions | transcription | speech
//! stream = true
//! concurrency = 2        # own closed loop; or `rate = 0.1` (+ `burstiness`) for an open loop
//! max_tokens = 128
//! input_tokens = 256     # generated prompt length; or `prompts = "prompts.jsonl"`
//!
//! [[request]]
//! name = "asr"
//! kind = "transcription"
//! audio_dir = "clips/"
//! rate = 0.1
//! ```
//!
//! Entries without their own `concurrency` or `rate` share the run's `--concurrency`/`--rate`,
//! picked in proportion to `weight`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;

use crate::BenchError;

/// The four request kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestKind {
    Chat,
    Completions,
    Transcription,
    Speech,
}

impl RequestKind {
    pub fn as_str(self) -> &'static str {
        match self {
            RequestKind::Chat => "chat",
            RequestKind::Completions => "completions",
            RequestKind::Transcription => "transcription",
            RequestKind::Speech => "speech",
        }
    }

    pub fn parse(text: &str) -> Result<Self, BenchError> {
        match text {
            "chat" => Ok(RequestKind::Chat),
            "completions" | "completion" => Ok(RequestKind::Completions),
            "transcription" | "transcriptions" => Ok(RequestKind::Transcription),
            "speech" | "tts" => Ok(RequestKind::Speech),
            other => Err(BenchError::BadInput(format!(
                "unknown request kind `{other}` (chat, completions, transcription, speech)"
            ))),
        }
    }

    /// Path under the `/v1` root.
    pub fn path(self) -> &'static str {
        match self {
            RequestKind::Chat => "/v1/chat/completions",
            RequestKind::Completions => "/v1/completions",
            RequestKind::Transcription => "/v1/audio/transcriptions",
            RequestKind::Speech => "/v1/audio/speech",
        }
    }
}

/// Load shape of a group of requests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// `n` workers, each sending its next request when the previous one ends.
    Closed { concurrency: u32 },
    /// Arrivals at `rate` per second whatever the server does; gaps Poisson (burstiness 1) or gamma.
    Open { rate: f64, burstiness: f64 },
}

impl Load {
    pub fn validate(&self) -> Result<(), BenchError> {
        match *self {
            Load::Closed { concurrency: 0 } => Err(BenchError::BadInput(
                "concurrency must be at least 1".into(),
            )),
            Load::Open { rate, .. } if !(1e-6..=1e7).contains(&rate) => {
                Err(BenchError::BadInput(format!(
                    "rate must be between 0.000001 and 10000000 requests per second, got {rate:?}"
                )))
            }
            Load::Open { burstiness, .. } if !(0.01..=100.0).contains(&burstiness) => {
                Err(BenchError::BadInput(format!(
                    "burstiness must be between 0.01 and 100, got {burstiness:?}"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// Prompts to draw from, in order, cycling.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompts {
    List(Vec<String>),
    /// Generated text of about `input_tokens` tokens (one short word per token).
    Generated {
        input_tokens: u32,
    },
}

impl Prompts {
    /// The `i`-th prompt. Generated prompts differ per request so a prefix cache cannot serve them.
    pub fn get(&self, i: u64) -> String {
        match self {
            Prompts::List(list) => list[(i % list.len() as u64) as usize].clone(),
            Prompts::Generated { input_tokens } => generated_prompt(*input_tokens, i),
        }
    }

    /// Reads a JSONL file: each line a JSON string, or an object with `prompt`, `text` or
    /// `messages` (the last user message's content is used).
    pub fn from_jsonl(path: &Path) -> Result<Self, BenchError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            BenchError::BadInput(format!("cannot read prompts file {}: {e}", path.display()))
        })?;
        let mut list = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let bad = |why: &str| {
                BenchError::BadInput(format!(
                    "prompts file {} line {}: {why}",
                    path.display(),
                    n + 1
                ))
            };
            let value: serde_json::Value =
                serde_json::from_str(line).map_err(|e| bad(&format!("not JSON ({e})")))?;
            let prompt = match &value {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o
                    .get("prompt")
                    .or_else(|| o.get("text"))
                    .and_then(|v| v.as_str())
                    .map(str::to_string)
                    .or_else(|| {
                        o.get("messages")?
                            .as_array()?
                            .iter()
                            .rev()
                            .find_map(|m| m.get("content")?.as_str().map(str::to_string))
                    }),
                _ => None,
            };
            list.push(prompt.ok_or_else(|| bad("no `prompt`, `text` or `messages`"))?);
        }
        if list.is_empty() {
            return Err(BenchError::BadInput(format!(
                "prompts file {} has no prompts",
                path.display()
            )));
        }
        Ok(Prompts::List(list))
    }
}

const WORDS: &[&str] = &[
    "the", "river", "stone", "light", "window", "quiet", "green", "paper", "seven", "market",
    "cloud", "orange", "table", "winter", "garden", "music", "north", "bridge", "silver", "horse",
];

fn generated_prompt(tokens: u32, i: u64) -> String {
    let mut out = format!("Request {i}:");
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..tokens.saturating_sub(3) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

/// One audio file to upload, read once.
#[derive(Debug, Clone)]
pub struct AudioClip {
    pub file_name: String,
    pub mime: &'static str,
    pub bytes: Arc<Vec<u8>>,
    /// Length in seconds when the header tells (WAV); used for RTFx.
    pub seconds: Option<f64>,
}

const AUDIO_EXTENSIONS: &[(&str, &str)] = &[
    ("wav", "audio/wav"),
    ("mp3", "audio/mpeg"),
    ("flac", "audio/flac"),
    ("ogg", "audio/ogg"),
    ("opus", "audio/ogg"),
    ("m4a", "audio/mp4"),
    ("webm", "audio/webm"),
];

/// Every audio file (by extension) directly in `dir`, sorted by name.
pub fn load_audio_dir(dir: &Path) -> Result<Vec<AudioClip>, BenchError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        BenchError::BadInput(format!("cannot read audio folder {}: {e}", dir.display()))
    })?;
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && mime_of(p).is_some())
        .collect();
    paths.sort();
    if paths.is_empty() {
        return Err(BenchError::BadInput(format!(
            "audio folder {} has no audio files (wav, mp3, flac, ogg, opus, m4a, webm)",
            dir.display()
        )));
    }
    paths
        .iter()
        .map(|p| {
            let bytes = std::fs::read(p)
                .map_err(|e| BenchError::BadInput(format!("cannot read {}: {e}", p.display())))?;
            Ok(AudioClip {
                file_name: p
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                mime: mime_of(p).unwrap_or("application/octet-stream"),
                seconds: wav_seconds(&bytes),
                bytes: Arc::new(bytes),
            })
        })
        .collect()
}

fn mime_of(path: &Path) -> Option<&'static str> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    AUDIO_EXTENSIONS
        .iter()
        .find(|(e, _)| *e == ext)
        .map(|(_, m)| *m)
}

/// Duration of a RIFF/WAVE file from its `fmt ` and `data` chunks.
pub fn wav_seconds(bytes: &[u8]) -> Option<f64> {
    if bytes.len() < 12 || &bytes[0..4] != b"RIFF" || &bytes[8..12] != b"WAVE" {
        return None;
    }
    let mut pos = 12;
    let mut byte_rate = None;
    while pos + 8 <= bytes.len() {
        let id = &bytes[pos..pos + 4];
        let size = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().ok()?) as usize;
        let body = pos + 8;
        if id == b"fmt " && body + 12 <= bytes.len() {
            byte_rate = Some(u32::from_le_bytes(
                bytes[body + 8..body + 12].try_into().ok()?,
            ));
        }
        if id == b"data" {
            let rate = byte_rate.filter(|r| *r > 0)? as f64;
            let len = size.min(bytes.len() - body);
            return Some(len as f64 / rate);
        }
        pos = body + size + (size & 1);
    }
    None
}

/// One kind of request the run sends.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Label in the report (`by_kind`); defaults to the kind.
    pub name: String,
    pub kind: RequestKind,
    pub stream: bool,
    /// Base URL (with or without `/v1`).
    pub url: String,
    pub model: String,
    pub api_key: Option<String>,
    pub max_tokens: u32,
    pub prompts: Arc<Prompts>,
    pub audio: Arc<Vec<AudioClip>>,
    pub voice: String,
    pub weight: u32,
    /// Own load; `None` shares the run's load.
    pub load: Option<Load>,
    /// The parsed endpoint, filled on first use (parsing it per request costs throughput).
    pub endpoint_url: std::sync::OnceLock<Option<reqwest::Url>>,
}

impl RequestSpec {
    /// The full endpoint URL.
    pub fn endpoint(&self) -> String {
        let base = self.url.trim_end_matches('/');
        let base = base.strip_suffix("/v1").unwrap_or(base);
        format!("{base}{}", self.kind.path())
    }

    /// [`RequestSpec::endpoint`] parsed once; `None` when it is not a valid URL.
    pub fn endpoint_url(&self) -> Option<&reqwest::Url> {
        self.endpoint_url
            .get_or_init(|| reqwest::Url::parse(&self.endpoint()).ok())
            .as_ref()
    }
}

/// Defaults for scenario entries, from the command line.
#[derive(Debug, Clone)]
pub struct SpecDefaults {
    pub url: String,
    pub model: String,
    pub api_key: Option<String>,
    pub max_tokens: u32,
    pub input_tokens: u32,
    pub prompts_file: Option<PathBuf>,
    pub audio_dir: Option<PathBuf>,
    pub voice: String,
    pub stream: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioFile {
    #[serde(default)]
    name: Option<String>,
    request: Vec<ScenarioEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScenarioEntry {
    name: Option<String>,
    kind: RequestKind,
    stream: Option<bool>,
    url: Option<String>,
    model: Option<String>,
    max_tokens: Option<u32>,
    input_tokens: Option<u32>,
    prompts: Option<PathBuf>,
    audio_dir: Option<PathBuf>,
    voice: Option<String>,
    weight: Option<u32>,
    concurrency: Option<u32>,
    rate: Option<f64>,
    burstiness: Option<f64>,
}

/// A parsed scenario: its name and its request specs.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: String,
    pub specs: Vec<RequestSpec>,
}

/// Parses scenario TOML text; relative paths resolve against `base_dir`.
pub fn parse_scenario(
    text: &str,
    origin: &str,
    base_dir: &Path,
    defaults: &SpecDefaults,
) -> Result<Scenario, BenchError> {
    let file: ScenarioFile = toml::from_str(text).map_err(|e| {
        let message = e.message().to_string();
        BenchError::BadInput(format!("scenario {origin}: {message}"))
    })?;
    if file.request.is_empty() {
        return Err(BenchError::BadInput(format!(
            "scenario {origin}: no [[request]] entries"
        )));
    }
    let mut specs = Vec::new();
    for entry in file.request {
        let resolve = |p: PathBuf| if p.is_absolute() { p } else { base_dir.join(p) };
        let load = match (entry.concurrency, entry.rate) {
            (Some(_), Some(_)) => {
                return Err(BenchError::BadInput(format!(
                    "scenario {origin}: an entry has both `concurrency` and `rate`; pick one"
                )));
            }
            (Some(concurrency), None) => Some(Load::Closed { concurrency }),
            (None, Some(rate)) => Some(Load::Open {
                rate,
                burstiness: entry.burstiness.unwrap_or(1.0),
            }),
            (None, None) => None,
        };
        if let Some(load) = &load {
            load.validate()
                .map_err(|e| BenchError::BadInput(format!("scenario {origin}: {e}")))?;
        }
        let spec = build_spec(
            entry.kind,
            SpecOverrides {
                name: entry.name,
                stream: entry.stream,
                url: entry.url,
                model: entry.model,
                max_tokens: entry.max_tokens,
                input_tokens: entry.input_tokens,
                prompts: entry.prompts.map(resolve),
                audio_dir: entry.audio_dir.map(resolve),
                voice: entry.voice,
                weight: entry.weight,
                load,
            },
            defaults,
        )
        .map_err(|e| match e {
            BenchError::BadInput(m) => BenchError::BadInput(format!("scenario {origin}: {m}")),
            other => other,
        })?;
        specs.push(spec);
    }
    Ok(Scenario {
        name: file.name.unwrap_or_else(|| origin.to_string()),
        specs,
    })
}

/// Per-entry settings that override the defaults.
#[derive(Debug, Default)]
pub struct SpecOverrides {
    pub name: Option<String>,
    pub stream: Option<bool>,
    pub url: Option<String>,
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub input_tokens: Option<u32>,
    pub prompts: Option<PathBuf>,
    pub audio_dir: Option<PathBuf>,
    pub voice: Option<String>,
    pub weight: Option<u32>,
    pub load: Option<Load>,
}

/// Builds one spec, loading its prompts or audio.
pub fn build_spec(
    kind: RequestKind,
    o: SpecOverrides,
    d: &SpecDefaults,
) -> Result<RequestSpec, BenchError> {
    let prompts = match o.prompts.as_ref().or(d.prompts_file.as_ref()) {
        Some(path)
            if matches!(
                kind,
                RequestKind::Chat | RequestKind::Completions | RequestKind::Speech
            ) =>
        {
            Prompts::from_jsonl(path)?
        }
        _ => Prompts::Generated {
            input_tokens: o.input_tokens.unwrap_or(d.input_tokens).max(1),
        },
    };
    let audio = if kind == RequestKind::Transcription {
        let dir = o
            .audio_dir
            .as_ref()
            .or(d.audio_dir.as_ref())
            .ok_or_else(|| {
                BenchError::BadInput(
                    "transcription requests need an audio folder (--audio-dir)".into(),
                )
            })?;
        load_audio_dir(dir)?
    } else {
        Vec::new()
    };
    let weight = o.weight.unwrap_or(1);
    if weight == 0 {
        return Err(BenchError::BadInput("weight must be at least 1".into()));
    }
    Ok(RequestSpec {
        name: o.name.unwrap_or_else(|| kind.as_str().to_string()),
        kind,
        // Transcription and speech answer whole unless a scenario entry asks for a stream.
        stream: match kind {
            RequestKind::Chat | RequestKind::Completions => o.stream.unwrap_or(d.stream),
            RequestKind::Transcription => o.stream.unwrap_or(false),
            RequestKind::Speech => false,
        },
        url: o.url.unwrap_or_else(|| d.url.clone()),
        model: o.model.unwrap_or_else(|| d.model.clone()),
        api_key: d.api_key.clone(),
        max_tokens: o.max_tokens.unwrap_or(d.max_tokens),
        prompts: Arc::new(prompts),
        audio: Arc::new(audio),
        voice: o.voice.unwrap_or_else(|| d.voice.clone()),
        weight,
        load: o.load,
        endpoint_url: std::sync::OnceLock::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> SpecDefaults {
        SpecDefaults {
            url: "http://127.0.0.1:1/v1/".into(),
            model: "m".into(),
            api_key: None,
            max_tokens: 16,
            input_tokens: 8,
            prompts_file: None,
            audio_dir: None,
            voice: "alloy".into(),
            stream: true,
        }
    }

    #[test]
    fn endpoint_joins_with_or_without_v1() {
        let mut spec =
            build_spec(RequestKind::Chat, SpecOverrides::default(), &defaults()).unwrap();
        assert_eq!(spec.endpoint(), "http://127.0.0.1:1/v1/chat/completions");
        spec.url = "http://h:2".into();
        spec.kind = RequestKind::Speech;
        assert_eq!(spec.endpoint(), "http://h:2/v1/audio/speech");
    }

    #[test]
    fn scenario_mixes_kinds_with_own_loads() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.wav"), wav(16000, 8000)).unwrap();
        let text = r#"
            name = "mix"
            [[request]]
            kind = "chat"
            concurrency = 2
            max_tokens = 32
            [[request]]
            name = "asr"
            kind = "transcription"
            audio_dir = "."
            rate = 0.1
        "#;
        let s = parse_scenario(text, "mix.toml", dir.path(), &defaults()).unwrap();
        assert_eq!(s.name, "mix");
        assert_eq!(s.specs.len(), 2);
        assert_eq!(s.specs[0].load, Some(Load::Closed { concurrency: 2 }));
        assert_eq!(s.specs[0].max_tokens, 32);
        assert_eq!(s.specs[1].name, "asr");
        assert_eq!(s.specs[1].audio.len(), 1);
        assert_eq!(s.specs[1].audio[0].seconds, Some(0.5));
    }

    #[test]
    fn malformed_scenarios_say_what_is_wrong() {
        let d = defaults();
        let here = Path::new(".");
        for (text, needle) in [
            ("[[request]]\nkind = \"fax\"", "fax"),
            (
                "[[request]]\nkind = \"chat\"\nrate = 1\nconcurrency = 2",
                "pick one",
            ),
            ("[[request]]\nkind = \"chat\"\nrate = -1", "rate"),
            ("request = 3", "scenario"),
            ("[[request]]\nkind = \"chat\"\ncolour = 1", "colour"),
            ("[[request]]\nkind = \"transcription\"", "audio folder"),
        ] {
            let err = parse_scenario(text, "s.toml", here, &d)
                .unwrap_err()
                .to_string();
            assert!(err.contains(needle), "{err} should mention {needle}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[test]
    fn audio_folder_without_audio_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("notes.txt"), "hi").unwrap();
        let err = load_audio_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no audio files"), "{err}");
    }

    #[test]
    fn prompts_from_jsonl_accept_strings_and_objects() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        std::fs::write(
            &path,
            "\"one\"\n{\"prompt\":\"two\"}\n\n{\"messages\":[{\"role\":\"user\",\"content\":\"three\"}]}\n",
        )
        .unwrap();
        let p = Prompts::from_jsonl(&path).unwrap();
        assert_eq!(
            (0..4).map(|i| p.get(i)).collect::<Vec<_>>(),
            ["one", "two", "three", "one"]
        );
        std::fs::write(&path, "{\"x\":1}\n").unwrap();
        assert!(
            Prompts::from_jsonl(&path)
                .unwrap_err()
                .to_string()
                .contains("line 1")
        );
    }

    #[test]
    fn generated_prompts_have_the_asked_length_and_differ() {
        let p = Prompts::Generated { input_tokens: 50 };
        assert_eq!(p.get(1).split_whitespace().count(), 49);
        assert_ne!(p.get(1), p.get(2));
    }

    pub(crate) fn wav(rate: u32, samples: u32) -> Vec<u8> {
        let data_len = samples * 2;
        let mut out = Vec::new();
        out.extend_from_slice(b"RIFF");
        out.extend_from_slice(&(36 + data_len).to_le_bytes());
        out.extend_from_slice(b"WAVEfmt ");
        out.extend_from_slice(&16u32.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&1u16.to_le_bytes());
        out.extend_from_slice(&rate.to_le_bytes());
        out.extend_from_slice(&(rate * 2).to_le_bytes());
        out.extend_from_slice(&2u16.to_le_bytes());
        out.extend_from_slice(&16u16.to_le_bytes());
        out.extend_from_slice(b"data");
        out.extend_from_slice(&data_len.to_le_bytes());
        out.resize(out.len() + data_len as usize, 0);
        out
    }
}
