"""Estimate the memory of every pipeline rank of a layout: `megalite estimate` (its help and
`megalite.profiling.estimate` say what it counts); this script only runs it. For example:

    python tools/estimate_memory.py --config configs/gpt2-1.3b.yaml --world-size 8 \\
        train.recompute=none
    python tools/estimate_memory.py --config configs/llama-7b.yaml --world-size 64 \\
        model.seq_len=131072 parallel.cp=4     # the world is tp x cp x dp x pp
"""

import sys

from megalite.cli import main

if __name__ == "__main__":
    sys.exit(main(["estimate", *sys.argv[1:]]))
