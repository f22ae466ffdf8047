//! The findings of issue 30's families, each on the engine's own wording (taken from the
//! engines' source and from the threads the fixtures cite): TGI's "total tokens" pool, a TGI
//! warm-up that failed for another reason, llama.cpp under Ollama answered in Ollama's settings,
//! an out-of-memory an engine came up after, multi-stage stacks, CUDA-graph profiling figures and
//! the `--kv-cache-memory` values a start-up prints.

use headroom_doctor::{Cause, Engine, diagnose_str};

#[test]
fn tgi_total_tokens_lowers_the_pool_and_never_raises_the_prefill() {
    // TGI's router message (huggingface/text-generation-inference#710), with its launcher args.
    let d = diagnose_str(
        "Args { model_id: \"/opt/ml/model\", num_shard: Some(8), max_input_length: 3072, max_total_tokens: 4096, max_batch_prefill_tokens: 4096, max_batch_total_tokens: 16000 }\n\
         ERROR text_generation_launcher: Method Warmup encountered an error.\n\
         Error: Not enough memory to handle 16000 total tokens with 2 prefill tokens. You need to decrease `--max-batch-total-tokens` or `--max-batch-prefill-tokens`\n",
    );
    let f = &d.findings[0];
    assert_eq!(d.engine, Some(Engine::Tgi));
    assert_eq!(f.cause, Cause::KvCacheTooSmall);
    assert_eq!(f.numbers["max_batch_total_tokens_that_fits"], 8000.0);
    assert!(
        f.fix.contains("`--max-batch-total-tokens 8000`"),
        "{}",
        f.fix
    );
    assert!(
        !d.findings
            .iter()
            .any(|f| f.fix.contains("`--max-batch-prefill-tokens")),
        "no finding may move the prefill: {:?}",
        d.findings
    );
}

#[test]
fn a_tgi_warmup_that_failed_without_running_out_is_not_a_memory_limit() {
    let d = diagnose_str(
        "Args { max_batch_prefill_tokens: Some(256), max_total_tokens: Some(512) }\n\
         ERROR text_generation_launcher: Method Warmup encountered an error.\n\
         RuntimeError: shape '[1, 256, 32, 128]' is invalid for input of size 1048576\n",
    );
    let f = &d.findings[0];
    assert_eq!(f.cause, Cause::NotOutOfMemory, "{:?}", d.findings);
    assert!(f.fix.contains("at 256 prefill tokens"), "{}", f.fix);
    assert!(f.fix.contains("is invalid for input of size"), "{}", f.fix);
}

#[test]
fn llama_cpp_under_ollama_is_answered_in_ollamas_settings() {
    // An Ollama runner's start line and llama.cpp's allocation failure in it.
    let d = diagnose_str(
        "time=2025-03-07T04:55:20.782Z level=INFO source=server.go:375 msg=\"starting llama server\" cmd=\"/usr/bin/ollama runner --model /m --ctx-size 8192 --batch-size 512 --n-gpu-layers 33 --parallel 4 --port 42509\"\n\
         ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1250.00 MiB on device 0: cudaMalloc failed: out of memory\n\
         ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 1310720000\n",
    );
    assert_eq!(d.engine, Some(Engine::Ollama));
    let f = &d.findings[0];
    assert_eq!(f.cause, Cause::ActivationPeak);
    for want in [
        "`num_batch 256`",
        "`num_ctx 1024`",
        "`OLLAMA_NUM_PARALLEL=1`",
        "`num_gpu 24`",
    ] {
        assert!(f.fix.contains(want), "{want} missing: {}", f.fix);
    }
    for foreign in ["-ub", "-ngl", "--tensor-split", "-c "] {
        assert!(!f.fix.contains(foreign), "{foreign} in: {}", f.fix);
    }
}

#[test]
fn an_out_of_memory_the_engine_came_up_after_did_not_stop_it() {
    let d = diagnose_str(
        "(EngineCore pid=7) WARNING 04-25 10:00:00 [autotuner.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.57 GiB of which 512.00 MiB is free.\n\
         (EngineCore pid=7) INFO 04-25 10:00:30 [core.py:1] init engine (profile, create kv cache, warmup model) took 40.00 seconds\n\
         (APIServer pid=1) INFO:     Application startup complete.\n",
    );
    assert_eq!(
        d.findings[0].cause,
        Cause::NotOutOfMemory,
        "{:?}",
        d.findings
    );
    assert!(
        d.findings[0].fix.contains("came up"),
        "{}",
        d.findings[0].fix
    );
    // The same out-of-memory with nothing after it stays the cause.
    let d = diagnose_str(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.57 GiB of which 512.00 MiB is free.\n",
    );
    assert_ne!(d.findings[0].cause, Cause::NotOutOfMemory);
}

