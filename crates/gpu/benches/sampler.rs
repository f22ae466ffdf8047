//! Sampler cost and rate against the scripted probe (no GPU needed).
//!
//! Prints (1) the cost of one tick and of one sample through the recording path (probe call,
//! ring buffer, optional sample-file line), as a ratio to the bare probe call; and (2) the rate a
//! real `Sampler` sustains at 50, 20, 10 and 5 ms, as a ratio to the requested rate, with the CPU
//! time the process spent per tick. `HEADROOM_BENCH_SECS` sets the seconds per rate (default 2).
//! Run: `cargo bench -p headroom-gpu --bench sampler`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use headroom_gpu::probe::{DeviceSnapshot, GpuProbe, ProcessMemory};
use headroom_gpu::sample::SampleWriter;
use headroom_gpu::sampler::{Recorder, Sampler, SamplerConfig, now_ms};
use headroom_gpu::scripted::ScriptedProbe;

const GIB: u64 = 1 << 30;
const GPUS: u32 = 2;
const PROCESSES: u32 = 3;

fn devices() -> Vec<DeviceSnapshot> {
    (0..GPUS)
        .map(|index| {
            let mut d = DeviceSnapshot::with_memory(index, 80 * GIB, 30 * GIB);
            d.name = "NVIDIA H100 80GB HBM3".into();
            d.reserved_bytes = 512 << 20;
            d.utilization_percent = Some(40);
            d.processes = (0..PROCESSES)
                .map(|p| ProcessMemory {
                    pid: 1000 + p,
                    name: format!("worker-{p}"),
                    used_bytes: (p as u64 + 1) * GIB,
                })
                .collect();
            d
        })
        .collect()
}

/// CPU time of every thread of this process, in ns (Linux schedstat); None elsewhere.
fn process_cpu_ns() -> Option<u64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc/self/task").ok()? {
        let path = entry.ok()?.path().join("schedstat");
        let text = std::fs::read_to_string(path).ok()?;
        total += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total)
}

fn per_iteration_ns(iterations: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iterations / 10 {
        f();
    }
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    start.elapsed().as_nanos() as f64 / iterations as f64
}

fn main() {
    let iterations = 100_000;
    let probe = ScriptedProbe::constant(devices());
    println!(
        "sampler bench: scripted probe with {GPUS} GPUs x {PROCESSES} processes, {iterations} iterations"
    );

    let reference = per_iteration_ns(iterations, || {
        black_box(probe.snapshot().ok());
    });
    println!("  probe.snapshot() alone (reference)      {reference:>9.0} ns/tick");

    let mut ring_only = Recorder::new(1536, None);
    let ring = per_iteration_ns(iterations, || {
        ring_only.record(now_ms(), probe.snapshot());
    });
    black_box(ring_only.stats().samples);
    println!(
        "  tick into ring                          {ring:>9.0} ns/tick = {:>6.0} ns/sample, ratio {:.2}x reference",
        ring / GPUS as f64,
        ring / reference
    );

    let dir = std::env::temp_dir().join(format!("headroom-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("samples.jsonl");
    let writer = SampleWriter::append(&file).expect("sample file");
    let mut with_file = Recorder::new(1536, Some(writer));
    let mut n = 0u32;
    let filed = per_iteration_ns(iterations, || {
        with_file.record(now_ms(), probe.snapshot());
        n += 1;
        if n.is_multiple_of(50) {
            with_file.flush();
        }
    });
    with_file.flush();
    let bytes = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    let lines = with_file.stats().samples.max(1);
    println!(
        "  tick into ring + sample file            {filed:>9.0} ns/tick = {:>6.0} ns/sample, ratio {:.2}x reference ({} bytes/line)",
        filed / GPUS as f64,
        filed / reference,
        bytes / lines
    );
    let _ = std::fs::remove_dir_all(&dir);

    let seconds: f64 = std::env::var("HEADROOM_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|s: &f64| *s > 0.0)
        .unwrap_or(2.0);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .expect("runtime");
    let probe: Arc<dyn GpuProbe> = Arc::new(ScriptedProbe::constant(devices()));
    println!(
        "  sustained rate of a running Sampler over {seconds} s each (ratio = achieved / requested):"
    );
    for interval_ms in [50u64, 20, 10, 5] {
        let interval = Duration::from_millis(interval_ms);
        // Reference: a bare tokio interval task that does nothing per tick.
        let cpu_before = process_cpu_ns();
        let bare_ticks = rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(seconds);
            let task = tokio::spawn(async move {
                let mut ticker = tokio::time::interval(interval);
                let mut ticks = 0u64;
                while tokio::time::Instant::now() < deadline {
                    ticker.tick().await;
                    ticks += 1;
                }
                ticks
            });
            task.await.unwrap_or(0)
        });
        let bare_cpu = match (cpu_before, process_cpu_ns()) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / bare_ticks.max(1) as f64),
            _ => None,
        };

        let cpu_before = process_cpu_ns();
        let started = Instant::now();
        let run = rt
            .block_on(async {
                let sampler = Sampler::start(Arc::clone(&probe), SamplerConfig::new(interval))?;
                tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
                sampler.stop().await
            })
            .expect("sampler run");
        let elapsed = started.elapsed().as_secs_f64();
        let cpu = match (cpu_before, process_cpu_ns(), bare_cpu) {
            (Some(a), Some(b), Some(bare)) => {
                let per_tick = b.saturating_sub(a) as f64 / run.stats.ticks.max(1) as f64;
                format!(
                    "CPU {:.1} us/tick vs {:.1} us/tick for a bare interval task (ratio {:.2})",
                    per_tick / 1000.0,
                    bare / 1000.0,
                    per_tick / bare.max(1.0)
                )
            }
            _ => "CPU n/a".into(),
        };
        let requested = 1000.0 / interval_ms as f64;
        let achieved = run.stats.ticks as f64 / elapsed;
        println!(
            "    every {interval_ms:>2} ms: {:>5} ticks in {elapsed:.2} s = {achieved:>6.1}/s vs {requested:>5.1}/s requested, ratio {:.3}; missed {}; {cpu}",
            run.stats.ticks,
            achieved / requested,
            run.stats.missed_ticks,
        );
    }
}
