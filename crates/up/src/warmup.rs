//! Talking to a backend while it is measured: the health check, and the warm-up job (an audio
//! clip posted as multipart `file` with its form fields, or a JSON body) with the clip's
//! duration read from its header by the gateway's own audio reader. A speech job (a JSON body with
//! `input`) is timed by the audio it answers with: the answer's WAV duration over the input's
//! characters is the backend's speech rate, which the speech lane's admission estimates from.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::UpError;
use crate::boxfile::{BackendConfig, Warmup};

/// A warm-up job ready to send: its body, content type and audio length.
#[derive(Debug, Clone)]
pub(crate) struct Job {
    pub url: String,
    pub body: Bytes,
    pub content_type: String,
    /// Seconds of audio in the clip, when its header says.
    pub audio_seconds: Option<f64>,
    /// A speech job: the characters of its `input` and its `speed` (1.0 unless given).
    pub speech: Option<SpeechInput>,
    pub timeout: Duration,
}

/// What a speech warm-up asks for.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SpeechInput {
    pub chars: usize,
    pub speed: f64,
}

/// One job's answer: how long it took and, when the answer is audio with a readable header,
/// how many seconds of audio it holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Answer {
    pub took: Duration,
    pub audio_seconds: Option<f64>,
}

impl SpeechInput {
    /// Seconds of speech per input character at speed 1 (the lane key `speech_seconds_per_char`),
    /// from the seconds of audio a job of this input answered with.
    pub fn seconds_per_char(&self, answered_seconds: f64) -> Option<f64> {
        (self.chars > 0 && answered_seconds > 0.0)
            .then(|| answered_seconds * self.speed / self.chars as f64)
    }
}

/// The speech request in a JSON warm-up body: `input` (a string) and `speed`.
fn speech_input(json: &str) -> Option<SpeechInput> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    let chars = v.get("input")?.as_str()?.chars().count();
    let speed = v
        .get("speed")
        .and_then(serde_json::Value::as_f64)
        .filter(|s| *s > 0.0)
        .unwrap_or(1.0);
    Some(SpeechInput { chars, speed })
}

const BOUNDARY: &str = "headroom-up-warmup-6d1f0c";

/// Builds the job once (the file is read here, so a missing or unreadable file fails before
/// anything runs).
pub(crate) fn prepare(backend: &BackendConfig, warmup: &Warmup) -> Result<Job, UpError> {
    let url = format!("{}{}", backend.upstream(), warmup.path);
    if let Some(json) = &warmup.json {
        return Ok(Job {
            url,
            body: Bytes::from(json.clone()),
            content_type: "application/json".into(),
            audio_seconds: None,
            speech: speech_input(json),
            timeout: warmup.timeout,
        });
    }
    let path = warmup.file.as_ref().expect("validated: file or json");
    let data = if warmup.repeat > 1 {
        repeated_wav(path, warmup.repeat)
            .map(|(bytes, _)| bytes)
            .map_err(|e| UpError::Config {
                key: "warmup.repeat".into(),
                message: e,
            })?
    } else {
        std::fs::read(path).map_err(|e| UpError::Io {
            what: format!("warm-up file {}", path.display()),
            source: e,
        })?
    };
    let audio_seconds = headroom_server::body_facts::audio_seconds(&data, "file")
        .ok()
        .flatten();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "clip".into());
    Ok(Job {
        url,
        body: multipart(&warmup.form, &name, &data),
        content_type: format!("multipart/form-data; boundary={BOUNDARY}"),
        audio_seconds,
        speech: None,
        timeout: warmup.timeout,
    })
}

/// The lane's shortest job, where the warm-up is longer than one: the clip once (a warm-up of
/// `repeat` copies), or the first sentence of a speech input of several. Text can slow a short
/// job by a larger factor than a long one (on this CPU box Whisper's 33 s warm-up ran 0.92 x
/// beside a generation, a 4 s clip 1.5-2 x), so whether text gives way is measured on both.
/// `None` when the warm-up is already one short job.
pub(crate) fn prepare_shortest(
    backend: &BackendConfig,
    warmup: &Warmup,
) -> Result<Option<Job>, UpError> {
    if let Some(json) = &warmup.json {
        let Some(short) = first_sentence_body(json) else {
            return Ok(None);
        };
        let once = Warmup {
            json: Some(short),
            ..warmup.clone()
        };
        return prepare(backend, &once).map(Some);
    }
    if warmup.repeat <= 1 {
        return Ok(None);
    }
    let once = Warmup {
        repeat: 1,
        ..warmup.clone()
    };
    prepare(backend, &once).map(Some)
}

