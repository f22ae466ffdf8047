//! Throughput of `headroom_doctor::diagnose` on a generated 50 MB engine log, against a plain
//! line-count pass (`BufRead::read_until` with a reused buffer) over the same bytes. Prints MB/s
//! for both and the ratio; run with `cargo bench -p headroom-doctor`.

use std::io::BufRead;
use std::time::{Duration, Instant};

const TARGET_BYTES: usize = 50 * 1024 * 1024;

/// Lines a busy vLLM server writes, with the occasional traceback, warning and OOM report.
fn generate_log() -> Vec<u8> {
    let routine = [
        "INFO 05-26 21:34:12 [loggers.py:123] Engine 000: Avg prompt throughput: 1523.4 tokens/s, Avg generation throughput: 812.9 tokens/s, Running: 17 reqs, Waiting: 3 reqs, GPU KV cache usage: 61.2%, Prefix cache hit rate: 12.0%",
        "INFO:     127.0.0.1:51234 - \"POST /v1/chat/completions HTTP/1.1\" 200 OK",
        "INFO 05-26 21:34:13 [logger.py:41] Received request chatcmpl-8287d124d13540a4b5f901437edcdf77: params: SamplingParams(n=1, temperature=0.7, top_p=1.0, max_tokens=512)",
        "DEBUG 05-26 21:34:13 [core.py:412] EngineCore loop active.",
        "(VllmWorker rank=1 pid=2445156) INFO 05-10 16:00:15 [multiproc_executor.py:470] worker heartbeat ok",
        "  File \"/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py\", line 294, in run_engine_core",
        "WARNING 05-26 21:34:14 [scheduler.py:171] Sequence group 42 is preempted by PreemptionMode.RECOMPUTE because there is not enough KV cache space.",
    ];
    let rare = [
        "INFO 12-20 20:25:46 worker.py:241] model weights take 7.51GiB; non_torch_memory takes 0.39GiB; PyTorch activation peak memory takes 2.53GiB; the rest of the memory reserved for KV Cache is 3.76GiB.",
        "(EngineCore_DP0 pid=26283) INFO 11-06 10:51:48 [kv_cache_utils.py:1229] GPU KV cache size: 75,840 tokens",
        "ERROR 03-13 09:00:43 [core.py:330] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.16 GiB. GPU 0 has a total capacity of 7.75 GiB of which 1.17 GiB is free. Including non-PyTorch memory, this process has 5.02 GiB memory in use. Of the allocated memory 4.81 GiB is allocated by PyTorch, and 18.97 MiB is reserved by PyTorch but unallocated.",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9866.00 MiB on device 1: cudaMalloc failed: out of memory",
    ];
    let mut out = Vec::with_capacity(TARGET_BYTES + 4096);
    let mut i: usize = 0;
    while out.len() < TARGET_BYTES {
        let line = if i.is_multiple_of(997) {
            rare[(i / 997) % rare.len()]
        } else {
            routine[i % routine.len()]
        };
        out.extend_from_slice(line.as_bytes());
        out.push(b'\n');
        i += 1;
    }
    out
}

/// Worst case: every line carries rule keywords (a crash loop of multi-worker tracebacks).
fn generate_error_log() -> Vec<u8> {
    let lines = [
        "(VllmWorker rank=1 pid=194255) ERROR 05-08 14:46:12 [multiproc_executor.py:435] Traceback (most recent call last):",
        "(VllmWorker rank=1 pid=194255) ERROR 05-08 14:46:12 [multiproc_executor.py:435]   File \"/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_model_runner.py\", line 1548, in execute_model",
        "(VllmWorker rank=1 pid=194255) ERROR 05-08 14:46:12 [multiproc_executor.py:435] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU 1 has a total capacity of 21.98 GiB of which 156.94 MiB is free. Including non-PyTorch memory, this process has 21.80 GiB memory in use. Of the allocated memory 21.42 GiB is allocated by PyTorch, and 24.12 MiB is reserved by PyTorch but unallocated.",
    ];
    let mut out = Vec::with_capacity(TARGET_BYTES + 4096);
    let mut i = 0;
    while out.len() < TARGET_BYTES {
        out.extend_from_slice(lines[i % lines.len()].as_bytes());
        out.push(b'\n');
        i += 1;
    }
    out
}

fn line_count(bytes: &[u8]) -> u64 {
    let mut reader = bytes;
    let mut buf = Vec::with_capacity(512);
    let mut n = 0;
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) => return n,
            Ok(_) => n += 1,
            Err(e) => panic!("in-memory read failed: {e}"),
        }
    }
}

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let v = f();
        best = best.min(start.elapsed());
        last = Some(v);
    }
    (best, last.expect("at least one run"))
}

fn main() {
    run(
        "serving log (routine lines, rare memory messages)",
        &generate_log(),
    );
    run(
        "crash loop (every line wakes the rules)",
        &generate_error_log(),
    );
}

fn run(label: &str, log: &[u8]) {
    println!("== {label}");
    let mb = log.len() as f64 / (1024.0 * 1024.0);
    let (t_count, lines) = best_of(3, || line_count(log));
    let (t_doctor, diagnosis) = best_of(3, || {
        headroom_doctor::diagnose(log).expect("in-memory read")
    });
    assert_eq!(
        diagnosis.lines_read, lines,
        "both passes must see the same lines"
    );
    let rate = |t: Duration| mb / t.as_secs_f64();
    println!("input: {mb:.1} MiB, {lines} lines");
    println!(
        "line count (read_until):  {:>8.1} ms  {:>8.1} MiB/s",
        t_count.as_secs_f64() * 1e3,
        rate(t_count)
    );
    println!(
        "headroom doctor diagnose: {:>8.1} ms  {:>8.1} MiB/s",
        t_doctor.as_secs_f64() * 1e3,
        rate(t_doctor)
    );
    println!(
        "ratio doctor / line count: {:.1}x",
        t_doctor.as_secs_f64() / t_count.as_secs_f64()
    );
    println!(
        "findings: {:?}",
        diagnosis
            .findings
            .iter()
            .map(|f| f.cause.as_str())
            .collect::<Vec<_>>()
    );
}
