#!/usr/bin/env bash
# Downloads, here, the Debian 12 packages that the lent GPU machine lacks to
# build and run Origami's CUDA tests and the `origami` binary, into .bundle/
# (git-ignored; the device tool carries it with carry [".bundle"]).
#
# Why: the GPU machine runs this workplace's "cuda" image (Ubuntu 24.04-like:
# g++, nvcc, CMake, ninja, python3 with PyTorch) with no apt and no internet.
# Origami also needs OpenMPI, oneDNN, toml++, nlohmann-json, CLI11, simdjson,
# xxhash, GoogleTest and pkg-config (CMakeLists.txt: find_package(PkgConfig)
# for libxxhash), and its CLI tests Debian's fortunes as their corpus. tools/gpu_check.sh unpacks these .debs into a private
# prefix there (dpkg-deb -x, never into /) and builds against it.
#
# What is taken: the build packages below (headers, CMake and pkg-config
# files, static GoogleTest, the MPI wrappers and mpirun), then every package
# their Depends/Pre-Depends reach, except
#   - BASE: what any Ubuntu 24.04 image with g++ has (the C and C++
#     runtimes, OpenMP's libgomp, zlib/zstd/lzma, libudev, ...);
#   - MAINTAINER: tools that only dpkg's install scripts use (dpkg -x runs none);
#   - UNUSED_DEV: dev packages of dependencies whose headers Origami never
#     includes (mpi.h includes no hwloc/PMIx/libevent header);
#   - PRUNED: what a single-node OpenMPI job (btl self,vader) runs without:
#     openssh-client (mpirun starts local ranks itself; ssh is only for
#     remote nodes) and libhwloc-plugins (hwloc's optional PCI/X11/NVML/XML
#     plugins, which pull in libxml2, libicu72 and X11: ~10 MiB; hwloc reads
#     the topology from /sys without them).
# Packages reached only through an excluded one are not taken either. Kept
# although a self,vader job does not use them: the fabric stack (libfabric,
# UCX, verbs, PSM; ~2.7 MiB of .debs), so OpenMPI's plugins all load. CUDA's
# libraries are never bundled: the GPU machine's match its driver.
#
# Output: .bundle/debs/*.deb and .bundle/MANIFEST (package=version, .deb
# bytes, installed KiB, and why it is there); the total size is printed.
# Idempotent: a .deb already there at the wanted version is kept, one no
# longer wanted (or of another version) is removed.
#
# Usage: tools/device_bundle.sh          (needs an amd64 Debian 12 with apt;
#                                          runs apt-get update when lists are missing)
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=.bundle
debs=$bundle/debs

die() { echo "device_bundle: $*" >&2; exit 1; }

# The GPU machine is x86-64 and these are bookworm's package names.
arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
[ "$arch" = amd64 ] || die "needs an amd64 Debian (the GPU machine is x86-64); this is $arch"
codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
[ "$codename" = bookworm ] ||
  die "needs Debian 12 (bookworm): the package lists below are bookworm's; this is '${codename:-unknown}'"

build_packages=(
  pkgconf pkgconf-bin                       # /usr/bin/pkg-config (bookworm's pkg-config is an empty transitional package)
  libopenmpi-dev openmpi-bin openmpi-common # mpi.h, the mpicc/mpicxx wrappers FindMPI asks, mpirun and orted
  libdnnl-dev                               # oneDNN: CPU GEMM
  ocl-icd-opencl-dev opencl-c-headers opencl-clhpp-headers  # dnnl's CMake config calls find_package(OpenCL)
  libtomlplusplus-dev nlohmann-json3-dev libcli11-dev
  libxxhash-dev libsimdjson-dev
  libgtest-dev libgmock-dev
  fortunes-min fortunes                     # the CLI tests' corpus (tests/cli_util.h: ORIGAMI_FORTUNES_DIR); no Depends
)
BASE=(libc6 libgcc-s1 libstdc++6 gcc-12-base libgomp1 libatomic1 zlib1g libzstd1 liblzma5 libbz2-1.0
      libcrypt1 libtinfo6 libselinux1 libpcre2-8-0 libacl1 libattr1 libaudit1 libaudit-common libcap-ng0
      libcap2 libudev1 libmd0 libbsd0 libuuid1 libssl3 libdb5.3 libreadline8 readline-common libgmp10
      libcom-err2 libkeyutils1 libsystemd0 liblz4-1 libgcrypt20 libgpg-error0 perl-base)
