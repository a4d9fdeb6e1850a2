#!/usr/bin/env bash
# Installs dependencies if needed, builds, and runs every test through CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
tools/build.sh "$@"
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 900
