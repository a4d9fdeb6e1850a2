#!/usr/bin/env bash
# The one prepared GPU check (README "Developers"). Here, once:
#   tools/device_bundle.sh                  (the Debian packages the GPU image lacks, into .bundle/)
# then on the lent GPU machine, through the device tool:
#   run(command='bash tools/gpu_check.sh', carry=['.bundle'], kind='nvidia-h200', timeout_s=540)
#
# Steps, each timed:
#   tools        the machine's compilers (g++ for nvcc, nvcc, CMake, ninja), glibc >= 2.36
#   unpack       .bundle/debs into a private prefix with dpkg-deb -x (never into /)
#   configure    build-gpu/ with -DORIGAMI_CUDA=ON for Hopper only (90-real),
#                against that prefix and the machine's own CUDA (cudart, cuBLAS, NCCL)
#   build        only `origami` and the test binaries whose tests carry the CTest
#                label cuda, with every core (ccache when there is one)
#   cpu_ops      BackendOps.cpu (the op harness's CPU half) and
#   mpi_np2      mpirun -np 2 origami groups --tp 2 through the bundled OpenMPI:
#                a broken bundle shows apart from a broken CUDA op
#   cuda_tests   ctest -L cuda (4 at a time on the one GPU)
#   train_gpu    4 steps of the Mixtral-like config (configs/gpu-mixtral-h200.toml; its global
#                batch; on a GPU smaller than the H200 it is sized for, the most
#                layers that fit) on cuda:0 in bf16 (the CUDA recipe), on a corpus made from this
#                checkout's text: tokens/s, TFLOP/s, MFU, peak memory, exposed
#                communication (medians of steps 3 and 4)
#   train_torch  tools/train_torch.py: the same config in PyTorch eager on the
#                same GPU (bf16 autocast, fp32 weights and AdamW), for
#                origami's tokens/s over PyTorch's; with --fit, and origami
#                again at the layer count PyTorch fitted when that is fewer
#   train_more   the other GPU configs (DeepSeek-like), each origami then its twin
#                (a config a deadline-cut call finished is kept, not run again)
#   bench_kernels  origami bench kernels --device cuda --json
#   bench_torch  tools/bench_kernels_torch.py (PyTorch at the same shapes)
# and last a table: each step's status and time, the CUDA test counts, and
# the kernels against PyTorch. The reports are tools/gpu_check_report.py's
# (tested on the CPU: tests/test_cli_gpu_check.cpp). A failed step prints its last 40 lines; steps
# after a failed build do not run. The order is the issue's: correctness,
# then the training figures (MFU, the ratio to PyTorch), then the kernel
# benchmarks that explain them. Every step has a time limit, and none runs
# past the deadline (ORIGAMI_GPU_DEADLINE seconds after the start, default
# 470: the issue's 8 minutes, with the device call's 540 s to spare for the
# last kill and the files' return): a step is cut at it, and a step
# with under 20 s left does not start, so the summary of what did run
# always comes back. The summary is rewritten after every step. A step the
# deadline did not start or cut short shows as `deadline`, and the summary's
# last line gives the ORIGAMI_GPU_STEPS that runs them in a second call.
#
# Results in RESULTS_DIR (default $OUT, else ./gpu-results), seven files since
# the device tool returns at most 8: gpu_check.log (every step's full
# output), ctest_cuda.xml, bench_kernels.json, bench_torch.json,
# train_gpu.json, train_torch.json, summary.txt.
# Without a GPU the CUDA tests skip and the benchmarks say there is no
# device; that fails the check unless --no-gpu-ok (tools/bundle_check.sh runs
# it so on a CPU machine). Exit status: 0 when every step passed, 1 when one
# failed and the deadline cut nothing, 2 on a usage error, 3 when the
# deadline cut a step (failures or not): the last line then reads
# `gpu_check: NEXT ORIGAMI_GPU_STEPS="..." ORIGAMI_GPU_DEADLINE=<...> bash
# tools/gpu_check.sh`, the second call, whose deadline is the device time
# left less 70 s (its timeout_s that time less 10 s).
#
# Usage: tools/gpu_check.sh [--no-gpu-ok] [RESULTS_DIR]
#        ORIGAMI_PREFIX (default /tmp/origami-prefix), ORIGAMI_GPU_BUILD (default build-gpu),
#        ORIGAMI_GPU_BUILD_TIMEOUT (seconds, default 330: the build's limit on 16 cores),
#        ORIGAMI_GPU_DEADLINE (seconds from the start, default 470),
#        ORIGAMI_GPU_STEPS (the steps after the build to run, default all: a second call
#          on the still-warm machine, right after a first one the deadline cut short,
#          runs the rest, e.g. ORIGAMI_GPU_STEPS="bench_kernels bench_torch"; build-gpu/ is
#          kept between calls, so its build takes seconds)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
report=$root/tools/gpu_check_report.py  # the steps' reports, in Python (tested on the CPU)

usage() { echo "usage: tools/gpu_check.sh [--no-gpu-ok] [RESULTS_DIR]" >&2; exit 2; }
no_gpu_ok=0
results=""
for a in "$@"; do
  case $a in
    --no-gpu-ok) no_gpu_ok=1 ;;
    -*) usage ;;
    *) [ -z "$results" ] || usage; results=$a ;;
  esac
done
results=${results:-${OUT:-$root/gpu-results}}
mkdir -p "$results" || { echo "gpu_check: cannot create $results" >&2; exit 2; }
results=$(cd "$results" && pwd)
prefix=${ORIGAMI_PREFIX:-/tmp/origami-prefix}
build=${ORIGAMI_GPU_BUILD:-build-gpu}
build_timeout=${ORIGAMI_GPU_BUILD_TIMEOUT:-330}  # s; 16 cores there, so a slower machine sets more
deadline=${ORIGAMI_GPU_DEADLINE:-470}  # s after the start (bash's SECONDS)
case $deadline in '' | *[!0-9]*) echo "gpu_check: ORIGAMI_GPU_DEADLINE must be whole seconds" >&2; exit 2 ;; esac
# A step's time limit: its own, or what is left before the deadline less
# 15 s, whichever is less (at least 1). Each limit is timeout's SIGTERM; a
# command still there kill_after seconds later gets SIGKILL (origami train
# stops at a step boundary on SIGTERM, and a step stuck in a CUDA call never
# reaches one), so a step ends by its limit + kill_after, and the summary
# still has its seconds before the deadline.
kill_after=8
budget() {
  local left=$((deadline - SECONDS - 15))
  [ $left -lt 1 ] && left=1
  echo $(($1 < left ? $1 : left))
}
bundle=$root/.bundle
log=$results/gpu_check.log
summary=$results/summary.txt
rm -f "$results/ctest_cuda.xml" "$results/bench_kernels.json" "$results/bench_torch.json" "$results/train_gpu.json" "$results/train_torch.json"
: > "$log"

# The binaries whose tests carry the CTest label cuda (tests/CMakeLists.txt).
# A labelled test in a binary not built here would be missing from ctest -L
# cuda without a word, so the build step warns about any such binary.
cuda_targets=(test_kernels_backend_ops test_kernels_device test_kernels_cuda_ops test_kernels_attention test_comm_nccl test_cli_cuda)

