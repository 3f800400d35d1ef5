"""Throughput of `megalite data prepare` against a plain single-process `tokenizers` loop.

The benchmark is `megalite.benchmarks.prepare` (its docstring says what is measured); this
script only runs it, as does `python -m megalite.benchmarks.prepare`. For example:

    python tools/bench_prepare.py --mb 64 --workers 4
"""

from megalite.benchmarks.prepare import main

if __name__ == "__main__":
    main()
