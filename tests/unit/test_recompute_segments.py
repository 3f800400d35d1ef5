"""sqrt(N) recompute (`train.recompute=segments`, Chen et al. 2016): the same gradients as no
recompute, about sqrt(L) segments per chunk, and what stays alive between forward and backward
is only the segments' inputs, s*b*h activations each."""

import math

import pytest
import torch
from megalite.models.causal_lm import segment_layers
from megalite.models.factory import model_class
from megalite.models.layers import BuildContext

from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.profiling.memory import SavedActivationTracker
from megalite.tensor_parallel import TPRandom, init_parameters

S, B, H, A = 32, 2, 64, 4


def _chunk(arch: str, recompute: str, n_layers: int):
    kv = ["model.n_kv_heads=2"] if arch == "llama" else []
    cfg = load_config(
        None,
        [f"model.arch={arch}", f"model.n_layers={n_layers}", f"model.hidden={H}"]
        + [f"model.n_heads={A}", f"model.seq_len={S}", "model.dropout=0.1", *kv],
    )
    ps = ParallelState.single()
    ctx = BuildContext(cfg.model, ps, TPRandom(5, ps), recompute=recompute)
    chunk = model_class(arch)(ctx, range(n_layers), has_embedding=False, has_head=False)
    init_parameters(chunk, 5, ps)
    return chunk.train()


@pytest.mark.parametrize(
    ("n_layers", "sizes"), [(1, [1]), (4, [2, 2]), (7, [3, 3, 1]), (16, [4] * 4)]
)
def test_segments_are_about_sqrt_of_the_layers(n_layers, sizes):
    assert [len(s) for s in segment_layers(list(range(n_layers)))] == sizes


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_segments_give_the_same_gradients(arch):
    """Dropout is on, so the replay of both RNG streams inside a rerun segment is exercised."""
    grads = {}
    for recompute in ("none", "segments"):
        chunk = _chunk(arch, recompute, 5)
        torch.manual_seed(0)
        x = torch.randn(B, S, H, requires_grad=True)
        g = torch.randn(B, S, H)
        torch.manual_seed(1)
        (chunk(x) * g).sum().backward()
        grads[recompute] = [x.grad] + [p.grad for p in chunk.parameters()]
    for got, want in zip(grads["segments"], grads["none"]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n_layers", [4, 9])
def test_only_segment_inputs_stay_alive(n_layers):
    """Between forward and backward a chunk of L layers keeps ceil(L / round(sqrt(L))) inputs
    of s*b*h fp32 values: the formula, within 5 %, against autograd's own saved tensors."""
    chunk = _chunk("gpt", "segments", n_layers)
    x = torch.randn(B, S, H, requires_grad=True)
    with SavedActivationTracker(exclude=list(chunk.parameters())) as saved:
        y = chunk(x)
    y.sum().backward()
    segments = math.ceil(n_layers / round(math.sqrt(n_layers)))
    formula = segments * S * B * H * 4
    assert saved.peak == pytest.approx(formula, rel=0.05)
    with SavedActivationTracker(exclude=list(chunk.parameters())) as kept_all:
        _chunk("gpt", "none", n_layers)(x)
    assert saved.peak < kept_all.peak / n_layers  # less than one layer's activations
