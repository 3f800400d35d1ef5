"""What a checkpoint save costs in step time: megalite sync, megalite async, torch DCP async_save.

The benchmark is `megalite.benchmarks.checkpoint_save` (its docstring says what is measured and
how); this script only runs it, as does `python -m megalite.benchmarks.checkpoint_save`:

    python tools/bench_checkpoint.py
    python tools/bench_checkpoint.py --configs configs/gpt-tiny.yaml --ranks 2
"""

from megalite.benchmarks.checkpoint_save import main

if __name__ == "__main__":
    main()