multiarch=x86_64-linux-gnu
L=$prefix/usr/lib/$multiarch
orig_ld_path=${LD_LIBRARY_PATH:-}

gpu=""  # "name, driver, memory" of GPU 0, empty without one
smi=$(command -v nvidia-smi || ls /usr/local/nvidia/bin/nvidia-smi /usr/bin/nvidia-smi 2>/dev/null | head -n 1 || true)
if [ -n "$smi" ] && "$smi" -L 2>/dev/null | grep -q '^GPU 0'; then
  gpu=$("$smi" --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
  gpu_memory_mib=$("$smi" --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' ')
fi
case ${gpu_memory_mib:-} in '' | *[!0-9]*) gpu_memory_mib="" ;; esac  # MiB of GPU 0, empty when unknown

# ---- steps: each prints to the log; returns 0 ok, 77 skipped, else failed;
# sets note[STEP] for the table.
declare -A status=() secs=() note=()
steps=()  # the steps run so far, in order
cut=()    # the steps the deadline did not start or cut short: a second call's ORIGAMI_GPU_STEPS
all_steps=(tools unpack configure build cpu_ops mpi_np2 cuda_tests train_gpu train_torch train_more bench_kernels bench_torch)
# ORIGAMI_GPU_STEPS: the steps after the build to run (default all), for a
# second call on the still-warm machine when the deadline cut the first
# short: build-gpu/ is still there, so the set-up steps take seconds.
wanted_steps=${ORIGAMI_GPU_STEPS:-cpu_ops mpi_np2 cuda_tests train_gpu train_torch train_more bench_kernels bench_torch}
for s in $wanted_steps; do
  case " ${all_steps[*]:4} " in *" $s "*) ;; *) echo "gpu_check: ORIGAMI_GPU_STEPS names '$s'; the steps after the build are: ${all_steps[*]:4}" >&2; exit 2 ;; esac
done
wanted() { [[ " $wanted_steps " == *" $1 "* ]]; }
cxx="" cc="" nvcc="" cmake_version=""

# A version at least a minimum (both dotted numbers).
version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n 1)" = "$2" ]; }

step_tools() {
  echo "host: $(. /etc/os-release 2>/dev/null && echo "${PRETTY_NAME:-?}"), $(uname -m), $(nproc) cores"
  local glibc
  glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  echo "glibc: ${glibc:-unknown}"
  # Debian 12's packages were built against glibc 2.36.
  if [ -z "$glibc" ] || ! version_at_least "$glibc" 2.36; then
    note[tools]="glibc ${glibc:-unknown} < 2.36: the bundled Debian 12 libraries need 2.36"; return 1
  fi
  cxx=$(command -v g++ || command -v c++ || true)
  cc=$(command -v gcc || command -v cc || true)
  [ -n "$cxx" ] && [ -n "$cc" ] || { note[tools]="no host C/C++ compiler (g++/gcc) for nvcc"; return 1; }
  echo "host compiler: $cxx ($("$cxx" --version | head -n 1))"
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -n 1 || true)
  [ -n "$nvcc" ] || { note[tools]="no nvcc on PATH nor in /usr/local/cuda*/bin"; return 1; }
  echo "nvcc: $nvcc ($("$nvcc" --version | grep -o 'release [0-9.]*' || echo '?'))"
  local t
  for t in cmake ctest ninja python3 dpkg-deb readelf; do
    command -v "$t" >/dev/null 2>&1 || { note[tools]="no $t on PATH"; return 1; }
  done
  cmake_version=$(cmake --version | head -n 1 | awk '{print $3}')
  echo "cmake $cmake_version, ninja $(ninja --version), $(python3 --version 2>&1)"
  version_at_least "$cmake_version" 3.25 || { note[tools]="cmake $cmake_version < 3.25 (CMakeLists.txt)"; return 1; }
  # Every MPI start resolves this host's name; with no network and no entry
  # in /etc/hosts each lookup stalls for seconds (measured in a debootstrap
  # root), across dozens of starts. The machine is lent bare and given back,
  # so the entry is added there.
  local host hosts_note=""
  host=$(hostname 2>/dev/null || uname -n)
  if [ -n "$host" ] && ! timeout 3 getent hosts "$host" >/dev/null 2>&1; then
    if [ -w /etc/hosts ] && printf '127.0.1.1 %s\n' "$host" >> /etc/hosts; then
      hosts_note="added $host to /etc/hosts (it did not resolve)"
    else
      hosts_note="$host does not resolve: every MPI start may stall"
    fi
    echo "$hosts_note"
  fi
  echo "GPU: ${gpu:-none}"
  local nvcc_version; nvcc_version=$("$nvcc" --version | grep -o 'V[0-9][0-9.]*' | tr -d V)
  note[tools]="$(basename "$cxx") $("$cxx" -dumpfullversion 2>/dev/null), nvcc $nvcc_version, cmake $cmake_version, glibc $glibc"
  [ -z "$hosts_note" ] || note[tools]+="; $hosts_note"
}

