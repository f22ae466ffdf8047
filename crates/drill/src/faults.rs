//! The night's faults, each carried out the way it happens on a real box: `kill -9` of a
//! backend's main process, readers who close the connection half-way through a stream, a request
//! far larger than any lane takes, broken bodies, uploads that trickle in, and a co-tenant — a
//! separate process that appears inside the memory pool, touches its memory, holds it, and exits.
//! Each leaves a [`FaultRecord`]: when, on what, and what the box answered.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::StreamExt;
use serde::Serialize;

use crate::boxes::Running;
use crate::client::{self, Shape, Target};
use crate::payload::{self, Body};
use crate::scenario::{FaultAction, Night, Payload, StreamKind};

/// One answer to a fault's request.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultAnswer {
    pub what: String,
    /// HTTP status, `None` when no answer came.
    pub status: Option<u16>,
    /// The body was an OpenAI-shaped error.
    pub openai_error: bool,
    pub secs: f64,
    pub note: Option<String>,
}

/// What a fault did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultRecord {
    pub kind: &'static str,
    pub at_s: f64,
    pub end_s: f64,
    pub target: String,
    pub outcome: String,
    pub answers: Vec<FaultAnswer>,
}

/// What the faults need of the drill.
#[derive(Clone)]
pub struct FaultContext {
    pub running: Arc<Running>,
    pub client: reqwest::Client,
    pub night: Arc<Night>,
    /// Per stream: where it goes and what it sends (same order as the night's streams).
    pub targets: Arc<Vec<Target>>,
    pub shapes: Arc<Vec<Shape>>,
    pub clock: Instant,
    /// The program that holds memory for a co-tenant (`headroom`, hidden subcommand).
    pub exe: PathBuf,
    pub capacity_bytes: u64,
    pub night_length: Duration,
    pub co_tenant_pid: Arc<Mutex<Option<u32>>>,
}

impl std::fmt::Debug for FaultContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultContext").finish_non_exhaustive()
    }
}

/// The hidden subcommand the co-tenant runs: `headroom drill-co-tenant --bytes N --seconds S`.
pub const CO_TENANT_COMMAND: &str = "drill-co-tenant";

/// Holds `bytes` of touched memory for `hold`, then returns (the co-tenant's body).
pub fn hold_memory(bytes: u64, hold: Duration) {
    let n = bytes as usize;
    let mut probe: Vec<u8> = Vec::new();
    let fits = probe.try_reserve_exact(n).is_ok();
    drop(probe);
    // Not zeroes: every page is written, so every page is really charged. `vec![b; n]` of bytes
    // is one memset, also in a debug build (CI's): `resize` wrote byte by byte there, 0.7 s of a
    // core for 120 MiB (0.04 s in release), taken from the audio jobs the co-tenant lands beside.
    let v: Vec<u8> = if fits { vec![0xA5; n] } else { Vec::new() };
    std::thread::sleep(hold);
    std::hint::black_box(&v);
}

impl FaultContext {
    fn now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

    fn stream_index(&self, name: &str) -> usize {
        self.night
            .streams
            .iter()
            .position(|s| s.name == name)
            .expect("fault streams are checked when the night is parsed")
    }

    /// Carries out `action` now.
    pub async fn run(&self, action: &FaultAction) -> FaultRecord {
        let at_s = self.now();
        let (target, outcome, answers) = match action {
            FaultAction::Kill9 { backend } => {
                (backend.clone(), self.kill9(backend).await, Vec::new())
            }
            FaultAction::LeaveMidStream {
                stream,
                after_events,
                count,
            } => {
                let i = self.stream_index(stream);
                let answers = futures_util::future::join_all(
                    (0..*count).map(|n| self.leave(i, *after_events, 1_000_000 + u64::from(n))),
                )
                .await;
                let left = answers
                    .iter()
                    .filter(|a| a.note.as_deref() == Some("left"))
                    .count();
                (
                    stream.clone(),
                    format!("{left} of {count} left after the first events"),
                    answers,
                )
            }
            FaultAction::Oversize { stream, bytes } => {
                let i = self.stream_index(stream);
                let a = self.oversize(i, *bytes).await;
                (stream.clone(), summarize(std::slice::from_ref(&a)), vec![a])
            }
            FaultAction::Malformed { stream } => {
                let i = self.stream_index(stream);
                let mut answers = Vec::new();
                for b in payload::malformed(self.shapes[i].kind) {
                    answers.push(self.raw(i, b.what, b.content_type, b.bytes, None).await);
                }
                (stream.clone(), summarize(&answers), answers)
            }
            FaultAction::SlowClient {
                stream,
                bytes_per_second,
                count,
            } => {
                let i = self.stream_index(stream);
                let answers = futures_util::future::join_all(
                    (0..*count).map(|n| self.slow(i, *bytes_per_second, 2_000_000 + u64::from(n))),
                )
                .await;
                (stream.clone(), summarize(&answers), answers)
            }
            FaultAction::CoTenant { amount, hold } => {
                let bytes = amount.bytes(self.capacity_bytes);
                let hold = hold.of(self.night_length);
                ("pool".into(), self.co_tenant(bytes, hold).await, Vec::new())
            }
        };
        FaultRecord {
            kind: action.name(),
            at_s,
            end_s: self.now(),
            target,
            outcome,
            answers,
        }
    }