MAINTAINER=(dpkg debconf cdebconf adduser passwd tar install-info libpam0g libpam-modules libpam-modules-bin
            libpam-runtime libsemanage2 libsemanage-common libsepol2 libdebian-installer4 libnewt0.52
            libslang2 libtextwrap1 sensible-utils)
UNUSED_DEV=(libhwloc-dev libevent-dev libibverbs-dev libpmix-dev libjs-jquery libjs-jquery-ui zlib1g-dev
            gfortran-12 gfortran googletest)
PRUNED=(openssh-client libhwloc-plugins)

declare -A excluded=() reached=() why=() version=() debsize=() instsize=()
for p in "${BASE[@]}"; do excluded[$p]=base; done
for p in "${MAINTAINER[@]}"; do excluded[$p]=maintainer; done
for p in "${UNUSED_DEV[@]}"; do excluded[$p]=unused-dev; done
for p in "${PRUNED[@]}"; do excluded[$p]=pruned; done

# apt's lists: without them apt-cache knows no candidates.
if ! apt-cache show --no-all-versions libopenmpi-dev >/dev/null 2>&1; then
  echo "device_bundle: apt-get update"
  apt-get update -qq || die "apt-get update failed"
fi

# The candidates of many packages in one apt-cache call (each call loads
# apt's whole cache): fills version, debsize, instsize and deps for every
# name that has a candidate (virtual and unknown names are skipped). deps is
# the Pre-Depends and Depends groups, ';' between groups, '|' between
# alternatives, version constraints and :any removed.
declare -A deps=()
load_info() {
  local name v s i d
  while IFS=$'\t' read -r name v s i d; do
    version[$name]=$v; debsize[$name]=$s; instsize[$name]=$i; deps[$name]=$d
  done < <(apt-cache show --no-all-versions "$@" 2>/dev/null | awk '
    BEGIN { RS = ""; FS = "\n" }
    {
      name = v = s = i = d = ""
      for (k = 1; k <= NF; k++) {
        line = $k
        if (line ~ /^Package:/) name = substr(line, 10)
        else if (line ~ /^Version:/) v = substr(line, 10)
        else if (line ~ /^Size:/) s = substr(line, 7)
        else if (line ~ /^Installed-Size:/) i = substr(line, 17)
        else if (line ~ /^(Pre-)?Depends:/) { sub(/^[^:]*: */, "", line); d = d (d == "" ? "" : ",") line }
      }
      gsub(/\([^)]*\)/, "", d); gsub(/:any/, "", d); gsub(/[ \t]/, "", d); gsub(/,/, ";", d)
      if (name != "" && v != "") printf "%s\t%s\t%s\t%s\t%s\n", name, v, s, i, d
    }')
}

