#!/usr/bin/env python3
"""GPT-MoE pretraining on `megatron.training.pretrain` with `--moe-token-dispatcher-type deepep`.

Mock data (MockGPTDataset) and NullTokenizer: no dataset or tokenizer files. Launched by
`examples/run_gpt_moe.sh` (one node) or `examples/slurm_gpt_moe.sbatch` (several).

`megatron.training` ships in the megatron-core wheels from 0.17 on (Python >= 3.12); for 0.16, put
a Megatron-LM checkout on PYTHONPATH (`MEGATRON_LM=/path/to/Megatron-LM`). With an unpatched
tree this script registers the runtime plugin before arguments are parsed; with a patched one
the plugin is a no-op on top. It drives both training APIs: `pretrain(provider, model_provider,
model_type, forward_step, extra_args_provider=, args_defaults=)` (0.16, 0.17) and, from 0.18,
`pretrain(config_container, ...)` after `parse_and_validate_args` (keywords, so that 0.18's
and 0.19's different argument orders both bind). The batch is read here (no TP broadcast),
so the example runs with tensor and context parallel size 1: EP carries the experts.

Extra flags (ours, named apart from Megatron's `--moe-deepep-num-sms` / `--moe-enable-deepep`,
which belong to the flex dispatcher): every `--moe-mdeep-*` flag of
`megatron_deepep.megatron.add_arguments`, e.g. `--moe-mdeep-metrics`, `--moe-mdeep-metrics-dir
DIR`, `--moe-mdeep-num-sms N`, `--moe-mdeep-transport {auto,local,nvlink,reference}`,
`--moe-mdeep-fp8-dispatch {off,blockwise,mxfp8,auto}` (README, "FP8 dispatch"). A patched
Megatron defines them as config fields itself; here they are added only when missing, and
`apply_arguments` makes the parsed values the dispatcher's defaults.

`MDEEP_GROUPED_MM_EXPERTS=1` (environment; the `examples/configs/` proxies set it): the experts
are `megatron.grouped_experts.GroupedMMExperts` (two `torch._grouped_mm` calls per layer) instead of
Megatron's `SequentialMLP` (a Python loop over the experts: host-bound with hundreds of small
experts); kept, with the reason logged, where `torch._grouped_mm` fails a one-call check.
`MDEEP_FP8_EXPERTS=1`: TE's grouped experts take the FP8 rows (`docs/fp8.md`).

`GPT_MOE_ARGS` (environment): more flags, shell-quoted, appended after the command line's (so
they win); the model-family templates in `examples/configs/` use it through the Slurm template.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import shlex
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_deepep.logs import quiet_known_noise  # noqa: E402

quiet_known_noise()  # before megatron-core is imported (megatron_deepep.logs.KNOWN_NOISE)
import megatron_deepep.megatron as mdm  # noqa: E402
from megatron_deepep import knobs  # noqa: E402

# Before megatron.training builds its parser: the CLI choices come from the config Literal.
mdm.register_deepep_dispatcher()

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import (  # noqa: E402
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402

ARGS_DEFAULTS = {"tokenizer_type": "NullTokenizer"}
logger = logging.getLogger("pretrain_gpt_moe")


def check_parallelism(args) -> None:
    """The batch is read on every rank (no TP broadcast, no CP split): TP = CP = 1."""
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--context-parallel-size", getattr(args, "context_parallel_size", 1))):
        if value != 1:
            raise SystemExit(f"pretrain_gpt_moe.py runs with {flag} 1 (got {value}); "
                             "--expert-model-parallel-size carries the experts")


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None, **unused_kwargs):
    """The GPT-MoE; Megatron 0.17+ passes `vp_stage`, `config` and `pg_collection`."""
    args = get_args()
    check_parallelism(args)
    mdm.apply_arguments(args)  # the parsed --moe-mdeep-* values become the option defaults
    if config is None:
        config = core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts,
                                                          args.moe_grouped_gemm)
        if knobs.get("FP8_EXPERTS"):  # docs/fp8.md: FP8 rows into TE's grouped GEMM
            from megatron_deepep.megatron.te_experts import with_fp8_experts

            spec = with_fp8_experts(spec)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm)
    if knobs.get("GROUPED_MM_EXPERTS"):  # the examples/configs proxies: grouped experts
        from megatron_deepep.megatron.grouped_experts import with_grouped_mm_experts

        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        grouped, note = with_grouped_mm_experts(spec, device)
        log = logger.info if grouped is not spec else logger.warning
        log("MDEEP_GROUPED_MM_EXPERTS=1: %s", note)
        spec = grouped
    extra = {k: v for k, v in (("vp_stage", vp_stage), ("pg_collection", pg_collection))
             if v is not None}
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process,
                    share_embeddings_and_output_weights=(
                        not args.untie_embeddings_and_output_weights),
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent, **extra)


BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator):
    """`(tokens, labels, loss_mask, attention_mask, position_ids)` on this GPU (None where the
    dataset gives no attention mask); all None on pipeline stages that take no input."""
    if not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        return (None,) * len(BATCH_KEYS)
    data = next(data_iterator)
    return tuple(data[k].cuda(non_blocking=True) if data.get(k) is not None else None
                 for k in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    total = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), num_tokens.view(1)])
    return total, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """One micro-batch. `return_schedule_plan`: Megatron's EP A2A overlap
    (`--overlap-moe-expert-parallel-comm`) asks for the model's schedule plan instead."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels,
                                         loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels)
    return output_tensor, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None,
        blend_per_split=None, split="100,0,0", path_to_cache=None,
        tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, mid_level_dataset_surplus=0.005)
    return BlendedMegatronDatasetBuilder(MockGPTDataset, train_val_test_num_samples,
                                         lambda: mpu.get_tensor_model_parallel_rank() == 0,
                                         config).build()


