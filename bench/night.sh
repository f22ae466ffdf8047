#!/usr/bin/env bash
# The night of the 3 AM page on the CPU box, twice: the engines set up by hand
# (examples/cpu-box.hand-set.toml: a fixed 45 % share for the LLM, clients straight to the
# engines), then the same engines under `headroom up` — the same night (examples/night.toml), the
# same memory limit (one cgroup of the box's capacity each), one after the other. Prints both
# reports side by side; exits 1 when the box set up by hand did not show the page or the box under
# up broke a verdict (each named in its report), 2 on bad input.
# Usage: bench/night.sh [--duration 1h] [--out DIR] [--box FILE] [--hand-set FILE]
#                       [--scenario FILE] [--without admission] [--idle-requests N] [--debug]
# A full hour of each on a quiet machine: bench/night.sh (about 2 h 10 min in all).
# CI runs the short night: bench/night.sh --duration 90s --idle-requests 2 --debug (both boxes,
# about 10 minutes together: each box's start, its idle figures, the night, its stop).
# Needs: scripts/backends.sh install (llama.cpp, Whisper, piper), root or a delegated memory cgroup.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=1h
out=night-$(date +%Y%m%d-%H%M%S)
box=examples/cpu-box-night.up.toml
hand_set=examples/cpu-box.hand-set.toml
scenario=examples/night.toml
without=()
idle=()
profile=release
while [ $# -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --box) box=$2; shift 2 ;;
    --hand-set) hand_set=$2; shift 2 ;;
    --scenario) scenario=$2; shift 2 ;;
    --without) without+=(--without "$2"); shift 2 ;;
    --idle-requests) idle=(--idle-requests "$2"); shift 2 ;;
    --debug) profile=debug; shift ;;
    *) echo "bench/night.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

if [ "$profile" = release ]; then
  cargo build --release --quiet --bin headroom
  headroom=${CARGO_TARGET_DIR:-target}/release/headroom
else
  cargo build --quiet --bin headroom
  headroom=${CARGO_TARGET_DIR:-target}/debug/headroom
fi
[ -x .backends/llm/bin/python ] && [ -x .backends/stt/bin/python ] && [ -x .backends/tts/bin/python ] ||
  scripts/backends.sh install
mkdir -p "$out"

t0=$SECONDS
hand_rc=0
"$headroom" drill --box "$box" --hand-set "$hand_set" --scenario "$scenario" --duration "$duration" \
  --report "$out/hand-set" "${idle[@]}" || hand_rc=$?
echo "night.sh: the box set up by hand took $((SECONDS - t0)) s (exit $hand_rc)"
[ "$hand_rc" = 2 ] && exit 2

t1=$SECONDS
up_rc=0
"$headroom" drill --box "$box" --scenario "$scenario" --duration "$duration" --report "$out/up" \
  "${without[@]}" "${idle[@]}" || up_rc=$?
echo "night.sh: the box under up took $((SECONDS - t1)) s (exit $up_rc)"
[ "$up_rc" = 2 ] && exit 2

echo
"$headroom" drill --compare "$out/hand-set" "$out/up" | tee "$out/side-by-side.md"
echo
echo "night.sh: reports in $out/hand-set and $out/up ($((SECONDS - t0)) s in all)"
if [ "$hand_rc" != 0 ]; then
  echo "night.sh: the box set up by hand did NOT show the page (see $out/hand-set/report.md)"
fi
if [ "$up_rc" != 0 ]; then
  echo "night.sh: the box under up broke a verdict (see $out/up/report.md)"
fi
[ "$hand_rc" = 0 ] && [ "$up_rc" = 0 ]