step_unpack() {
  if [ ! -f "$bundle/MANIFEST" ]; then
    note[unpack]="no .bundle/MANIFEST: run tools/device_bundle.sh on the CPU machine, carry .bundle"; return 1
  fi
  # rm -rf only a prefix this script made (its marker file), never /, /usr, ...
  case $prefix in /*/*) ;; *) note[unpack]="ORIGAMI_PREFIX must be an absolute path two levels deep: $prefix"; return 1 ;; esac
  if [ -e "$prefix" ] && [ ! -e "$prefix/.origami-prefix" ]; then
    note[unpack]="$prefix exists and was not made by gpu_check.sh: give another ORIGAMI_PREFIX"; return 1
  fi
  rm -rf "$prefix" && mkdir -p "$prefix" && touch "$prefix/.origami-prefix" || { note[unpack]="cannot make $prefix"; return 1; }
  local line pv p v f n=0 bytes=0
  while read -r line; do
    case $line in ''|'#'*) continue ;; esac
    pv=${line%% *}; p=${pv%%=*}; v=${pv#*=}
    f=$(ls "$bundle/debs/${p}_"*.deb 2>/dev/null | head -n 1)
    if [ -z "$f" ] || [ "$(dpkg-deb -f "$f" Version)" != "$v" ]; then
      note[unpack]="bundle lacks $p=$v: rerun tools/device_bundle.sh"; return 1
    fi
    dpkg-deb -x "$f" "$prefix" || { note[unpack]="dpkg-deb -x $f failed"; return 1; }
    n=$((n + 1)); bytes=$((bytes + $(stat -c %s "$f")))
  done < "$bundle/MANIFEST"
  echo "unpacked $n packages ($((bytes / 1048576)) MiB of .debs) into $prefix"
  # What the packages' install scripts would have made (Debian alternatives).
  local b
  for b in mpicc:mpicc.openmpi mpicxx:mpic++.openmpi mpic++:mpic++.openmpi mpirun:mpirun.openmpi mpiexec:mpiexec.openmpi; do
    ln -sfn "${b#*:}" "$prefix/usr/bin/${b%%:*}"
  done
  ln -sfn openmpi/lib/libmpi.so "$L/libmpi.so"
  ln -sfn ../../lib/$multiarch/openmpi/include "$prefix/usr/include/$multiarch/mpi"
  local psm; psm=$(ls "$prefix"/usr/lib/libpsm1/libpsm_infinipath.so.1.* 2>/dev/null | head -n 1)
  [ -n "$psm" ] && ln -sfn "../libpsm1/$(basename "$psm")" "$L/libpsm_infinipath.so.1"
  # A library the machine already has (same soname in ldconfig's cache) is
  # taken from the machine: the prefix's copy becomes a link to it, so no
  # process mixes an older Debian copy with the machine's newer libraries.
  # Not the libraries the build compiles against (their headers are the
  # bundle's) nor OpenMPI's and PMIx's own, whose plugins and helpers in the
  # prefix must match their library's exact version.
  local cache soname host shared=()
  cache=$(ldconfig -p 2>/dev/null)
  while read -r f; do
    case $(basename "$f") in
      libmpi* | libopen-* | libompitrace* | liboshmem* | libmca_* | libpmix* | libuc[mpst]* | libfabric* | \
        libhwloc* | libibverbs* | librdmacm* | libpsm* | libdnnl* | libtomlplusplus* | libsimdjson* | libxxhash*)
        continue ;;  # with the plugins and headers of their own version in the prefix
    esac
    soname=$(readelf -d "$f" 2>/dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    [ -n "$soname" ] || continue
    host=$(awk -v s="$soname" '$1 == s && /x86-64/ {print $NF; exit}' <<<"$cache")
    [ -n "$host" ] && [ -e "$host" ] || continue
    ln -sf "$host" "$f" && shared+=("$soname") && echo "the machine's own $soname: $host"
  done < <(find "$L" "$prefix/lib/$multiarch" -maxdepth 1 -type f -name 'lib*.so.*' 2>/dev/null)
  # OpenMPI and PMIx plugins whose libraries cannot be found would print a
  # load error at every start: set them aside.
  local dropped=()
  mkdir -p "$prefix/disabled-plugins"
  while read -r f; do
    if LD_LIBRARY_PATH=$(runtime_ld_path) ldd "$f" 2>/dev/null | grep -q 'not found'; then
      echo "plugin set aside (unresolved libraries): $f"
      LD_LIBRARY_PATH=$(runtime_ld_path) ldd "$f" | grep 'not found'
      mv "$f" "$prefix/disabled-plugins/" && dropped+=("$(basename "$f" .so)")
    fi
  done < <(find "$L/openmpi/lib/openmpi3" "$L/pmix2/lib/pmix" -name '*.so' 2>/dev/null)
  note[unpack]="$n packages, $((bytes / 1048576)) MiB"
  [ ${#shared[@]} -gt 0 ] && note[unpack]+="; machine's own: ${shared[*]}"
  [ ${#dropped[@]} -gt 0 ] && note[unpack]+="; plugins set aside: ${dropped[*]}"
  return 0
}

# Where the CUDA files live on this machine (toolkit, driver, the Python
# wheels): one search, listed in the log. The libraries' folders go on
# LD_LIBRARY_PATH (cuBLAS is dlopen'ed by name when it is not in the
# toolkit folder the build recorded); nccl.h and libnccl go to CMake.
cuda_files="" cuda_lib_dirs=""
find_cuda_files() {
  local toolkit l p d
  toolkit=$(cd "$(dirname "$nvcc")/.." && pwd)
  cuda_files=$(find "$toolkit" /usr/local/cuda*/ /usr/local/nvidia /usr/lib/$multiarch /usr/include /opt /usr/local/lib \
    \( -name libcudart.so.13 -o -name libcublas.so.13 -o -name libcublasLt.so.13 -o -name libcuda.so.1 \
       -o -name nccl.h -o -name libnccl.so -o -name libnccl.so.2 -o -name cublasLt.h \) 2>/dev/null)
  # The driver's libcuda is the loader's business: a toolkit's compat/ copy
  # (NVIDIA's images carry one for older drivers) put ahead of a newer
  # driver makes every CUDA call fail (error 803), and stubs/ holds a
  # link-time stand-in. Its folder is added only when the loader cannot
  # find it otherwise.
  cuda_files=$(grep -v -e '/compat/' -e '/stubs/' <<<"$cuda_files")
  for l in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2 libcuda.so.1; do
    p=$(first_file "$l")
    if [ "$l" = libcuda.so.1 ] && ldconfig -p 2>/dev/null | grep -q '^[[:space:]]*libcuda\.so\.1 '; then
      echo "$l: the loader's ($(ldconfig -p | awk '$1 == "libcuda.so.1" {print $NF; exit}'))"
      continue
    fi
    echo "$l: ${p:-not found}"
    [ -n "$p" ] || continue
    d=$(dirname "$p")
    case ":$cuda_lib_dirs:" in *":$d:"*) ;; *) cuda_lib_dirs=${cuda_lib_dirs:+$cuda_lib_dirs:}$d ;; esac
  done
}
first_file() {  # NAME [UNDER]: the first file found of that name (under UNDER if given)
  awk -v n="$1" -v u="${2:-}" '{ b = $0; sub(/.*\//, "", b) } b == n && index($0, u) == 1 { print; exit }' <<<"$cuda_files"
}
runtime_ld_path() {
  echo "$L:$prefix/lib/$multiarch:$L/openmpi/lib:$L/pmix2/lib${cuda_lib_dirs:+:$cuda_lib_dirs}${orig_ld_path:+:$orig_ld_path}"
}

# The prefix for every later step: its tools first on PATH, its libraries on
# LD_LIBRARY_PATH (python3 gets the machine's own), OpenMPI relocated
# (OPAL_PREFIX; PMIx beside it: PMIX_PREFIX, and its plugin folder named,
# since mpirun hands PMIx the unrelocated prefix) and set for one node:
# shared memory and self only, no single-copy CMA (refused in some
# sandboxes), root allowed, and `false` as the remote-start agent, since
# without ssh OpenMPI's launcher refuses to start even local ranks.
use_prefix() {
  export PATH="$prefix/usr/bin:$PATH"
  export LD_LIBRARY_PATH; LD_LIBRARY_PATH=$(runtime_ld_path)
  export OPAL_PREFIX=$prefix/usr PMIX_PREFIX=$L/pmix2 PMIX_INSTALL_PREFIX=$L/pmix2 OMPI_MCA_pmix_base_silence_warning=1
  export PMIX_MCA_mca_base_component_path=$L/pmix2/lib/pmix
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm_rsh_agent=false
  export OMPI_MCA_btl=self,vader OMPI_MCA_pml=ob1 OMPI_MCA_osc=^ucx OMPI_MCA_btl_vader_single_copy_mechanism=none
  export PKG_CONFIG_LIBDIR=$L/pkgconfig:$prefix/usr/share/pkgconfig PKG_CONFIG_SYSROOT_DIR=$prefix
  # The CLI tests' corpus (tests/cli_util.h, preprocess_fortunes): the
  # bundle's fortunes where the machine has no package of its own.
  [ -f /usr/share/games/fortunes/fortunes ] || export ORIGAMI_FORTUNES_DIR=$prefix/usr/share/games/fortunes
}

