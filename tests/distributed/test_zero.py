"""ZeRO data parallelism: equivalence with the single-process run (dp 2 and 4, zero 0 and 1,
combined with tp, with interleaved pp, and the full 3D layout on 8 ranks), the optimizer's
memory per rank, and the overlap of the gradient reduce-scatter with backward."""

import pytest
import torch
from equivalence import TINY, assert_equivalent

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("zero", [0, 1])
def test_dp_matches_single_process(builtin_corpus, tmp_path, dp, zero):
    assert_equivalent(dp, LLAMA, (f"parallel.zero={zero}",), tmp_path)


@pytest.mark.parametrize(
    "world,layout",
    [
        (4, ("parallel.tp=2", "parallel.zero=1")),
        (
            4,
            ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved", "parallel.zero=1"),
        ),
        (8, ("parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero=1")),
    ],
    ids=["dp2-tp2", "dp2-pp2-vpp2", "3d-tp2-pp2-dp2-sp"],
)
def test_zero1_composes(builtin_corpus, tmp_path, world, layout):
    assert_equivalent(world, GPT, layout, tmp_path)  # GPT: tied embeddings across stages


def _build(overrides, world_size):
    cfg = load_config(None, [*TINY, *overrides])
    ps = build_parallel_state(cfg.parallel.tp, cfg.parallel.pp, torch.device("cpu"))
    return build_run(cfg, ps)


def _optimizer_bytes(zero, precision):
    run = _build(
        [f"parallel.zero={zero}", "parallel.bucket_mb=0.05", f"train.precision={precision}"], 2
    )
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in run.optimizer.states
        for t in (s.exp_avg, s.exp_avg_sq) + ((s.master,) if s.master is not s.params else ())
    )
    params = sum(p.numel() for p in run.names)
    padding = sum(b.params_flat.numel() for b in run.buffers) - params
    buckets = sum(len(b.buckets) for b in run.buffers)
    return state_bytes, params, padding, buckets


@pytest.mark.parametrize("zero", [0, 1])
@pytest.mark.parametrize("precision,per_element", [("bf16", 12), ("fp32", 8)])
def test_optimizer_memory_per_rank(zero, precision, per_element):
    """zero=1: 12 bytes (fp32 master, m, v) per parameter / dp, to within bucket padding;
    zero=0: per parameter. fp32 parameters are their own master copy: 8 bytes (m, v)."""
    dp = 2
    for state_bytes, params, padding, buckets in run_ranks(dp, _optimizer_bytes, zero, precision):
        share = params / dp if zero else params
        assert buckets > 2 and padding <= (dp - 1) * buckets  # each bucket pads to a multiple of dp
        assert per_element * share <= state_bytes <= per_element * (share + padding)


def _events(_):
    """Record collectives and the moment the embedding's gradient (the last one backward
    produces) is accumulated in the last micro-batch."""
    run = _build(["parallel.zero=1", "parallel.bucket_mb=0.05"], 2)
    embedding = run.named_parameters()["wte.weight"]
    torch.manual_seed(0)
    tokens = torch.randint(0, 500, (4, 33))
    with comm.record_collectives() as log:
        embedding.register_post_accumulate_grad_hook(lambda p: log.append("embedding grad"))
        train_step(run, tokens, 1e-3)
    return [e if isinstance(e, str) else e.op for e in log], len(run.buffers[0].buckets)


def test_reduce_scatter_overlaps_backward():
    events, buckets = run_ranks(2, _events, None)[0]
    assert buckets > 2
    last_grad = len(events) - 1 - events[::-1].index("embedding grad")
    first_grad = events.index("embedding grad")
    scatters = [i for i, e in enumerate(events) if e == "reduce_scatter"]
    assert len(scatters) == buckets, "one reduce-scatter per bucket, none for micro-batch 1"
    assert all(i > first_grad for i in scatters), "nothing is reduced before the last micro-batch"
    assert scatters[0] < last_grad, "the first bucket must be reduced while backward still runs"
