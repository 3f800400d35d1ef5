"""The peak FLOP/s that MFU divides by, and the cores of this machine.

The peak is a property of the hardware, never of the run: a GPU's dense datasheet figure for
the training dtype (never the 2:4-sparsity one), and a CPU's best large matmul, measured once
per machine with all its cores and cached on disk (`cpu_peak_flops`), so that every run and
every rank on that machine divides by the same number. Below everything that reports MFU or
sizes work to the cores (metrics, the planner, the offloaded optimizer).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used, so that `megalite plan` starts without torch
    import torch


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak TFLOP/s of one GPU by matmul input dtype, from its vendor's datasheet."""

    name: str
    bf16: float
    fp16: float
    tf32: float
    fp32: float


# First match wins: more specific names come before those they contain ("H100 PCIe" before
# "H100", "L40S" before "L4", "A100" before "A10G" and "A10"). The patterns are matched against
# torch.cuda.get_device_name(), lower-cased, e.g. "NVIDIA H100 80GB HBM3" or "AMD Instinct MI300X".
GPU_PEAKS: tuple[tuple[str, GpuPeak], ...] = (
    (r"h100.*pcie", GpuPeak("H100 PCIe", 756.0, 756.0, 378.0, 51.0)),
    (r"h100.*nvl", GpuPeak("H100 NVL", 835.0, 835.0, 418.0, 60.0)),
    (r"h100", GpuPeak("H100 SXM", 989.4, 989.4, 494.7, 66.9)),
    (r"h200.*nvl", GpuPeak("H200 NVL", 835.0, 835.0, 418.0, 60.0)),
    (r"h200", GpuPeak("H200 SXM", 989.4, 989.4, 494.7, 66.9)),
    (r"b200", GpuPeak("B200 (HGX, 1000 W)", 2250.0, 2250.0, 1100.0, 75.0)),
    (r"a100", GpuPeak("A100", 312.0, 312.0, 156.0, 19.5)),
    (r"l40s", GpuPeak("L40S", 362.1, 362.1, 183.0, 91.6)),
    (r"\bl4\b", GpuPeak("L4", 121.0, 121.0, 60.0, 30.3)),
    (r"a10g", GpuPeak("A10G", 70.0, 70.0, 35.0, 35.0)),
    (r"\ba10\b", GpuPeak("A10", 125.0, 125.0, 62.5, 31.2)),
    (r"rtx 4090", GpuPeak("RTX 4090", 165.2, 165.2, 82.6, 82.6)),
    (r"mi300x", GpuPeak("MI300X", 1307.4, 1307.4, 653.7, 163.4)),
)
"""Sources: NVIDIA's H100, H200, A100, L40S, L4 and A10 datasheets, the HGX B200 and Ada
(RTX 4090: fp16/bf16 with fp32 accumulate) whitepapers, AMD's MI300X datasheet; the A10G (an AWS
part without a public NVIDIA datasheet) as AWS publishes it. fp32 is the non-tensor rate (the
MI300X's is its fp32 matrix rate)."""


def gpu_peak(device_name: str) -> GpuPeak | None:
    """The table's entry for a device name as torch reports it, or None when it is not there."""
    lowered = device_name.lower()
    for pattern, peak in GPU_PEAKS:
        if re.search(pattern, lowered):
            return peak
    return None


def gpu_peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of a GPU for `precision` (bf16, fp16 or fp32; fp32 matmuls run as
    TF32 unless torch's float32 matmul precision is "highest"), or None for a device missing
    from the table."""
    import torch

    peak = gpu_peak(device_name)
    if peak is None:
        return None
    if precision == "fp32":
        tf32 = torch.get_float32_matmul_precision() != "highest"
        tflops = peak.tf32 if tf32 else peak.fp32
    else:
        tflops = getattr(peak, precision)
    return tflops * 1e12


def unknown_peak_message(device: torch.device) -> str:
    """What a run says once when it cannot compute MFU."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_model()
    return (
        f"unknown peak for {name}: pass logging.peak_tflops=<dense TFLOP/s of one device> "
        "to get MFU (logged as null until then)"
    )


@functools.cache
def peak_flops(device: torch.device, precision: str) -> float | None:
    """Dense peak FLOP/s of one device for the training `precision`: a GPU's datasheet figure
    (None when the GPU is unknown), or the whole machine's for a CPU, which its ranks share."""
    import torch

    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), precision)
    return cpu_peak_flops(precision)


