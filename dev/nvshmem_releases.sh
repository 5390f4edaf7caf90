#!/usr/bin/env bash
# The NVSHMEM link tests (tests/kernels/test_nvshmem_link.py) against each NVSHMEM release, on a
# CPU machine, in the current Python environment (the package with its jit and test extras):
#   bash dev/nvshmem_releases.sh                          # every tested release
#   VERSIONS="3.4.5 3.8.0" bash dev/nvshmem_releases.sh   # some (CI: the oldest and newest)
#   DRY_RUN=1 bash dev/nvshmem_releases.sh                # the plan; runs nothing
# VERSIONS: default megatron_deepep.kernels.nvshmem_link.TESTED_NVSHMEM; a new release is tried
#   by naming it here (docs/internode.md, "New NVSHMEM or torch releases").
# WHEELS (default .whl/nvshmem, ignored): the nvidia-nvshmem-cu13 wheels, each downloaded once
#   (pip download --no-deps) and unpacked once into WHEELS/<version>/, which goes first on
#   PYTHONPATH: the link then finds that release's headers and device library before the
#   installed one (checked before its tests run). PYTHON (default python3): the interpreter.
# One line per release (its pytest counts), then the summary; exit 1 if any release failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl/nvshmem}
if [ -z "${VERSIONS:-}" ]; then
  VERSIONS=$(PYTHONPATH=$PWD "$PYTHON" -c "from megatron_deepep.kernels.nvshmem_link import \
TESTED_NVSHMEM; print(' '.join(TESTED_NVSHMEM))") || { echo "releases: no VERSIONS"; exit 2; }
fi
TESTS=(tests/kernels/test_nvshmem_link.py)
SUMMARY=()
FAILED=0
for version in $VERSIONS; do
  dir="$WHEELS/$version"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    echo "dry run: $version: pip download --no-deps --only-binary=:all:" \
      "nvidia-nvshmem-cu13==$version -d $WHEELS (unless there); unzip into $dir;" \
      "PYTHONPATH=$dir:$PWD $PYTHON -m pytest -q ${TESTS[*]}"
    continue
  fi
  start=$SECONDS
  mkdir -p "$WHEELS"
  wheel=$(ls "$WHEELS"/nvidia_nvshmem_cu13-"$version"-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: \
      "nvidia-nvshmem-cu13==$version" -d "$WHEELS" || true
    wheel=$(ls "$WHEELS"/nvidia_nvshmem_cu13-"$version"-*.whl 2>/dev/null | head -n 1)
  fi
  if [ -z "$wheel" ]; then
    SUMMARY+=("nvshmem $version: FAIL no wheel (pip download nvidia-nvshmem-cu13==$version)")
    FAILED=1
    continue
  fi
  if [ ! -f "$dir/nvidia/nvshmem/lib/libnvshmem_device.a" ]; then
    rm -rf "$dir" && mkdir -p "$dir" && "$PYTHON" -m zipfile -e "$wheel" "$dir" || {
      SUMMARY+=("nvshmem $version: FAIL could not unpack $wheel"); FAILED=1; continue; }
  fi
  found=$(PYTHONPATH=$dir:$PWD "$PYTHON" -c "from megatron_deepep.kernels import nvshmem_link \
as n; print(n.version_text(n.nvshmem_version()), n.nvshmem_paths().device_library)" 2>&1)
  if [ "${found%% *}" != "$version" ]; then
    SUMMARY+=("nvshmem $version: FAIL the link would use another NVSHMEM: $found")
    FAILED=1
    continue
  fi
  echo "=== nvshmem $version: $found"
  log=$(mktemp "${TMPDIR:-/tmp}/mdeep-nvshmem-$version.XXXXXX")
  PYTHONPATH=$dir:$PWD "$PYTHON" -m pytest -q -rs -p no:cacheprovider "${TESTS[@]}" 2>&1 \
    | tee "$log"
  rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || FAILED=1
  SUMMARY+=("nvshmem $version: rc $rc in $((SECONDS - start)) s: $(grep -E \
    "passed|failed|error" "$log" | tail -n 1)")
  rm -f "$log"
done
[ "${DRY_RUN:-0}" = 1 ] && exit 0
printf '%s\n' "releases: summary" "${SUMMARY[@]}"
exit "$FAILED"