/// The JSON body with its `input` cut to the first sentence, when the input has more than one.
fn first_sentence_body(json: &str) -> Option<String> {
    let mut v: serde_json::Value = serde_json::from_str(json).ok()?;
    let input = v.get("input")?.as_str()?.trim().to_string();
    let end = input
        .char_indices()
        .find(|&(i, c)| {
            matches!(c, '.' | '!' | '?')
                && input[i + c.len_utf8()..].starts_with(char::is_whitespace)
        })
        .map(|(i, c)| i + c.len_utf8())?;
    let first = input[..end].to_string();
    if input[end..].trim().is_empty() {
        return None;
    }
    v["input"] = serde_json::Value::String(first);
    Some(v.to_string())
}

/// Reads a WAV clip and writes it `repeat` times in a row as one WAV; returns the bytes and the
/// length in seconds.
pub fn repeated_wav(clip: &Path, repeat: u32) -> Result<(Vec<u8>, f64), String> {
    let mut reader =
        hound::WavReader::open(clip).map_err(|e| format!("clip {}: {e}", clip.display()))?;
    let spec = reader.spec();
    if spec.sample_format != hound::SampleFormat::Int || spec.bits_per_sample != 16 {
        return Err(format!(
            "clip {}: 16-bit PCM WAV expected ({} bits, {:?})",
            clip.display(),
            spec.bits_per_sample,
            spec.sample_format
        ));
    }
    let samples: Vec<i16> = reader
        .samples::<i16>()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("clip {}: {e}", clip.display()))?;
    if samples.is_empty() {
        return Err(format!("clip {} has no samples", clip.display()));
    }
    let mut out = std::io::Cursor::new(Vec::new());
    {
        let mut writer = hound::WavWriter::new(&mut out, spec)
            .map_err(|e| format!("writing the repeated clip: {e}"))?;
        for _ in 0..repeat {
            for &s in &samples {
                writer
                    .write_sample(s)
                    .map_err(|e| format!("writing the repeated clip: {e}"))?;
            }
        }
        writer
            .finalize()
            .map_err(|e| format!("writing the repeated clip: {e}"))?;
    }
    let frames = samples.len() as f64 / f64::from(spec.channels.max(1));
    let seconds = frames * f64::from(repeat) / f64::from(spec.sample_rate.max(1));
    Ok((out.into_inner(), seconds))
}

/// A multipart/form-data body: the text fields, then the file. Written by hand because it is
/// a fixed, tiny layout (RFC 7578) and reqwest's multipart feature would add dependencies.
fn multipart(
    fields: &std::collections::BTreeMap<String, String>,
    name: &str,
    data: &[u8],
) -> Bytes {
    let mut out = Vec::with_capacity(data.len() + 512);
    for (k, v) in fields {
        out.extend_from_slice(
            format!("--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                .as_bytes(),
        );
    }
    out.extend_from_slice(
        format!(
            "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{}\"\r\nContent-Type: application/octet-stream\r\n\r\n",
            name.replace('"', "")
        )
        .as_bytes(),
    );
    out.extend_from_slice(data);
    out.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
    Bytes::from(out)
}

/// Runs the job once; the time it took and the audio it answered with.
pub(crate) async fn run(client: &reqwest::Client, job: &Job) -> Result<Answer, String> {
    let start = Instant::now();
    let response = client
        .post(&job.url)
        .header("content-type", &job.content_type)
        .body(job.body.clone())
        .timeout(job.timeout)
        .send()
        .await
        .map_err(|e| format!("request failed: {e}"))?;
    let status = response.status();
    // Read the whole answer: the backend's work is done when its body is.
    let body = response
        .bytes()
        .await
        .map_err(|e| format!("reading the answer failed: {e}"))?;
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        return Err(format!("HTTP {status}: {text}"));
    }
    let took = start.elapsed();
    // Only an answer to a speech job is read as audio (a transcription's JSON is not).
    let audio_seconds = job.speech.and_then(|_| {
        headroom_server::body_facts::audio_seconds(&body, "answer")
            .ok()
            .flatten()
    });
    Ok(Answer {
        took,
        audio_seconds,
    })
}

