#!/usr/bin/env bash
# Configures and builds Origami into ./build (Release, Ninja). Extra arguments
# go to CMake's configure step (e.g. -DORIGAMI_CUDA=OFF).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
ninja -C build -j "$(nproc)"
