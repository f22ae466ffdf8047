//! The bodies the night sends, built once per stream: a WAV clip repeated into long audio (read
//! and written with `hound`), plain sentences to speak, and transcript-like chat prompts. Also the
//! fault bodies: an oversize request and the broken ones. Content is never logged.

use std::path::Path;
use std::sync::Arc;

use headroom_bench::workload::Prompts;
use serde_json::json;

use crate::scenario::{Payload, Stream, StreamKind};

/// What a stream's requests carry, ready to send many times.
#[derive(Debug, Clone)]
pub enum Body {
    Audio {
        wav: Arc<Vec<u8>>,
        seconds: f64,
    },
    Json {
        /// Builds the JSON of request `seq`.
        template: JsonTemplate,
    },
}

#[derive(Debug, Clone)]
pub enum JsonTemplate {
    Speech {
        model: String,
        text: Arc<String>,
        voice: String,
        format: String,
    },
    Chat {
        model: String,
        instruction: String,
        prompts: Arc<Prompts>,
        max_tokens: u32,
        stream: bool,
    },
}

impl JsonTemplate {
    pub fn body(&self, seq: u64) -> serde_json::Value {
        match self {
            JsonTemplate::Speech {
                model,
                text,
                voice,
                format,
            } => {
                // Streamed or whole is how the client reads the answer (the official client's
                // streaming response reads the same body as it arrives): the body is the same.
                json!({"model": model, "input": text.as_str(), "voice": voice, "response_format": format})
            }
            JsonTemplate::Chat {
                model,
                instruction,
                prompts,
                max_tokens,
                stream,
            } => {
                let mut b = json!({
                    "model": model,
                    "messages": [{"role": "user", "content": format!("{instruction}\n{}", prompts.get(seq))}],
                    "max_tokens": max_tokens,
                    "temperature": 0.7,
                    "stream": stream,
                });
                if *stream {
                    b["stream_options"] = json!({"include_usage": true});
                }
                b
            }
        }
    }
}

/// Sentences a voice assistant might say; repeated and cut to the length asked for.
const SENTENCES: &[&str] = &[
    "Your next meeting starts in ten minutes in the small room on the second floor.",
    "I have moved the call with the design team to Thursday afternoon at three.",
    "The weather tonight is clear and cold, with a light wind from the north.",
    "Here is the summary of the interview you recorded this morning.",
    "The quick brown fox jumps over the lazy dog, hello from the gateway test.",
    "Chapter two begins on a quiet street where the lamps were lit one by one.",
];

/// About `chars` characters of whole sentences (at least one).
pub fn speech_text(chars: u32) -> String {
    let mut out = String::new();
    let mut i = 0;
    while out.len() < chars as usize || out.is_empty() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(SENTENCES[i % SENTENCES.len()]);
        i += 1;
    }
    if out.len() > chars as usize && chars as usize >= SENTENCES[0].len() {
        // Cut at the last sentence end that fits.
        if let Some(end) = out[..chars as usize].rfind('.') {
            out.truncate(end + 1);
        }
    }
    out
}

pub use headroom_up::warmup::repeated_wav;

/// A WAV of about `bytes` bytes made of `clip` repeated: a real recording, just far too long.
pub fn oversize_wav(clip: &Path, bytes: u64) -> Result<Vec<u8>, String> {
    let (one, _) = repeated_wav(clip, 1)?;
    let per = (one.len() as u64).saturating_sub(44).max(1);
    let repeat = (bytes / per).clamp(1, 100_000) as u32;
    repeated_wav(clip, repeat).map(|(b, _)| b)
}

/// The body of every request of `stream`.
pub fn body_of(stream: &Stream) -> Result<Body, String> {
    Ok(match &stream.payload {
        Payload::Audio { clip, repeat } => {
            let (wav, seconds) = repeated_wav(clip, *repeat)?;
            Body::Audio {
                wav: Arc::new(wav),
                seconds,
            }
        }
        Payload::Speech {
            chars,
            voice,
            format,
            ..
        } => Body::Json {
            template: JsonTemplate::Speech {
                model: stream.model.clone(),
                text: Arc::new(speech_text(*chars)),
                voice: voice.clone(),
                format: format.clone(),
            },
        },
        Payload::Chat {
            instruction,
            input_tokens,
            max_tokens,
            stream: streamed,
        } => Body::Json {
            template: JsonTemplate::Chat {
                model: stream.model.clone(),
                instruction: instruction.clone(),
                prompts: Arc::new(Prompts::Generated {
                    input_tokens: *input_tokens,
                }),
                max_tokens: *max_tokens,
                stream: *streamed,
            },
        },
    })
}

/// One broken request: what it is, its content type and its bytes.
#[derive(Debug, Clone)]
pub struct Broken {
    pub what: &'static str,
    pub content_type: String,
    pub bytes: Vec<u8>,
}

