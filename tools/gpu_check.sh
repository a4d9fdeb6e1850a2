#!/usr/bin/env bash
# The one prepared GPU check (README "Developers"). Two halves:
#
#   tools/gpu_check.sh pack   here, on the CPU machine: a CUDA build
#                             (-DORIGAMI_CUDA=ON) and a bundle in .gpu/ of the
#                             test binaries, the origami binary and every
#                             shared library they need that the device image
#                             lacks (oneDNN, OpenMPI with its plugins and
#                             PMIx, toml++, ...). CUDA libraries (cudart,
#                             cuBLAS, NCCL) are the device's own.
#   tools/gpu_check.sh run    on the lent GPU machine, through the device
#                             tool with carry [".gpu"]: unpacks the bundle,
#                             prints the device, runs the CUDA tests (the
#                             device ledger, Tensor::to, copies and fills,
#                             the context's stream and handle; every op of the
#                             op x backend harness: written ones against the
#                             CPU, stubbed ones must stop naming themselves),
#                             then the NCCL test under mpirun, and ends with a
#                             table of what passed. Logs go to $OUT.
#
# Budget: the run half takes about a minute of device time plus the start;
# give it timeout_s 300 so a rerun still fits the 15-minute lease.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bundle=.gpu/bundle.tar.gz

pack() {
  set -e
  tools/setup.sh
  tools/build.sh -DORIGAMI_CUDA=ON
  grep -q "ORIGAMI_WITH_CUDA" build/build.ninja || { echo "gpu_check: build/ is not a CUDA build" >&2; exit 1; }
  grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/lib" "$stage/usr/lib/x86_64-linux-gnu" "$stage/usr/share" "$stage/usr/bin"
  local bins=(build/tests/test_kernels_device build/tests/test_kernels_backend_ops build/tests/test_comm_nccl
              build/tools/origami)
  cp "${bins[@]}" "$stage/bin/"
  # Every library the binaries and OpenMPI's plugins load, except the C
  # runtime (the device's is newer) and CUDA's own (the device's match its driver).
  local skip='^(libc|libm|libdl|libpthread|librt|libutil|ld-linux-x86-64|libstdc\+\+|libgcc_s|libcudart|libcublas|libcublasLt|libnccl|libcuda)\.so'
  { for b in "${bins[@]}"; do ldd "$b"; done
    find /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 -name '*.so*' -exec ldd {} \; 2>/dev/null
  } | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u | while read -r lib; do
    basename "$lib" | grep -Eq "$skip" || cp -L "$lib" "$stage/lib/"
  done
  cp -a /usr/lib/x86_64-linux-gnu/openmpi /usr/lib/x86_64-linux-gnu/pmix2 "$stage/usr/lib/x86_64-linux-gnu/"
  cp -a /usr/share/openmpi "$stage/usr/share/"
  [ -d /usr/share/pmix ] && cp -a /usr/share/pmix "$stage/usr/share/"
  cp -L /usr/bin/orterun "$stage/usr/bin/mpirun"
  cp -L /usr/bin/orted "$stage/usr/bin/orted"
  git rev-parse --short HEAD > "$stage/REVISION"
  mkdir -p .gpu
  tar -C "$stage" -czf "$bundle" .
  rm -rf "$stage"
  echo "gpu_check: $bundle $(du -h "$bundle" | cut -f1) at $(git rev-parse --short HEAD)"
  echo "gpu_check: on the device machine: run(command='bash tools/gpu_check.sh run', carry=['.gpu'], timeout_s=300)"
}

# The directory holding a CUDA library on the device, searched where the
# image keeps them (toolkit, driver, the Python wheels).
lib_dir_of() {
  find /usr/local/cuda*/ /usr/local/nvidia /usr/lib/x86_64-linux-gnu /opt /usr/local/lib -name "$1" 2>/dev/null |
    head -1 | xargs -r dirname
}

run() {
  local out=${OUT:-/tmp/gpu_check_out} g=/tmp/origami-gpu
  mkdir -p "$out" "$g"
  [ -f "$bundle" ] || { echo "gpu_check: no $bundle (run 'tools/gpu_check.sh pack' here and carry .gpu)"; exit 1; }
  tar -C "$g" -xzf "$bundle"
  echo "== device"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
  echo "bundle revision $(cat $g/REVISION), tree revision $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  local cuda_dirs=""
  for l in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    d=$(lib_dir_of "$l"); [ -n "$d" ] && cuda_dirs="$cuda_dirs:$d"; echo "$l: ${d:-MISSING}"
  done
  export LD_LIBRARY_PATH="$g/lib$cuda_dirs:$g/usr/lib/x86_64-linux-gnu/openmpi/lib:${LD_LIBRARY_PATH:-}"
  export OPAL_PREFIX="$g/usr" PMIX_INSTALL_PREFIX="$g/usr/lib/x86_64-linux-gnu/pmix2" PATH="$g/usr/bin:$PATH"
  export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  declare -A result
  local names=()
  check() {  # name, command...
    local name=$1; shift
    names+=("$name")
    echo "== $name: $*"
    local t0=$SECONDS
    ( cd "$root" && timeout 240 "$@" ) > "$out/$name.log" 2>&1
    local rc=$?
    tail -25 "$out/$name.log"
    result[$name]="rc=$rc $(grep -Eo '[0-9]+ tests? (from [0-9]+ test suites? ran|passed)|\[  PASSED  \] [0-9]+ tests?|\[  SKIPPED \] [0-9]+ tests?|\[  FAILED  \] [0-9]+ tests?' "$out/$name.log" | tr '\n' ' ') $((SECONDS - t0)) s"
  }
  check device "$g/bin/test_kernels_device" --gtest_brief=1
  check harness "$g/bin/test_kernels_backend_ops" --gtest_filter='*_cuda'
  check harness_cpu "$g/bin/test_kernels_backend_ops" --gtest_filter='BackendOpsTable.*:*_cpu' --gtest_brief=1
  check mpi_groups mpirun --oversubscribe -np 2 "$g/bin/origami" groups --tp 2
  check nccl mpirun --oversubscribe -np 1 "$g/bin/test_comm_nccl" --gtest_brief=1
  echo "== summary (logs in \$OUT)"
  for n in "${names[@]}"; do printf '%-12s %s\n' "$n" "${result[$n]}"; done
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh pack|run" >&2; exit 2 ;;
esac
