"""`python -m megatron_deepep.bench`: the dispatch and combine benchmark (`bench.run`)."""

from megatron_deepep.bench.run import main

main()
