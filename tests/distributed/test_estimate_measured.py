"""The memory estimate equals measurement: on 4 gloo ranks, GPT and Llama in many layouts (tp 1
and 2, sp on and off, recompute none / selective / full / segments, pp 2 with every schedule,
ZeRO-1 over dp 2 and 4, dropout on and off, fp32 and bf16), each rank's parameter, gradient and
optimizer bytes counted from its live tensors equal `estimate_layout`'s for its pipeline stage
exactly, and the peak of the activations autograd keeps over a real schedule
(`SavedActivationTracker`; under zb-h1 / zb-v with what the split backward keeps from B to W)
is within 5 % of the estimate."""

import pytest
import torch

from megalite.config import Config, load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.memory import SavedActivationTracker, live_bytes
from megalite.training.setup import build_run
from megalite.training.step import micro_batches

WORLD = 4
DEFERRED = "deferred weight-grad inputs"
MICROBATCHES = 4
TINY = (
    "model.n_layers=4",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",
    "model.seq_len=32",
    "train.micro_batch_size=2",
)
LAYOUTS = {
    "gpt": [
        ("parallel.zero=1", "parallel.bucket_mb=0.05", "train.recompute=segments"),
        ("parallel.tp=2", "model.dropout=0.1"),
        ("parallel.tp=2", "parallel.sp=true", "train.recompute=selective", "model.dropout=0.1"),
        (
            "parallel.pp=2",
            "parallel.schedule=gpipe",
            "train.recompute=full",
            "train.precision=bf16",
        ),
        ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.schedule=1f1b"),
        (
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=interleaved",
            "parallel.zero=1",
            "train.recompute=full",
            "train.recompute_layers=1",
        ),
        ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.schedule=zb-h1"),
        (
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=zb-v",
            "train.recompute=selective",
            "model.dropout=0.1",
        ),
    ],
    "llama": [
        ("model.n_kv_heads=2", "parallel.zero=1", "model.dropout=0.1", "train.precision=bf16"),
        ("model.n_kv_heads=1", "parallel.tp=2", "parallel.sp=true"),
        ("model.n_kv_heads=2", "parallel.tp=2", "train.recompute=selective", "model.dropout=0.1"),
        ("model.n_kv_heads=2", "parallel.pp=2", "parallel.schedule=1f1b", "train.recompute=full"),
        ("model.n_kv_heads=2", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"),
        ("model.n_kv_heads=1", "parallel.pp=2", "parallel.tp=2", "parallel.schedule=zb-h1"),
        (
            "model.n_kv_heads=2",
            "parallel.pp=2",
            "parallel.vpp=2",
            "parallel.schedule=zb-v",
            "parallel.zero=1",
        ),
    ],
}


def _config(path: str | None, overrides: tuple[str, ...]) -> Config:
    """The layout with MICROBATCHES micro-batches per step on each of its dp ranks."""
    base = load_config(path, overrides)
    p = base.parallel
    batch = base.train.micro_batch_size * MICROBATCHES * WORLD // (p.tp * p.pp)
    return load_config(path, [*overrides, f"train.global_batch_size={batch}"])


def _measure(cfgs: list[Config]) -> list[tuple[int, dict[str, int], int]]:
    """(pp rank, live bytes, peak saved-activation bytes) of this rank for every config."""
    results = []
    for cfg in cfgs:
        ps = build_parallel_state(cfg.parallel.tp, cfg.parallel.pp, torch.device("cpu"))
        run = build_run(cfg, ps)
        run.train(True)
        torch.manual_seed(ps.dp_rank)
        rows = MICROBATCHES * cfg.train.micro_batch_size
        tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.seq_len + 1))
        batches = micro_batches(tokens, cfg.train.micro_batch_size)
        held = [t for chunk in run.chunks for t in (*chunk.parameters(), *chunk.buffers())]
        with SavedActivationTracker(exclude=held) as saved:
            run.executor.run(run.schedule(len(batches)), batches, loss_weight=1e-3)
        assert saved.current == 0  # every saved tensor was released by backward
        results.append((ps.pp_rank, live_bytes(run), saved.peak))
    return results


def _check(cfgs: list[Config], names: list[str]) -> None:
    per_rank = run_ranks(WORLD, _measure, cfgs, timeout=240)
    for i, (cfg, name) in enumerate(zip(cfgs, names, strict=True)):
        est = estimate_layout(cfg, WORLD, device="cpu")
        for rank, results in enumerate(per_rank):
            pp_rank, live, peak = results[i]
            stage = est.stages[pp_rank]
            where = f"{name} rank {rank} (pp rank {pp_rank})"
            predicted = {
                "params": stage.part("parameters"),
                "buffers": stage.part("buffers"),
                "grads": stage.part("gradients"),
                "optimizer": stage.part("optimizer"),
            }
            assert live == predicted, where
            kept = sum(map(stage.part, ("activations", "head weight grads", DEFERRED)))
            print(f"{where}: saved activations measured {peak} B, estimated {kept} B")
            assert peak == pytest.approx(kept, rel=0.05), where


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_estimate_equals_measurement(arch):
    cfgs = [_config(None, (f"model.arch={arch}", *TINY, *layout)) for layout in LAYOUTS[arch]]
    _check(cfgs, [f"{arch} {layout}" for layout in LAYOUTS[arch]])


SHIPPED = {  # at the shipped widths, vocabulary (the head's chunked loss) and micro-batch 8
    "configs/gpt-tiny.yaml": ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2"),
    "configs/llama-tiny.yaml": ("parallel.tp=2", "parallel.sp=true", "parallel.zero=1"),
}


def test_estimate_equals_measurement_at_the_shipped_sizes():
    _check([_config(path, layout) for path, layout in SHIPPED.items()], list(SHIPPED))
