#!/usr/bin/env python3
"""GPT-MoE pretraining on `megatron.training.pretrain` with `--moe-token-dispatcher-type deepep`.

Mock data (MockGPTDataset) and NullTokenizer: no dataset or tokenizer files. Launched by
`examples/run_gpt_moe.sh` (one node) or `examples/slurm_gpt_moe.sbatch` (several).

`megatron.training` is not in the pip megatron-core wheel: put a Megatron-LM checkout (0.16+) on
PYTHONPATH (`MEGATRON_LM=/path/to/Megatron-LM`). With an unpatched checkout this script registers
the runtime plugin before arguments are parsed; with a patched one the plugin is a no-op on top.

Extra flags (ours, named apart from Megatron's `--moe-deepep-num-sms` / `--moe-enable-deepep`,
which belong to the flex dispatcher): every `--moe-mdeep-*` flag of
`megatron_deepep.megatron.add_arguments`, e.g. `--moe-mdeep-metrics`, `--moe-mdeep-metrics-dir
DIR`, `--moe-mdeep-num-sms N`, `--moe-mdeep-transport {auto,nvlink,reference}`,
`--moe-mdeep-fp8-dispatch {off,blockwise,mxfp8,auto}` (README, "FP8 dispatch"). A patched
Megatron defines them as config fields itself; here they are added only when missing, and
`apply_arguments` makes the parsed values the dispatcher's defaults.
"""

from __future__ import annotations

import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import megatron_deepep.megatron as mdm  # noqa: E402

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
from megatron.training.utils import (  # noqa: E402
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)

def model_provider(pre_process=True, post_process=True, *unused_args, **unused_kwargs):
    args = get_args()
    mdm.apply_arguments(args)  # the parsed --moe-mdeep-* values become the option defaults
    config = core_transformer_config_from_args(args)
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts,
                                                          args.moe_grouped_gemm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm)
    return GPTModel(config=config, transformer_layer_spec=spec,
                    vocab_size=args.padded_vocab_size,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process,
                    share_embeddings_and_output_weights=(
                        not args.untie_embeddings_and_output_weights),
                    position_embedding_type=args.position_embedding_type,
                    rotary_percent=args.rotary_percent)


def get_batch(data_iterator):
    if not (mpu.is_pipeline_first_stage() or mpu.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = get_batch_on_this_tp_rank(data_iterator)
    batch = get_batch_on_this_cp_rank(batch)
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"],
            batch["position_ids"])


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float()
    loss_mask = loss_mask.view(-1).float()
    total = torch.sum(losses.view(-1) * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = torch.cat([total.clone().detach().view(1), num_tokens.view(1)])
    return total, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
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


if __name__ == "__main__":
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder,
             forward_step, extra_args_provider=mdm.add_arguments,
             args_defaults={"tokenizer_type": "NullTokenizer"})
