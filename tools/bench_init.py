"""Start-up cost of initialising one rank's weights: shard-only against full-tensor draws.

The benchmark is `megalite.benchmarks.init` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.init`. For example:

    python tools/bench_init.py --layout configs/llama-7b.yaml:tp=8,pp=4,vpp=2
"""

from megalite.benchmarks.init import main

if __name__ == "__main__":
    main()
