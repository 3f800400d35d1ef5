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

import torch
from megalite.kernels.gpu_build import TARGETS, Built, Job, Launch, _UncomputedProducts, problems

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
    there would never be compiled for a GPU. Another Triton release is refused by name: the
    recording uses Triton's internals."""
    found = _in_build_process(
        """
        import importlib, inspect, json, pkgutil, re
        import torch
        from triton.runtime.autotuner import Autotuner
        from triton.runtime.jit import JITFunction
        import megalite.kernels as kernels
        from megalite.kernels import gpu_build

        shapes = gpu_build.Shapes(
            hidden=256,
            head_dim=64,
            heads=4,
            kv_heads=2,
            ffn=512,
            vocab=8064,
            real_vocab=8000,
            experts=8,
        )
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
        import triton
        triton.__version__ = "3.8.1"  # internals it was not written against
        try:
            gpu_build.launches(shapes, torch.bfloat16)
            refused = None
        except gpu_build.UnsupportedTriton as error:
            refused = str(error)
        print(json.dumps({"launched": sorted(launched), "refused": refused,
                          **{k: sorted(v) for k, v in recorded.items()}}))
        """,
        tmp_path,
    )
    launched = set(found["launched"])
    assert {"_fwd_kernel", "_rows_kernel", "_wgrad_kernel", "_norm_bwd_kernel"} <= launched
    assert set(found["torch.bfloat16"]) == launched
    # fp32: all but the weight-gradient GEMM, which takes 16-bit inputs only
    assert set(found["torch.float32"]) == launched - {"_wgrad_kernel"}
    assert "Triton 3.9's internals, and this is Triton 3.8.1" in found["refused"]


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
    largest tiles, and where every dK/dV tile but 64 x 32 and head_dim 256's 32 x 16 spilled):
    every candidate of the causal sweep, forward and backward, compiles for sm90, and each
    launch has one that fits. The README's run builds the tiny configs' shapes, every call."""
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
    # the sweeps: forward 5, the backward's preprocessing 1, dK/dV 6, dQ 4
    assert [kernels.count(k) for k in ("_fwd_kernel", "_bwd_preprocess")] == [5, 1]
    assert [kernels.count(k) for k in ("_bwd_dkdv_kernel", "_bwd_dq_kernel")] == [6, 4]


def test_one_rank_of_a_layout_compiles_what_one_gpu_does_not(tmp_path):
    """A config is built at one rank's sizes in its own layout as well as on one GPU. Where a
    split leaves one K/V head (llama-tiny's 2 at tp 4) or one expert (mixtral-tiny's 8 at ep 8)
    a rank, Triton compiles kernels of their own, which the single GPU's build never asks for;
    a layout that specialises nothing new adds no compile."""
    for name, layout in (("llama", "tp: 4"), ("mixtral", "tp: 2\n  ep: 8")):
        text = (REPO / f"configs/{name}-tiny.yaml").read_text()
        (tmp_path / f"{name}.yaml").write_text(f"{text}\nparallel:\n  {layout}\n")
    found = _in_build_process(
        f"""
        import json
        from types import SimpleNamespace
        from megalite.benchmarks import kernel_build
        from megalite.kernels import gpu_build

        def built(config, layouts):
            args = SimpleNamespace(configs=[config], layouts=layouts, dtypes=["bf16"], calls=None)
            labels = kernel_build._launches(args, gpu_build)
            jobs = gpu_build.jobs(list(labels), [gpu_build.TARGETS["sm90"]])
            return {{"splits": sorted({{labels[job.launch][1] for job in jobs}}),
                     "rank only": sorted({{job.launch.name for job in jobs
                                           if labels[job.launch][1] != "1x1"}}),
                     "jobs": len(jobs)}}

        found = {{}}
        for config in ("{tmp_path}/llama.yaml", "{tmp_path}/mixtral.yaml",
                       "configs/mixtral-tiny.yaml"):
            found[config] = {{"single": built(config, ["single"]),
                              "both": built(config, ["single", "own"]),
                              "rank": repr(kernel_build._shapes(config, "own", gpu_build)[1])}}
        print(json.dumps(found))
        """,
        tmp_path,
    )
    llama, mixtral = (found[f"{tmp_path}/{name}.yaml"] for name in ("llama", "mixtral"))
    assert "heads=1, kv_heads=1," in llama["rank"]
    assert "heads=2, kv_heads=1, ffn=" in mixtral["rank"]
    assert mixtral["rank"].endswith("experts=1, tokens=256)")
    for layout in (llama, mixtral):
        # the rank's own compiles are new; the single GPU's are all still there
        assert layout["both"]["splits"] == ["1x1", layout["both"]["splits"][1]]
        assert layout["both"]["jobs"] > layout["single"]["jobs"]
    assert llama["both"]["splits"][1] == "4x1"
    assert {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"} <= set(llama["both"]["rank only"])
    assert mixtral["both"]["splits"][1] == "2x8"
    assert "_rows_kernel" in mixtral["both"]["rank only"]  # the grouped GEMM, at one expert
    shipped = found["configs/mixtral-tiny.yaml"]  # tp 1, ep 1: its own layout is one GPU
    assert shipped["both"] == shipped["single"]


def test_a_training_step_launches_only_what_the_build_compiles(tmp_path):
    """The build's recorded calls stand for what training launches: one bf16 training step of
    each tiny model, recorded in a build-only process (on every rank of its layout for tp 4 +
    SP, tp 2 x ep 2, cp 2 with documents and cp 4 all-gather; its matrix products uncomputed,
    so a CPU without bf16 instructions records it as fast), launches no compile (kernel,
    argument types, specialisations, constants, candidate) that `build_kernels` of the same
    config and layout does not compile. It caught
    the weight-gradient kernel's overwrite mode and the causal blocks of document masking and
    context parallelism (the build had compiled non-causal ones, which no model launches)."""
    found = _in_build_process(
        f"""
        import json
        from pathlib import Path
        from types import SimpleNamespace
        import torch
        from megalite.benchmarks import kernel_build
        from megalite.config import load_config, save_config
        from megalite.kernels import gpu_build
        from megalite.launch import run_ranks
        from megalite.parallel_state import ParallelState
        from megalite.tensor_parallel import cross_entropy
        from megalite.training.loop import setup_topology
        from megalite.training.setup import build_run
        from megalite.training.step import train_step
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        SM90 = gpu_build.TARGETS["sm90"]

        def compiles(launches):
            backend = make_backend(GPUTarget("cuda", SM90.capability, 32))
            return {{repr(key) for launch in launches
                     for _, key in gpu_build._bound(launch, SM90, backend)}}

        # the loss is chunked as on a GPU (chunk sizes set the kernels' pointer alignments)
        cross_entropy.CHUNK_LOGIT_BYTES["cpu"] = cross_entropy.CHUNK_LOGIT_BYTES["cuda"]

        def step_compiles(config, world):
            cfg = load_config(config, [])
            ps = setup_topology(cfg) if world > 1 else ParallelState.single()
            run = build_run(cfg, ps, eos_id=1)
            torch.manual_seed(0)
            windows = cfg.train.global_batch_size // ps.size("dp")
            tokens = torch.randint(0, cfg.model.vocab_size, (windows, cfg.model.seq_len + 1))
            launches = []
            with gpu_build.record_launches(launches, "training step"):
                train_step(run, tokens, 1e-3)
            return sorted(compiles(launches))

        SHIPPED_ONE_LAYER = ["model.n_layers=1", "train.micro_batch_size=2"]
        CASES = {{  # the config, and the world it runs on
            # its width, heads and vocabulary; 2 x 1024 tokens make loss chunks of 1334 and 714
            "gpt2-124m": ("gpt2-124m", [*SHIPPED_ONE_LAYER, "train.global_batch_size=2"], 1),
            "gpt": ("gpt-tiny", [], 1),
            "llama-documents": ("llama-tiny", ["data.document_mask=true"], 1),
            "mixtral": ("mixtral-tiny", [], 1),
            "llama-tp4-sp": ("llama-tiny", ["parallel.tp=4", "parallel.sp=true"], 4),
            "mixtral-tp2-ep2": ("mixtral-tiny", ["parallel.tp=2", "parallel.ep=2"], 4),
            "llama-cp2-docs": ("llama-tiny", ["parallel.cp=2", "data.document_mask=true"], 2),
            "llama-cp4-gather": ("llama-tiny", ["parallel.cp=4", "parallel.cp_comm=allgather"], 4),
        }}
        found = {{}}
        for case, (name, overrides, world) in CASES.items():
            config = "{tmp_path}/" + case + ".yaml"
            overrides = ["train.precision=bf16", "train.device=cpu", "train.micro_batch_size=4",
                         *overrides]
            save_config(load_config(f"configs/{{name}}.yaml", overrides), Path(config))
            if world == 1:
                stepped = step_compiles(config, 1)
            else:  # every rank's, together
                stepped = sorted(set().union(*run_ranks(world, step_compiles, config, world)))
            args = SimpleNamespace(configs=[config], layouts=["own"], dtypes=["bf16"], calls=None)
            built = compiles(kernel_build._launches(args, gpu_build))
            missing = [key for key in stepped if key not in built]
            found[case] = {{"stepped": len(stepped), "kernels": sorted({{k[2:40].split("'")[0]
                           for k in stepped}}), "missing": missing[:3], "n_missing": len(missing)}}
        print(json.dumps(found))
        """,
        tmp_path,
    )
    assert len(found) == 8
    for case, result in found.items():
        assert result["n_missing"] == 0, (case, result["missing"])
        assert {"_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"} <= set(result["kernels"])
    assert "_rows_kernel" in found["mixtral"]["kernels"]
    assert "_fwd_kernel" in found["gpt"]["kernels"]


def test_a_recording_computes_no_matrix_product():
    """Inside a recording torch's products give empty tensors of the shape, strides and dtype
    they would have, and out= or in-place ones leave theirs as they were: a bf16 step's products
    cost nothing on a CPU without bf16 instructions. Every other op still computes."""
    a, b = torch.ones(6, 4, dtype=torch.bfloat16), torch.ones(5, 4, dtype=torch.bfloat16)
    out, accumulated = torch.zeros(6, 5, dtype=torch.bfloat16), torch.zeros(6, 5)
    with _UncomputedProducts():
        products = [a @ b.t(), torch.addmm(out, a, b.t()), torch.ones(3, 6, 4) @ torch.ones(4, 2)]
        torch.mm(a, b.t(), out=out)
        accumulated.addmm_(a.float(), b.float().t())
        added = a + a
    expected = [a.float() @ b.float().t(), a.float() @ b.float().t(), torch.empty(3, 6, 2)]
    for product, like in zip(products, expected):
        assert (product.shape, product.stride()) == (like.shape, like.stride())
    assert [p.dtype for p in products] == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert not out.any() and not accumulated.any()
    assert torch.equal(added, torch.full_like(a, 2))


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