step_configure() {
  find_cuda_files
  use_prefix
  # The driver must start under the library path every later step runs
  # with, or the CUDA tests would only skip and the build be for nothing:
  # cuInit through ctypes, before the build.
  if [ -n "$gpu" ]; then
    local probe
    # "load-error ..." when libcuda itself does not load: as fatal as a
    # failing cuInit. Anything else (python3 itself broken by the prefix's
    # libraries) says nothing of the driver: noted, and the build goes on.
    probe=$(python3 -c 'import ctypes
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    print("load-error", e)
    raise SystemExit
version = ctypes.c_int(0)
rc = cuda.cuInit(0)
cuda.cuDriverGetVersion(ctypes.byref(version))
print(rc, version.value)' 2>&1 | tail -n 1)
    echo "cuInit under the check's LD_LIBRARY_PATH: $probe (status, driver CUDA version; 0 = it starts)"
    case $probe in
      "0 "*) ;;
      [0-9]*" "[0-9]* | load-error*)
        note[configure]="the CUDA driver does not start with the check's libraries (${probe:0:120}; LD_LIBRARY_PATH in the log)"
        echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
        return 1 ;;
      *) echo "the cuInit probe did not run (python3 ctypes): going on" ;;
    esac
  fi
  mpicxx -showme:compile | grep -q "$prefix" || { note[configure]="mpicxx does not point into $prefix (OPAL_PREFIX)"; return 1; }
  local args=(-S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
    -DORIGAMI_CUDA=ON -DORIGAMI_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_ARCHITECTURES=90-real
    -DORIGAMI_TEST_TIMEOUT=180
    -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_HOST_COMPILER="$cxx"
    -DCMAKE_PREFIX_PATH="$prefix/usr" -DPKG_CONFIG_EXECUTABLE="$prefix/usr/bin/pkgconf"
    -DMPI_C_COMPILER="$prefix/usr/bin/mpicc" -DMPI_CXX_COMPILER="$prefix/usr/bin/mpicxx"
    -DMPIEXEC_EXECUTABLE="$prefix/usr/bin/mpirun"
    # CMake 4 refuses policy versions below 3.5; bookworm's CMake files ask
    # 2.6...3.19 and the like (a range, which CMake 4 takes; this is the net).
    -DCMAKE_POLICY_VERSION_MINIMUM=3.5)
  if command -v ccache >/dev/null 2>&1; then
    args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  fi
  # cuBLAS's headers: the toolkit's, else (a toolkit without its cuBLAS
  # development files, with PyTorch's wheels beside it) the first one with
  # a libcublasLt.so.13 in its own tree (not another CUDA's), on the
  # compilers' include path (gcc, and nvcc through it, read CPATH).
  local h toolkit_inc inc=""; toolkit_inc=$(cd "$(dirname "$nvcc")/../include" 2>/dev/null && pwd)
  if [ ! -f "$toolkit_inc/cublasLt.h" ]; then
    while IFS= read -r h; do
      [ "$(basename "$h")" = cublasLt.h ] || continue
      if [ -n "$(first_file libcublasLt.so.13 "$(dirname "$(dirname "$h")")")" ]; then inc=$h; break; fi
    done <<<"$cuda_files"
    if [ -n "$inc" ]; then
      CPATH="$(dirname "$inc")${CPATH:+:$CPATH}"
      export CPATH
      echo "cublasLt.h not in $toolkit_inc: using $(dirname "$inc") (CPATH)"
    else
      echo "no cublasLt.h beside a libcublasLt.so.13: the build will fail on it"
    fi
  fi
  # NCCL: the toolkit's, else the PyTorch wheel's, whose libnccl.so.2 has no
  # unversioned link for find_library: the library beside the header found.
  # The first header that has a library in its own tree (a stray header
  # found first must not leave NCCL out).
  local h tree lib
  while IFS= read -r h; do
    [ "$(basename "$h")" = nccl.h ] || continue
    tree=$(dirname "$(dirname "$h")")
    lib=$(first_file libnccl.so "$tree"); [ -n "$lib" ] || lib=$(first_file libnccl.so.2 "$tree")
    if [ -n "$lib" ]; then
      args+=(-DORIGAMI_NCCL_INCLUDE_DIR="$(dirname "$h")" -DORIGAMI_NCCL_LIBRARY="$lib")
      break
    fi
  done <<<"$cuda_files"
  echo "cmake ${args[*]}"
  local out; out=$(mktemp)
  timeout -k "$kill_after" "$(budget 300)" cmake "${args[@]}" 2>&1 | tee "$out"
  local rc=${PIPESTATUS[0]}
  note[configure]="$(grep -o 'Origami CUDA backend: .*' "$out" | head -n 1)"
  note[configure]+="; $(grep -o 'Origami NCCL backend: .*' "$out" | head -n 1)"
  rm -f "$out"
  return "$rc"
}

