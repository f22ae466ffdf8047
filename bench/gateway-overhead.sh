#!/usr/bin/env bash
# Benchmark (not a test): latency and throughput `headroom serve` adds in front of a fast upstream,
# beside nginx as a plain reverse proxy. Needs nginx (Debian) and oha (crates.io); installs them.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  apt-get install -y -qq nginx-light >/dev/null || { apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null; }
fi
command -v oha >/dev/null || cargo install --locked --quiet oha
cargo build --release --quiet --bin headroom
python3 bench/gateway_overhead.py --headroom target/release/headroom "$@"