def uses_config_container(pretrain_fn) -> bool:
    """True for the 0.18+ `pretrain(cfg_container, ...)`, False for the older argument-parsing
    `pretrain(train_valid_test_dataset_provider, model_provider, ...)`."""
    return next(iter(inspect.signature(pretrain_fn).parameters)) == "cfg_container"


def pretrain_call(pretrain_fn):
    """`(args, kwargs)` of this version's `pretrain_fn` call (0.18+: parses the flags first)."""
    train_valid_test_datasets_provider.is_distributed = True
    if not uses_config_container(pretrain_fn):
        return ((train_valid_test_datasets_provider, model_provider,
                 ModelType.encoder_or_decoder, forward_step),
                dict(extra_args_provider=mdm.add_arguments, args_defaults=ARGS_DEFAULTS))
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    args = parse_and_validate_args(extra_args_provider=mdm.add_arguments,
                                   args_defaults=ARGS_DEFAULTS)
    check_parallelism(args)
    return ((pretrain_cfg_container_from_args(args),),
            dict(train_valid_test_dataset_provider=train_valid_test_datasets_provider,
                 model_provider=model_provider, model_type=ModelType.encoder_or_decoder,
                 forward_step_func=forward_step))


def use_prebuilt_dataset_helpers() -> bool:
    """Skips `megatron.training`'s build of the dataset helpers when they are prebuilt.

    The megatron-core wheels ship `megatron/core/datasets/helpers_cpp` built, but not the Makefile
    that `megatron.training` runs `make` on (rank 0, at start-up): the build fails and training
    exits. A Megatron-LM source tree (with its Makefile) keeps building as usual.

    Returns:
        True when the build step was replaced by a no-op.
    """
    from megatron.core.datasets import utils as dataset_utils

    if os.path.exists(os.path.join(os.path.dirname(dataset_utils.__file__), "Makefile")):
        return False
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return False
    logger.info("megatron.core.datasets.helpers_cpp is prebuilt: skipping its build")
    dataset_utils.compile_helpers = lambda: None
    return True


def append_env_args(argv: list, environ=os.environ) -> list:
    """`argv` plus the flags in `GPT_MOE_ARGS` (shell-quoted), which come last and so override
    the launcher's own: how `examples/configs/*.sh` send a model family's flags through
    `examples/slurm_gpt_moe.sbatch` (Slurm passes the environment to every task)."""
    return argv + shlex.split(environ.get("GPT_MOE_ARGS", ""))


def main() -> None:
    sys.argv = append_env_args(sys.argv)
    use_prebuilt_dataset_helpers()
    call_args, call_kwargs = pretrain_call(pretrain)
    pretrain(*call_args, **call_kwargs)


if __name__ == "__main__":
    main()