# Breadth-first over Depends from the build packages, one wave at a time.
for p in "${build_packages[@]}"; do why[$p]=build; done
wave=("${build_packages[@]}")
while [ ${#wave[@]} -gt 0 ]; do
  fresh=()
  for p in "${wave[@]}"; do [ -n "${version[$p]:-}" ] || fresh+=("$p"); done
  [ ${#fresh[@]} -gt 0 ] && load_info "${fresh[@]}"
  for p in "${wave[@]}"; do
    [ -n "${version[$p]:-}" ] || die "no candidate for '$p' (apt-get update? or a name that changed in bookworm)"
  done
  # Alternatives not yet known: one call to learn which have a candidate.
  unknown=()
  for p in "${wave[@]}"; do
    IFS=';|' read -r -a names <<<"${deps[$p]}"
    for a in "${names[@]}"; do
      [ -n "$a" ] && [ -z "${version[$a]:-}" ] && [ -z "${excluded[$a]:-}" ] && unknown+=("$a")
    done
  done
  [ ${#unknown[@]} -gt 0 ] && load_info "${unknown[@]}"
  next=()
  for p in "${wave[@]}"; do
    IFS=';' read -r -a groups <<<"${deps[$p]}"
    for group in "${groups[@]}"; do
      [ -z "$group" ] && continue
      IFS='|' read -r -a alts <<<"$group"
      chosen=""
      for a in "${alts[@]}"; do  # an excluded alternative satisfies the group
        if [ -n "${excluded[$a]:-}" ]; then chosen=excluded; reached[$a]="${reached[$a]:-}${reached[$a]:+ }$p"; break; fi
      done
      [ -n "$chosen" ] && continue
      for a in "${alts[@]}"; do  # else the first with a candidate (skips virtual names)
        if [ -n "${version[$a]:-}" ]; then chosen=$a; break; fi
      done
      [ -n "$chosen" ] || die "'$p' depends on '$group', none of which has a candidate: name a provider in BASE or build_packages"
      if [ -z "${why[$chosen]:-}" ]; then why[$chosen]="dep of $p"; next+=("$chosen"); fi
    done
  done
  wave=("${next[@]}")
done

mkdir -p "$debs"
wanted=()
for p in "${!why[@]}"; do wanted+=("$p"); done
IFS=$'\n' wanted=($(sort <<<"${wanted[*]}")); unset IFS

# Keep a .deb already at the wanted version; drop everything else.
declare -A have=()
for f in "$debs"/*.deb; do
  [ -e "$f" ] || continue
  pv=$(dpkg-deb -f "$f" Package Version 2>/dev/null | awk '{print $2}' | paste -sd=) || pv=""
  p=${pv%%=*}
  if [ -n "$p" ] && [ "${version[$p]:-}" = "${pv#*=}" ] && [ -z "${have[$p]:-}" ]; then
    have[$p]=$f
  else
    rm -f "$f"
  fi
done
missing=()
for p in "${wanted[@]}"; do [ -n "${have[$p]:-}" ] || missing+=("$p=${version[$p]}"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "device_bundle: downloading ${#missing[@]} package(s)"
  (cd "$debs" && apt-get download -qq -o APT::Sandbox::User=root "${missing[@]}") ||
    die "apt-get download failed for: ${missing[*]}"
fi

# MANIFEST: what is in the bundle and why; gpu_check.sh checks the .debs against it.
total=0
{
  echo "# Debian 12 packages for tools/gpu_check.sh, made by tools/device_bundle.sh"
  echo "# package=version  deb_bytes  installed_KiB  why"
  for p in "${wanted[@]}"; do
    f=$(ls "$debs/${p}_"*.deb 2>/dev/null | head -n 1)
    [ -n "$f" ] || die "'$p' was not downloaded"
    b=$(stat -c %s "$f"); total=$((total + b))
    printf '%s=%s %d %d %s\n' "$p" "${version[$p]}" "$b" "${instsize[$p]}" "${why[$p]}"
  done
} > "$bundle/MANIFEST"
# The excluded packages that were reached, for the record.
{
  echo "# reached but not bundled: reason package <- needed by"
  for p in "${!reached[@]}"; do echo "${excluded[$p]} $p <- ${reached[$p]}"; done | sort
} > "$bundle/EXCLUDED"

count=${#wanted[@]}
mib=$(awk -v b=$total 'BEGIN{printf "%.1f", b/1048576}')
echo "device_bundle: $count packages in $debs, $((total / 1024)) KiB ($mib MiB); manifest $bundle/MANIFEST"
echo "device_bundle: on the GPU machine: run(command='bash tools/gpu_check.sh', carry=['.bundle'], kind='nvidia-h200', timeout_s=540)"