# A self-contained script (torch only), run in a fresh process: the measurement then uses every
# core without touching the caller's threads, RNG or a forked OpenMP pool.
_MATMUL_BENCHMARK = """
import sys, time, torch

threads, largest, dtype = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
repeats, slow = int(sys.argv[4]), float(sys.argv[5])
torch.set_num_threads(threads)
g = torch.Generator().manual_seed(0)
n = 256
while True:  # up to `largest`, or where one product takes `slow` seconds (slow dtypes)
    a, b = (torch.randn(n, n, generator=g).to(dtype) for _ in range(2))
    start = time.perf_counter()
    a @ b
    if n >= largest or time.perf_counter() - start > slow:
        break
    n *= 2
best = 0.0
for _ in range(repeats):
    start = time.perf_counter()
    a @ b
    best = max(best, 2 * n**3 / (time.perf_counter() - start))
print(n, best)
"""
CPU_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
PEAK_CACHE_FILE = "cpu_peak_flops.json"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_peak_key(precision: str) -> str:
    """What the cached peak belongs to: this host, its CPU, the cores usable, torch and dtype."""
    import torch

    return " | ".join(
        (socket.gethostname(), _cpu_model(), f"{cpu_cores()} cores", torch.__version__, precision)
    )


def measure_cpu_peak_flops(precision: str, repeats: int = 5, slow: float = 0.25) -> float:
    """Best of `repeats` large square matmuls on all cores, in a fresh process: as large as
    keeps every core busy, or, where the dtype is slow, the first size (doubling from 256)
    whose product takes over `slow` seconds (fp16 on most CPUs: a product of 2048 takes
    seconds, and a first fp16 run would seem to hang)."""
    cores = cpu_cores()
    size = 2048 if cores <= 16 else 4096  # large enough to keep every core busy
    args = [str(cores), str(size), CPU_DTYPES[precision], str(repeats), str(slow)]
    done = subprocess.run(
        [sys.executable, "-c", _MATMUL_BENCHMARK, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": str(cores)},
    )
    return float(done.stdout.split()[-1])


def cpu_peak_flops(precision: str, cache_dir: Path | None = None) -> float:
    """This machine's peak FLOP/s for `precision`: measured by the first process that asks
    (under a file lock, so ranks starting together measure once, and never while another
    measures), then read back from `<cache>/cpu_peak_flops.json` (cache: $MEGALITE_CACHE, else
    ~/.cache/megalite). Delete the file to measure again."""
    from megalite.data.builtin import cache_root  # the one machine-wide cache of megalite

    root = cache_root(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    path, key = root / PEAK_CACHE_FILE, cpu_peak_key(precision)
    with open(root / (PEAK_CACHE_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        peaks = _read_peaks(path)
        if key not in peaks:
            peaks[key] = measure_cpu_peak_flops(precision)
            _write_atomically(path, json.dumps(peaks, indent=1, sort_keys=True))
        return float(peaks[key])


def raise_cpu_peak_flops(precision: str, achieved: float, cache_dir: Path | None = None) -> None:
    """Record that this machine achieved `achieved` FLOP/s: a peak measured while the cores were
    busy with other work reads low, and the machine has just shown it can do more. The cached
    peak only ever rises, so MFU never reads above 1 because of when the peak was taken."""
    from megalite.data.builtin import cache_root

    root = cache_root(cache_dir)
    path, key = root / PEAK_CACHE_FILE, cpu_peak_key(precision)
    with open(root / (PEAK_CACHE_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        peaks = _read_peaks(path)
        if achieved > peaks.get(key, 0.0):
            peaks[key] = achieved
            _write_atomically(path, json.dumps(peaks, indent=1, sort_keys=True))


def _read_peaks(path: Path) -> dict[str, float]:
    """The cached peaks; none when the file is missing or damaged (then measured again)."""
    try:
        peaks = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return peaks if isinstance(peaks, dict) else {}


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_id() -> int:
    """This host's name as a stable 63-bit number (Python's hash() differs per process)."""
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
