#!/usr/bin/env bash
# Proves the GPU machine's bundle path here, on a CPU machine: runs
# tools/gpu_check.sh --no-gpu-ok in a clean Debian 12 root that has only what
# the GPU image has (g++, CMake, ninja, python3, and the CUDA toolkit of this
# machine bind-mounted read-only at /usr/local/cuda) and none of Origami's
# dev packages, so the build can only succeed against the private prefix
# that gpu_check.sh unpacks from .bundle/. The CPU steps must pass there
# (BackendOps.cpu, mpirun -np 2 through the bundled OpenMPI); the CUDA tests
# skip and the benchmarks report that there is no device.
#
# How the root is made follows tools/fresh_check.sh: debootstrap minbase
# from the mirror apt uses, /etc/hosts copied in (MPI's hostname lookups
# stall without it), /proc /sys /dev /dev/shm /dev/pts mounted.
#
# Needs root (debootstrap, mount, chroot) and /usr/local/cuda. Runs
# tools/device_bundle.sh first (idempotent). Not part of CI: the build
# alone takes ~15 minutes on 2 cores.
#
# Usage: tools/bundle_check.sh [ROOT_DIR]      (default: a new dir under /tmp)
#   A ROOT_DIR left by an earlier run keeps its base system (debootstrap and
#   apt are skipped); the checkout, the bundle and the prefix are always new.
#   ORIGAMI_BUNDLE_KEEP=1 keeps the root afterwards (a failed run always does).
# Exit status: gpu_check.sh's (0 when every step passed), 2 on a setup error.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)

die() { echo "bundle_check: $*" >&2; exit 2; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, mount, chroot)"
cuda=$(readlink -f /usr/local/cuda 2>/dev/null || true)
[ -x "$cuda/bin/nvcc" ] || die "no CUDA toolkit at /usr/local/cuda (nvcc): the check builds the CUDA backend"

root=${1:-$(mktemp -d /tmp/origami-bundle.XXXXXX)}
mkdir -p "$root"
marker=$root/.origami-bundle-base
if [ ! -e "$marker" ] && [ -n "$(ls -A "$root")" ]; then
  die "$root is neither empty nor a root made by an earlier bundle_check"
fi

t_start=$(date +%s)
phase() {  # name, start time: prints the phase's wall time
  local dt=$(( $(date +%s) - $2 ))
  echo "bundle_check: [$1] ${dt} s ($((dt / 60)) min $((dt % 60)) s)"
}

t=$(date +%s)
tools/device_bundle.sh
phase bundle "$t"

mounted=()
status=2
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
  if [ "${ORIGAMI_BUNDLE_KEEP:-0}" != 1 ] && [ "$status" -eq 0 ]; then
    rm -rf --one-file-system "$root"
  else
    echo "bundle_check: kept $root"
  fi
}
trap cleanup EXIT

mount_root() {
  cp /etc/hosts "$root/etc/hosts"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  local m
  for m in proc sys dev dev/shm dev/pts; do
    mkdir -p "$root/$m"
    case $m in
      proc) mount -t proc proc "$root/proc" ;;
      sys) mount -t sysfs sys "$root/sys" ;;
      *) mount --bind "/$m" "$root/$m" ;;
    esac
    mounted+=("$root/$m")
  done
}

in_root() {  # command: runs it in the root with a clean environment
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive bash -c "$1"
}

if [ -e "$marker" ]; then
  echo "bundle_check: reusing the base system in $root"
  mount_root
else
  mirror=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n 1 || true)
  [ -n "$mirror" ] || mirror=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
                               awk '{print $2}' | grep -v security | head -n 1 || true)
  [ -n "$mirror" ] || die "no Debian mirror found in /etc/apt/sources.list{,.d/}"
  if ! command -v debootstrap >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  t=$(date +%s)
  echo "bundle_check: debootstrap bookworm (minbase) from $mirror into $root"
  debootstrap --variant=minbase bookworm "$root" "$mirror" > "$root.debootstrap.log" 2>&1 || {
    tail -n 20 "$root.debootstrap.log" >&2; die "debootstrap failed"; }
  rm -f "$root.debootstrap.log"
  mount_root
  # What the GPU image has, and no more: compilers, CMake, ninja, python3.
  apt="apt-get -o APT::Sandbox::User=root"
  in_root "$apt update -qq && $apt install -y -qq --no-install-recommends g++ make cmake ninja-build python3 >/dev/null" ||
    die "apt-get install in the root failed"
  touch "$marker"
  phase root "$t"
fi

# The root must not have what the bundle brings, or the proof proves nothing.
for p in libopenmpi-dev openmpi-bin libdnnl-dev libtomlplusplus-dev nlohmann-json3-dev libcli11-dev libxxhash-dev \
         libsimdjson-dev libgtest-dev pkgconf; do
  if in_root "dpkg-query -W -f='\${Status}' $p 2>/dev/null | grep -q 'install ok installed'"; then
    die "the root has $p installed: use a new ROOT_DIR"
  fi
done

# Bookworm's CMake 3.25.1 fails on CUDA 13, which has no nvToolsExt
# (FindCUDAToolkit sets a property on the target it did not make); the GPU
# image's newer CMake has the fix, and this machine's image carries it as a
# patched module: the root gets that module.
module=usr/share/cmake-3.25/Modules/FindCUDAToolkit.cmake
if [ -f "$root/$module" ] && ! grep -q 'if(TARGET CUDA::nvToolsExt' "$root/$module"; then
  grep -q 'if(TARGET CUDA::nvToolsExt' "/$module" 2>/dev/null ||
    die "the root's CMake 3.25 FindCUDAToolkit fails on CUDA 13 and this machine has no fixed /$module to copy"
  cp "/$module" "$root/$module"
  echo "bundle_check: the root's FindCUDAToolkit.cmake replaced by this machine's (CUDA 13 has no nvToolsExt)"
fi

# The toolkit, read-only, where the GPU image keeps it.
mkdir -p "$root/usr/local/cuda"
mount --bind "$cuda" "$root/usr/local/cuda" && mounted+=("$root/usr/local/cuda")
mount -o remount,bind,ro "$root/usr/local/cuda"

# The checkout as the device tool sends it (tracked and untracked files git
# does not ignore) and the bundle, which it sends when carry names it.
t=$(date +%s)
rm -rf "$root/work/origami" "$root/tmp/origami-prefix"
mkdir -p "$root/work/origami"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' |
  tar --null -T - -cf - | tar -xf - -C "$root/work/origami"
cp -a .bundle "$root/work/origami/.bundle"
echo "bundle_check: checkout $(du -sh --exclude=.bundle "$root/work/origami" | cut -f1), bundle $(du -sh .bundle | cut -f1)"
phase copy "$t"

# The build's time limit and the deadline are the GPU machine's (16 cores); here 2 cores take longer.
t=$(date +%s)
set +e
in_root "cd /work/origami && ORIGAMI_GPU_BUILD_TIMEOUT=3600 ORIGAMI_GPU_DEADLINE=7200 tools/gpu_check.sh --no-gpu-ok gpu-results"
status=$?
set -e
phase gpu_check "$t"
phase total "$t_start"
echo "bundle_check: results in $root/work/origami/gpu-results/ (summary.txt, gpu_check.log)"
if [ $status -eq 0 ]; then
  echo "bundle_check: PASSED: the bundle alone builds Origami's CUDA build and runs its CPU and MPI checks"
else
  echo "bundle_check: FAILED (gpu_check.sh exit $status)" >&2
fi
exit $status
