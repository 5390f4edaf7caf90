"""Every environment variable megatron_deepep reads: one prefix, one parser, one table.

The bottom layer: imports nothing of the package. Other modules call `get(name)` with the name
without its prefix (`get("PDL")` reads `MDEEP_PDL`); nobody else reads `os.environ` for a knob.
The README's knob table is `markdown_table()` (a CPU test checks they agree).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, Optional

PREFIX = "MDEEP_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(name: str, text: str) -> bool:
    """The one boolean parser: 1/true/yes/on or 0/false/no/off, any case.

    Raises:
        ValueError: naming the variable, for anything else.
    """
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected one of {_TRUE + _FALSE}")


def _parse_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected an integer") from None


def _parse_float(name: str, text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number") from None


def _parse_str(name: str, text: str) -> str:
    return text.strip()


def _parse_int_list(name: str, text: str) -> tuple:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected comma-separated integers") from None


_PARSERS: Dict[str, Callable] = {"bool": parse_bool, "int": _parse_int, "float": _parse_float,
                                 "str": _parse_str, "ints": _parse_int_list}


@dataclasses.dataclass(frozen=True)
class Knob:
    """One environment variable.

    Attributes:
        name: without the prefix.
        kind: "bool", "int", "float", "str" or "ints" (comma-separated integers).
        default: the value when unset or empty (None: decided by the code that reads it).
        shown_default: the default as the README shows it.
        doc: what it does, for the README.
        group: "dispatcher" (the Megatron dispatcher's options), "transport" (read when a
            transport is built) or "jit" (kernel compilation and launch); the test harness's
            own knobs are "tests" (tests/helpers/knobs.py, not in this table).
    """

    name: str
    kind: str
    default: object
    shown_default: str
    doc: str
    group: str

    @property
    def env_name(self) -> str:
        return PREFIX + self.name


_TABLE = (
    # The Megatron dispatcher's options (`DeepEPOptions`; a config field or
    # `register_deepep_dispatcher(...)` keyword overrides them).
    Knob("TRANSPORT", "str", None, "auto",
         "`auto` (the EP = 1 kernels at EP = 1, NVLink kernels within a node, the internode "
         "kernels across nodes, the pure-torch reference without CUDA), `local`, `nvlink`, "
         "`internode` or `reference`", "dispatcher"),
    Knob("RANKS_PER_NODE", "int", None, "unset", "declares nodes of this many contiguous EP "
         "ranks (virtual nodes); unset: the ranks' host names", "dispatcher"),
    Knob("NUM_SMS", "int", None, "24", "SM budget of the communication kernels", "dispatcher"),
    Knob("NUM_MAX_TOKENS_PER_RANK", "int", None, "next power of two >= the first call, "
         ">= 4096", "most tokens one rank dispatches per call; the same on every rank (a "
         "Buffer a CUDA graph captured cannot grow: set it when token counts vary)",
         "dispatcher"),
    Knob("METRICS", "bool", None, "0", "per-layer communication and load metrics in Megatron's "
         "MoE tracker (TensorBoard / W&B)", "dispatcher"),
    Knob("METRICS_DIR", "str", None, "unset", "also write one JSON line per step and rank there "
         "(`python -m megatron_deepep.tools.report DIR`: the HTML report, and PNGs with "
         "matplotlib)", "dispatcher"),
    Knob("FP8_DISPATCH", "str", None, "off", "FP8 on the wire: `off`, `blockwise`, `mxfp8`, "
         "`auto` (TE's active recipe) or a format name", "dispatcher"),
    Knob("RANK_CAPACITY_FACTOR", "str", None, "unset", "sync-free dispatch: receive at most "
         "factor x tokens x top-k rows per rank (Megatron's `--moe-expert-rank-capacity-factor` "
         "wins where it exists); more is an error. The bound CUDA graphs around the dispatch "
         "need (`docs/cuda_graphs.md`)", "dispatcher"),
    Knob("EXPERT_MAP", "str", None, "unset", "a placement from `python -m "
         "megatron_deepep.tools.balance --json` (per layer, or one plan for every layer): the "
         "dispatcher routes logical experts to its physical slots", "dispatcher"),
    Knob("REPLAN", "int", None, "unset", "re-plan the placement from the recorded loads at each "
         "checkpoint save (a plan file in the iteration folder), with this many extra slots for "
         "copies of hot experts (0: none; a multiple of EP, at most E x (EP - 1)); a resume takes "
         "the plan of its checkpoint (an explicit `MDEEP_EXPERT_MAP` wins)", "dispatcher"),
    Knob("COMM_SHARE_WARN", "int", 20, "20", "warn once per layer and crossing when "
         "(dispatch + combine) time exceeds this percent of expert compute (metrics on; 0: "
         "off)", "dispatcher"),
    Knob("FP8_EXPERTS", "bool", False, "0", "`examples/pretrain_gpt_moe.py` builds its TE experts "
         "with `te_experts.with_fp8_experts`: FP8 rows into TE's grouped GEMM in training "
         "(`docs/fp8.md`)", "dispatcher"),
    Knob("FP8_COLUMNWISE", "str", "kernel", "kernel", "how the FP8 experts make the weight "
         "gradient's columnwise copy of their FP8 rows: `kernel` (one pass, FP8 in and out, "
         "`cuda_src/fp8_columnwise.cu`) or `dequantize` (bf16 rows, then TE's `split_quantize`)",
         "dispatcher"),
    Knob("GROUPED_MM_EXPERTS", "bool", False, "0", "`examples/pretrain_gpt_moe.py` swaps "
         "Megatron's `SequentialMLP` experts (a Python loop over the experts) for "
         "`megatron.grouped_experts.GroupedMMExperts` (two `torch._grouped_mm` calls); where "
         "`torch._grouped_mm` fails a one-call check it keeps `SequentialMLP` and logs why "
         "(`examples/configs/` proxies: on)", "dispatcher"),
    # Transports (read when one is built, so every rank of the EP group must agree).
    Knob("INTERNODE_STAGING", "str", "auto", "auto", "the internode transport's node staging: "
         "`full` (receive regions for every source rank's N_max tokens, ~N_max (4 M + L M + R) "
         "rows per rank), `ring` (L rings of `MDEEP_INTERNODE_RING_SLOTS` slots per rank, "
         "~4 M N_max + 2 L C rows; `docs/internode.md`, \"Ring staging\") or `auto`: full "
         "staging while its block fits `MDEEP_INTERNODE_STAGING_MAX_GB`, else ring staging, "
         "else ring staging with the network ring (K = 8)", "transport"),
    Knob("INTERNODE_STAGING_MAX_GB", "float", 4.0, "4", "with `MDEEP_INTERNODE_STAGING=auto`: "
         "the symmetric block per rank (GB, 1e9 bytes) a staging may take to be chosen",
         "transport"),
    Knob("INTERNODE_RING_SLOTS", "int", 512, "512", "slots C of each ring (one per pair of "
         "ranks of a node, each way) with `MDEEP_INTERNODE_STAGING=ring`", "transport"),
    Knob("INTERNODE_NET_RING_CHUNKS", "int", 0, "0", "the network ring (with "
         "`MDEEP_INTERNODE_STAGING=ring` or `auto`): K > 0 bounds the network regions to K "
         "chunks of 32 tokens per rail peer and region, ~4 M K 32 + 2 L C rows per rank "
         "(`docs/internode.md`, \"Network ring\"); 0: N_max tokens per node (off; `auto` may "
         "still pick K = 8)", "transport"),
    Knob("SHARED_GPU", "bool", False, "0", "declares that ranks of one host share a GPU "
         "(testing several ranks on one GPU); unset, a kernel transport warns naming the "
         "ranks of a host that share one (a job that forgot `torch.cuda.set_device`)",
         "transport"),
    # Kernel compilation and launch.
    Knob("CACHE_DIR", "str", None, "`~/.cache/megatron_deepep`", "compiled-kernel cache; keyed "
         "by source and included headers, options, arch and NVRTC version. Its folder and "
         "entries are used only when owned by a trusted owner and writable by nobody else "
         "(`MDEEP_CACHE_TRUST`); a new folder is made 0700", "jit"),
    Knob("CACHE_TRUST", "str", None, "unset", "whose kernel cache files are used; unset: the "
         "current user's alone (entries written 0600). A shared cache is this explicit choice: "
         "`user:NAME` (or `user:UID`): also what that account wrote (entries 0644, e.g. filled "
         "by `python -m megatron_deepep.tools.precompile`); `group:NAME` (or `group:GID`): "
         "what members of that group wrote, in a folder of that group writable by no one "
         "else (entries 0640, new folders 2770). An untrusted folder or entry is ignored with one "
         "warning and the kernel compiled again", "jit"),
    Knob("ARCH", "str", None, "the current GPU", "NVRTC target, e.g. `sm_90`", "jit"),
    Knob("JIT_DEBUG", "bool", False, "0", "log every compile with its options and NVRTC log",
         "jit"),
    Knob("JIT_LINEINFO", "bool", False, "0", "compile with `-lineinfo` (profilers)", "jit"),
    Knob("JIT_NO_CACHE", "bool", False, "0", "always recompile", "jit"),
    Knob("PDL", "bool", True, "1", "programmatic dependent launch: the EP = 1 expand starts "
         "while the layout kernel ends (`0`: after it)", "jit"),
)

KNOBS: Dict[str, Knob] = {knob.name: knob for knob in _TABLE}


def get(name: str, default: Optional[object] = None):
    """The parsed value of `MDEEP_<name>`, else `default`, else the table's default.

    Raises:
        KeyError: `name` is not in the table (every knob must be).
        ValueError: the variable does not parse (the message names it).
    """
    return read(KNOBS[name], default)


def read(knob: Knob, default: Optional[object] = None):
    """The parsed value of `knob`'s variable, else `default`, else the knob's default (the test
    harness reads its own `MDEEP_TEST_*` knobs through this, outside the users' table)."""
    text = os.environ.get(knob.env_name, "")
    if text.strip() == "":
        return knob.default if default is None else default
    return _PARSERS[knob.kind](knob.env_name, text)


def markdown_table() -> str:
    """The README's knob table: variable, default, what it does."""
    lines = ["| variable | default | what it does |", "|---|---|---|"]
    for knob in _TABLE:
        lines.append(f"| `{knob.env_name}` | {knob.shown_default} | {knob.doc} |")
    return "\n".join(lines)
