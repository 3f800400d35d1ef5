"""Benchmark the pieces of a mixture-of-experts layer (the grouped GEMM against the per-expert
loop), and print a table.

The benchmark is `megalite.benchmarks.moe` (its docstring says what is measured and how); this
script only runs it, as does `python -m megalite.benchmarks.moe`. For example:

    python tools/bench_moe.py                 # a GPU: the Triton kernel; CPU: the reference
    python tools/bench_moe.py --cpu-smoke     # tiny sizes under the Triton interpreter
"""

import sys

from megalite.benchmarks.moe import main

if __name__ == "__main__":
    sys.exit(main())
