#!/usr/bin/env bash
# The internode tier (tests/gpu/test_internode_gpu.py) at 2x1 and 2x2 virtual nodes with an
# NVSHMEM newer than the image's, carried into the call as the few files of its wheel that the
# link and the host runtime need; and the same with the image's NVSHMEM, to show nothing else
# changed.
#   bash dev/gpu/nvshmem_newest.sh prepare WHEEL   # here (network, no GPU): packs the subset
#   bash dev/gpu/nvshmem_newest.sh run [TARBALL]   # on the GPU machine, carrying .nvshmem/
#   DRY_RUN=1 bash dev/gpu/nvshmem_newest.sh run   # the plan (every command); runs nothing
# prepare: from the nvidia-nvshmem-cu13 WHEEL, .nvshmem/nvshmem-VERSION.tar.xz (ignored) with
#   include/ (NVRTC compiles the kernels against it), lib/libnvshmem_device.a (nvJitLink links
#   them), lib/libnvshmem_host.so.3 (bootstrap, heap, nvshmemx_cumodule_init: torch loads it),
#   lib/nvshmem_bootstrap_uid.so.3 (torch starts NVSHMEM with a unique id; the host library
#   opens it beside itself) and the dist-info; then the sizes against the 64 MiB carry limit
#   (this tarball plus the checkout's tracked and untracked files).
# run: pieces (PIECES, default "newest image"), each under its limit, never past BUDGET (570 s):
#   newest  the tarball unpacked to a temporary folder, first on PYTHONPATH (headers, device
#           library) and its host library in LD_PRELOAD (torch's libtorch_nvshmem.so finds
#           libnvshmem_host.so.3 by RPATH, which LD_LIBRARY_PATH does not override; a preloaded
#           library of that soname does); a check that the device library and the host library
#           in the process are both the tarball's release; then the tier
#   image   the tier with the image's NVSHMEM
# The tier: MDEEP_TEST_NODES=2x1,2x2, MDEEP_TEST_CALLS=$CALLS (default 30), every test of the
# file but the 3x2 shapes; NVSHMEM_REMOTE_TRANSPORT=none in both (all PEs on one host: P2P).
# Logs and one summary line per piece go to $OUT (default .bench_out/nvshmem_newest); exit 1
# if a piece failed.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 2
CARRY=${CARRY:-.nvshmem}  # where prepare writes and run looks (carry it)
LIMIT_MIB=64

usage() {
  echo "usage: bash dev/gpu/nvshmem_newest.sh prepare WHEEL | run [TARBALL]"
  exit 2
}

# Files of the wheel the device needs, relative to its root.
SUBSET=(nvidia/nvshmem/include nvidia/nvshmem/lib/libnvshmem_device.a
        nvidia/nvshmem/lib/libnvshmem_host.so.3 nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3)

prepare() {
  local wheel=$1 version dir tarball tree
  [ -f "$wheel" ] || usage
  version=$(basename "$wheel" | cut -d- -f2)
  dir=$(mktemp -d "${TMPDIR:-/tmp}/mdeep-nvshmem.XXXXXX")
  python3 -m zipfile -e "$wheel" "$dir" || exit 2
  tarball=$CARRY/nvshmem-$version.tar.xz
  mkdir -p "$CARRY"
  echo "prepare: $version, the subset (bytes, unpacked):"
  (cd "$dir" && du -sb "${SUBSET[@]}" nvidia_nvshmem_cu13-"$version".dist-info) || exit 2
  (cd "$dir" && tar -cf - "${SUBSET[@]}" nvidia_nvshmem_cu13-"$version".dist-info) \
    | xz -6 -T0 > "$tarball" || exit 2
  rm -rf "$dir"
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -n 1 \
    | cut -f1)
  python3 - "$tarball" "$tree" "$LIMIT_MIB" <<'PY'
import os
import sys

tarball, tree, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
size = os.path.getsize(tarball)
mib = lambda n: n / (1 << 20)
print(f"prepare: {tarball} {mib(size):.1f} MiB + checkout {mib(tree):.1f} MiB = "
      f"{mib(size + tree):.1f} MiB of the {limit} MiB carry limit"
      + ("" if size + tree <= limit << 20 else ": OVER THE LIMIT"))
PY
  echo "prepare: carry [\"$CARRY\"]; on the GPU: bash dev/gpu/nvshmem_newest.sh run $tarball"
}

