//! Fuzz harnesses (stable Rust, proptest) for the gateway's readers of untrusted input: the
//! request inspector, multipart forms, the audio container probes, the Prometheus text reader,
//! the upstream client's response reader and the fast path's request-head reader.
//! See fuzz/README.md.

#[path = "../../../fuzz/support.rs"]
mod fuzz_support;

use fuzz_support::fuzz;
use headroom_server::audio::{AudioProbe, probe};
use headroom_server::body_facts::{JsonRoute, parse_json};
use headroom_server::config::EngineKind;
use headroom_server::multipart;

#[test]
fn fuzz_request_inspector() {
    fuzz("inspect_json", |data| {
        for route in [JsonRoute::Chat, JsonRoute::Completions, JsonRoute::Speech] {
            if let Err(e) = parse_json(route, data)
                && (!e.status.is_client_error() || e.code.is_empty())
            {
                return Err(format!("{route:?}: not a 4xx with a code: {e:?}"));
            }
        }
        Ok(())
    });
}

#[test]
fn fuzz_multipart() {
    fuzz("multipart", |data| {
        let Ok(parts) = multipart::parse(data, "B") else {
            return Ok(());
        };
        if parts.len() > multipart::MAX_PARTS {
            return Err(format!("{} parts", parts.len()));
        }
        for p in parts {
            if p.data.start > p.data.end || p.data.end > data.len() {
                return Err(format!(
                    "part range {:?} outside {} bytes",
                    p.data,
                    data.len()
                ));
            }
        }
        Ok(())
    });
}

#[test]
fn fuzz_audio_probes() {
    fuzz("audio_probe", |data| match probe(data) {
        AudioProbe::Duration { seconds, .. } if !(seconds.is_finite() && seconds >= 0.0) => {
            Err(format!("duration {seconds}"))
        }
        _ => Ok(()),
    });
}

#[tokio::test(start_paused = true)]
async fn fuzz_prometheus_reader() {
    let now = tokio::time::Instant::now();
    fuzz("prometheus", |data| {
        let text = String::from_utf8_lossy(data);
        for kind in [EngineKind::Vllm, EngineKind::LlamaCpp] {
            if let Some(load) = headroom_server::scrape::parse_engine_metrics(kind, &text, now) {
                for v in [load.waiting, load.running, load.kv_cache_usage]
                    .into_iter()
                    .flatten()
                {
                    if !v.is_finite() {
                        return Err(format!("{v} read as a value"));
                    }
                }
            }
        }
        Ok(())
    });
}

#[test]
fn fuzz_upstream_response() {
    use bytes::BytesMut;
    use headroom_server::upstream::wire::{Decoder, MAX_HEAD_BYTES, Step, parse_head};
    fuzz("upstream_response", |data| {
        let mut buf = BytesMut::from(data);
        let Ok(Some(head)) = parse_head(&mut buf) else {
            return Ok(());
        };
        let mut decoder = Decoder::new(head.framing);
        let mut body = 0usize;
        // Each step takes bytes out of the buffer or ends: the loop is bounded by the input.
        for _ in 0..=data.len() + 2 {
            match decoder.step(&mut buf) {
                Ok(Step::Data(d)) if d.is_empty() => return Err("an empty data step".into()),
                Ok(Step::Data(d)) => body += d.len(),
                Ok(Step::NeedMore | Step::End) | Err(_) => return Ok(()),
            }
            if body > data.len() {
                return Err(format!("{body} body bytes from {} input bytes", data.len()));
            }
        }
        Err(format!(
            "no end after {} steps (cap {MAX_HEAD_BYTES})",
            data.len() + 2
        ))
    });
}

#[test]
fn fuzz_h1_request() {
    use headroom_server::listen::h1::fuzz_parse;
    fuzz("h1_request", |data| fuzz_parse(data).map(|_| ()));
}
