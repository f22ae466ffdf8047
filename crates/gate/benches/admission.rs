//! What one admission costs in process with memory admission on: admit + release on a lane with a
//! memory need, against a ledger that holds a reading and eight outstanding reservations, beside
//! the same on a lane without one (the reference). Prints p50/p99 per admit and the ratio of the
//! p50 to the 5 µs target. Run with `cargo bench -p headroom-gate --bench admission`.

use std::time::{Duration, Instant};

use headroom_gate::{AdmitRequest, Gate, GpuNeed, LaneSpec, LedgerSettings, MemoryReading, Policy};

const ROUNDS: usize = 20_000;
const TARGET: Duration = Duration::from_micros(5);
const MIB: u64 = 1 << 20;

fn lane(name: &str, gpu: Option<GpuNeed>) -> LaneSpec {
    LaneSpec {
        max_inflight: 64,
        policy: Policy::Reject,
        gpu,
        ..LaneSpec::new(name, &["http://127.0.0.1:1", "http://127.0.0.1:2"])
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p).ceil() as usize).saturating_sub(1)]
}

fn main() {
    let need = GpuNeed {
        device: 0,
        bytes_per_job: 300 * MIB,
        bytes_per_audio_second: MIB,
        margin_bytes: 64 * MIB,
        fail_open: false,
        learn: true,
        longest_clip_seconds: Some(600.0),
    };
    let gate = Gate::new(
        vec![lane("stt", Some(need)), lane("text", None)],
        None,
        Some(LedgerSettings::default()),
    )
    .expect("valid gate");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        gate.push_memory_reading(MemoryReading {
            device: 0,
            total_bytes: 80 << 30,
            free_bytes: 60 << 30,
            owners: vec![
                ("http://127.0.0.1:1".into(), 2 << 30),
                ("http://127.0.0.1:2".into(), 2 << 30),
            ],
            at: tokio::time::Instant::now(),
        });
        let request = AdmitRequest {
            audio_seconds: Some(12.5),
            ..AdmitRequest::default()
        };
        // Eight jobs in flight, so the check walks real reservations.
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(gate.admit(0, request.clone()).await.expect("fits"));
        }
        let mut rows = Vec::new();
        for (name, lane) in [
            ("text lane, no memory need (reference)", 1),
            ("stt lane, memory ledger", 0),
        ] {
            let mut samples = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                let start = Instant::now();
                let permit = gate.admit(lane, request.clone()).await.expect("admitted");
                samples.push(start.elapsed());
                drop(permit);
            }
            samples.sort();
            rows.push((name, percentile(&samples, 0.5), percentile(&samples, 0.99)));
        }
        drop(held);
        println!("admission cost per admit, {ROUNDS} admits each (release not timed)");
        for (name, p50, p99) in &rows {
            println!(
                "  {name:<40} p50 {:>8.2} µs  p99 {:>8.2} µs",
                us(*p50),
                us(*p99)
            );
        }
        let (_, reference, _) = rows[0];
        let (_, memory, _) = rows[1];
        println!(
            "  memory admission p50 / reference p50: {:.2}x",
            memory.as_secs_f64() / reference.as_secs_f64().max(1e-12)
        );
        println!(
            "  memory admission p50 / 5 µs target:   {:.3} ({})",
            memory.as_secs_f64() / TARGET.as_secs_f64(),
            if memory < TARGET {
                "within target"
            } else {
                "OVER TARGET"
            }
        );
    });
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
