#!/usr/bin/env bash
# The whole test suite: unit tests of every crate, the integration binary (real servers on
# 127.0.0.1, the official openai Python client), then end-to-end tests through `headroom serve`
# in front of real llama.cpp and Whisper servers on this CPU (scripts/backends.sh installs them
# under .backends/ from PyPI, starts them, and this script stops them again), and in front of a real
# vLLM on this CPU (installed and started once for the whole session: it takes minutes to start;
# the venv and the converted model stay cached in .backends/ for the next run).
# With the end-to-end part it also installs chromium and prometheus (promtool) from Debian's
# packages when missing and checks deploy/ (alert rules, systemd units).
# HEADROOM_SKIP_E2E=1 runs the Rust tests alone, with no Python or Debian packages.
# HEADROOM_SKIP_VLLM=1 leaves out vLLM (a 6 GiB venv, ~5 GiB of memory while it runs); CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

e2e=1
[ "${HEADROOM_SKIP_E2E:-0}" = 1 ] && e2e=0
vllm=$e2e
[ "${HEADROOM_SKIP_VLLM:-0}" = 1 ] && vllm=0

if [ $e2e = 1 ]; then
  scripts/backends.sh install
  if [ $vllm = 1 ]; then
    t0=$SECONDS
    scripts/backends.sh install vllm
    echo "vLLM install (cached after the first run): $((SECONDS - t0)) s"
  else
    echo "HEADROOM_SKIP_VLLM=1: the vLLM end-to-end tests are NOT run"
  fi
  export HEADROOM_PYTHON=$PWD/.backends/client/bin/python HEADROOM_REQUIRE_PY=1
  # Chromium for the status page test, promtool for the alert rules (Debian packages).
  scripts/system-deps.sh
  export HEADROOM_REQUIRE_BROWSER=1
  # The drill's memory-limit test makes a memory cgroup: required here, never skipped.
  export HEADROOM_REQUIRE_CGROUP=1
  scripts/check-deploy.sh
fi

cargo test --workspace --locked "$@"

if [ $e2e = 1 ]; then
  trap 'scripts/backends.sh stop' EXIT
  # The tests find the servers where backends.sh put them (HEADROOM_*_PORT move them).
  # shellcheck disable=SC2046
  export $(scripts/backends.sh env)
  scripts/backends.sh start
  .backends/client/bin/python -m pytest -q -p no:cacheprovider tests/e2e --ignore tests/e2e/test_vllm.py \
    --ignore tests/e2e/test_up_audio_vllm.py
  if [ $vllm = 1 ]; then
    # vLLM runs alone: its start (three processes importing torch) and its ~5 GiB do not compete
    # with the llama.cpp and Whisper tests, and their timings do not compete with it.
    scripts/backends.sh stop llama
    scripts/backends.sh stop whisper
    # `headroom up` with an audio vLLM: it starts its own vLLM and llama.cpp (on free ports),
    # before the shared vLLM below takes its memory.
    t0=$SECONDS
    .backends/client/bin/python -m pytest -q -p no:cacheprovider tests/e2e/test_up_audio_vllm.py
    echo "up with an audio vLLM: $((SECONDS - t0)) s"
    t0=$SECONDS
    scripts/backends.sh start vllm
    echo "vLLM start: $((SECONDS - t0)) s"
    .backends/client/bin/python -m pytest -q -p no:cacheprovider tests/e2e/test_vllm.py
    # The metric names the gateway reads (its own constants) against this live vLLM.
    # shellcheck disable=SC2046
    env $(cat .backends/run/vllm.env) cargo test --locked --test integration live_vllm -- --ignored
  fi
fi
