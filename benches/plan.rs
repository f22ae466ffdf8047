//! Benchmark: how fast a catalog plan answers, in process and as a whole `headroom plan` run,
//! printed beside a reference (the 50 ms target, and spawning `true` as the floor of any process).
//! Run with `cargo bench --bench plan`.

use std::process::Command;
use std::time::{Duration, Instant};

use headroom_inspect::resolve::{Env, resolve_model};
use headroom_plan::{PlanRequest, plan, units::GIB};

const TARGET: Duration = Duration::from_millis(50);

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn measure(n: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    (percentile(&times, 0.5), percentile(&times, 0.99))
}

fn main() {
    let env = Env::default();
    let models = [
        "meta-llama/Llama-3.1-8B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct-AWQ",
        "deepseek-ai/DeepSeek-V3",
        "google/gemma-3-27b-it",
        "openai/gpt-oss-120b",
    ];
    let mut i = 0;
    let (in_p50, in_p99) = measure(2000, || {
        let m = resolve_model(models[i % models.len()], &env).unwrap();
        let mut req = PlanRequest::new(24 * GIB);
        req.max_model_len = Some(16_384);
        req.target_concurrency = Some(64);
        std::hint::black_box(plan(&m.spec, &req).unwrap());
        i += 1;
    });

    let exe = env!("CARGO_BIN_EXE_headroom");
    let (cli_p50, cli_p99) = measure(30, || {
        let out = Command::new(exe)
            .args([
                "plan",
                "--model",
                "Qwen/Qwen2.5-7B-Instruct-AWQ",
                "--gpu",
                "24GiB",
                "--reserve",
                "whisper-large-v3",
                "--max-model-len",
                "16384",
                "--max-num-seqs",
                "4",
                "--format",
                "json",
            ])
            .env("HF_HOME", "/nonexistent")
            .output()
            .unwrap();
        assert!(out.status.success());
    });
    let (true_p50, _) = measure(30, || {
        Command::new("true").status().unwrap();
    });

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{:<34} {:>10} {:>10} {:>16}",
        "catalog plan", "p50 ms", "p99 ms", "p50 / 50 ms target"
    );
    println!(
        "{:<34} {:>10.4} {:>10.4} {:>16.5}",
        "in process (resolve + plan)",
        ms(in_p50),
        ms(in_p99),
        in_p50.as_secs_f64() / TARGET.as_secs_f64()
    );
    println!(
        "{:<34} {:>10.3} {:>10.3} {:>16.4}",
        "headroom plan (whole process)",
        ms(cli_p50),
        ms(cli_p99),
        cli_p50.as_secs_f64() / TARGET.as_secs_f64()
    );
    println!(
        "{:<34} {:>10.3} {:>10} {:>16.4}",
        "reference: spawning `true`",
        ms(true_p50),
        "",
        true_p50.as_secs_f64() / TARGET.as_secs_f64()
    );
}
