"""`python scripts/multinode_check.py ...` from a checkout: the multi-node check (correctness
against the reference, then GB/s per NIC), the same command as `python -m
megatron_deepep.multinode_check` (its docstring and `--help` say how to launch it)."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "megatron_deepep")) and _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)  # run from a checkout: its megatron_deepep, installed or not

from megatron_deepep.multinode_check import main  # noqa: E402  (after the path above)

if __name__ == "__main__":
    sys.exit(main())