    async fn kill9(&self, backend: &str) -> String {
        use rustix::process::{Pid, Signal, kill_process};
        let view = self.running.view().await;
        let Some(pid) = view
            .backends
            .iter()
            .find(|b| b.name == backend)
            .and_then(|b| b.pid)
        else {
            return format!("{backend} was not running (nothing to kill)");
        };
        match Pid::from_raw(pid as i32).map(|p| kill_process(p, Signal::KILL)) {
            Some(Ok(())) => format!("kill -9 {pid} ({backend})"),
            Some(Err(e)) => format!("kill -9 {pid} ({backend}) failed: {e}"),
            None => format!("{backend} has no valid PID"),
        }
    }

    /// Sends a streamed request and closes the connection after `after` events (or chunks).
    async fn leave(&self, i: usize, after: u32, seq: u64) -> FaultAnswer {
        let start = Instant::now();
        let what = format!("leaves after {after} events");
        let r = client::build(&self.client, &self.targets[i], &self.shapes[i], seq)
            .timeout(self.night.streams[i].deadline)
            .send()
            .await;
        let r = match r {
            Ok(r) => r,
            Err(e) => {
                return FaultAnswer {
                    what,
                    status: None,
                    openai_error: false,
                    secs: start.elapsed().as_secs_f64(),
                    note: Some(headroom_bench::client::describe_reqwest(&e)),
                };
            }
        };
        let status = r.status().as_u16();
        if !r.status().is_success() {
            return FaultAnswer {
                what,
                status: Some(status),
                openai_error: false,
                secs: start.elapsed().as_secs_f64(),
                note: Some("refused before any event".into()),
            };
        }
        let mut events = 0u32;
        let mut body = r.bytes_stream();
        let mut note = "the answer ended before the client left".to_string();
        while let Some(Ok(chunk)) = body.next().await {
            events += if self.shapes[i].kind == StreamKind::Chat {
                chunk.windows(5).filter(|w| w == b"data:").count() as u32
            } else {
                1
            };
            if events >= after {
                note = "left".into();
                break;
            }
        }
        drop(body);
        FaultAnswer {
            what,
            status: Some(status),
            openai_error: false,
            secs: start.elapsed().as_secs_f64(),
            note: Some(note),
        }
    }

    async fn oversize(&self, i: usize, bytes: u64) -> FaultAnswer {
        let shape = &self.shapes[i];
        match &self.night.streams[i].payload {
            Payload::Audio { clip, .. } => match payload::oversize_wav(clip, bytes) {
                Ok(wav) => {
                    let (ct, body) = multipart(&wav, &shape.model);
                    self.raw(i, "a one-hour recording", ct, body, None).await
                }
                Err(e) => FaultAnswer {
                    what: "a one-hour recording".into(),
                    status: None,
                    openai_error: false,
                    secs: 0.0,
                    note: Some(e),
                },
            },
            _ => {
                let body = payload::oversize_json(shape.kind, bytes);
                self.raw(i, "a huge input", "application/json".into(), body, None)
                    .await
            }
        }
    }

    /// The stream's own request, its body sent at `rate` bytes a second.
    async fn slow(&self, i: usize, rate: u64, seq: u64) -> FaultAnswer {
        let shape = &self.shapes[i];
        let (ct, body) = match &shape.body {
            Body::Audio { wav, .. } => multipart(wav, &shape.model),
            Body::Json { template } => (
                "application/json".into(),
                template.body(seq).to_string().into_bytes(),
            ),
        };
        self.raw(i, "an upload that trickles in", ct, body, Some(rate))
            .await
    }

    /// Posts `bytes` to stream `i`'s route (trickled at `rate` bytes a second when given).
    async fn raw(
        &self,
        i: usize,
        what: &str,
        content_type: String,
        bytes: Vec<u8>,
        rate: Option<u64>,
    ) -> FaultAnswer {
        let start = Instant::now();
        let target = &self.targets[i];
        let url = format!(
            "{}{}",
            target.base.trim_end_matches('/'),
            self.shapes[i].kind.path()
        );
        let len = bytes.len();
        let body = match rate {
            None => reqwest::Body::from(bytes),
            Some(rate) => {
                let step = (rate / 4).max(1) as usize;
                let chunks: Vec<Bytes> = Bytes::from(bytes)
                    .chunks(step)
                    .map(Bytes::copy_from_slice)
                    .collect();
                let s = futures_util::stream::iter(chunks).then(|c| async move {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    Ok::<Bytes, std::io::Error>(c)
                });
                reqwest::Body::wrap_stream(s)
            }
        };
        let mut req = self
            .client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .header(reqwest::header::CONTENT_LENGTH, len)
            .timeout(self.night.streams[i].deadline)
            .body(body);
        if let Some(k) = &target.api_key {
            req = req.bearer_auth(k);
        }
        match req.send().await {
            Ok(r) => {
                let status = r.status().as_u16();
                let body = r.bytes().await.unwrap_or_default();
                FaultAnswer {
                    what: what.to_string(),
                    status: Some(status),
                    openai_error: client::is_openai_error(&body),
                    secs: start.elapsed().as_secs_f64(),
                    note: client::error_code(&body),
                }
            }
            Err(e) => FaultAnswer {
                what: what.to_string(),
                status: None,
                openai_error: false,
                secs: start.elapsed().as_secs_f64(),
                note: Some(headroom_bench::client::describe_reqwest(&e)),
            },
        }
    }

