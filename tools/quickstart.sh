#!/usr/bin/env bash
# Installs dependencies, builds, turns Debian's fortunes into the demo corpus
# and trains the default tiny model with mpirun on CPU ranks.
# Usage: tools/quickstart.sh [CONFIG] [extra `origami train` arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/tiny-dense.toml}
shift || true
ranks=${ORIGAMI_RANKS:-1}

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
