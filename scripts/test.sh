#!/usr/bin/env bash
# The whole test suite. End-to-end tests run the workspace's real binaries and
# libraries (arbiter, shim, simulator, runtime), so everything is built first.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --workspace --all-targets
cargo test --workspace "$@"
