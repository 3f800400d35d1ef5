"""Single-process training throughput: megalite against Hugging Face transformers.

The benchmark is `megalite.benchmarks.single` (its docstring says what is measured and how);
this script only runs it, as does `python -m megalite.benchmarks.single`. For example:

    python tools/bench_single.py --arch llama --kv-heads 2 --threads 2
"""

from megalite.benchmarks.single import main

if __name__ == "__main__":
    main()