[ $# -ge 1 ] || usage
case $1 in
  prepare) [ $# -eq 2 ] || usage; prepare "$2"; exit $? ;;
  run) [ $# -le 2 ] || usage ;;
  *) usage ;;
esac
TARBALL=${2:-$(ls "$CARRY"/nvshmem-*.tar.xz 2>/dev/null | sort -V | tail -n 1)}
VERSION=$(basename "${TARBALL:-nvshmem-NEWEST.tar.xz}" .tar.xz)
VERSION=${VERSION#nvshmem-}
LOGS=${OUT:-.bench_out/nvshmem_newest}
BUDGET_S=${BUDGET:-570}
PIECES=${PIECES:-newest image}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NVSHMEM_REMOTE_TRANSPORT=none PYTHONUNBUFFERED=1
TIER=(env MDEEP_TEST_NODES=2x1,2x2 MDEEP_TEST_CALLS="${CALLS:-30}" python3 -m pytest -m gpu -q
      -rs --durations=5 tests/gpu/test_internode_gpu.py -k "not 3x2")
# The device library and the process's host library: both must be VERSION.
CHECK=(python3 -c "import torch; from megatron_deepep.kernels import nvshmem_link as n; \
d = n.version_text(n.nvshmem_version()); h = n.check_host_library(); \
h = h and n.version_text(h); print('torch', torch.__version__, 'device library', d, \
n.nvshmem_paths().device_library, 'host library', h, n._loaded_host_library()); \
assert d == h == '$VERSION', 'expected both at $VERSION'")
SUMMARY=()
FAILED=0
mkdir -p "$LOGS"
source dev/gpu/time_limit.sh  # run LIMIT LOG command...
if [ "${DRY_RUN:-0}" != 1 ]; then
  [ -n "${TARBALL:-}" ] || [[ " $PIECES " != *" newest "* ]] || {
    echo "nvshmem_newest: no $CARRY/nvshmem-*.tar.xz (prepare it, carry $CARRY)"; exit 2; }
  source dev/gpu/wheels.sh
  print_versions nvshmem_newest | tee "$LOGS/versions.txt"
  python3 -c "import importlib.metadata as m; print('image NVSHMEM', \
m.version('nvidia-nvshmem-cu13'))" | tee -a "$LOGS/versions.txt"
fi

# piece NAME LIMIT command...: under time_limit.sh's `run`; its counts line into the summary.
piece() {
  local name=$1 limit=$2 rc log="$LOGS/$1.log"
  shift 2
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "dry run: $name (limit $limit s): $(printf '%q ' "$@")"
    return 0
  fi
  run "$limit" "$log" "$@" > /dev/null
  rc=$?
  # A tier whose tests all skipped (no GPU, NVSHMEM unavailable) proved nothing.
  if [ "$rc" -eq 0 ] && [[ $name == tier-* ]] && ! grep -qE "[0-9]+ passed" "$log"; then
    rc=1
  fi
  [ "$rc" -eq 0 ] || FAILED=1
  SUMMARY+=("$name: rc $rc: $(grep -E "passed|failed|error|skipped|host library|Error" "$log" \
    | tail -n 1 | cut -c1-200)")
  return $rc
}

for name in $PIECES; do
  case $name in
    newest)
      if [ "${DRY_RUN:-0}" = 1 ]; then dir=${NVSHMEM_DIR:-/tmp/mdeep-nvshmem-$VERSION.XXXXXX}
      else dir=${NVSHMEM_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/mdeep-nvshmem-$VERSION.XXXXXX")}; fi
      piece unpack 60 python3 -c "import sys, tarfile; \
tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
        "${TARBALL:-$CARRY/nvshmem-NEWEST.tar.xz}" "$dir" || continue
      lib=$dir/nvidia/nvshmem/lib/libnvshmem_host.so.3
      newest=(env PYTHONPATH="$dir:$PWD" LD_PRELOAD="$lib"
              MDEEP_CACHE_DIR="$PWD/.bench_out/nvshmem_newest_cache/$VERSION")
      piece "check-$VERSION" 60 "${newest[@]}" "${CHECK[@]}" || continue
      piece "tier-$VERSION" 300 "${newest[@]}" "${TIER[@]}" ;;
    image)
      piece tier-image 300 env PYTHONPATH="$PWD" "${TIER[@]}" ;;
    *) echo "nvshmem_newest: unknown piece '$name'"; exit 2 ;;
  esac
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
printf '%s\n' "nvshmem_newest: summary ($SECONDS s)" "${SUMMARY[@]}" | tee "$LOGS/summary.txt"
exit "$FAILED"
