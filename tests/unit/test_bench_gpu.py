"""The GPU benchmark (`megalite.benchmarks.gpu`) at a tiny size on CPU: its table has a row per
contender and both sides learn; a contender whose state waits in host memory between its steps
(or, with --resident, stays on the device) trains exactly as one that never left the device."""

from pathlib import Path

import pytest
import torch

from megalite.benchmarks import gpu, harness
from megalite.parallel_state import ParallelState

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "gpt2-124m.yaml")
TINY = ["--device", "cpu", "--configs", CONFIG, "--layers", "2", "--hidden", "64", "--heads", "2"]
TINY += ["--seq", "32", "--vocab", "512", "--micro-batch", "2", "--steps", "3", "--warmup", "1"]
NAMES = ["megalite", "megalite compile", "transformers compile"]


@pytest.mark.parametrize("where", [[], ["--resident"]], ids=["parked", "resident"])
def test_tiny_run_on_cpu(capsys, where):
    args = gpu.options().parse_args(TINY + where)
    rows = gpu.run(args)
    assert [(row["model"], row["name"]) for row in rows] == [("gpt2-124m", n) for n in NAMES]
    for row in rows:
        assert len(row["losses"]) == 4
        assert row["losses"][-1] < row["losses"][0], row["name"]
        assert row["tokens_s"] > 0 and row["tflops"] > 0 and row["compile_s"] is not None
        assert "peak_bytes" not in row  # a CPU has no allocator peak to read

    # the rows' megalite trained as a run that stayed put: moving its state off and back
    # between steps (storages emptied and refilled in place) changed nothing, nor did staying
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


def test_state_waits_off_the_device_between_steps():
    """The contender's storages are emptied at once (shared ones once) and after each `leave`;
    `enter` brings the same values back into the same storages, so views and optimizer
    references stay valid."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    alias = model.weight.view(-1)  # a view shares the weight's storage
    tensors = [*model.parameters(), alias, *optimizer.state[model.weight].values()]
    before = [t.clone() for t in tensors]
    contender = harness.Contender("c", lambda tokens: {"loss": 0.0})
    gpu.off_device_between_steps(contender, lambda: tensors, torch.device("cpu"))

    for _ in range(2):
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
        contender.enter()
        for tensor, value in zip(tensors, before):
            assert torch.equal(tensor, value)
        assert alias.data_ptr() == model.weight.data_ptr()
        contender.leave()


def test_resident_state_stays_on_the_device():
    model = torch.nn.Linear(4, 3)
    contender = harness.Contender("c", lambda tokens: {"loss": 0.0})
    gpu.between_steps(contender, model.parameters, torch.device("cpu"), resident=True)
    contender.enter()
    contender.leave()
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())


def test_resident_peak_is_own_state_plus_the_steps_rise(monkeypatch):
    """On a GPU holding every contender, a contender's peak counts its own state (1,000 bytes)
    and what its step allocated above the start (5,000 -> 5,700), not the others' state."""
    allocated = {"now": 5_000, "max": 5_700}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["max"])
    monkeypatch.setattr(gpu, "_storages", lambda tensors, device: list(tensors))
    state = [torch.empty(600, dtype=torch.uint8).untyped_storage() for _ in range(2)]
    state[1].resize_(400)
    contender = harness.Contender("c", lambda tokens: {"loss": 0.0})
    gpu.between_steps(contender, lambda: state, torch.device("cuda"), resident=True)
    contender.enter()
    contender.leave()
    assert contender.info["peak_bytes"] == 1_000 + 700
    allocated.update(now=5_100, max=5_300)  # a smaller step later does not lower it
    contender.enter()
    contender.leave()
    assert contender.info["peak_bytes"] == 1_700
