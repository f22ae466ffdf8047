#!/usr/bin/env bash
# Benchmark (not a test): does `headroom serve` keep speech-to-text latency predictable while text
# floods in, and what does text still get? Both CPU servers use every core, so they contend for the
# machine the way two engines contend for one GPU. Runs every condition (audio idle; text alone;
# back-to-back clips and clips with gaps, each with preempt on and off; with --baselines the flood
# direct and through nginx) in repeated rounds and prints the median of the rounds with the spread:
# audio p50/p95 and p95 against idle, text requests completed and tokens/s against text alone.
# Usage: bench/protection.sh [--rounds N] [--clips N] [--flood N] [--max-tokens N] [--gap S]
#                            [--text-seconds S] [--baselines] [--text-engine llamacpp|vllm] [--json FILE]
#                            [--compare-up]
# --compare-up: `headroom up` with examples/cpu-box.up.toml (its own engines, free ports) against
# `headroom serve` with examples/cpu-box.toml, one box at a time, under the same flood and clips:
# the table of docs/up.md.
# Ports: HEADROOM_LLAMA_PORT, HEADROOM_WHISPER_PORT (see scripts/backends.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  echo "installing nginx (Debian package nginx-light)"
  apt-get install -y -qq nginx-light >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; }
fi
cargo build --release --quiet --bin headroom
scripts/backends.sh install
HEADROOM_BACKEND_THREADS=$(nproc) scripts/backends.sh start
# --text-engine vllm: text goes to vLLM on this CPU instead (preempt_mode = "pause" is compared too).
case " $* " in *" --text-engine vllm "*)
  scripts/backends.sh install vllm
  scripts/backends.sh start vllm
  export HEADROOM_VLLM_URL=http://127.0.0.1:${HEADROOM_VLLM_PORT:-18082} ;;
esac
export HEADROOM_LLAMA_URL=http://127.0.0.1:${HEADROOM_LLAMA_PORT:-18080}
export HEADROOM_WHISPER_URL=http://127.0.0.1:${HEADROOM_WHISPER_PORT:-18081}
trap 'scripts/backends.sh stop >/dev/null' EXIT
PYTHONUNBUFFERED=1 .backends/client/bin/python bench/protection.py --headroom target/release/headroom "$@"
