#!/usr/bin/env python3
"""Re-placement at checkpoint save, applied at resume: a tiny GPT-MoE on the CPU, end to end.

    torchrun --nproc-per-node 2 examples/replan_resume.py --out runs/replan --phase train
    torchrun --nproc-per-node 2 examples/replan_resume.py --out runs/replan --phase resume
    torchrun --nproc-per-node 2 examples/replan_resume.py --out runs/replan --phase resume \\
        --no-replan

Each phase is a fresh start, as a user's job is. `train` builds the model under
`--moe-mdeep-replan` (contiguous placement: no checkpoint yet), trains on routing skewed towards
two experts, and saves a checkpoint: the plugin's wrap of `dist_checkpointing.save` writes the
plan (`mdeep_expert_plan.json`) beside it. `resume` builds the model anew from that checkpoint
folder: with the option on, the layers are built with the plan's placement (copies of the hot
experts), and the logical checkpoint loads weights and Adam state into it; `--no-replan`
resumes the same checkpoint in the contiguous placement. Both then train the same batches, so
their losses agree to fp32 rounding while the idle share (`1 - mean / max` of the tokens each
EP rank's experts receive) falls under the plan; both equal the losses `train` records when it
goes on after the save (`continued_losses`), so weights and optimizer state were restored.
Rank 0 writes `<phase>[_no_replan].json` (losses, idle share per step, the placement) into
`--out`.

megatron-core 0.16's wheel has no `megatron.training`, so this drives the pieces its
`pretrain` uses: `GPTModel` (local spec, `SequentialMLP` experts), `DistributedDataParallel`
with `finalize_model_grads`, `get_megatron_optimizer` (Adam, fp32), and `dist_checkpointing`
save and load of the model's and the optimizer's sharded state dicts, with Megatron's tracker
file. The resume directory is handed to the plugin with `replan.set_resume_dir` (under
megatron.training it is `--load`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import warnings

import torch
import torch.distributed as dist

from compare_dispatchers import allow_megatron_on_cpu, allow_megatron_without_te, init_distributed

logger = logging.getLogger("replan_resume")

#: The router's expert bias: experts 0 and 1 are picked far more often (sigmoid scores).
HOT_BIAS = (3.0, 1.5, 0.0, 0.0)
SEQ_LENGTH, MICRO_BATCH, HIDDEN, VOCAB, NUM_EXPERTS, TOPK = 32, 2, 64, 256, 4, 2


class _HostTorch:
    """`torch` as Megatron's optimizer modules see it on the CPU: their constructors and grad
    clipping allocate small buffers with `device='cuda'`; those go to the CPU."""

    FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name not in self.FACTORIES:
            return value

        def on_host(*args, **kwargs):
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return on_host


def allow_megatron_optimizer_on_cpu() -> None:
    """Lets `get_megatron_optimizer`'s fp32 optimizer and its grad clipping (with the local
    multi-tensor fallbacks in `megatron.core.utils`) run on the CPU."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    optimizer.torch = clip_grads.torch = utils.torch = _HostTorch()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint and result folder")
    p.add_argument("--phase", choices=("train", "resume"), required=True)
    p.add_argument("--steps", type=int, default=4, help="training steps of this phase")
    p.add_argument("--replan", type=int, default=2,
                   help="--moe-mdeep-replan: extra slots for copies of hot experts")
    p.add_argument("--no-replan", action="store_true",
                   help="resume without the option (the contiguous placement)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def build(args):
    """The GPT-MoE in Megatron's DDP and its Megatron optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, ffn_hidden_size=2 * HIDDEN, num_attention_heads=4,
        num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=HIDDEN,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_router_dtype="fp32",
        moe_token_dispatcher_type="deepep", expert_model_parallel_size=dist.get_world_size(),
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ_LENGTH, position_embedding_type="rope")
    for module in model.modules():  # skewed routing, the same on every rank and placement
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.copy_(torch.tensor(HOT_BIAS))
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=0.0, bf16=False, fp16=False), [ddp])
    return ddp, opt


def batch(args, step):
    """Step `step`'s batch of this rank: the same in every run."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + step * 10 + dist.get_rank())
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ_LENGTH + 1), generator=gen)
    pos = torch.arange(SEQ_LENGTH).unsqueeze(0).expand(MICRO_BATCH, -1)
    mask = torch.tril(torch.ones(SEQ_LENGTH, SEQ_LENGTH)).view(1, 1, SEQ_LENGTH, SEQ_LENGTH) < 0.5
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), pos, mask


