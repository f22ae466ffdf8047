#!/usr/bin/env bash
# Instructions per proxied request of `headroom serve` under callgrind, a reference binary against
# this tree's release build, side by side (see bench/gateway_callgrind.py). Needs valgrind and nginx.
# Usage: bench/gateway-callgrind.sh BEFORE_BINARY [--requests N] [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bench/gateway-callgrind.sh BEFORE_BINARY [--requests N] [--rounds N]" >&2; exit 2; }
BEFORE=$1; shift
[ -x "$BEFORE" ] || { echo "gateway-callgrind: $BEFORE is not an executable" >&2; exit 2; }
cargo build --release --quiet --bin headroom
exec python3 bench/gateway_callgrind.py --before "$BEFORE" --after target/release/headroom "$@"