#[test]
fn sglang_decode_retractions_are_the_scheduler_going_on() {
    let d = diagnose_str(
        "[2025-03-07 21:49:33 TP13] Decode out of memory happened. #retracted_reqs: 1, #new_token_ratio: 0.4513 -> 0.7513\n",
    );
    assert_eq!(d.findings.len(), 1);
    assert_eq!(d.findings[0].cause, Cause::NotOutOfMemory);
    assert!(
        d.findings[0].fix.contains("retracted"),
        "{}",
        d.findings[0].fix
    );
}

#[test]
fn stages_sized_per_process_that_ran_out_are_named_with_their_budgets() {
    let d = diagnose_str(
        "(Worker pid=1) [Stage-0] INFO 02-26 07:43:01 [gpu_worker.py:1] Free memory on device (78.00/79.19 GiB) on startup. Desired GPU memory utilization is (0.6, 47.51 GiB).\n\
         (Worker pid=1) [Stage-0] INFO 02-26 07:43:05 [base.py:1] Available KV cache memory: 20.00 GiB (process-scoped)\n\
         (Worker pid=2) [Stage-1] INFO 02-26 07:43:06 [gpu_worker.py:1] Free memory on device (30.00/79.19 GiB) on startup. Desired GPU memory utilization is (0.3, 23.76 GiB).\n\
         (Worker pid=2) [Stage-1] INFO 02-26 07:43:09 [base.py:1] Available KV cache memory: 10.00 GiB (process-scoped)\n\
         (Worker pid=3) [Stage-2] INFO 02-26 07:43:10 [gpu_model_runner.py:1] Model loading took 4.00 GiB memory and 6.3 seconds\n\
         (Worker pid=3) [Stage-2] ERROR 02-26 07:44:00 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 200.00 MiB is free.\n",
    );
    let f = &d.findings[0];
    assert_eq!(f.cause, Cause::OtherProcessHoldsMemory, "{:?}", d.findings);
    assert_eq!(f.numbers["stages"], 3.0);
    assert!((f.numbers["utilization_sum"] - 0.9).abs() < 1e-9);
    assert_eq!(f.numbers["unbudgeted_weights_gib"], 4.0);
    assert!(f.fix.contains("process-scoped"), "{}", f.fix);
    // 1 − 4 / 79.19 − 0.05 = 0.899 → 0.89
    assert!(f.fix.contains("at most 0.89"), "{}", f.fix);
}

#[test]
fn graph_profiling_and_kv_cache_memory_figures_are_the_logs_own() {
    let d = diagnose_str(
        "(EngineCore pid=79) INFO 07-30 07:11:00 [gpu_worker.py:560] Free memory on device (78.20/79.19 GiB) on startup. Desired GPU memory utilization is (0.95, 75.23 GiB).\n\
         (EngineCore pid=79) INFO 07-30 07:11:00 [gpu_worker.py:575] CUDA graph memory profiling is enabled (default since v0.21.0). The current --gpu-memory-utilization=0.9500 is equivalent to --gpu-memory-utilization=0.9139 without CUDA graph memory profiling. To maintain the same effective KV cache size as before, increase --gpu-memory-utilization to 0.9861. To disable, set VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0.\n\
         (EngineCore pid=79) INFO 07-30 07:12:00 [gpu_worker.py:804] Free memory on device (78.20/79.19 GiB) on startup. Desired GPU memory utilization is (0.95, 75.23 GiB). Actual usage is 51.66 GiB for consumed memory (weights + non-torch), 2.4 GiB for peak activation, and 0.71 GiB for CUDAGraph memory. Replace gpu_memory_utilization config with `--kv-cache-memory=20064085607` (18.69 GiB) to fit into requested memory, or `--kv-cache-memory=26927570944` (25.08 GiB) to fully utilize gpu memory. Current kv cache memory in use is 19.54 GiB.\n\
         (EngineCore pid=79) ERROR 07-30 07:13:00 [core.py:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 300.00 MiB is free. Error in model execution\n",
    );
    let s = d.startup.as_ref().expect("start-up figures");
    // (0.95 − 0.9139) × 79.19
    assert!((s.cuda_graph_estimate_gib.unwrap() - 0.036_1 * 79.19).abs() < 1e-6);
    assert_eq!(s.consumed_gib, Some(51.66));
    assert_eq!(s.breakdown.activation_peak_gib, Some(2.4));
    assert_eq!(s.breakdown.cuda_graph_gib, Some(0.71));
    assert_eq!(s.kv_cache_memory_fits_bytes, Some(20_064_085_607));
    assert_eq!(s.kv_cache_memory_fills_bytes, Some(26_927_570_944));
    let f = &d.findings[0];
    assert_eq!(f.cause, Cause::ActivationPeak);
    assert!(
        f.fix.contains("`--kv-cache-memory=20064085607`"),
        "{}",
        f.fix
    );
}
