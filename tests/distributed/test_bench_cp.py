"""`tools/bench_cp.py` runs on gloo ranks and prints both communication modes, with the bytes
each sends: the ring K/V forward and back plus fp32 dK/dV, the all-gather its K/V pieces."""

import subprocess
import sys
from pathlib import Path

ARGS = ["--seq", "256", "--heads", "2", "--kv-heads", "1", "--head-dim", "16"]
TOOL = Path(__file__).parents[2] / "tools" / "bench_cp.py"


def test_bench_cp_prints_both_modes():
    command = [sys.executable, str(TOOL), *ARGS, "--cp", "2", "--steps", "1", "--warmup", "0"]
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
    rows = {
        line.split()[0]: line.split() for line in lines if line.startswith(("p2p", "allgather"))
    }
    kv_mib = 2 * 128 * 16 * 4 / 2**20  # one rank's stacked K/V: 2 x 128 tokens x 16 x fp32
    # ring, cp 2: K/V once forward, once backward, fp32 dK/dV twice (to the next, then home)
    assert float(rows["p2p"][3]) == round(4 * kv_mib, 2)
    assert float(rows["p2p"][1]) > 0 and float(rows["allgather"][1]) > 0
