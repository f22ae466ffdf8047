//! Talking to a backend while it is measured: the health check, and the warm-up job (an audio
//! clip posted as multipart `file` with its form fields, or a JSON body) with the clip's
//! duration read from its header by the gateway's own audio reader.

use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::UpError;
use crate::boxfile::{BackendConfig, Warmup};

/// A warm-up job ready to send: its body, content type and audio length.
#[derive(Debug, Clone)]
pub struct Job {
    pub url: String,
    pub body: Bytes,
    pub content_type: String,
    /// Seconds of audio in the clip, when its header says.
    pub audio_seconds: Option<f64>,
    pub timeout: Duration,
}

const BOUNDARY: &str = "headroom-up-warmup-6d1f0c";

/// Builds the job once (the file is read here, so a missing or unreadable file fails before
/// anything runs).
pub fn prepare(backend: &BackendConfig, warmup: &Warmup) -> Result<Job, UpError> {
    let url = format!("{}{}", backend.upstream(), warmup.path);
    if let Some(json) = &warmup.json {
        return Ok(Job {
            url,
            body: Bytes::from(json.clone()),
            content_type: "application/json".into(),
            audio_seconds: None,
            timeout: warmup.timeout,
        });
    }
    let path = warmup.file.as_ref().expect("validated: file or json");
    let data = std::fs::read(path).map_err(|e| UpError::Io {
        what: format!("warm-up file {}", path.display()),
        source: e,
    })?;
    let audio_seconds = headroom_server::inspect::audio_seconds(&data, "file")
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
        timeout: warmup.timeout,
    })
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

/// Runs the job once; the time it took.
pub async fn run(client: &reqwest::Client, job: &Job) -> Result<Duration, String> {
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
    Ok(start.elapsed())
}

/// One health check: true on a 2xx answer within `timeout`.
pub async fn healthy(client: &reqwest::Client, url: &str, timeout: Duration) -> bool {
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
}
