#!/usr/bin/env bash
# Request rate `headroom bench` drives against a trivial local server, compared with what oha
# (cargo install oha) drives against the same server with the same connections and duration.
# Prints both rates and the ratio headroom/oha. Both run closed loops of non-streamed POSTs.
#
#   bench/bench-vs-oha.sh            # 10 s, 32 connections
#   DURATION=20 CONCURRENCY=64 bench/bench-vs-oha.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-10}"
CONCURRENCY="${CONCURRENCY:-32}"
BODY='{"model":"trivial","messages":[{"role":"user","content":"hello"}],"max_tokens":1,"stream":false}'

OHA="$(command -v oha || true)"
if [ -z "$OHA" ] && [ -x "$HOME/.cargo/bin/oha" ]; then OHA="$HOME/.cargo/bin/oha"; fi
if [ -z "$OHA" ]; then
    echo "bench-vs-oha: oha not found; install it with: cargo install oha" >&2
    exit 2
fi

cargo build --release --quiet -p headroom --bin headroom
cargo build --release --quiet -p headroom-bench --example trivial_server

OUT="$(mktemp -d)"
mkfifo "$OUT/addr"
target/release/examples/trivial_server 127.0.0.1:0 >"$OUT/addr" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; rm -rf "$OUT"' EXIT
read -r ADDR <"$OUT/addr"
URL="http://$ADDR"
echo "trivial server on $URL"

# Warm both up briefly so neither pays for cold connections in its figure.
"$OHA" -z 1s -c "$CONCURRENCY" --no-tui -m POST -H 'content-type: application/json' -d "$BODY" \
    "$URL/v1/chat/completions" >/dev/null

"$OHA" -z "${DURATION}s" -c "$CONCURRENCY" --no-tui --output-format json -m POST \
    -H 'content-type: application/json' -d "$BODY" "$URL/v1/chat/completions" >"$OUT/oha.json"
target/release/headroom bench --url "$URL" --model trivial --no-stream --no-gpu \
    --max-tokens 1 --input-tokens 1 --concurrency "$CONCURRENCY" --duration "${DURATION}s" \
    --warmup "$CONCURRENCY" --format json >"$OUT/headroom.json" 2>/dev/null

python3 - "$OUT/oha.json" "$OUT/headroom.json" "$DURATION" "$CONCURRENCY" <<'PY'
import json, sys
oha = json.load(open(sys.argv[1]))
hr = json.load(open(sys.argv[2]))
oha_rps = oha["summary"]["requestsPerSec"]
oha_ok = oha["summary"]["successRate"]
hr_rps = hr["request_throughput_rps"]
hr_ok = hr["outcomes"]["ok"] / max(1, hr["requests_completed"])
print(f"duration {sys.argv[3]} s, {sys.argv[4]} connections, non-streamed POST /v1/chat/completions")
print(f"oha:            {oha_rps:10.0f} req/s (success rate {oha_ok:.3f})")
print(f"headroom bench: {hr_rps:10.0f} req/s (ok fraction {hr_ok:.3f}, e2e p50 {hr['e2e_ms']['p50']} ms)")
print(f"ratio headroom/oha: {hr_rps / oha_rps:.2f}")
PY
