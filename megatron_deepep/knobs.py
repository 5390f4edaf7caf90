"""Every environment variable megatron_deepep reads: one prefix, one parser, one table.

The bottom layer: imports nothing of the package. Other modules call `get(name)` with the name
without its prefix (`get("PDL")` reads `MDEEP_PDL`); nobody else reads `os.environ` for a knob.
Each knob declares its valid values (choices, bounds, a pattern), so a bad value is a
`ValueError` naming the variable wherever it is read, and `check_environment()` (run when a
Buffer or the Megatron dispatcher is built) checks every `MDEEP_*` variable that is set, read
there or not. The README's knob table is `markdown_table()` (a CPU test checks they agree).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import re
from typing import Callable, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

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
        read_by: who reads it, for the README: "dispatcher" (the Megatron dispatcher: the
            runtime plugin or a patched fork), "Buffer" (`Buffer` / `get_buffer`, so also the
            dispatcher and the tools, which build one), "kernels" (every kernel compile and
            launch), "kernels, once per process" (the first launch that needs it) or the tools
            and examples that read it.
        choices: the values a "str" knob takes (empty: any).
        low: the smallest value of a number (None: no bound).
        low_open: `low` itself is excluded (a number > low).
        high: the largest value of a number (None: no bound).
        pattern: a regular expression a "str" value must match in full (None: any).
        form: the values `pattern` takes, in words (for its error message).
        is_file: a "str" value names a file that must be readable.
    """

    name: str
    kind: str
    default: object
    shown_default: str
    doc: str
    group: str
    read_by: str = ""
    choices: Tuple[str, ...] = ()
    low: Optional[float] = None
    low_open: bool = False
    high: Optional[float] = None
    pattern: Optional[str] = None
    form: str = ""
    is_file: bool = False

    @property
    def env_name(self) -> str:
        return PREFIX + self.name

    def check(self, text: str, value):
        """`value` (parsed from `text`) if this knob takes it.

        Raises:
            ValueError: naming the variable, the value and what it takes.
        """
        where = f"{self.env_name}={text!r}"
        if self.choices and value not in self.choices:
            close = difflib.get_close_matches(str(value), self.choices, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: expected one of {', '.join(self.choices)}{hint}")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise ValueError(f"{where}: expected {self.form or self.pattern}")
        if self.is_file:
            try:
                with open(value, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"{where}: cannot read that file ({exc.strerror})") from None
        if self.kind in ("int", "float"):
            too_low = self.low is not None and (value <= self.low if self.low_open
                                                 else value < self.low)
            too_high = self.high is not None and value > self.high
            if too_low or too_high or (self.kind == "float" and not math.isfinite(value)):
                raise ValueError(f"{where}: expected {self.range_text()}")
        return value

    def range_text(self) -> str:
        """The numbers this knob takes, in words ("an integer >= 1")."""
        noun = "an integer" if self.kind == "int" else "a finite number"
        if self.low is not None and self.high is not None and not self.low_open:
            return f"{noun} in [{_number(self.low)}, {_number(self.high)}]"
        bounds = []
        if self.low is not None:
            bounds.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            bounds.append(f"<= {_number(self.high)}")
        return f"{noun} {' and '.join(bounds)}".strip()



def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


_BUFFER = "Buffer"
_DISPATCHER = "dispatcher"
_KERNELS = "kernels"
_KERNELS_ONCE = "kernels, once per process"
_EXAMPLE = "`examples/pretrain_gpt_moe.py`, `examples/compare_dispatchers.py`"

#: FP8_DISPATCH's values: `megatron_deepep.fp8.dispatch.FLAG_NAMES` and the format names of
#: `megatron_deepep.fp8.FORMATS` (a CPU test checks they agree; this layer imports neither).
FP8_DISPATCH_VALUES = ("off", "blockwise", "mxfp8", "auto", "blockwise_1x128",
                       "blockwise_1x128_fp32_scales", "mxfp8_1x32")

#: The transports (`megatron_deepep.transport`), listed here alone: the bottom layer checks
#: MDEEP_TRANSPORT, and the transport package and the dispatcher's option take this list.
TRANSPORT_NAMES = ("auto", "local", "nvlink", "internode", "reference")

_TABLE = (
    # The Megatron dispatcher's options (`DeepEPOptions`; a config field or
    # `register_deepep_dispatcher(...)` keyword overrides them).
    Knob("TRANSPORT", "str", None, "auto",
         "`auto` (the EP = 1 kernels at EP = 1, NVLink kernels within a node, the internode "
         "kernels across nodes, the pure-torch reference without CUDA), `local`, `nvlink`, "
         "`internode` or `reference`", "dispatcher",
         read_by=_BUFFER, choices=TRANSPORT_NAMES),
    Knob("RANKS_PER_NODE", "int", None, "unset", "declares nodes of this many contiguous EP "
         "ranks (virtual nodes); unset: the ranks' host names", "dispatcher",
         read_by=_BUFFER, low=1),
    Knob("NUM_SMS", "int", None, "24", "SM budget of the communication kernels", "dispatcher",
         read_by=_BUFFER, low=1),
    Knob("NUM_MAX_TOKENS_PER_RANK", "int", None, "next power of two >= the first call, "
         ">= 4096", "most tokens one rank dispatches per call; the same on every rank (a "
         "Buffer a CUDA graph captured cannot grow: set it when token counts vary)",
         "dispatcher", read_by=_DISPATCHER, low=1),
    Knob("METRICS", "bool", None, "0", "per-layer communication and load metrics in Megatron's "
         "MoE tracker (TensorBoard / W&B)", "dispatcher", read_by=_DISPATCHER),
    Knob("METRICS_DIR", "str", None, "unset", "also write one JSON line per step and rank there "
         "(`python -m megatron_deepep.tools.report DIR`: the HTML report, and PNGs with "
         "matplotlib)", "dispatcher", read_by=_DISPATCHER),
    Knob("FP8_DISPATCH", "str", None, "off", "FP8 on the wire: `off`, `blockwise`, `mxfp8`, "
         "`auto` (TE's active recipe) or a format name", "dispatcher",
         read_by=_DISPATCHER, choices=FP8_DISPATCH_VALUES),
    Knob("RANK_CAPACITY_FACTOR", "float", None, "unset", "sync-free dispatch: receive at most "
         "factor x tokens x top-k rows per rank (Megatron's `--moe-expert-rank-capacity-factor` "
         "wins where it exists); more is an error. The bound CUDA graphs around the dispatch "
         "need (`docs/cuda_graphs.md`)", "dispatcher", read_by=_DISPATCHER, low=0, low_open=True),
    Knob("EXPERT_MAP", "str", None, "unset", "a placement from `python -m "
         "megatron_deepep.tools.balance --json` (per layer, or one plan for every layer): the "
         "dispatcher routes logical experts to its physical slots", "dispatcher",
         read_by=_DISPATCHER, is_file=True),
    Knob("REPLAN", "int", None, "unset", "re-plan the placement from the recorded loads at each "
         "checkpoint save (a plan file in the iteration folder), with this many extra slots for "
         "copies of hot experts (0: none; a multiple of EP, at most E x (EP - 1)); a resume takes "
         "the plan of its checkpoint (an explicit `MDEEP_EXPERT_MAP` wins)", "dispatcher",
         read_by=_DISPATCHER, low=0),
    Knob("COMM_SHARE_WARN", "int", 20, "20", "warn once per layer and crossing when "
         "(dispatch + combine) time exceeds this percent of expert compute (metrics on; 0: "
         "off)", "dispatcher", read_by=_DISPATCHER + ", `tools.report`", low=0),
    Knob("FP8_EXPERTS", "bool", False, "0", "`examples/pretrain_gpt_moe.py` builds its TE experts "
         "with `te_experts.with_fp8_experts`: FP8 rows into TE's grouped GEMM in training "
         "(`docs/fp8.md`)", "dispatcher", read_by="`examples/pretrain_gpt_moe.py`"),
    Knob("FP8_COLUMNWISE", "str", "kernel", "kernel", "how the FP8 experts make the weight "
         "gradient's columnwise copy of their FP8 rows: `kernel` (one pass, FP8 in and out, "
         "`cuda_src/fp8_columnwise.cu`) or `dequantize` (bf16 rows, then TE's `split_quantize`)",
         "dispatcher", read_by=_DISPATCHER, choices=("kernel", "dequantize")),
    Knob("GROUPED_MM_EXPERTS", "bool", False, "0", "`examples/pretrain_gpt_moe.py` swaps "
         "Megatron's `SequentialMLP` experts (a Python loop over the experts) for "
         "`megatron.grouped_experts.GroupedMMExperts` (two `torch._grouped_mm` calls); where "
         "`torch._grouped_mm` fails a one-call check it keeps `SequentialMLP` and logs why "
         "(`examples/configs/` proxies: on)", "dispatcher", read_by=_EXAMPLE),
    # Transports (read when one is built, so every rank of the EP group must agree).
    Knob("INTERNODE_STAGING", "str", "auto", "auto", "the internode transport's node staging: "
         "`full` (receive regions for every source rank's N_max tokens, ~N_max (4 M + L M + R) "
         "rows per rank), `ring` (L rings of `MDEEP_INTERNODE_RING_SLOTS` slots per rank, "
         "~4 M N_max + 2 L C rows; `docs/internode.md`, \"Ring staging\") or `auto`: full "
         "staging while its block fits `MDEEP_INTERNODE_STAGING_MAX_GB`, else ring staging, "
         "else ring staging with the network ring (K = 8)", "transport",
         read_by=_BUFFER, choices=("full", "ring", "auto")),
    Knob("INTERNODE_STAGING_MAX_GB", "float", 4.0, "4", "with `MDEEP_INTERNODE_STAGING=auto`: "
         "the symmetric block per rank (GB, 1e9 bytes) a staging may take to be chosen",
         "transport", read_by=_BUFFER, low=0, low_open=True),
    Knob("INTERNODE_RING_SLOTS", "int", 512, "512", "slots C of each ring (one per pair of "
         "ranks of a node, each way) with `MDEEP_INTERNODE_STAGING=ring`", "transport",
         read_by=_BUFFER, low=1, high=2**20),
    Knob("INTERNODE_NET_RING_CHUNKS", "int", 0, "0", "the network ring (with "
         "`MDEEP_INTERNODE_STAGING=ring` or `auto`): K > 0 bounds the network regions to K "
         "chunks of 32 tokens per rail peer and region, ~4 M K 32 + 2 L C rows per rank "
         "(`docs/internode.md`, \"Network ring\"); 0: N_max tokens per node (off; `auto` may "
         "still pick K = 8)", "transport", read_by=_BUFFER, low=0, high=4096),
    Knob("NVLINK_KERNELS", "str", "auto", "auto", "the NVLink transport's kernels: `fused` "
         "(one launch per dispatch and per combine, senders and receivers at once, per-slot "
         "flags), `split` (a send kernel, then a receive kernel after a barrier over every "
         "peer) or `auto`: the fused dispatch of bf16 rows, the split FP8 dispatch and combine, "
         "the faster of each on an H100 under MPS (`benchmarks/h100_2026-12-07_mps.md`)",
         "transport", read_by=_BUFFER, choices=("auto", "fused", "split")),
    Knob("SHARED_GPU", "bool", False, "0", "declares that ranks of one host share a GPU "
         "(testing several ranks on one GPU); unset, a kernel transport warns naming the "
         "ranks of a host that share one (a job that forgot `torch.cuda.set_device`)",
         "transport", read_by=_BUFFER),
    # Kernel compilation and launch.
    Knob("CACHE_DIR", "str", None, "`~/.cache/megatron_deepep`", "compiled-kernel cache; keyed "
         "by source and included headers, options, arch and NVRTC version. Its folder and "
         "entries are used only when owned by a trusted owner and writable by nobody else "
         "(`MDEEP_CACHE_TRUST`); a new folder is made 0700", "jit", read_by=_KERNELS),
    Knob("CACHE_TRUST", "str", None, "unset", "whose kernel cache files are used; unset: the "
         "current user's alone (entries written 0600). A shared cache is this explicit choice: "
         "`user:NAME` (or `user:UID`): also what that account wrote (entries 0644, e.g. filled "
         "by `python -m megatron_deepep.tools.precompile`); `group:NAME` (or `group:GID`): "
         "what members of that group wrote, in a folder of that group writable by no one "
         "else (entries 0640, new folders 2770). An untrusted folder or entry is ignored with one "
         "warning and the kernel compiled again", "jit",
         read_by=_KERNELS, pattern=r"(user|group):[^:]+",
         form="user:NAME, user:UID, group:NAME or group:GID"),
    Knob("ARCH", "str", None, "the current GPU", "NVRTC target, e.g. `sm_90`", "jit",
         read_by=_KERNELS, pattern=r"sm_[0-9]+[af]?",
         form="an NVRTC target such as sm_90"),
    Knob("JIT_DEBUG", "bool", False, "0", "log every compile with its options and NVRTC log",
         "jit", read_by=_KERNELS),
    Knob("JIT_LINEINFO", "bool", False, "0", "compile with `-lineinfo` (profilers)", "jit",
         read_by=_KERNELS),
    Knob("JIT_NO_CACHE", "bool", False, "0", "always recompile", "jit", read_by=_KERNELS),
    # 48: a model, each path's µs as max(a / SMs, its HBM floor) fitted to the two budgets
    # measured (benchmarks/h100_2026-12-06_fp8.md, round 7: 24 and 132 SMs), puts the crossover
    # at 44-46 SMs; the register path's knee is 39, the row stage's 49-51.
    Knob("FP8_ROW_STAGE_MIN_SMS", "int", 48, "48", "the quantizing EP = 1 FP8 expand stages "
         "each row in shared memory from this SM budget up (HBM the limit) and quantizes in "
         "registers below it (each SM's load/store path the limit); `0`: the row stage at "
         "every budget", "jit", read_by=_KERNELS_ONCE, low=0),
    Knob("PDL", "bool", True, "1", "programmatic dependent launch: the EP = 1 expand starts "
         "while the layout kernel ends (`0`: after it)", "jit", read_by=_KERNELS_ONCE),
)

KNOBS: Dict[str, Knob] = {knob.name: knob for knob in _TABLE}


def get(name: str, default: Optional[object] = None):
    """The parsed value of `MDEEP_<name>`, else `default`, else the table's default.

    Raises:
        KeyError: `name` is not in the table (every knob must be).
        ValueError: the variable does not parse or is out of its range (the message names it).
    """
    return read(KNOBS[name], default)


def read(knob: Knob, default: Optional[object] = None):
    """The parsed value of `knob`'s variable, else `default`, else the knob's default (the test
    harness reads its own `MDEEP_TEST_*` knobs through this, outside the users' table).

    Raises:
        ValueError: the variable does not parse or is out of its range (the message names it).
    """
    text = os.environ.get(knob.env_name, "")
    if text.strip() == "":
        return knob.default if default is None else default
    return knob.check(text, _PARSERS[knob.kind](knob.env_name, text))


#: The names already warned about, comma-separated: set by `_warn_once` and inherited by the
#: processes this one starts (a job's ranks and runs), so each warning comes once per job.
WARNED_ENV = PREFIX + "KNOBS_WARNED"
#: Prefixes of `MDEEP_*` variables that are not users' knobs (the test harness's own, and the
#: record of the warnings given).
_OTHER_PREFIXES = ("TEST_", WARNED_ENV[len(PREFIX):])
_warned_names: set = set()
_dispatcher_built = False


def check_environment(reader: str = _BUFFER) -> None:
    """Checks every `MDEEP_*` variable that is set, whoever reads it: a bad value raises, an
    unknown name logs one warning (with the closest knob), and, for a `reader` of "Buffer"
    outside the Megatron dispatcher, a dispatcher-only knob logs one warning that the Buffer
    does not read it (warnings: once per process, on global rank 0).

    Args:
        reader: "Buffer" (a `Buffer` is being built) or "dispatcher" (the Megatron dispatcher
            resolves its options; Buffers it builds then stay quiet about its knobs).

    Raises:
        ValueError: the first set variable whose value is bad, named.
    """
    global _dispatcher_built
    if reader == _DISPATCHER:
        _dispatcher_built = True
    for env_name in sorted(os.environ):
        if not env_name.startswith(PREFIX) or os.environ[env_name].strip() == "":
            continue
        name = env_name[len(PREFIX):]
        knob = KNOBS.get(name)
        if knob is None:
            if not name.startswith(_OTHER_PREFIXES):
                close = difflib.get_close_matches(name, KNOBS, n=1)
                hint = f"; did you mean {PREFIX}{close[0]}?" if close else ""
                _warn_once(env_name, "%s is set but is no megatron_deepep knob (README, "
                           "\"Knobs\")%s", env_name, hint)
            continue
        read(knob)
        if reader == _BUFFER and not _dispatcher_built and not knob.read_by.startswith(
                (_BUFFER, _KERNELS)):
            _warn_once(env_name, "%s is set, but the Buffer API does not read it (read by: %s)",
                       env_name, knob.read_by)


def _warn_once(key: str, message: str, *args) -> None:
    """Warns once per process and the processes it starts (`WARNED_ENV`), on the first rank
    only (every rank sees the same variables)."""
    inherited = os.environ.get(WARNED_ENV, "").split(",")
    if key in _warned_names or key in inherited or os.environ.get("RANK", "0") != "0":
        return
    _warned_names.add(key)
    os.environ[WARNED_ENV] = ",".join(name for name in inherited + [key] if name)
    logger.warning(message, *args)


def markdown_table() -> str:
    """The README's knob table: variable, default, who reads it, what it does."""
    lines = ["| variable | default | read by | what it does |", "|---|---|---|---|"]
    for knob in _TABLE:
        lines.append(f"| `{knob.env_name}` | {knob.shown_default} | {knob.read_by} | "
                     f"{knob.doc} |")
    return "\n".join(lines)


def main() -> int:
    """`python megatron_deepep/knobs.py`: checks the `MDEEP_*` environment with the standard
    library alone (what `examples/run_gpt_moe.sh` runs first): 0, or 2 and one line on stderr
    naming the bad variable. Unknown names warn on stderr; stdout gets `WARNED_ENV`'s value,
    for the caller to pass on to the job's processes."""
    import sys

    logging.basicConfig(format="megatron_deepep: %(message)s")
    try:
        check_environment(_DISPATCHER)
    except ValueError as exc:
        print(f"megatron_deepep: {exc}", file=sys.stderr, flush=True)
        return 2
    print(os.environ.get(WARNED_ENV, ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
