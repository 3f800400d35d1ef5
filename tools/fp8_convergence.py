"""Train gpt-tiny 300 steps in the training precision and under each float8 recipe, print the
final validation losses and plot the curves (the benchmark is `megalite.benchmarks.fp8_convergence`;
its docstring says what is run). For example:

    python tools/fp8_convergence.py                      # gpt-tiny, 300 steps, builtin corpus
    python tools/fp8_convergence.py --recipes none tensorwise --steps 100
"""

import sys

from megalite.benchmarks.fp8_convergence import main

if __name__ == "__main__":
    sys.exit(main())
