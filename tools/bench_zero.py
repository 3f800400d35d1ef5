"""ZeRO-1 on two gloo ranks: megalite against DDP + ZeroRedundancyOptimizer(AdamW).

The benchmark is `megalite.benchmarks.zero` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.zero`. For example:

    python tools/bench_zero.py --microbatches 4 --no-baselines
    torchrun --nproc-per-node 2 tools/bench_zero.py
"""

from megalite.benchmarks.zero import main

if __name__ == "__main__":
    main()
