//! Fuzz harnesses (stable Rust, proptest) for the gateway's readers of untrusted input: the
//! request inspector, multipart forms, the audio container probes and the Prometheus text reader.
//! See fuzz/README.md.

#[path = "../../../fuzz/support.rs"]
mod fuzz_support;

use fuzz_support::fuzz;
use headroom_server::audio::{AudioProbe, probe};
use headroom_server::config::EngineKind;
use headroom_server::inspect::{JsonRoute, parse_json};
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
