"""Pipeline parallelism, pp=2 on two gloo ranks: megalite's 1F1B, interleaved 1F1B, ZB-H1 and
ZB-V against torch.distributed.pipelining's 1F1B, interleaved 1F1B and ZBV schedules.

The benchmark is `megalite.benchmarks.pp` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.pp`. For example:

    python tools/bench_pp.py --microbatches 4
    torchrun --nproc-per-node 2 tools/bench_pp.py
"""

from megalite.benchmarks.pp import main

if __name__ == "__main__":
    main()
