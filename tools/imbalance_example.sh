#!/usr/bin/env bash
# The README's worked example of `origami imbalance` on configs/tiny-moe.toml
# at EP 4 (4 ranks): three 350-step runs (no balancing, aux loss, expert
# bias), the report comparing them, placement advice from the unbalanced
# run's steps 251-300, and its resume from the step-300 checkpoint under the
# advised placement. Prints the predicted and the measured per-EP-rank
# max/mean of steps 301-350, placed and contiguous. About 5 minutes on 2 cores.
#
# Usage: tools/imbalance_example.sh [OUT_DIR]   (default: runs/imbalance-example)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/imbalance-example}
origami=build/tools/origami
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np 4)
common=(--set parallel.ep=4 --set training.steps=350 --set export.dir= --set logging.interval=50)
[ -x "$origami" ] || tools/build.sh
if [ ! -f data/fortunes.idx ]; then  # the corpus, as tools/quickstart.sh prepares it
  mkdir -p data
  mapfile -t inputs < <(find /usr/share/games/fortunes -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
  "$origami" preprocess --format fortune --output-prefix data/fortunes --input "${inputs[@]}"
fi
rm -rf "$out" && mkdir -p "$out"

train() {  # name, extra --set arguments...
  local name=$1; shift
  echo "imbalance_example: training $name"
  "${mpi[@]}" "$origami" train configs/tiny-moe.toml "${common[@]}" --set logging.dir="$out/$name" "$@" > "$out/$name.log"
}
train none --set moe.load_balancing=none --set checkpoint.dir="$out/none/ckpt" --set checkpoint.interval=300
train aux_loss --set moe.load_balancing=aux_loss
train expert_bias --set moe.load_balancing=none --set moe.expert_bias=true

# Alerts make the tool exit 1: expected for the unbalanced run.
"$origami" imbalance "$out/none" "$out/aux_loss" "$out/expert_bias" --steps 251:300 --html "$out/report.html" || true
"$origami" imbalance "$out/none" --steps 251:300 --place --ep 4 --out "$out/placement.toml" --json > "$out/advice.json" || true
train placed --set moe.load_balancing=none --set checkpoint.load="$out/none/ckpt/step-00000300" \
  --set moe.expert_placement="$out/placement.toml"
"$origami" imbalance "$out/placed" --steps 301:350 --json > "$out/placed.json" || true
"$origami" imbalance "$out/none" --steps 301:350 --json > "$out/contiguous.json" || true
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
advice = json.load(open(f"{out}/advice.json"))["placement"]["layers"]
placed = json.load(open(f"{out}/placed.json"))["runs"][0]["layers"]
contig = json.load(open(f"{out}/contiguous.json"))["runs"][0]["layers"]
print("layer  predicted (steps 251-300)  measured placed (301-350)  measured contiguous (301-350)")
for a, p, c in zip(advice, placed, contig):
    print(f"{a['layer']:5d}  {a['after_max_over_mean']:25.3f}  {p['ep']['max_over_mean']:25.3f}  {c['ep']['max_over_mean']:29.3f}")
PY