/// Broken bodies for a stream's route: what clients with bugs send.
pub fn malformed(kind: StreamKind) -> Vec<Broken> {
    let json = |what, text: &str| Broken {
        what,
        content_type: "application/json".into(),
        bytes: text.as_bytes().to_vec(),
    };
    match kind {
        StreamKind::Chat => vec![
            json(
                "truncated JSON",
                r#"{"model": "smollm2", "messages": [{"role": "user", "content": "hel"#,
            ),
            json(
                "messages is a string",
                r#"{"model": "smollm2", "messages": "hello"}"#,
            ),
            json(
                "max_tokens is negative",
                r#"{"model": "smollm2", "messages": [{"role":"user","content":"hi"}], "max_tokens": -5}"#,
            ),
            json("not JSON at all", "hello there"),
        ],
        StreamKind::Speech => vec![
            json("truncated JSON", r#"{"model": "tts-1", "input": "Good mor"#),
            json(
                "input is a number",
                r#"{"model": "tts-1", "input": 42, "voice": "alloy"}"#,
            ),
            json("no input", r#"{"model": "tts-1", "voice": "alloy"}"#),
        ],
        StreamKind::Transcription => {
            let boundary = "drillboundary29";
            let form =
                |fields: &str| -> Vec<u8> { format!("{fields}--{boundary}--\r\n").into_bytes() };
            let ct = format!("multipart/form-data; boundary={boundary}");
            vec![
                Broken {
                    what: "no file part",
                    content_type: ct.clone(),
                    bytes: form(&format!(
                        "--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
                    )),
                },
                Broken {
                    what: "a file that is not audio",
                    content_type: ct.clone(),
                    bytes: form(&format!(
                        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"notes.wav\"\r\nContent-Type: audio/wav\r\n\r\nthis is not a recording\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n"
                    )),
                },
                Broken {
                    what: "multipart cut off",
                    content_type: ct,
                    bytes: format!("--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF").into_bytes(),
                },
                json("JSON instead of a form", r#"{"file": "a.wav"}"#),
            ]
        }
    }
}

/// A chat or speech request body of about `bytes` bytes (a huge input).
pub fn oversize_json(kind: StreamKind, bytes: u64) -> Vec<u8> {
    let filler = "word ".repeat((bytes as usize / 5).max(1));
    let v = match kind {
        StreamKind::Speech => json!({"model": "tts-1", "input": filler, "voice": "alloy"}),
        _ => {
            json!({"model": "smollm2", "messages": [{"role": "user", "content": filler}], "max_tokens": 16})
        }
    };
    v.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fox() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/audio/fox.wav")
    }

    #[test]
    fn a_repeated_clip_is_a_valid_wav_of_n_times_the_length() {
        let (one, s1) = repeated_wav(&fox(), 1).unwrap();
        let (five, s5) = repeated_wav(&fox(), 5).unwrap();
        assert!((4.0..5.0).contains(&s1), "fox.wav is about 4.3 s: {s1}");
        assert!((s5 - 5.0 * s1).abs() < 1e-6);
        // The header's own length figure (read by the bench crate's reader) agrees.
        let header_s = headroom_bench::workload::wav_seconds(&five).unwrap();
        assert!((header_s - s5).abs() < 0.01, "{header_s} vs {s5}");
        assert!(five.len() > 4 * one.len());
    }

    #[test]
    fn an_oversize_wav_reaches_the_size_asked() {
        let b = oversize_wav(&fox(), 4 << 20).unwrap();
        assert!(
            b.len() as u64 >= (4 << 20) - 200_000 && (b.len() as u64) < (5 << 20),
            "{}",
            b.len()
        );
    }

    #[test]
    fn speech_text_has_the_length_asked_in_whole_sentences() {
        let short = speech_text(60);
        assert!(short.ends_with('.'));
        let long = speech_text(1200);
        assert!((1000..=1300).contains(&long.len()), "{}", long.len());
        assert!(long.ends_with('.'));
    }

    #[test]
    fn chat_bodies_differ_per_request_and_ask_for_usage_when_streamed() {
        let t = JsonTemplate::Chat {
            model: "m".into(),
            instruction: "Clean up:".into(),
            prompts: Arc::new(Prompts::Generated { input_tokens: 50 }),
            max_tokens: 9,
            stream: true,
        };
        let a = t.body(1);
        let b = t.body(2);
        assert_ne!(a["messages"], b["messages"]);
        assert_eq!(a["stream_options"]["include_usage"], true);
        assert!(
            a["messages"][0]["content"]
                .as_str()
                .unwrap()
                .starts_with("Clean up:\n")
        );
    }

    #[test]
    fn every_route_has_broken_bodies_that_are_really_broken() {
        for kind in [
            StreamKind::Chat,
            StreamKind::Speech,
            StreamKind::Transcription,
        ] {
            let list = malformed(kind);
            assert!(list.len() >= 3, "{kind:?}");
            for b in list.iter().filter(|b| b.content_type == "application/json") {
                let parsed: Result<serde_json::Value, _> = serde_json::from_slice(&b.bytes);
                if let Ok(v) = parsed {
                    // Valid JSON must still be a wrong request for the route.
                    let wrong = match kind {
                        StreamKind::Chat => {
                            !v["messages"].is_array()
                                || v["max_tokens"].as_i64().is_some_and(|m| m < 0)
                        }
                        StreamKind::Speech => !v["input"].is_string(),
                        StreamKind::Transcription => true,
                    };
                    assert!(wrong, "{kind:?} {}", b.what);
                }
            }
        }
    }
}
