# The GPU scripts' shared preamble (sourced by every dev/gpu/gpu_*.sh).
#
# WHEELS_DIR (default: the repository's ignored .whl/): the wheels a bare GPU machine lacks (the
#   megatron-core 0.19.2 wheel; for the TE scripts the Transformer Engine 2.20.2 wheel set built
#   for that machine). SITE_DIR (default: a new folder from mktemp): where they are installed.
# install_wheels NAME: every wheel of WHEELS_DIR into SITE_DIR in ONE pip command (one at a time
#   with --target silently drops TE's extension .so); puts SITE_DIR and the repository on
#   PYTHONPATH. On failure it says so as "NAME: FAIL ..." and returns 2.
# install_wheels_if_any NAME: the same when WHEELS_DIR holds wheels, else nothing.
# print_versions NAME: one line "NAME: torch ... cuda ... | megatron-core ... | TE ..." (the GPU
#   and driver first); what failed to import is named with its error.

WHEELS_DIR=${WHEELS_DIR:-.whl}
SITE_DIR=${SITE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/mdeep-site.XXXXXX")}

install_wheels() {
  local name=$1 start
  start=$(date +%s)
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE_DIR" "$WHEELS_DIR"/*.whl; then
    echo "$name: FAIL pip could not install $WHEELS_DIR/*.whl into $SITE_DIR"
    return 2
  fi
  export PYTHONPATH=$SITE_DIR:$PWD
  echo "$name: wheels installed in $(( $(date +%s) - start )) s"
}

install_wheels_if_any() {
  if ls "$WHEELS_DIR"/*.whl >/dev/null 2>&1; then
    install_wheels "$1" || return 2
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
}

print_versions() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 - "$1" <<'PY'
import sys
import warnings

warnings.filterwarnings("ignore")
import torch

line = f"torch {torch.__version__} cuda {torch.version.cuda}"
try:
    import megatron.core
    line += f" | megatron-core {megatron.core.__version__}"
except Exception as exc:  # the tests that need it skip and say why
    line += f" | megatron-core import FAILED ({type(exc).__name__}: {str(exc)[:120]})"
try:
    import transformer_engine
    import transformer_engine.pytorch as te
    available = te.is_fp8_block_scaling_available(return_reason=True)
    line += f" | TE {transformer_engine.__version__} block scaling {available}"
except Exception as exc:  # the TE cases skip (or table B's rows say why)
    line += f" | TE import FAILED ({type(exc).__name__}: {str(exc)[:120]})"
print(f"{sys.argv[1]}:", line)
PY
}
