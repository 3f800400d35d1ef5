"""Compiling the kernels for a GPU without one (`megalite.kernels.gpu_build`): the recorded calls
reach every kernel megalite launches, and what would fail on a GPU is named, from a real
compile. The build of the shipped configs' kernels themselves is the README's
`python tools/build_kernels.py` (tests/e2e/test_readme.py).

The builds run in a subprocess: a build-only process imports the kernels with their GPU
sweeps, where this session imported them for the interpreter."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

from megalite.kernels.gpu_build import TARGETS, Built, Job, Launch, problems

REPO = Path(__file__).resolve().parents[2]


def _in_build_process(script: str, directory: Path) -> dict:
    """Run `script` in a build-only process (from a file: Triton reads a kernel's source); it
    prints one JSON object, returned here."""
    path = directory / "build_script.py"
    path.write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MEGALITE_TRITON_BUILD_ONLY"] = "1"
    done = subprocess.run(
        [sys.executable, str(path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_recorded_calls_launch_every_kernel_megalite_has(tmp_path):
    """Every Triton kernel a kernels module launches (`name[grid](...)` in its source) is among
    the launches `kernel_calls` records, in 16 bits and in fp32: a new kernel without a call
    there would never be compiled for a GPU."""
    found = _in_build_process(
        """
        import importlib, inspect, json, pkgutil, re
        import torch
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        import megalite.kernels as kernels
        from megalite.kernels import gpu_build

        shapes = gpu_build.Shapes(hidden=256, heads=4, kv_heads=2, ffn=512, vocab=8064, experts=8)
        recorded = {}
        for dtype in (torch.bfloat16, torch.float32):
            for launch in gpu_build.launches(shapes, dtype):
                recorded.setdefault(str(dtype), set()).add(launch.name)
        launched = set()
        for module in pkgutil.iter_modules(kernels.__path__):
            module = importlib.import_module(f"megalite.kernels.{module.name}")
            source = inspect.getsource(module)
            for name, value in vars(module).items():
                kernel = isinstance(value, (JITFunction, Autotuner))
                if kernel and re.search(rf"\\b{name}\\[", source):
                    launched.add(name)
        print(json.dumps({"launched": sorted(launched),
                          **{k: sorted(v) for k, v in recorded.items()}}))
        """,
        tmp_path,
    )
    launched = set(found["launched"])
    assert {"_fwd_kernel", "_rows_kernel", "_wgrad_kernel", "_norm_bwd_kernel"} <= launched
    assert set(found["torch.bfloat16"]) == launched
    # fp32: all but the weight-gradient GEMM, which takes 16-bit inputs only
    assert set(found["torch.float32"]) == launched - {"_wgrad_kernel"}


def test_what_would_fail_on_the_gpu_is_named_from_a_real_compile(tmp_path):
    """A toy kernel compiled for real: a tile whose two pipeline stages need more shared memory
    than an sm89 block has (99 KiB) is reported with what it needs, but passes on sm90 beside a
    candidate that fits; a kernel the compiler rejects is reported with the compiler's error."""
    found = _in_build_process(
        """
        import json
        import torch
        import triton
        import triton.language as tl
        from megalite.kernels import gpu_build

        @triton.jit
        def tile_product(A, B, C, K, BLOCK: tl.constexpr):
            rows = tl.arange(0, BLOCK)
            acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
            for k in range(0, K, BLOCK):
                a = tl.load(A + rows[:, None] * K + k + rows[None, :])
                b = tl.load(B + (k + rows[:, None]) * BLOCK + rows[None, :])
                acc += tl.dot(a, b)
            tl.store(C + rows[:, None] * BLOCK + rows[None, :], acc)

        @triton.jit
        def mismatched(A, BLOCK: tl.constexpr):
            rows = tl.arange(0, BLOCK)
            a = tl.load(A + rows[:, None] * BLOCK + rows[None, :])
            b = tl.load(A + rows[:, None] * 2 * BLOCK + tl.arange(0, 2 * BLOCK)[None, :])
            tl.store(A + rows, tl.sum(tl.dot(b, a), axis=1))

        x = torch.empty(256, 4096, dtype=torch.bfloat16)
        big = triton.Config({"BLOCK": 128}, num_warps=8, num_stages=3)
        small = triton.Config({"BLOCK": 64}, num_warps=4, num_stages=2)
        launches = [
            gpu_build.Launch("big tiles", tile_product, (x, x, x, 4096), {}, [big]),
            gpu_build.Launch("either", tile_product, (x, x, x, 4096), {}, [big, small]),
            gpu_build.Launch("wrong shapes", mismatched, (x,), {"BLOCK": 32}, [None]),
        ]
        targets = [gpu_build.TARGETS["sm89"], gpu_build.TARGETS["sm90"]]
        built = [gpu_build.build(job) for job in gpu_build.jobs(launches, targets)]
        rows = [[b.job.launch.call, b.job.candidate, b.job.target.name, b.shared, b.error]
                for b in built]
        print(json.dumps({"rows": rows, "problems": gpu_build.problems(built)}))
        """,
        tmp_path,
    )
    shared = {(call, cand, target): need for call, cand, target, need, _ in found["rows"]}
    assert shared[("big tiles", "128 w8 s3", "sm89")] > 99 * 1024
    assert shared[("either", "64 w4 s2", "sm89")] <= 99 * 1024
    assert ("either", "128 w8 s3", "sm89") not in shared  # the same compile as "big tiles"
    problems_found = found["problems"]
    assert len(problems_found) == 3, problems_found
    assert any("tile_product (big tiles) on sm89: no candidate fits" in p for p in problems_found)
    failed = [p for p in problems_found if p.startswith("mismatched - on ")]
    assert len(failed) == 2, problems_found
    assert all("CompilationError: input and other must have equal reduction" in p for p in failed)


def test_attention_at_a_shipped_head_size_of_128_builds_for_an_h100():
    """Mixtral 8x7B's attention at its own sizes (head_dim 128, 4 query heads per K/V head: the
    largest tiles, and where every dK/dV tile but 64 x 32 spilled): every candidate of the
    causal sweep, forward and backward, compiles for sm90, and each launch has one that fits.
    The README's run builds the tiny configs' shapes, every call."""
    done = subprocess.run(
        [sys.executable, "tools/build_kernels.py", "--configs", "configs/mixtral-8x7b.yaml"]
        + ["--calls", "attention", "--jobs", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("mixtral-8x7b")]
    kernels = [next(cell for cell in row if cell.startswith("_")) for row in rows]
    # the sweeps: forward 5, the backward's preprocessing 1, dK/dV 5, dQ 4
    assert [kernels.count(k) for k in ("_fwd_kernel", "_bwd_preprocess")] == [5, 1]
    assert [kernels.count(k) for k in ("_bwd_dkdv_kernel", "_bwd_dq_kernel")] == [5, 4]


def _built(launch: Launch, target: str, shared: int, error: str | None = None) -> Built:
    job = Job(launch, f"{shared}", TARGETS[target], source=None, options={})
    return Built(job, seconds=0.0, shared=shared, error=error)


def test_a_launch_is_fine_when_one_candidate_fits():
    """The autotuner skips a candidate that does not fit, so a launch fails only when none
    does; a compile error is a problem whatever else fits."""
    tight = TARGETS["sm89"].shared_memory
    sweep = Launch("sweep", SimpleNamespace(__name__="sweep_kernel"), (), {}, [])
    lone = Launch("lone", SimpleNamespace(__name__="lone_kernel"), (), {}, [])
    fine = [_built(sweep, "sm89", tight + 1), _built(sweep, "sm89", tight)]
    assert problems(fine) == []
    too_big = [_built(lone, "sm89", tight + 1)]
    assert len(problems(fine + too_big)) == 1
    broken = [_built(sweep, "sm90", 0, error="PTXASError: bad")]
    assert problems(fine + broken) == ["sweep_kernel 0 on sm90: PTXASError: bad"]