    async fn co_tenant(&self, bytes: u64, hold: Duration) -> String {
        let procs = self.running.view().await.procs_file;
        let hold_args = [
            CO_TENANT_COMMAND.to_string(),
            "--bytes".into(),
            bytes.to_string(),
            "--seconds".into(),
            format!("{:.3}", hold.as_secs_f64()),
        ];
        let mut cmd = match &procs {
            Some(p) => {
                let mut c = tokio::process::Command::new("sh");
                c.arg("-c")
                    .arg("echo $$ > \"$0\" && exec \"$@\"")
                    .arg(p)
                    .arg(&self.exe);
                c
            }
            None => tokio::process::Command::new(&self.exe),
        };
        cmd.args(hold_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return format!("could not start the co-tenant: {e}"),
        };
        *self.co_tenant_pid.lock().expect("co-tenant lock") = child.id();
        let status = child.wait().await;
        *self.co_tenant_pid.lock().expect("co-tenant lock") = None;
        let place = if procs.is_some() {
            "inside the pool"
        } else {
            "outside any pool: the box has no memory cgroup to join"
        };
        use std::os::unix::process::ExitStatusExt;
        match status {
            Ok(s) if s.success() => format!(
                "held {} MiB for {:.0} s {place}, then left",
                bytes >> 20,
                hold.as_secs_f64()
            ),
            Ok(s) => format!(
                "held {} MiB {place} and ended early ({})",
                bytes >> 20,
                s.signal()
                    .map(|n| format!("signal {n}"))
                    .unwrap_or_else(|| s.to_string())
            ),
            Err(e) => format!("co-tenant: {e}"),
        }
    }
}

/// A multipart form with the clip as `file` and the model, as bytes (so it can be trickled).
pub fn multipart(wav: &[u8], model: &str) -> (String, Vec<u8>) {
    let boundary = "drillclip29";
    let mut out = Vec::with_capacity(wav.len() + 400);
    out.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"response_format\"\r\n\r\njson\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"clip.wav\"\r\nContent-Type: audio/wav\r\n\r\n"
        )
        .as_bytes(),
    );
    out.extend_from_slice(wav);
    out.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), out)
}

/// `3 × 400, 1 × 413` and how many were OpenAI-shaped errors.
fn summarize(answers: &[FaultAnswer]) -> String {
    let mut counts: std::collections::BTreeMap<String, usize> = Default::default();
    for a in answers {
        let k = a
            .status
            .map(|s| s.to_string())
            .unwrap_or_else(|| "no answer".into());
        *counts.entry(k).or_default() += 1;
    }
    let shaped = answers.iter().filter(|a| a.openai_error).count();
    let list: Vec<String> = counts.iter().map(|(k, n)| format!("{n} × {k}")).collect();
    format!(
        "{}; {shaped} of {} OpenAI-shaped errors",
        list.join(", "),
        answers.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multipart_body_carries_the_clip_whole() {
        let (ct, body) = multipart(b"RIFFxxxxWAVE", "whisper-1");
        assert!(ct.ends_with("boundary=drillclip29"));
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("name=\"file\"; filename=\"clip.wav\""));
        assert!(text.contains("\r\n\r\nRIFFxxxxWAVE\r\n--drillclip29--\r\n"));
        assert!(text.contains("whisper-1"));
    }

    #[test]
    fn answers_are_summarized_by_status() {
        let a = |s: Option<u16>, shaped| FaultAnswer {
            what: "x".into(),
            status: s,
            openai_error: shaped,
            secs: 0.1,
            note: None,
        };
        assert_eq!(
            summarize(&[
                a(Some(400), true),
                a(Some(400), true),
                a(Some(500), false),
                a(None, false)
            ]),
            "2 × 400, 1 × 500, 1 × no answer; 2 of 4 OpenAI-shaped errors"
        );
    }

    #[test]
    fn the_co_tenant_holds_what_it_is_asked() {
        let before = headroom_gpu::tree_memory(std::process::id())
            .unwrap()
            .rss_bytes;
        let t = std::thread::spawn(|| hold_memory(64 << 20, Duration::from_secs(3)));
        // Measured while it holds (retried: a busy machine may take a moment to write 64 MiB).
        let mut grew = 0;
        for _ in 0..25 {
            std::thread::sleep(Duration::from_millis(100));
            let now = headroom_gpu::tree_memory(std::process::id())
                .unwrap()
                .rss_bytes;
            grew = now.saturating_sub(before);
            if grew >= 63 << 20 {
                break;
            }
        }
        assert!(grew >= 63 << 20, "grew by {grew}");
        t.join().unwrap();
    }
}
