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
    """`["--a", "1", "--b"]` -> `[("--a", "1"), ("--b", True)]` (a switch has the value True)."""
    out = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        if not flag.startswith("--"):
            raise FlagError(f"expected a flag, got {flag!r} (after "
                            f"{flags[i - 1] if i else 'nothing'})")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
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


def main(argv: Sequence[str]) -> int:
    """`python examples/megatron_flags.py [--gpu] -- FLAGS`: 0 if every flag can be placed, else
    one line naming the first that cannot (what `run_gpt_moe.sh` runs before it starts
    torchrun, so a mistyped flag is one line, not every rank's traceback)."""
    argv = list(argv)
    cpu = "--gpu" not in argv[:argv.index("--")] if "--" in argv else True
    flags = argv[argv.index("--") + 1:] if "--" in argv else argv
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's import-time notices (no TE, no Apex)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_deepep.logs import quiet_known_noise

    quiet_known_noise()
    try:
        parse(flags, cpu=cpu)
    except FlagError as exc:
        print(f"run_gpt_moe.sh: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
