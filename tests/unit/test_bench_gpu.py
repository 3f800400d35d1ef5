"""The GPU benchmark (`megalite.benchmarks.gpu`) at a tiny size on CPU: its table has a row per
contender and both sides learn; each contender, trained alone in a plain loop, trains exactly
as a run of its own, and is freed before the next one is built."""

import weakref
from pathlib import Path

import pytest
import torch

from megalite.benchmarks import gpu, harness
from megalite.parallel_state import ParallelState

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "gpt2-124m.yaml")
TINY = ["--device", "cpu", "--configs", CONFIG, "--layers", "2", "--hidden", "64", "--heads", "2"]
TINY += ["--seq", "32", "--vocab", "512", "--micro-batch", "2", "--steps", "3", "--warmup", "1"]
NAMES = ["megalite", "megalite compile", "transformers compile"]


def test_tiny_run_on_cpu(capsys):
    args = gpu.options().parse_args(TINY)
    rows = gpu.run(args)
    assert [(row["model"], row["name"]) for row in rows] == [("gpt2-124m", n) for n in NAMES]
    for row in rows:
        assert len(row["losses"]) == 4
        assert row["losses"][-1] < row["losses"][0], row["name"]
        assert row["tokens_s"] > 0 and row["tflops"] > 0 and row["compile_s"] is not None
        assert "peak_bytes" not in row  # a CPU has no allocator peak to read

    # the rows' megalite trained as a run of its own does, on the same batches
    model = gpu.model_args(args, CONFIG)
    run = harness.megalite_run(
        gpu.benchmark_config(model, torch.device("cpu")), ParallelState.single()
    )
    step = harness.megalite_step(run, model.lr)
    batches = harness.make_batches(model, 4, model.micro_batch)
    assert rows[0]["losses"] == pytest.approx([step(b)["loss"] for b in batches], rel=1e-6)

    gpu.report(args, rows)
    table = capsys.readouterr().out
    assert "tokens/s" in table and "MFU" in table and "compile s" in table
    for name in NAMES:
        assert f"{name} " in table


def test_a_measured_contender_is_freed():
    """Nothing of a contender outlives its row: the next one gets the device to itself."""
    built = []

    def build() -> harness.Contender:
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        built.append(weakref.ref(model))

        def step(tokens: torch.Tensor) -> dict[str, float]:
            optimizer.zero_grad()
            loss = model(tokens).sum()
            loss.backward()
            optimizer.step()
            return {"loss": loss.item()}

        return harness.Contender("c", step)

    row = gpu.measure_alone(build, [torch.ones(2, 4)] * 3, 1, torch.device("cpu"), 8)
    assert built[0]() is None
    assert row["name"] == "c" and len(row["losses"]) == 3 and row["compile_s"] is not None
