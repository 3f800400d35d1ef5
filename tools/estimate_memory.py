"""Estimate the memory of one GPU of a training run (first pipeline stage, the fullest one).

The estimate is `megalite.profiling.memory_report` (its docstring says what it counts); this
script only prints it, as does `python -m megalite.profiling.memory_report`. For example:

    python tools/estimate_memory.py --config configs/gpt2-1.3b.yaml --world-size 8 \
        train.recompute=none
"""

from megalite.profiling.memory_report import main

if __name__ == "__main__":
    main()
