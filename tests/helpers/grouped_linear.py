"""A CPU stand-in for Transformer Engine's grouped linears under Megatron's `TEGroupedMLP`.

`TEGroupedMLP` (megatron-core's, unchanged) builds its `linear_fc1` / `linear_fc2` from its
submodules; these classes take the arguments `TEColumnParallelGroupedLinear` and
`TERowParallelGroupedLinear` take, keep TE's parameter naming (`weight<i>`, `bias<i>` per local
expert, one `_extra_state` split per gemm) and build their sharded state dict with the code of
megatron-core 0.16.1's `TEGroupedLinear._sharded_state_dict_grouped` (which needs TE to import),
so `TEGroupedMLP.sharded_state_dict`, the plugin's logical order and dist_checkpointing run as
with TE. The GPU tier's `tests/gpu/test_grouped_checkpoint_gpu.py` runs the real TE classes.
"""

from __future__ import annotations

import torch


class GroupedLinear(torch.nn.Module):
    """`num_gemms` linears `[out, in]` (fp32, CPU); extra state: one tag tensor per gemm."""

    tp_axis_map = {"weight": 0, "bias": 0}

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias,
                 skip_bias_add, is_expert, tp_comm_buffer_name=None, pg_collection=None,
                 name=None):  # name: megatron-core 0.19 passes the module path
        super().__init__()
        assert is_expert
        self.num_gemms, self.use_bias, self.skip_bias_add = num_gemms, bias, skip_bias_add
        self._pg_collection, self._tp_group = pg_collection, pg_collection.expt_tp
        for i in range(num_gemms):
            setattr(self, f"weight{i}", torch.nn.Parameter(torch.randn(output_size, input_size)))
            if bias:
                setattr(self, f"bias{i}", torch.nn.Parameter(torch.randn(output_size)))
        self.tags = [torch.zeros(1) for _ in range(num_gemms)]  # what TE's fp8 meta would be

    def get_extra_state(self):
        return [t.clone() for t in self.tags]

    def set_extra_state(self, state):
        self.tags = [t.clone() for t in state]

    def _split_extra_state(self, state):
        return list(state)

    def forward(self, x, m_splits):
        outs = [rows @ getattr(self, f"weight{i}").t()
                for i, rows in enumerate(torch.split(x, list(m_splits)))]
        return torch.cat(outs), None

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # megatron-core 0.16.1 TEGroupedLinear._sharded_state_dict_grouped, unchanged in effect.
        from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        singleton_local_shards = (metadata or {}).get("singleton_local_shards", False)
        sharded_state_dict = {}
        full_state_dict = self.state_dict(prefix="", keep_vars=True)
        ep = self._pg_collection.ep
        num_global_experts = ep.size() * self.num_gemms
        local_expert_indices_offset = ep.rank() * self.num_gemms
        ep_axis = len(sharded_offsets)
        extra_states = self._split_extra_state(full_state_dict["_extra_state"])
        for gemm_idx in range(self.num_gemms):
            global_expert_idx = local_expert_indices_offset + gemm_idx
            state_dict = {f"{gemm_idx}.weight": full_state_dict[f"weight{gemm_idx}"],
                          f"{gemm_idx}._extra_state": extra_states[gemm_idx]}
            if self.use_bias:
                state_dict[f"{gemm_idx}.bias"] = full_state_dict[f"bias{gemm_idx}"]
            if singleton_local_shards:
                expert_prefix = f"{global_expert_idx}.{prefix}"
                new_sharded_offsets = sharded_offsets
            else:
                expert_prefix = prefix
                new_sharded_offsets = (*sharded_offsets,
                                       (ep_axis, global_expert_idx, num_global_experts))
            sub_sd = make_sharded_tensors_for_checkpoint(
                state_dict, "", self.tp_axis_map, new_sharded_offsets, tp_group=self._tp_group,
                dp_cp_group=metadata["dp_cp_group"])
            replace_prefix_for_sharding(sub_sd, f"{gemm_idx}.", expert_prefix)
            sharded_state_dict[f"{prefix}weight{gemm_idx}"] = sub_sd[f"{gemm_idx}.weight"]
            sharded_state_dict[f"{prefix}_extra_state{'' if gemm_idx == 0 else gemm_idx}"] = \
                sub_sd[f"{gemm_idx}._extra_state"]
            if self.use_bias:
                sharded_state_dict[f"{prefix}bias{gemm_idx}"] = sub_sd[f"{gemm_idx}.bias"]
        for sh_ten in sharded_state_dict.values():
            replica_id = sh_ten.replica_id
            sh_ten.replica_id = (*replica_id[:2], self._pg_collection.expt_dp.rank())
        return sharded_state_dict


class ColumnGroupedLinear(GroupedLinear):
    """`TEColumnParallelGroupedLinear`'s stand-in (output rows split over expert TP)."""

    tp_axis_map = {"weight": 0, "bias": 0}


class RowGroupedLinear(GroupedLinear):
    """`TERowParallelGroupedLinear`'s stand-in (input columns split over expert TP)."""

    tp_axis_map = {"weight": 1}
