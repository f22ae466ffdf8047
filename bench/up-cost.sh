#!/usr/bin/env bash
# Benchmark (not a test): `headroom up`'s own CPU on the example box (bring-up, the warm-up's
# 40 Hz sampling, ready and idle) beside `headroom serve`'s, optionally against a second binary.
# Usage: bench/up-cost.sh [--before BIN] [--rounds N] [--idle-seconds S] [--port-base N] [--json FILE]
# Needs the engines of scripts/backends.sh install (.backends/); ports --port-base+2, +3, +80, +81.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet --bin headroom
[ -x .backends/stt/bin/faster-whisper-server ] || scripts/backends.sh install
python3 bench/up_cost.py "$@"
