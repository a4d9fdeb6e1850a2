#!/usr/bin/env bash
# Runs the README's two commands on a brand-new Debian 12 (bookworm) system:
# creates a minimal root with debootstrap from the mirror this machine's apt
# already uses, copies the checkout in (tracked and untracked files that git
# does not ignore, so no build/ or data/), and inside it with chroot runs
#   tools/quickstart.sh   (installs, builds, trains the default tiny MoE)
#   tools/test.sh         (builds and runs every test)
# printing the wall time of each. Exit status: 0 when both pass.
#
# Not part of CI (it takes a while): run it before landing a change to
# dependencies or build files. Needs root (debootstrap, mounts, chroot).
#
# Usage: tools/fresh_check.sh [ROOT_DIR]     (default: a new dir under /tmp)
#        ORIGAMI_FRESH_KEEP=1 keeps the root afterwards (a failed run always does).
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(pwd)

if [ "$(id -u)" -ne 0 ]; then
  echo "fresh_check: must run as root (debootstrap, mount, chroot)" >&2
  exit 2
fi
root=${1:-$(mktemp -d /tmp/origami-fresh.XXXXXX)}
mkdir -p "$root"
if [ -n "$(ls -A "$root")" ]; then
  echo "fresh_check: $root is not empty; give a new or empty directory" >&2
  exit 2
fi

# The mirror: the first Debian URI apt is configured with (deb822 .sources or
# one-line .list files).
mirror=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n 1 || true)
if [ -z "$mirror" ]; then
  mirror=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | awk '{print $2}' |
           grep -v security | head -n 1 || true)
fi
if [ -z "$mirror" ]; then
  echo "fresh_check: no Debian mirror found in /etc/apt/sources.list{,.d/}" >&2
  exit 2
fi

if ! command -v debootstrap >/dev/null 2>&1; then
  echo "fresh_check: installing debootstrap"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
fi

mounted=()
status=0
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -l "${mounted[i]}" 2>/dev/null || true; done
  if [ "${ORIGAMI_FRESH_KEEP:-0}" != 1 ] && [ $status -eq 0 ]; then
    rm -rf --one-file-system "$root"
  else
    echo "fresh_check: kept $root"
  fi
}
trap cleanup EXIT

echo "fresh_check: debootstrap bookworm (minbase) from $mirror into $root"
t0=$(date +%s)
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
  tail -n 20 "$root.debootstrap.log" >&2
  exit 1
}
rm -f "$root.debootstrap.log"
echo "fresh_check: root ready in $(( $(date +%s) - t0 )) s"

# Name resolution (apt inside, and MPI's own hostname lookups: without
# /etc/hosts every MPI start stalls for seconds).
cp /etc/hosts "$root/etc/hosts"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
for m in proc sys dev dev/shm dev/pts; do
  mkdir -p "$root/$m"
  case $m in
    proc) mount -t proc proc "$root/proc" ;;
    sys) mount -t sysfs sys "$root/sys" ;;
    *) mount --bind "/$m" "$root/$m" ;;
  esac
  mounted+=("$root/$m")
done

# The checkout as git sees it: committed and uncommitted work, nothing ignored.
mkdir -p "$root/work/origami"
git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -e "{}" && printf "%s\0" "{}"' |
  tar --null -T - -cf - | tar -xf - -C "$root/work/origami"

run_in_root() {  # name, command
  local name=$1 cmd=$2 t status
  echo "fresh_check: [$name] $cmd"
  t=$(date +%s)
  set +e
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM=dumb bash -c "cd /work/origami && $cmd" >"$root/$name.log" 2>&1
  status=$?
  set -e
  local dt=$(( $(date +%s) - t ))
  tail -n 15 "$root/$name.log"
  echo "fresh_check: [$name] exit $status in ${dt} s ($((dt / 60)) min $((dt % 60)) s)"
  return $status
}

run_in_root quickstart "tools/quickstart.sh" || status=1
if [ $status -eq 0 ]; then
  # The trained run must have produced its metrics and export.
  for f in runs/tiny-moe/metrics.jsonl runs/tiny-moe/export/model.safetensors; do
    [ -s "$root/work/origami/$f" ] || { echo "fresh_check: quickstart did not write $f" >&2; status=1; }
  done
fi
run_in_root tests "tools/test.sh" || status=1
if [ $status -eq 0 ]; then
  echo "fresh_check: both README commands passed on a fresh Debian 12 root"
else
  echo "fresh_check: FAILED (the root is kept: $root/quickstart.log, $root/tests.log)" >&2
fi
exit $status
