# The GPU scripts' shared preamble (sourced by scripts/gpu_te.sh, gpu_layer.sh, gpu_graphs.sh).
#
# install_wheels NAME: every wheel of the repository's ignored .whl/ (the megatron-core 0.19.2
#   wheel, the TE 2.20.2 set of ../shared/wheels/te-2.20.2-cp312-sm90/) into /tmp/site in ONE pip
#   command (one at a time with --target silently drops TE's extension .so); puts /tmp/site and
#   the repository on PYTHONPATH. On failure it says so as "NAME: FAIL ..." and returns 2.
# print_versions NAME: one line "NAME: torch ... cuda ... | megatron-core ... | TE ..." (the GPU
#   and driver first); what failed to import is named with its error.

install_wheels() {
  local name=$1 start
  start=$(date +%s)
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl; then
    echo "$name: FAIL pip could not install .whl/*.whl into /tmp/site"
    return 2
  fi
  export PYTHONPATH=/tmp/site:$PWD
  echo "$name: wheels installed in $(( $(date +%s) - start )) s"
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
