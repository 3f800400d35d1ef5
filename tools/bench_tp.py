"""Tensor parallelism, tp=2 on two gloo ranks: megalite against PyTorch's own TP (DTensor).

The benchmark is `megalite.benchmarks.tp` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.tp`. For example:

    python tools/bench_tp.py --steps 12 --microbatches 8
    torchrun --nproc-per-node 2 tools/bench_tp.py
"""

from megalite.benchmarks.tp import main

if __name__ == "__main__":
    main()
