#!/usr/bin/env bash
# Benchmark (not a test): `headroom serve` against hostile clients and failing upstreams, with the
# gateway's default timeouts. Takes the binary to measure, so a build of main ("before") and of a
# branch ("after") can be run side by side:
#   bash bench/hostile.sh target/release/headroom [--watch SECONDS] [--json FILE]
# Prints: slot freed after a never-reading client (s), slowloris and idle connections closed (s),
# deliveries of a POST whose upstreams close, requests served beside a hung replica, peak RSS
# under 20 x 45 MiB uploads, and answers to new clients while 2,000 connections are held with the
# gateway at `ulimit -n 1024` (the driver starts that gateway under the limit). Needs python3
# (standard library only); takes 2-4 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ ! -x "$1" ]; then
  echo "usage: bash bench/hostile.sh PATH/TO/headroom [--watch SECONDS] [--json FILE]" >&2
  exit 2
fi
binary=$(realpath "$1")
shift
echo "# $binary; load average $(cut -d' ' -f1-3 /proc/loadavg)"
python3 bench/hostile.py --headroom "$binary" "$@"
