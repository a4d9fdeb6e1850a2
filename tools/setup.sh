#!/usr/bin/env bash
# Installs Origami's build, test and demo dependencies from Debian packages.
# Idempotent: when every package is already installed it changes nothing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  openmpi-bin libopenmpi-dev          # MPI: origami is an MPI program at any rank count
  libtomlplusplus-dev                 # config files
  libdnnl-dev                         # oneDNN: CPU GEMM
  ocl-icd-opencl-dev                  # oneDNN's CMake config calls find_package(OpenCL); only a Recommends of libdnnl-dev
  nlohmann-json3-dev libcli11-dev     # JSON, command lines
  libxxhash-dev                       # checkpoint file digests (XXH3)
  libsimdjson-dev                     # origami imbalance: streaming metrics.jsonl
  libgtest-dev libgmock-dev           # tests
  fortunes fortunes-min               # demo corpus (/usr/share/games/fortunes)
  python3 python3-numpy python3-torch # independent float64 reference of the model math (tests)
  chromium                            # headless browser test of the imbalance HTML report
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} dependencies present"
  exit 0
fi

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
