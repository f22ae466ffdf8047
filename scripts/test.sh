#!/usr/bin/env bash
# The whole test suite: unit tests of every crate, the integration binary and the doc tests.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace --locked "$@"
