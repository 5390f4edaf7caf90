"""Megatron's `alltoall` dispatcher as a baseline, with and without TE's fused permute.

Megatron-core permutes tokens around its all-to-all with `moe_utils.permute` / `unpermute` /
`sort_chunks_by_idxs`. With `TransformerConfig.moe_permute_fusion=True` each of them calls
Transformer Engine's fused kernel instead (`fused_permute`, `fused_permute_with_probs`,
`fused_unpermute`, `fused_sort_chunks_by_index[_with_probs]`, imported by `moe_utils` from
`megatron.core.extensions.transformer_engine`), and the dispatcher keeps its sort indices on the
GPU (`permute_idx_device`), so one host sync point fewer. The config refuses the flag when any
of the five is missing ("fused permutation is not available. Please install TE >= 2.1.0."). A
fair comparison runs both: the benches and the main-job comparison show one row each, and the
fused row is a labelled skip with this module's reason where it cannot run.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

#: Run name -> (table label, `moe_permute_fusion`). The names are what `--dispatchers` /
#: `DISPATCHER` take; both build Megatron's `alltoall` dispatcher.
ALLTOALL_RUNS: Dict[str, Tuple[str, bool]] = {
    "alltoall-fused": ("alltoall (fused permute)", True),
    "alltoall": ("alltoall (unfused)", False),
}

#: The `moe_utils` names `TransformerConfig` checks before it accepts `moe_permute_fusion=True`.
FUSED_PERMUTE_NAMES = ("fused_permute", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                       "fused_sort_chunks_by_index_with_probs", "fused_unpermute")


def label(fused: bool) -> str:
    """The table label of the alltoall row with (`fused`) or without TE's fused permute."""
    return ALLTOALL_RUNS["alltoall-fused" if fused else "alltoall"][0]


def split_run(name: str) -> Tuple[str, bool]:
    """`(moe_token_dispatcher_type, moe_permute_fusion)` of a run name: "alltoall-fused" is
    `("alltoall", True)`; any other name is itself, unfused."""
    if name in ALLTOALL_RUNS:
        return "alltoall", ALLTOALL_RUNS[name][1]
    return name, False


def permute_fusion_reason(device: str = "cuda") -> str:
    """Why `moe_permute_fusion=True` cannot run here ("" when it can).

    Args:
        device: "cuda" or "cpu": where the layer would run (TE's permute kernels are GPU-only).

    Returns:
        One line naming what is missing: no GPU, Transformer Engine not importable, or the
        fused functions megatron-core looks for absent (TE older than 2.1).
    """
    if device != "cuda":
        return ("Transformer Engine's fused permute (moe_permute_fusion=True) runs on a GPU "
                "only; this run is on the CPU")
    from megatron_deepep.fp8 import te_bridge

    ok, reason = te_bridge.te_available()
    if not ok:
        return f"moe_permute_fusion=True needs Transformer Engine: {reason}"
    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception as exc:  # megatron-core missing or broken: the row says so
        return f"megatron-core is not importable ({type(exc).__name__}: {exc})"
    missing = missing_fused_functions(vars(moe_utils))
    if missing:
        return (f"megatron-core's moe_utils has no {', '.join(missing)} (Transformer Engine "
                f"{'.'.join(map(str, te_bridge.te_version()))} imports; TE >= 2.1 provides "
                f"them)")
    return ""


def missing_fused_functions(namespace: dict) -> List[str]:
    """The names of `FUSED_PERMUTE_NAMES` absent or None in `namespace` (`vars(moe_utils)`)."""
    return [name for name in FUSED_PERMUTE_NAMES if namespace.get(name) is None]