/// One health check: true on a 2xx answer within `timeout`.
pub(crate) async fn healthy(client: &reqwest::Client, url: &str, timeout: Duration) -> bool {
    matches!(
        client.get(url).timeout(timeout).send().await,
        Ok(r) if r.status().is_success()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_multipart_body_carries_fields_and_file() {
        let mut fields = std::collections::BTreeMap::new();
        fields.insert("model_name".to_string(), "whisper-1".to_string());
        let body = multipart(&fields, "fox.wav", b"RIFFdata");
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("name=\"model_name\"\r\n\r\nwhisper-1\r\n"));
        assert!(text.contains("name=\"file\"; filename=\"fox.wav\""));
        assert!(text.contains("\r\n\r\nRIFFdata\r\n"));
        assert!(text.ends_with(&format!("--{BOUNDARY}--\r\n")));
    }

    #[test]
    fn a_speech_warm_up_counts_its_input_and_its_rate_comes_from_the_answer() {
        let input = speech_input(r#"{"model":"tts-1","input":"Ünïcode counts chars.","speed":2}"#)
            .expect("a speech body");
        // 21 characters (not 25 bytes), at speed 2.
        assert_eq!(
            input,
            SpeechInput {
                chars: 21,
                speed: 2.0
            }
        );
        // 1.47 s of speech made at speed 2 is 2.94 s at speed 1: 0.14 s a character.
        let rate = input.seconds_per_char(1.47).unwrap();
        assert!((rate - 0.14).abs() < 1e-9, "{rate}");
        assert_eq!(input.seconds_per_char(0.0), None);
        assert_eq!(speech_input(r#"{"input":42}"#), None);
        assert_eq!(speech_input("not json"), None);
        let plain = speech_input(r#"{"input":"abcd","speed":"fast"}"#).unwrap();
        assert_eq!(plain.speed, 1.0);
    }

    #[test]
    fn the_shortest_job_is_one_copy_of_the_clip_or_the_first_sentence() {
        let dir = tempfile::tempdir().unwrap();
        let fox = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/audio/fox.wav");
        let audio = |repeat: u32| {
            format!(
                "[memory]\nprobe = \"host\"\ncapacity = \"1GiB\"\n[[backends]]\nname = \"stt\"\nrole = \"audio\"\nengine = \"whisper\"\ncommand = \"x\"\nport = 20081\n[backends.warmup]\nfile = \"{}\"\nrepeat = {repeat}\n",
                fox.display()
            )
        };
        let speech = |input: &str| {
            format!(
                "[memory]\nprobe = \"host\"\ncapacity = \"1GiB\"\n[[backends]]\nname = \"tts\"\nrole = \"audio\"\ncommand = \"x\"\nport = 20082\n[backends.warmup]\npath = \"/v1/audio/speech\"\njson = '{{\"model\":\"tts-1\",\"input\":\"{input}\",\"speed\":1.5}}'\n"
            )
        };
        let shortest = |text: String| {
            let config = crate::boxfile::BoxConfig::parse(&text, dir.path()).unwrap();
            let b = &config.backends[0];
            prepare_shortest(b, b.warmup.as_ref().unwrap()).unwrap()
        };
        assert!(shortest(audio(1)).is_none());
        let once = shortest(audio(8)).expect("a repeated clip has a shorter job");
        let seconds = once.audio_seconds.unwrap();
        assert!((4.0..4.6).contains(&seconds), "{seconds}");
        assert!(shortest(speech("Just one sentence, and no more.")).is_none());
        let first = shortest(speech("It is three. The call moved! Bring the notes?"))
            .expect("several sentences have a shorter job");
        let body: serde_json::Value = serde_json::from_slice(&first.body).unwrap();
        assert_eq!(body["input"], "It is three.");
        assert_eq!(body["speed"], 1.5);
        assert_eq!(first.speech.unwrap().chars, 12);
    }

    #[test]
    fn a_repeated_warm_up_clip_is_one_clip_that_many_times_as_long() {
        let dir = tempfile::tempdir().unwrap();
        let fox = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/audio/fox.wav");
        let backend_for = |repeat: u32| {
            let text = format!(
                "[memory]\nprobe = \"host\"\ncapacity = \"1GiB\"\n[[backends]]\nname = \"stt\"\nrole = \"audio\"\nengine = \"whisper\"\ncommand = \"x\"\nport = 20081\n[backends.warmup]\nfile = \"{}\"\nrepeat = {repeat}\n",
                fox.display()
            );
            crate::boxfile::BoxConfig::parse(&text, dir.path()).unwrap()
        };
        let seconds = |repeat: u32| {
            let config = backend_for(repeat);
            let b = &config.backends[0];
            prepare(b, b.warmup.as_ref().unwrap())
                .unwrap()
                .audio_seconds
                .unwrap()
        };
        let one = seconds(1);
        // fox.wav is 4.3 s long (its header, read by serve's own audio reader).
        assert!((4.0..4.6).contains(&one), "{one}");
        assert!((seconds(8) - 8.0 * one).abs() < 0.01, "{}", seconds(8));
    }
}