def idle_share(layers: dict) -> float:
    """`1 - mean / max` of the tokens per EP rank, averaged over the MoE layers."""
    shares = []
    for m in layers.values():
        slots = m["tokens_per_expert"]
        per_rank = len(slots) // dist.get_world_size()
        loads = [sum(slots[r * per_rank:(r + 1) * per_rank])
                 for r in range(dist.get_world_size())]
        shares.append(1.0 - sum(loads) / len(loads) / max(loads) if max(loads) else 0.0)
    return sum(shares) / len(shares)


def train(args, ddp, opt, first_step):
    from megatron.core.distributed import finalize_model_grads

    from megatron_deepep.megatron import metrics

    losses, shares = [], []
    for step in range(first_step, first_step + args.steps):
        tokens, labels, pos, mask = batch(args, step)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
        shares.append(idle_share(metrics.flush(step)))
    return losses, shares


def _sharded(ddp, opt, is_loading=False):
    model = ddp.module.sharded_state_dict()
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=is_loading)}


def save(args, ddp, opt, iteration):
    """As Megatron's `save_checkpoint`: the iteration folder, then the tracker file."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    folder = os.path.join(args.out, "ckpt", f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    dist.barrier()
    # One writer thread: more spawn writer processes, which CPU ranks do not need.
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    dist_checkpointing.save(_sharded(ddp, opt), folder, sharded_strategy=strategy)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "ckpt", "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return folder


def load(args, ddp, opt) -> int:
    """As Megatron's `load_checkpoint`: the tracker's iteration, model then optimizer."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(args.out, "ckpt", "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    folder = os.path.join(args.out, "ckpt", f"iter_{iteration:07d}")
    state = dist_checkpointing.load(_sharded(ddp, opt, is_loading=True), folder)
    ddp.module.load_state_dict(state["model"], strict=False)
    opt.load_state_dict(state["optimizer"])
    return iteration


def placement(ddp) -> dict:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return {str(m.layer_number): m.token_dispatcher.physical_to_logical
            for m in ddp.module.modules() if isinstance(m, MoELayer)}


def main(argv=None) -> None:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    init_distributed(cpu=True)
    allow_megatron_on_cpu()
    allow_megatron_without_te()
    allow_megatron_optimizer_on_cpu()
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's writer syncs CUDA
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()  # a thread queue: no writer processes

    import megatron_deepep.megatron as mdm
    from megatron_deepep.megatron import replan

    replan_slots = None if args.no_replan else args.replan
    mdm.register_deepep_dispatcher(transport="reference", metrics=True, replan=replan_slots)
    replan.set_resume_dir(os.path.join(args.out, "ckpt") if args.phase == "resume" else None)
    ddp, opt = build(args)
    first_step = load(args, ddp, opt) if args.phase == "resume" else 0
    losses, shares = train(args, ddp, opt, first_step)
    result = {"phase": args.phase, "replan": replan_slots, "first_step": first_step,
              "losses": losses, "idle_share": shares, "placement": placement(ddp)}
    if args.phase == "train":
        folder = save(args, ddp, opt, first_step + args.steps)
        result["plan_file"] = os.path.join(folder, replan.PLAN_FILE)
        # The run had it not stopped: what both resumes must reproduce.
        result["continued_losses"], _ = train(args, ddp, opt, first_step + args.steps)
    if dist.get_rank() == 0:
        name = args.phase + ("_no_replan" if args.no_replan else "")
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump(result, f, indent=1)
        logger.info("%s: losses %s; idle share %s; placement %s", name,
                    [round(x, 6) for x in losses], [round(x, 3) for x in shares],
                    result["placement"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
