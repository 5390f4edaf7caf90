"""Command-line tools, each run as `python -m megatron_deepep.tools.<name>`:

- `precompile`: build the kernels into the cache ahead of a job (no GPU needed).
- `multinode_check`: the internode transport against the reference, then GB/s per NIC.
- `internode_model`: network and NVLink time of a cluster shape, from bytes and link rates.
- `sweep`: dispatch, combine and expert GEMM times of a model family over EP sizes.
- `balance`: an expert placement (with replicas of hot experts) from recorded loads.
- `report`, `plot_metrics`: a run's dispatcher metrics as an HTML report or PNG figures.
"""
