"""Megatron command-line flags -> the model `examples/compare_dispatchers.py` builds.

`compare_dispatchers.py` builds its GPT-MoE from megatron-core alone (no `megatron.training`
parser). Given Megatron flags after `--` (what `bash examples/run_gpt_moe.sh FLAGS` and the
`examples/configs/` templates pass on a machine without a GPU), it builds that model instead of
its default one: the flags that are `TransformerConfig` fields go into the config, the sizes
into its own options, ours (`--moe-mdeep-*`) into the dispatcher's options. What has no meaning
in this run is dropped, each flag named with the reason; a flag it cannot place is refused (one
line), never ignored.

    flags = parse(["--num-experts", "256", "--moe-router-topk", "8", "--swiglu"])
    flags.args      # {"num_experts": 256, "topk": 8}
    flags.config    # {"gated_linear_unit": True, "activation_func": <silu>}
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence, Tuple

#: Flags that set compare_dispatchers.py's own options (its argparse names).
ARGS = {"--num-layers": "num_layers", "--hidden-size": "hidden_size",
        "--num-experts": "num_experts", "--moe-router-topk": "topk",
        "--seq-length": "seq_length", "--micro-batch-size": "micro_batch_size",
        "--vocab-size": "vocab_size", "--lr": "lr", "--seed": "seed"}
#: GPTModel's own arguments.
MODEL = {"--rotary-base": "rotary_base", "--position-embedding-type": "position_embedding_type"}
#: Our flags with no meaning on the CPU (`--cpu`): the reason it says when it drops them.
DROPPED_ON_CPU = {
    "--moe-mdeep-num-sms": "the SM budget of the kernels; the reference transport runs none",
    "--moe-mdeep-transport": "a machine without a GPU has the reference transport only",
    "--moe-mdeep-ranks-per-node": "the gloo ranks of this run are one node",
}
#: Flags with no meaning in this run: the reason it says when it drops them.
DROPPED = {
    "--moe-mdeep-metrics": "metrics follow --metrics-dir (METRICS=1 in run_gpt_moe.sh)",
    "--moe-mdeep-metrics-dir": "metrics follow --metrics-dir (METRICS=1 in run_gpt_moe.sh)",
    "--moe-layer-freq": "every layer of this model is an MoE layer",
    "--max-position-embeddings": "the sequence length sets it",
    "--bf16": "this run is bf16 already",
    "--transformer-impl": "this run builds Megatron's local (non-TE) layers",
}
#: Switches that a value of another flag stands for here.
IMPLIED = {"--group-query-attention": "--num-query-groups"}
#: The main job's dispatchers (`--moe-token-dispatcher-type` of `run_gpt_moe.sh`, or its
#: DISPATCHER): Megatron's `alltoall` with TE's fused permute is `alltoall-fused`.
DISPATCHERS = ("deepep", "alltoall", "alltoall-fused")
DISPATCHER_FLAG = "--moe-token-dispatcher-type"
#: Each run of compare_dispatchers.py sets its own dispatcher (`--dispatchers`).
DROPPED[DISPATCHER_FLAG] = "each run sets its own (compare_dispatchers.py --dispatchers)"


@dataclasses.dataclass
class MegatronFlags:
    """Where each flag went."""

    args: Dict[str, object] = dataclasses.field(default_factory=dict)
    config: Dict[str, object] = dataclasses.field(default_factory=dict)
    model: Dict[str, object] = dataclasses.field(default_factory=dict)
    deepep: Dict[str, object] = dataclasses.field(default_factory=dict)
    dropped: List[Tuple[str, str]] = dataclasses.field(default_factory=list)  # (flag, why)


class FlagError(ValueError):
    """A flag this run cannot place; the message is one line naming it."""


def split(flags: Sequence[str]) -> List[Tuple[str, object]]:
    """`["--a", "1", "--b", "--c=2"]` -> `[("--a", "1"), ("--b", True), ("--c", "2")]` (a
    switch has the value True)."""
    out = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise FlagError(f"expected a flag, got {flag!r} (after "
                            f"{flags[i - 1] if i else 'nothing'})")
        if "=" in flag:
            out.append(tuple(flag.split("=", 1)))
            i += 1
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out.append((flag, flags[i + 1]))
            i += 2
        else:
            out.append((flag, True))
            i += 1
    return out


def value(text):
    """A flag's text as Megatron's parser would type it: int, float, bool or str."""
    if text is True:
        return True
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(str(text).lower(), text)


def did_you_mean(flag: str, fields, ours) -> str:
    """"; did you mean --x?" for the closest flag this run places (or "")."""
    import difflib

    known = set(ARGS) | set(MODEL) | set(DROPPED) | set(DROPPED_ON_CPU) | set(IMPLIED)
    known |= {"--swiglu", "--disable-bias-linear"}
    known |= {"--" + name.replace("_", "-") for name in fields}
    known |= {"--moe-mdeep-" + name.replace("_", "-") for name in ours}
    close = difflib.get_close_matches(flag, sorted(known), n=1)
    return f"; did you mean {close[0]}?" if close else ""


def parse(flags: Sequence[str], cpu: bool = True) -> MegatronFlags:
    """Places every flag (the last of a repeated flag wins, as with argparse); `cpu`: the run
    is on the CPU (`DROPPED_ON_CPU` is dropped too).

    Raises:
        FlagError: a flag that is no `TransformerConfig` field and none this run knows.
    """
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepep.megatron.options import DeepEPOptions

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    ours = {f.name for f in dataclasses.fields(DeepEPOptions)}
    pairs = split(flags)
    given = {flag for flag, _ in pairs}
    out = MegatronFlags()
    for flag, text in pairs:
        name = flag[2:].replace("-", "_")
        if flag in ARGS:
            out.args[ARGS[flag]] = value(text)
        elif flag in MODEL:
            out.model[MODEL[flag]] = value(text)
        elif flag in DROPPED or (cpu and flag in DROPPED_ON_CPU):
            out.dropped.append((flag, DROPPED.get(flag) or DROPPED_ON_CPU[flag]))
        elif flag in IMPLIED:
            continue
        elif flag == "--swiglu":
            out.config.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
        elif flag == "--disable-bias-linear":
            out.config["add_bias_linear"] = False
        elif flag.startswith("--moe-mdeep-") and name[len("moe_mdeep_"):] in ours:
            out.deepep[name[len("moe_mdeep_"):]] = value(text)
        elif name in fields:
            out.config[name] = value(text)
        else:
            raise FlagError(f"{flag} is no TransformerConfig field and no flag this run knows "
                            f"(examples/megatron_flags.py lists those)"
                            + did_you_mean(flag, fields, ours))
    for switch, needs in IMPLIED.items():
        field = needs[2:].replace("-", "_")
        if field in out.config and switch not in given:  # as megatron.training: ignored
            out.dropped.append((needs, f"only used with {switch}"))
            del out.config[field]
    return out


def check_dispatcher(where: str, name: str) -> str:
    """`name` if the main job runs that dispatcher (`DISPATCHERS`).

    Args:
        where: what gave it, as the error starts: "--moe-token-dispatcher-type " or
            "DISPATCHER=".
        name: the value given.

    Raises:
        FlagError: naming `where`, the value and the choices.
    """
    if name in DISPATCHERS:
        return name
    import difflib

    close = difflib.get_close_matches(name.lower(), DISPATCHERS, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    raise FlagError(f"{where}{name!r}: expected one of {', '.join(DISPATCHERS)}{hint}")


def job_flags(flags: Sequence[str], dispatcher_env: str = "") -> Tuple[str, List[str], str]:
    """The main job's own flag taken out of `flags` (`run_gpt_moe.sh FLAGS`).

    Args:
        flags: the command line after the script's name.
        dispatcher_env: the DISPATCHER variable ("": unset).

    Returns:
        `(dispatcher, the other flags, note)`: `--moe-token-dispatcher-type` wins over
        DISPATCHER, which wins over `deepep`; the other flags with `--a=b` as `--a b`; a
        one-line note when the flag chose the dispatcher ("" otherwise).

    Raises:
        FlagError: a dispatcher the job does not run, or a word that is no flag.
    """
    dispatcher = check_dispatcher("DISPATCHER=", dispatcher_env) if dispatcher_env else "deepep"
    rest, given = [], None
    for flag, text in split(flags):
        if flag != DISPATCHER_FLAG:
            rest += [flag] if text is True else [flag, text]
        elif text is True:
            raise FlagError(f"{DISPATCHER_FLAG} needs a value: one of {', '.join(DISPATCHERS)}")
        else:
            given = check_dispatcher(DISPATCHER_FLAG + " ", text)
    if given is None:
        return dispatcher, rest, ""
    over = (f" (over DISPATCHER={dispatcher_env})"
            if dispatcher_env and dispatcher_env != given else "")
    return given, rest, f"{DISPATCHER_FLAG} {given} from the command line{over}"


def _quiet_imports() -> None:
    """Drops megatron-core's import-time notices (no TE, no Apex) in this process."""
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_deepep.logs import quiet_known_noise

    quiet_known_noise()


