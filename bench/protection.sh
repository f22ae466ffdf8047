#!/usr/bin/env bash
# Benchmark (not a test): does `headroom serve` keep speech-to-text latency predictable while text
# floods in? Both CPU servers use every core, so they contend for the machine the way two engines
# contend for one GPU. Prints a table of transcription latency (idle; flood direct; flood through
# nginx least_conn; flood through headroom serve; then clips with gaps, direct and through headroom)
# with ratios to idle, and what text completes meanwhile beside text with audio idle.
# Usage: bench/protection.sh [--clips N] [--flood N] [--max-tokens N] [--gap S] [--json FILE]
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
export HEADROOM_LLAMA_URL=http://127.0.0.1:${HEADROOM_LLAMA_PORT:-18080}
export HEADROOM_WHISPER_URL=http://127.0.0.1:${HEADROOM_WHISPER_PORT:-18081}
trap 'scripts/backends.sh stop >/dev/null' EXIT
PYTHONUNBUFFERED=1 .backends/client/bin/python bench/protection.py --headroom target/release/headroom "$@"
