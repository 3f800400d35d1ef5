"""What creating the process groups costs each rank, at 1,024 ranks (torch's fake backend) and on
gloo ranks here.

The benchmark is `megalite.benchmarks.group_startup` (its docstring says what is measured and
how); this script only runs it, as does `python -m megalite.benchmarks.group_startup`:

    python tools/bench_group_startup.py
    python tools/bench_group_startup.py --fake 1024:8:8 --gloo 8:2:2
"""

from megalite.benchmarks.group_startup import main

if __name__ == "__main__":
    main()
