"""Benchmark megalite's fused kernels against PyTorch on a GPU, and print a table.

The benchmark is `megalite.benchmarks.kernels` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.kernels`. For example:

    python tools/bench_kernels.py --cpu-smoke      # tiny sizes under the Triton interpreter
"""

import sys

from megalite.benchmarks.kernels import main

if __name__ == "__main__":
    sys.exit(main())
