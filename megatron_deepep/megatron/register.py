"""Runtime plugin: makes `deepep` a dispatcher type of an unmodified pip megatron-core.

    import megatron_deepep.megatron as mdm
    mdm.register_deepep_dispatcher()          # before building configs / parsing arguments

After the call (megatron-core 0.16.x to 0.19.x) `--moe-token-dispatcher-type deepep` and
`TransformerConfig(moe_token_dispatcher_type="deepep")` work, `MoELayer` builds a
`DeepEPTokenDispatcher`, the A2A overlap keeps the rows our experts need, and Megatron's step-end
MoE report carries `megatron_deepep.megatron.metrics` (when enabled). `patching` lists and makes
every change; each wraps the original, and `unregister_deepep_dispatcher()` undoes all of them.
On Megatron-LM source trees the patches in `patches/` do the same statically.
"""

from __future__ import annotations

import logging

from megatron_deepep.megatron import patching
from megatron_deepep.megatron.options import (
    CONFIG_PREFIX,
    FP8_DISPATCH_CHOICES,
    TRANSPORT_CHOICES,
    set_default_options,
)

logger = logging.getLogger(__name__)

_STATE = {"registered": False}


# ----------------------------------------------------------------------------------------------
def register_deepep_dispatcher(**options) -> None:
    """Makes `moe_token_dispatcher_type="deepep"` work in this process (idempotent).

    Call it before TransformerConfigs are built and before megatron.training parses arguments.

    Args:
        **options: defaults for `DeepEPOptions` (`transport`, `num_sms`,
            `num_max_tokens_per_rank`, `metrics`, `metrics_dir`, `fp8_dispatch`,
            `rank_capacity_factor`, `expert_map`, `replan`); config fields
            `moe_mdeep_<name>` (patched Megatron) override them, and they override `MDEEP_<NAME>`
            environment variables.
    """
    set_default_options(**options)
    if _STATE["registered"]:
        return
    patching.install()
    _STATE["registered"] = True
    logger.info("megatron_deepep: moe_token_dispatcher_type='deepep' registered")


def is_registered() -> bool:
    return bool(_STATE["registered"])


def unregister_deepep_dispatcher() -> None:
    """Restores every attribute `register_deepep_dispatcher` replaced (`patching.undo_all`)."""
    patching.undo_all()
    _STATE["registered"] = False


# ----------------------------------------------------------------------------------------------
#: Our command-line flags (`megatron.training`'s `extra_args_provider`), one per DeepEPOptions
#: field: `--moe-mdeep-<name>`, named apart from Megatron's own flags (`--moe-deepep-num-sms`,
#: `--moe-enable-deepep`, `--fp8-format`, `--fp8-recipe` ...).
ARGUMENTS = [
    ("--moe-mdeep-transport", dict(type=str, default=None,
                                   choices=list(TRANSPORT_CHOICES),
                                   help="megatron_deepep transport")),
    ("--moe-mdeep-num-sms", dict(type=int, default=None, help="SMs of the comm kernels")),
    ("--moe-mdeep-ranks-per-node", dict(
        type=int, default=None, help="EP ranks per node (default: from host names)")),
    ("--moe-mdeep-num-max-tokens-per-rank", dict(
        type=int, default=None, help="most tokens one rank dispatches (same on every rank)")),
    ("--moe-mdeep-metrics", dict(action="store_true", default=None,
                                 help="megatron_deepep per-layer comm/load metrics")),
    ("--moe-mdeep-metrics-dir", dict(type=str, default=None,
                                     help="also write metrics as JSON lines here")),
    ("--moe-mdeep-fp8-dispatch", dict(
        type=str, default=None, choices=list(FP8_DISPATCH_CHOICES),
        help="FP8 token dispatch: blockwise (TE Float8BlockScaling, 1x128), mxfp8 (TE "
             "MXFP8BlockScaling, 1x32), auto (the active TE recipe's format) or off")),
    ("--moe-mdeep-rank-capacity-factor", dict(
        type=float, default=None,
        help="sync-free dispatch: each rank receives at most factor x tokens x top-k rows "
             "(Megatron's --moe-expert-rank-capacity-factor wins where it exists)")),
    ("--moe-mdeep-expert-map", dict(
        type=str, default=None,
        help="expert placement JSON from python -m megatron_deepep.tools.balance --json (expert "
             "weights permuted to match)")),
    ("--moe-mdeep-replan", dict(
        type=int, default=None, metavar="EXTRA_SLOTS",
        help="re-plan the expert placement at each checkpoint save and take it at resume, with "
             "this many extra slots for copies of hot experts (0: none; a multiple of EP)")),
]


def add_arguments(parser):
    """Adds the `--moe-mdeep-*` flags that `parser` lacks (a patched Megatron defines them as
    config fields); usable as `pretrain(..., extra_args_provider=add_arguments)`."""
    group = parser.add_argument_group(title="megatron_deepep")
    for flag, kwargs in ARGUMENTS:
        if flag not in parser._option_string_actions:
            group.add_argument(flag, **kwargs)
    return parser


def check_replan_arguments(args) -> None:
    """Refuses `--moe-mdeep-replan` where a resume could not move the optimizer state.

    Megatron's distributed optimizer saves its state in the data-parallel layout
    ("dp_reshardable") unless `--dist-ckpt-optim-fully-reshardable` is given; that layout keeps
    expert moments in physical slot order, so a new placement would give experts another
    expert's moments.

    Raises:
        ValueError: naming the flags and the way out.
    """
    if getattr(args, CONFIG_PREFIX + "replan", None) is None:
        return
    if not getattr(args, "use_distributed_optimizer", False):
        return
    if getattr(args, "ckpt_format", "torch_dist") != "torch_dist":
        raise ValueError(f"--moe-mdeep-replan with --use-distributed-optimizer needs "
                         f"--ckpt-format torch_dist (its expert plan rides on distributed "
                         f"checkpoints), got --ckpt-format {args.ckpt_format}")
    if not getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        has_flag = hasattr(args, "dist_ckpt_optim_fully_reshardable")
        raise ValueError(
            "--moe-mdeep-replan with --use-distributed-optimizer: the optimizer state is saved in "
            "the data-parallel layout ('dp_reshardable'), which keeps expert moments in physical "
            "slot order, so the next resume could not move them with their experts. "
            + ("Add --dist-ckpt-optim-fully-reshardable" if has_flag else
               "This Megatron has no --dist-ckpt-optim-fully-reshardable (megatron-core 0.17+)")
            + ", drop --use-distributed-optimizer, or drop --moe-mdeep-replan")


def apply_arguments(args) -> None:
    """Makes parsed `--moe-mdeep-*` values the option defaults (`register_deepep_dispatcher`),
    after `check_replan_arguments`."""
    check_replan_arguments(args)
    options = {}
    for flag, _ in ARGUMENTS:
        name = flag[len("--moe-mdeep-"):].replace("-", "_")
        value = getattr(args, CONFIG_PREFIX + name, None)
        if value is False:  # store_true left unset
            value = None
        options[name] = value
    register_deepep_dispatcher(**options)
