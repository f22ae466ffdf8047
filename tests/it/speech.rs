//! The speech lane's cost: a `/v1/audio/speech` request is admitted on the memory its audio will
//! need, and its audio seconds come from its input's characters (times the lane's
//! `speech_seconds_per_char`, over its `speed`), so a long narration needs more than a short
//! reply. Through the gateway in front of the in-process fake upstream, with a scripted pool.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use headroom_gpu::{DeviceSnapshot, GpuProbe, ProbeError};
use headroom_server::ServeSettings;
use serde_json::json;

use crate::common::SERIAL;
use crate::serve::{audio_lane, base, client, json_of};
use crate::serve_upstream;

/// A pool with a fixed free figure (what the memory feed reads).
struct Pool(AtomicU64);

impl GpuProbe for Pool {
    fn snapshot(&self) -> Result<Vec<DeviceSnapshot>, ProbeError> {
        Ok(vec![DeviceSnapshot::with_memory(
            0,
            24 << 30,
            (24 << 30) - self.0.load(Ordering::Relaxed),
        )])
    }
}

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_speech_request_is_admitted_on_the_audio_its_characters_make() {
    let _serial = SERIAL.lock().await;
    let up = serve_upstream::start().await;
    // 0.1 s a character, 100 MiB per audio second, 1 GiB per job and a 512 MiB margin: with
    // 2 GiB free, 5.12 s of speech fit (51 characters at speed 1).
    let toml = format!(
        "listen = \"127.0.0.1:0\"\nscrape_interval = \"50ms\"\n{}",
        audio_lane(
            &up,
            "max_inflight = 4\nmax_audio_seconds = 600.0\nspeech_seconds_per_char = 0.1\nmax_input_chars = 100\ngpu_memory_per_job = \"1GiB\"\ngpu_memory_per_audio_second = \"100MiB\"\ngpu_memory_margin = \"512MiB\""
        )
    );
    let pool = Arc::new(Pool(AtomicU64::new(2 << 30)));
    let g = headroom_server::spawn(ServeSettings::from_toml(&toml).unwrap(), Some(pool))
        .await
        .unwrap();
    let (c, b) = (client(), base(&g));
    // A finished job's reservation stays until a reading taken after its release shows its
    // memory gone: each request below starts from an empty ledger.
    let settled = || async {
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while g.gate.snapshot().memory[0].reservations > 0 {
            assert!(tokio::time::Instant::now() < until, "a reservation stayed");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    };
    let speak = |input: String, speed: Option<f64>| {
        let mut body = json!({"model": "tts-1", "voice": "alloy", "input": input});
        if let Some(s) = speed {
            body["speed"] = json!(s);
        }
        c.post(format!("{b}/v1/audio/speech"))
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
    };
    // A short reply fits.
    let r = speak("a".repeat(50), None).await.unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    settled().await;
    // 60 characters are 6 s of speech: 1 GiB + 600 MiB + 512 MiB is over 2 GiB, and with no job
    // running none can make room: refused at once (503), with the figures.
    let r = speak("a".repeat(60), None).await.unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let e = json_of(r).await;
    assert_eq!(e["error"]["code"], "gpu_memory", "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains(&format!("need_bytes={}", 1024 * MIB + 600 * MIB)),
        "{e}"
    );
    // Spoken twice as fast, the same 60 characters are 3 s: they fit.
    let r = speak("a".repeat(60), Some(2.0)).await.unwrap();
    assert_eq!(r.status(), 200);
    settled().await;
    // Characters, not bytes: 50 three-byte characters are 5 s, as 50 ASCII ones are.
    let r = speak("語".repeat(50), None).await.unwrap();
    assert_eq!(r.status(), 200);
    // Over the lane's character limit, and a speed OpenAI's API refuses: 400 before admission.
    let r = speak("a".repeat(101), None).await.unwrap();
    assert_eq!(r.status(), 400);
    let e = json_of(r).await;
    assert_eq!(e["error"]["code"], "input_too_long", "{e}");
    assert_eq!(e["error"]["param"], "input", "{e}");
    let r = speak("hello".into(), Some(5.0)).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(json_of(r).await["error"]["param"], "speed");
    let r = speak("   ".into(), None).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(json_of(r).await["error"]["param"], "input");
    g.shutdown().await.unwrap();
}
