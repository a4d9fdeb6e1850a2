#!/usr/bin/env bash
# Configures and builds Origami into ./build (Release, Ninja). Extra arguments
# go to CMake's configure step (e.g. -DORIGAMI_CUDA=OFF). Warnings in CUDA
# sources are errors here (CI builds through this script).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DORIGAMI_CUDA_WERROR=ON "$@" >/dev/null
ninja -C build -j "$(nproc)"
