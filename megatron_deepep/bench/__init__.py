"""Benchmarks, each run as `python -m megatron_deepep.bench[.<name>]`:

- `run` (`python -m megatron_deepep.bench`): dispatch and combine against the HBM floor and
  Megatron's `alltoall` dispatcher; `--nodes MxL` on virtual nodes.
- `layer`: the whole MoE layer (router, dispatcher, experts) under several dispatchers.
- `peers`: the NVLink transport beside NCCL's all-to-all and the peer-copy ceiling.
- `network`: the internode network leg's cost per byte.
- `reference`: the pure-torch reference transport's collectives and host reads per call site.
"""
