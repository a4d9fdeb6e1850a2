#!/usr/bin/env bash
# Installs dependencies, builds, turns Debian's fortunes into the demo corpus
# and trains the default tiny MoE with mpirun on CPU ranks: configs/tiny-moe.toml
# on ORIGAMI_RANKS ranks (default 2) with its 8 experts split over them
# (expert parallelism = rank count, so use 1, 2, 4 or 8 ranks).
# Usage: tools/quickstart.sh [CONFIG [extra `origami train` arguments]]
set -euo pipefail
cd "$(dirname "$0")/.."
ranks=${ORIGAMI_RANKS:-2}
if [ $# -gt 0 ]; then
  config=$1
  shift
else
  config=configs/tiny-moe.toml
  set -- --set parallel.ep="$ranks"
fi

tools/setup.sh
tools/build.sh

if [ ! -f data/fortunes.idx ]; then
  mkdir -p data
  # Every fortune file of the package (plain text, entries separated by '%').
  mapfile -t inputs < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
  build/tools/origami preprocess --format fortune --output-prefix data/fortunes --input "${inputs[@]}"
fi

# --bind-to none: each rank runs cores/ranks OpenMP threads, which a
# one-core binding would squeeze onto a single core.
mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks" build/tools/origami train "$config" "$@"
