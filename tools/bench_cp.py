"""Context-parallel attention: ring against all-gathered K/V (`megalite.benchmarks.cp`). E.g.

python tools/bench_cp.py --seq 4096 --cp 2
torchrun --nproc-per-node 8 tools/bench_cp.py --seq 32768 --heads 32 --kv-heads 8 --head-dim 128
"""

from megalite.benchmarks.cp import main

if __name__ == "__main__":
    main()