step_build() {
  local t known missing=()
  known=$(ninja -C "$build" -t targets all 2>/dev/null | sed 's/:.*//')
  for t in origami "${cuda_targets[@]}"; do
    grep -qx "$t" <<<"$known" || missing+=("$t")
  done
  [ ${#missing[@]} -eq 0 ] || { note[build]="no target ${missing[*]}: update cuda_targets in tools/gpu_check.sh"; return 1; }
  # Binaries with tests labelled cuda that are not built here, read from
  # gtest_discover_tests' files (best effort: their form is CMake's own).
  local unbuilt=()
  for t in $(grep -l 'LABELS;cuda' "$build"/tests/*_include.cmake 2>/dev/null | sed 's|.*/||; s|\[.*||' | sort -u); do
    [[ " ${cuda_targets[*]} " == *" $t "* ]] || unbuilt+=("$t")
  done
  if [ ${#unbuilt[@]} -gt 0 ]; then
    echo "WARNING: ${unbuilt[*]} carry tests labelled cuda but are not built: add them to cuda_targets"
    note[build]="WARNING not built, labelled cuda: ${unbuilt[*]}; "
  fi
  local jobs; jobs=$(nproc)
  echo "ninja -j $jobs origami ${cuda_targets[*]}"
  timeout -k "$kill_after" "$(budget "$build_timeout")" ninja -C "$build" -j "$jobs" origami "${cuda_targets[@]}" || return
  note[build]+="$(( ${#cuda_targets[@]} + 1 )) targets, $jobs jobs"
}

step_cpu_ops() {
  local out rc; out=$(mktemp)
  timeout -k "$kill_after" "$(budget 180)" ctest --test-dir "$build" -R '^BackendOps\.cpu$' --no-tests=error --output-on-failure 2>&1 | tee "$out"
  rc=${PIPESTATUS[0]}
  local failed  # gtest's names of the failed cases, the last part of each
  failed=$(grep -oE '^\[  FAILED  \] [^ ,]+[./][^ ,]+' "$out" | sed 's|.*[./]||' | sort -u | tr '\n' ' ')
  note[cpu_ops]="BackendOps.cpu${failed:+; failed: $failed}"
  rm -f "$out"
  return "$rc"
}

step_mpi_np2() {
  local out
  out=$(timeout -k "$kill_after" "$(budget 60)" "$prefix/usr/bin/mpirun" --oversubscribe -np 2 "$build/tools/origami" groups --tp 2 2>&1)
  local rc=$?
  echo "$out"
  [ $rc -eq 0 ] || return $rc
  grep -q 'dense tp' <<<"$out" || { note[mpi_np2]="origami groups printed no 'dense tp' line"; return 1; }
  note[mpi_np2]="mpirun -np 2 origami groups --tp 2"
}

cuda_counts=""
cuda_figures=""  # the tests' "[ measured ]" lines, one per line
# The cuda-labelled tests that skip on a machine with one GPU, by design: the
# error path of a CUDA context on a machine without a device, a copy
# refused between two devices, NCCL between two ranks on two GPUs, and
# training on two GPUs. Any other skip there (NCCL left out at configure,
# say, which skips every CommNccl test) fails the step.
expected_skips=(ExecContext.CudaContextWithoutBackendOrDeviceIsAUserError
                CudaDeviceDeathTest.AContextCopiesOnlyItsOwnDeviceAndTheHost
                CommNccl.TwoRanksOnTwoGpusMatchTheTaggedExpectations
                CudaTrain.TwoGpuLayoutsMatchOneCpuRankInFp32)
step_cuda_tests() {
  # Passed tests' output is kept whole in the JUnit file: their "[ measured ]"
  # lines (tolerances met, the start-up peak) go into the summary. CTest
  # itself stops 15 s inside the step's limit (--stop-time: the tests still
  # running time out, the rest are not run), so the JUnit file and the
  # counts come back even when the tests need more time than is left.
  local limit stop stop_at
  limit=$(budget 240)
  stop_at=$((SECONDS + (limit > 30 ? limit - 15 : limit)))
  stop=$(date -d "+$((stop_at - SECONDS)) seconds" +%H:%M:%S)  # a time before now is tomorrow's
  timeout -k "$kill_after" "$limit" ctest --test-dir "$build" -L cuda --no-tests=error --output-on-failure -j 4 \
    --stop-time "$stop" --test-output-size-passed 65536 --test-output-size-failed 65536 --output-junit "$results/ctest_cuda.xml"
  local rc=$?
  [ $rc -eq 124 ] && return 124
  # passed failed skipped total, from CTest's JUnit file
  cuda_counts=$(python3 "$report" ctest-counts "$results/ctest_cuda.xml" 2>/dev/null)
  cuda_figures=$(python3 "$report" ctest-figures "$results/ctest_cuda.xml" 2>/dev/null)
  local passed failed skipped total
  read -r passed failed skipped total <<<"${cuda_counts:-? ? ? ?}"
  note[cuda_tests]="$passed passed, $failed failed, $skipped skipped (of $total)"
  # Stopped at --stop-time by a limit the deadline set: the tests it did not
  # finish are the second call's (status 75); its failures show in the note.
  # Its own 240 s running out is a failure: a second call would meet it again.
  if [ $rc -ne 0 ] && [ "$limit" -lt 240 ] && [ $SECONDS -ge $((stop_at - 1)) ]; then return 75; fi
  [ $rc -eq 0 ] || return 1
  if [ -z "$gpu" ]; then
    note[cuda_tests]+="; no GPU"
    [ $no_gpu_ok -eq 1 ] && return 0
    return 1
  fi
  local unexpected
  if ! unexpected=$(python3 "$report" unexpected-skips "$results/ctest_cuda.xml" "${expected_skips[@]}" 2>&1); then
    note[cuda_tests]+="; the skip check failed"
    echo "cuda_tests: could not list the skipped tests: $unexpected" >&2
    return 1
  fi
  if [ -n "$unexpected" ]; then
    note[cuda_tests]+="; skipped on a GPU machine: $(echo "$unexpected" | head -3 | tr '\n' ' ')"
    echo "cuda_tests: tests skipped with a GPU present (each should run here):" >&2
    echo "$unexpected" >&2
    return 1
  fi
}

# A JSON file that python3 can read.
is_json() { python3 -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null; }

# Without a GPU a benchmark's failure or no-op is expected: skipped with
# --no-gpu-ok, failed without.
no_gpu_verdict() {  # step
  note[$1]="no GPU${note[$1]:+: ${note[$1]}}"
  [ $no_gpu_ok -eq 1 ] && return 77
  return 1
}

step_bench_kernels() {
  timeout -k "$kill_after" "$(budget 150)" "$build/tools/origami" bench kernels --device cuda --json > "$results/bench_kernels.json"
  local rc=$?
  [ -s "$results/bench_kernels.json" ] || rm -f "$results/bench_kernels.json"
  if [ -z "$gpu" ]; then note[bench_kernels]="exit $rc"; no_gpu_verdict bench_kernels; return; fi
  [ $rc -eq 0 ] || return $rc
  is_json "$results/bench_kernels.json" || { note[bench_kernels]="stdout is not one JSON object"; return 1; }
}

step_bench_torch() {
  [ -f tools/bench_kernels_torch.py ] || { note[bench_torch]="no tools/bench_kernels_torch.py"; return 1; }
  # The machine's own libraries for PyTorch: the prefix's and the toolkit's
  # would come before its wheels' on LD_LIBRARY_PATH.
  (
    if [ -n "$orig_ld_path" ]; then export LD_LIBRARY_PATH=$orig_ld_path; else unset LD_LIBRARY_PATH; fi
    PYTHONUNBUFFERED=1 timeout -k "$kill_after" "$(budget 120)" python3 tools/bench_kernels_torch.py --json "$results/bench_torch.json"
  )
  local rc=$?
  if [ -z "$gpu" ]; then note[bench_torch]="exit $rc"; no_gpu_verdict bench_torch; return; fi
  [ $rc -eq 0 ] || return $rc
  is_json "$results/bench_torch.json" || { note[bench_torch]="no JSON in bench_torch.json"; return 1; }
  if grep -q '"skipped"' "$results/bench_torch.json"; then note[bench_torch]="PyTorch sees no GPU"; return 1; fi
}

# The GPU configs, Mixtral-like first: its MFU and its ratio to PyTorch are
# the issue's targets, so a run cut short by the deadline has them.
gpu_configs=()
for c in "$root/configs/gpu-mixtral-h200.toml" "$root"/configs/gpu-*.toml; do
  [ -f "$c" ] && [[ " ${gpu_configs[*]} " != *" $c "* ]] && gpu_configs+=("$c")
done
primary=("${gpu_configs[@]:0:1}")  # train_gpu, train_torch: the issue's targets
rest=("${gpu_configs[@]:1}")       # train_more: origami, then the twin, of each

# train_steps bf16 steps of config $2 on cuda:0 into $build/train-$1/metrics.jsonl;
# further arguments are more --set overrides. The config's own global batch
# (8 x 4096 tokens for both GPU configs): the AdamW update over every
# parameter is memory-bound (~60 ms at 7.5B parameters), and a smaller
# batch would charge it to fewer tokens and understate the MFU that
# training at that batch gets.
train_steps=4  # 2 of warm-up, then the median of 2 (tools/gpu_check_report.py)
origami_gpu_train() {
  local run=$1 c=$2
  shift 2
  rm -rf "$build/train-$run"
  echo "origami train $c $* ($train_steps steps)"
  timeout -k "$kill_after" "$(budget 100)" "$build/tools/origami" train "$c" --set data.path="$build/gpu-corpus" \
    --set training.steps="$train_steps" \
    --set lr_schedule.warmup_steps=1 --set runtime.precision=bf16 \
    --set export.dir= --set logging.dir="$build/train-$run" "$@"
}

# The layers each GPU config runs with: its own on an H200, the most that
# fit on a smaller GPU (an H100's 80 GB holds 3 of the Mixtral-like
# config's 5), so that the per-layer figures still come back. What fits is
# the plan's peak within the GPU's memory less fit_reserve, the part the
# plan does not count (CUDA context, cuBLAS and attention workspaces,
# allocator slack: a guess, unmeasured; the plan's peak is the CPU ledger's
# but for workspaces); a run that still runs out of memory is tried once
# more at a layer fewer.
declare -A layers=()  # config name -> layers its runs use
fit_reserve=6000000000  # bytes
config_layers() { sed -n 's/^num_layers *= *\([0-9]*\).*/\1/p' "$1" | head -n 1; }

# Config $2 as run $1 at the layers that fit GPU 0 (without a GPU, the
# config's own); sets layers[$1].
origami_gpu_train_fitted() {
  local run=$1 c=$2 full fit retried=0 rc out
  full=$(config_layers "$c")
  fit=$full
  if [ -n "$gpu_memory_mib" ] && [ -n "$full" ]; then
    # Should the plan fail, the config's own layers: origami's start-up
    # check and the one retry below still keep the run inside the GPU.
    fit=$(python3 "$report" fit-layers "$build/tools/origami" "$c" "$((gpu_memory_mib * 1048576))" "$fit_reserve") ||
      { echo "$run: fit-layers failed; trying the config's $full layers"; fit=$full; }
    if [ "$fit" -eq 0 ]; then
      echo "$run: not one layer fits the GPU's $gpu_memory_mib MiB less the $fit_reserve-byte reserve"
      layers[$run]=0
      echo 0 > "$build/layers-$run"
      return 1
    fi
  fi
  out=$(mktemp)
  while :; do
    layers[$run]=$fit
    echo "$fit" > "$build/layers-$run"  # for a later call's train_torch (ORIGAMI_GPU_STEPS)
    if [ -n "$full" ] && [ "$fit" -lt "$full" ]; then
      echo "$run: at $fit of its $full layers (this GPU has $gpu_memory_mib MiB)"
      origami_gpu_train "$run" "$c" --set model.num_layers="$fit" 2>&1 | tee "$out"
    else
      origami_gpu_train "$run" "$c" 2>&1 | tee "$out"
    fi
    rc=${PIPESTATUS[0]}
    # Out of memory (the allocator's or the start-up check's "... of memory"):
    # the reserve was short.
    if [ "$rc" -eq 2 ] && [ "$fit" -gt 1 ] && [ $retried -eq 0 ] && grep -q "of memory" "$out"; then
      retried=1 fit=$((fit - 1))
      echo "$run: out of memory; once more at $fit layers"
      continue
    fi
    rm -f "$out"
    return "$rc"
  done
}

# Whether $1 seconds of work fit before the deadline (less the last kill's
# 17 s): a run started with less would be cut, so it is left to a second call.
time_for() { [ $((deadline - SECONDS - 17)) -ge "$1" ]; }
# Whether a run's status is the deadline's kill rather than its own failure.
cut_by_deadline() { { [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; } && [ $SECONDS -ge $((deadline - 17)) ]; }
# Whether run $1 left all train_steps records (an earlier call's, kept: a
# second call does not train a config the first finished again).
trained() { [ -f "$build/train-$1/metrics.jsonl" ] && [ "$(grep -c '"step"' "$build/train-$1/metrics.jsonl")" -ge "$train_steps" ]; }
declare -A tried=()  # config name -> 1 once this call started its origami run

# The corpus every GPU run reads: this checkout's text, made once per build.
make_corpus() {
  local built inputs
  [ -f "$build/gpu-corpus.idx" ] && [ -f "$build/gpu-corpus.bin" ] && return 0
  built=$(cd "$build" && pwd)
  inputs=$(find "$root" -path "$built" -prune -o -path "$root/.bundle" -prune -o -path "$root/.git" -prune -o \
             -type f \( -name '*.md' -o -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.toml' \) -print | sort)
  # shellcheck disable=SC2086  # one argument per file
  timeout -k "$kill_after" "$(budget 60)" "$build/tools/origami" preprocess --format text --output-prefix "$build/gpu-corpus" --input $inputs
}

# Origami's run of each config given (train_steps bf16 steps, fitted to the
# GPU): 0 when all ran, 1 when one failed, 75 when the deadline cut one or
# left it unstarted (failures then stay in the log and the report's note).
train_origami() {
  local c name rc cut=0 failed=0
  for c in "$@"; do
    name=$(basename "$c" .toml)
    if trained "$name"; then
      echo "$name: kept from an earlier call ($build/train-$name)"
      [ -f "$build/layers-$name" ] && layers[$name]=$(cat "$build/layers-$name")
      continue
    fi
    time_for 45 || { echo "$name: not started, $((deadline - SECONDS)) s before the deadline"; cut=1; break; }
    tried[$name]=1
    origami_gpu_train_fitted "$name" "$c"
    rc=$?
    if cut_by_deadline "$rc"; then cut=1; break; fi
    [ "$rc" -eq 0 ] || failed=1
  done
  [ $cut -eq 1 ] && return 75
  return $failed
}

# The configs that have origami runs in $build or tried one in this call
# (for the reports: a config not run yet is left out of them, not reported
# as missing).
configs_with() {  # PREFIX (train- or torch-), then the configs
  local p=$1 c name out=()
  shift
  for c in "$@"; do
    name=$(basename "$c" .toml)
    if [ "$p" = train- ]; then
      { [ -d "$build/train-$name" ] || [ -n "${tried[$name]:-}" ]; } && out+=("$c")  # a failed run: "no metrics"
    else
      [ -f "$build/torch-$name.json" ] && out+=("$c")
    fi
  done
  [ ${#out[@]} -eq 0 ] || printf '%s\n' "${out[@]}"
}

# train_gpu.json ({config: record}: each run's last record, its rates the
# median of the timed steps) from every config run so far; prints its note.
report_train_gpu() {
  local ran=()
  mapfile -t ran < <(configs_with train- "${gpu_configs[@]}")
  GPU_NAME="$gpu" python3 "$report" train-gpu "$results/train_gpu.json" "$build" "$train_steps" "${ran[@]}"
}
report_train_torch() {
  local ran=()
  mapfile -t ran < <(configs_with torch- "${gpu_configs[@]}")
  python3 "$report" train-torch "$results/train_torch.json" "$results/train_gpu.json" "$build" "$train_steps" "${ran[@]}"
}

# The issue's target config (Mixtral-like) in origami: tokens/s, TFLOP/s,
# MFU, peak memory, exposed communication.
step_train_gpu() {
  [ ${#primary[@]} -gt 0 ] || { note[train_gpu]="no configs/gpu-*.toml"; return 1; }
  local rc out
  make_corpus
  rc=$?
  cut_by_deadline $rc && return 75
  [ $rc -eq 0 ] || { note[train_gpu]="origami preprocess of the checkout's text failed"; return 1; }
  train_origami "${primary[@]}"
  rc=$?
  out=$(report_train_gpu)
  echo "$out"
  note[train_gpu]="bf16: $out"
  [ $rc -eq 75 ] && return 75
  if [ -z "$gpu" ]; then no_gpu_verdict train_gpu; return; fi
  return $rc
}

# True when the twin's result is out of memory even at one layer: a finding
# (the report says so), where any other failure of the twin fails the step.
twin_out_of_memory() {  # its JSON
  python3 -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1])).get("error", "").startswith("CUDA out of memory"))' \
    "$1" 2>/dev/null
}

# Config $1 through tools/train_torch.py (PyTorch eager, same shape, same
# batch, same precision) on the same GPU, for origami's tokens/s over
# PyTorch's. The configs fill the GPU with origami's 16 bytes of state per
# parameter; eager PyTorch also holds autocast's bf16 weight copies and more
# activations, so the twin runs with --fit (one layer fewer after each
# out-of-memory), starting at the layers origami ran, and where it ran fewer,
# origami runs again at that count (train-NAME-LN): the ratio is like for
# like, and the layers PyTorch could not fit are reported. PyTorch running
# out of memory even at one layer is a finding, not a failure of the check.
# Origami's side runs first when no earlier step left it (a second call on a
# fresh machine): the ratio is always of two runs of this call's GPU.
# 0, 1 (failed) or 75 (the deadline's).
train_twin() {
  local c=$1 name full fitted rc
  name=$(basename "$c" .toml)
  [ -n "${layers[$name]:-}" ] || { [ -f "$build/layers-$name" ] && layers[$name]=$(cat "$build/layers-$name"); }
  if ! trained "$name" && [ -n "${tried[$name]:-}" ]; then
    echo "$name: origami's run failed in this call: no twin to compare it with"
    return 1
  fi
  if ! trained "$name" && [ "${layers[$name]:-}" != 0 ]; then
    echo "$name: origami's side first (no run of it in $build)"
    train_origami "$c"
    rc=$?
    [ $rc -eq 0 ] || return $rc
  fi
  full=${layers[$name]:-$(config_layers "$c")}
  if [ "$full" = 0 ]; then  # not one layer fits: nothing of origami's to compare with
    printf '{"config": "%s", "skipped": "not one layer fits this GPU"}\n' "$name" > "$build/torch-$name.json"
    return 0
  fi
  local rc=0
  if grep -q '"tokens_per_s"' "$build/torch-$name.json" 2>/dev/null; then
    echo "$name: the twin's result kept from an earlier call"
  else
    rm -f "$build/torch-$name.json"
    run_twin "$name" "$c" "$full"
    rc=$?
    [ $rc -eq 75 ] && return 75
  fi
  local failed=0
  [ $rc -eq 0 ] || failed=1
  # With a GPU here, a twin that saw none is a broken PyTorch, not a result.
  if [ -n "$gpu" ] && grep -q '"skipped"' "$build/torch-$name.json" 2>/dev/null; then failed=1; fi
  fitted=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("layers", 0))' \
             "$build/torch-$name.json" 2>/dev/null || echo 0)
  if [ "${fitted:-0}" -gt 0 ] && [ -n "$full" ] && [ "$fitted" -lt "$full" ] && ! trained "$name-L$fitted"; then
    time_for 45 || return 75
    origami_gpu_train "$name-L$fitted" "$c" --set model.num_layers="$fitted"
    rc=$?
    cut_by_deadline "$rc" && return 75
    [ $rc -eq 0 ] || failed=1
  fi
  return $failed
}

# The twin of config $2 (name $1) at up to $3 layers into $build/torch-NAME.json:
# 0 (a result, or out of memory even at one layer), 1, or 75 (the deadline's).
run_twin() {
  local name=$1 c=$2 full=$3 rc
  time_for 60 || { echo "$name: twin not started, $((deadline - SECONDS)) s before the deadline"; return 75; }
  # expandable_segments: PyTorch's own advice against fragmentation, which
  # a model filling the card would otherwise pay for in allocator retries.
  (
    if [ -n "$orig_ld_path" ]; then export LD_LIBRARY_PATH=$orig_ld_path; else unset LD_LIBRARY_PATH; fi
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 \
      timeout -k "$kill_after" "$(budget 180)" python3 tools/train_torch.py "$c" --steps 2 --warmup 2 \
      --precision bf16 --fit ${full:+--layers "$full"} --json "$build/torch-$name.json"
  )
  rc=$?
  if cut_by_deadline "$rc"; then rm -f "$build/torch-$name.json"; return 75; fi
  [ $rc -eq 0 ] || twin_out_of_memory "$build/torch-$name.json" || return 1
  return 0
}

# The target config's twin: origami's tokens/s over PyTorch eager's.
step_train_torch() {
  [ -f tools/train_torch.py ] || { note[train_torch]="no tools/train_torch.py"; return 1; }
  [ ${#primary[@]} -gt 0 ] || { note[train_torch]="no configs/gpu-*.toml"; return 1; }
  local rc out
  train_twin "${primary[0]}"
  rc=$?
  report_train_gpu > /dev/null  # origami's side as it stands (it may have run just now, in train_twin)
  out=$(report_train_torch)
  echo "$out"
  note[train_torch]="bf16: $out"
  [ $rc -eq 75 ] && return 75
  if [ -z "$gpu" ]; then no_gpu_verdict train_torch; return; fi
  # A result with a ratio for the config (an out-of-memory twin counts) is a pass.
  grep -q -e "no result" -e "no origami figure" <<<"$out" && return 1
  return $rc
}

# The other GPU configs (DeepSeek-like), after the target's figures: for
# each, origami's run, then its twin; both reports then hold every config.
step_train_more() {
  [ ${#rest[@]} -gt 0 ] || { note[train_more]="no other GPU config"; return 0; }
  local c rc=0 r out verdict ran=()
  make_corpus
  r=$?
  cut_by_deadline $r && return 75
  [ $r -eq 0 ] || { note[train_more]="origami preprocess of the checkout's text failed"; return 1; }
  for c in "${rest[@]}"; do
    train_origami "$c"
    r=$?
    [ $r -eq 75 ] && { rc=75; break; }
    [ $r -eq 0 ] || rc=1
    train_twin "$c"
    r=$?
    [ $r -eq 75 ] && { rc=75; break; }
    [ $r -eq 0 ] || rc=1
  done
  out="$(report_train_gpu) | $(report_train_torch)"
  echo "$out"
  note[train_more]="bf16: $out"
  [ $rc -eq 75 ] && return 75
  if [ -z "$gpu" ]; then no_gpu_verdict train_more; return; fi
  # The verdict is of this step's configs (train_torch judges the first).
  mapfile -t ran < <(configs_with torch- "${rest[@]}")
  verdict=$(python3 "$report" train-torch /dev/null "$results/train_gpu.json" "$build" "$train_steps" "${ran[@]}")
  grep -q -e "no result" -e "no origami figure" <<<"$verdict" && return 1
  [ ${#ran[@]} -eq ${#rest[@]} ] || return 1
  return $rc
}

# ---- runner and summary

# run STEP: runs step_STEP with its output appended to the log; prints a
# status line, and the output's tail when it failed.
run() {
  local name=$1 t0=$SECONDS start rc
  steps+=("$name")
  if [ $((deadline - SECONDS)) -lt 20 ]; then
    status[$name]=deadline secs[$name]=0 note[$name]="not started: $((deadline - SECONDS)) s left before the ${deadline} s deadline"
    cut+=("$name")
    echo "gpu_check: [$name] ${note[$name]}"
    write_summary
    return 3
  fi
  start=$(($(wc -l < "$log") + 1))
  printf '\n===== %s\n' "$name" >> "$log"
  "step_$name" >> "$log" 2>&1
  rc=$?
  secs[$name]=$((SECONDS - t0))
  case $rc in
    0) status[$name]=ok ;;
    77) status[$name]=skipped ;;
    124) status[$name]=FAILED; note[$name]="timed out${note[$name]:+; ${note[$name]}}" ;;
    *) status[$name]=FAILED ;;
  esac
  # A step the deadline stopped is one for the second call, not a verdict on
  # the code: killed by a limit that ran out with the time left (15 s
  # before the deadline, not its own limit earlier), or a step that says so
  # itself (status 75: cuda_tests, which CTest's --stop-time ends first).
  if [ $rc -eq 75 ] || { { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $SECONDS -ge $((deadline - 17)) ]; }; then
    status[$name]=deadline note[$name]="stopped by the ${deadline} s deadline${note[$name]:+; ${note[$name]}}"
    cut+=("$name")
  fi
  echo "gpu_check: [$name] ${status[$name]} in ${secs[$name]} s${note[$name]:+ (${note[$name]})}"
  if [ "${status[$name]}" != ok ] && [ "${status[$name]}" != skipped ]; then
    echo "---- last lines of $name (all of it in $log)"
    tail -n +"$start" "$log" | tail -n 40
    echo "----"
  fi
  write_summary
  [ "${status[$name]}" = deadline ] && return 3
  [ $rc -eq 0 ] || [ $rc -eq 77 ]
}

# The kernel table: origami's bench kernels beside PyTorch's, matched by key
# (tools/bench_kernels.cpp names its lines so that bench_kernels_torch.py's
# counterparts share the key). Tolerant of missing files and keys.
kernel_table() {
  python3 "$report" kernel-table "$results/bench_kernels.json" "$results/bench_torch.json"
}

# The steps after the build that a second call should run: those the
# deadline cut or did not start (every wanted one when it cut a set-up step,
# which a second call runs anyway).
rerun_steps() {
  local s out=()
  for s in "${all_steps[@]:4}"; do
    wanted "$s" || continue
    if [ "${status[$s]:-}" = deadline ] || { [ -z "${status[$s]:-}" ] && [ ${#cut[@]} -gt 0 ]; }; then out+=("$s"); fi
  done
  echo "${out[*]}"
}

write_summary() {
  {
    echo "== gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'); full output: $log)"
    echo "GPU: ${gpu:-none}   prefix: $prefix   build: $build"
    printf '%-14s %-8s %6s  %s\n' step status time note
    local n total=0
    for n in "${steps[@]}"; do
      printf '%-14s %-8s %4s s  %s\n' "$n" "${status[$n]}" "${secs[$n]}" "${note[$n]:-}"
      total=$((total + secs[$n]))
    done
    for n in "${all_steps[@]}"; do
      [ -n "${status[$n]:-}" ] && continue
      if wanted "$n" || [[ " ${all_steps[*]:0:4} " == *" $n "* ]]; then
        printf '%-14s %-8s %4s    %s\n' "$n" "not run" "" "an earlier step $([ ${#cut[@]} -gt 0 ] && echo 'met the deadline' || echo failed)"
      else
        printf '%-14s %-8s %4s    %s\n' "$n" "not run" "" "not in ORIGAMI_GPU_STEPS"
      fi
    done
    printf '%-14s %-8s %4s s\n' total "" "$total"
    [ ${#cut[@]} -gt 0 ] && echo "the deadline cut: ${cut[*]}; the rest, at once on the still-warm machine: ORIGAMI_GPU_STEPS=\"$(rerun_steps)\" ORIGAMI_GPU_DEADLINE=<device seconds left - 70> bash tools/gpu_check.sh"
    [ -n "$cuda_counts" ] && echo "CUDA tests (ctest -L cuda): ${note[cuda_tests]}"
    [ -n "$cuda_figures" ] && printf 'CUDA tests measured:\n%s\n' "$cuda_figures"
    kernel_table 2>&1
  } > "$summary"
}

# ---- main
echo "gpu_check: results in $results, prefix $prefix, build $build, GPU: ${gpu:-none}"
ok=1
run tools && run unpack && run configure && run build || ok=0
# A first call's training is its own: what a build directory holds from
# another call (another binary, another config) is never reported as this
# one's. A second call (ORIGAMI_GPU_STEPS) keeps the first's finished runs.
[ -n "${ORIGAMI_GPU_STEPS:-}" ] || rm -rf "$build"/train-* "$build"/torch-*.json "$build"/layers-*
if [ $ok -eq 1 ]; then
  for s in "${all_steps[@]:4}"; do
    if wanted "$s"; then run "$s" || ok=0; fi
  done
fi
write_summary
echo
cat "$summary"
failed=()
for n in "${steps[@]}"; do [ "${status[$n]}" = FAILED ] && failed+=("$n"); done
if [ $ok -eq 1 ]; then
  echo "gpu_check: PASSED"
elif [ ${#cut[@]} -gt 0 ]; then
  # Whatever failed, the steps the deadline cut are still to measure: the
  # last line is the second call, to make at once on the still-warm machine
  # with the device time left (the caller knows it: ORIGAMI_GPU_DEADLINE =
  # that time less 70 s, the call's timeout_s that time less 10 s).
  echo "gpu_check: INCOMPLETE (${failed[*]:+failed: ${failed[*]}; }the deadline cut ${cut[*]})"
  echo "gpu_check: NEXT ORIGAMI_GPU_STEPS=\"$(rerun_steps)\" ORIGAMI_GPU_DEADLINE=<device seconds left - 70> bash tools/gpu_check.sh"
  exit 3
else
  echo "gpu_check: FAILED (${failed[*]:-a step}; logs in $results)"
fi
[ $ok -eq 1 ]