def _checkable_on_this_cpu() -> bool:
    """True where the CPU demonstration is the job's path and `parse` can run before anything
    is installed (no GPU; torch and megatron-core importable)."""
    import importlib.util

    import prepare_env  # examples/prepare_env.py, beside this file

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron") is None:
        return False
    return prepare_env.find_gpus()[0] == 0


def job_main(flags: Sequence[str]) -> int:
    """`python examples/megatron_flags.py --job -- FLAGS`: what `run_gpt_moe.sh` runs first,
    before it probes or installs anything. 2 and one line for a bad dispatcher or, where the
    CPU demonstration will run them and megatron-core is there, a flag `parse` refuses; else
    0, one note line when the flag chose the dispatcher, and on stdout NUL-terminated fields:
    the dispatcher, 1 if the flags were checked here (else 0), then the other flags."""
    import os
    import sys

    try:
        dispatcher, rest, note = job_flags(flags, os.environ.get("DISPATCHER", ""))
        checked = not rest
        if rest and _checkable_on_this_cpu():
            _quiet_imports()
            parse(rest, cpu=True)
            checked = True
    except FlagError as exc:
        print(f"run_gpt_moe.sh: {exc}", file=sys.stderr)
        return 2
    if note:
        print(f"run_gpt_moe.sh: {note}", file=sys.stderr)
    sys.stdout.write("".join(f"{field}\0" for field in [dispatcher, str(int(checked)), *rest]))
    return 0


def main(argv: Sequence[str]) -> int:
    """`python examples/megatron_flags.py [--gpu] -- FLAGS`: 0 if every flag can be placed, else
    one line naming the first that cannot (what `run_gpt_moe.sh` runs before it starts
    torchrun, so a mistyped flag is one line, not every rank's traceback); `--job -- FLAGS`:
    `job_main`."""
    argv = list(argv)
    options = argv[:argv.index("--")] if "--" in argv else []
    flags = argv[argv.index("--") + 1:] if "--" in argv else argv
    if "--job" in options:
        return job_main(flags)
    import sys

    _quiet_imports()
    try:
        parse(flags, cpu="--gpu" not in options)
    except FlagError as exc:
        print(f"run_gpt_moe.sh: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
