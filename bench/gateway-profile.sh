#!/usr/bin/env bash
# Profile (not a test): where `headroom serve` spends its time per proxied request. Starts the
# same fast nginx upstream and one-lane gateway as bench/gateway-overhead.sh, loads the gateway
# with wrk (closed loop) while `perf record` samples it, and prints the hottest frames, self time
# and inclusive. Needs perf (Debian linux-perf), nginx and wrk (Debian); release binary.
# Usage: bench/gateway-profile.sh [seconds] [connections]   (PORT_BASE=N picks ports N..N+2)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_LOAD=${1:-10}
CONNS=${2:-32}
BASE=${PORT_BASE:-20400}
UP=$BASE PROXY=$((BASE + 1)) GW=$((BASE + 2))
for tool in perf wrk; do command -v $tool >/dev/null || { echo "gateway-profile: needs $tool" >&2; exit 2; }; done
cargo build --release --quiet --bin headroom
DIR=$(mktemp -d /tmp/headroom-profile-XXXX)
chmod 755 "$DIR"
python3 - "$DIR" "$UP" "$PROXY" "$GW" <<'PY'
import pathlib, sys
sys.path.insert(0, "bench")
import gateway_overhead as g
d, up, proxy, gw = sys.argv[1], *map(int, sys.argv[2:])
pathlib.Path(d, "nginx.conf").write_text(g.NGINX.format(prefix=d, upstream=up, proxy=proxy, answer=g.ANSWER))  # the upstream only
pathlib.Path(d, "headroom.toml").write_text(g.HEADROOM.format(port=gw, upstream=up, threads=""))
pathlib.Path(d, "body.lua").write_text(
    'wrk.method = "POST"\nwrk.body = [[' + g.BODY + ']]\nwrk.headers["content-type"] = "application/json"\n')
PY
"$(command -v nginx || echo /usr/sbin/nginx)" -c "$DIR/nginx.conf" -p "$DIR" &
NGINX=$!
target/release/headroom serve --config "$DIR/headroom.toml" >/dev/null &
HR=$!
trap 'kill $HR $NGINX 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -fsS -o /dev/null -H 'content-type: application/json' \
  -d '{"model":"m","messages":[{"role":"user","content":"hi"}]}' "http://127.0.0.1:$GW/v1/chat/completions" && break; sleep 0.1; done
perf record -F 1999 --call-graph dwarf,32768 -p "$HR" -o "$DIR/perf.data" -- sleep "$SECONDS_LOAD" 2>/dev/null &
PERF=$!
sleep 0.5
wrk -t1 -c"$CONNS" -d"$((SECONDS_LOAD - 1))s" -s "$DIR/body.lua" "http://127.0.0.1:$GW/v1/chat/completions"
wait $PERF || true
echo "== self time (top frames)"
perf report -i "$DIR/perf.data" --no-children --sort dso,symbol --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -40
echo "== inclusive time"
perf report -i "$DIR/perf.data" --children --sort symbol --stdio -g none 2>/dev/null | grep -v '^#' | grep -v '^$' | head -60
echo "perf data: $DIR/perf.data"
