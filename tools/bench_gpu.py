"""Training throughput on one GPU: megalite (eager and compiled) against Hugging Face
transformers under torch.compile.

The benchmark is `megalite.benchmarks.gpu` (its docstring says what is measured and how); this
script only runs it, as does `python -m megalite.benchmarks.gpu`. For example:

    python tools/bench_gpu.py --configs configs/gpt2-1.3b.yaml --micro-batch 4
"""

from megalite.benchmarks.gpu import main

if __name__ == "__main__":
    main()
