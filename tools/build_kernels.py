"""Compile every Triton kernel megalite launches for a GPU, on any machine, and print what each
candidate tile needs there: shared memory, registers, spilled bytes, compile seconds.

The tool is `megalite.benchmarks.kernel_build` (its docstring says what is built and how to read
the table); this script only runs it, as does `python -m megalite.benchmarks.kernel_build`:

    python tools/build_kernels.py                                   # shipped configs, bf16, sm90
    python tools/build_kernels.py --targets sm90 sm80 sm89 --dtypes bf16 fp16
"""

import sys

from megalite.benchmarks.kernel_build import main

if __name__ == "__main__":
    sys.exit(main())
