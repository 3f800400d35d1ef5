"""Activation recompute: `full` and `selective` give the same gradients as `none` (dropout on,
so the RNG replay is exercised), and the bytes kept for backward per layer fall as Korthikanti
et al. (2022) predict: s*b*h*(34 + 5*a*s/h), 34*s*b*h with selective, 2*s*b*h with full."""

import pytest
import torch
from megalite.models.factory import model_class
from megalite.models.layers import BuildContext

from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.profiling.activations import Shapes, layer_body
from megalite.profiling.memory import SavedActivationTracker, activation_bytes_per_layer
from megalite.tensor_parallel import TPRandom, init_parameters

S, B, H, A = 64, 2, 64, 4


def _config(arch: str, n_layers: int, *overrides: str):
    kv = ["model.n_kv_heads=4"] if arch == "llama" else []
    return load_config(
        None,
        [
            f"model.arch={arch}",
            f"model.n_layers={n_layers}",
            f"model.hidden={H}",
            f"model.n_heads={A}",
            f"model.seq_len={S}",
            "model.dropout=0.1",
            f"train.micro_batch_size={B}",
            f"train.global_batch_size={B}",
            *kv,
            *overrides,
        ],
    )


def _layers(arch: str, recompute: str, n_layers: int, dtype: torch.dtype, limit=None):
    cfg = _config(arch, n_layers)
    ps = ParallelState.single()
    ctx = BuildContext(cfg.model, ps, TPRandom(5, ps), recompute=recompute, recompute_layers=limit)
    chunk = model_class(arch)(ctx, range(n_layers), has_embedding=False, has_head=False)
    init_parameters(chunk, 5, ps)
    return chunk.to(dtype).train()


def _grads(arch: str, recompute: str):
    chunk = _layers(arch, recompute, 2, torch.float32)
    torch.manual_seed(0)
    x = torch.randn(B, S, H, requires_grad=True)
    g = torch.randn(B, S, H)
    torch.manual_seed(1)  # the dropout stream
    (chunk(x) * g).sum().backward()
    return [x.grad] + [p.grad for p in chunk.parameters()]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(arch, recompute):
    reference = _grads(arch, "none")
    for got, want in zip(_grads(arch, recompute), reference):
        assert torch.equal(got, want)


def _saved_bytes(recompute: str, n_layers: int = 1, limit: int | None = None) -> int:
    chunk = _layers("gpt", recompute, n_layers, torch.bfloat16, limit)
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    with SavedActivationTracker(exclude=list(chunk.parameters())) as saved:
        y = chunk(x)
    y.sum().backward()
    return saved.peak


def _cpu_dropout_mask_bytes(recompute: str) -> int:
    """The formula counts 1-byte dropout masks (CUDA's fused dropout); PyTorch's CPU dropout
    keeps its mask in the activation dtype, one byte more per element: the two residual masks
    (s*b*h each) and, unless recomputed, the attention-probability mask (a*s*s*b)."""
    return {"none": 2 * S * B * H + A * S * S * B, "selective": 2 * S * B * H, "full": 0}[recompute]


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_saved_activation_bytes_match_the_formula(recompute):
    measured = _saved_bytes(recompute)
    formula = activation_bytes_per_layer(S, B, H, A, recompute=recompute)
    predicted = formula + _cpu_dropout_mask_bytes(recompute)
    print(
        f"{recompute}: measured {measured} B, formula {formula:.0f} B, with CPU masks "
        f"{predicted:.0f} B per layer"
    )
    # What is left: LayerNorm mean/rstd and the shared causal mask, under 1.5% here.
    assert measured == pytest.approx(predicted, rel=0.015)


def test_memory_estimate_counts_only_the_recomputed_layers():
    """recompute=full with recompute_layers=1 of 4: one layer keeps only its input, three keep
    everything (their input, held by their first LayerNorm, and their body). The estimator's
    closed form says so, and the bytes autograd keeps agree."""
    cfg = _config("gpt", 4, "train.recompute=full", "train.recompute_layers=1")
    shapes = Shapes(cfg, element=2, device="cpu")
    layer_input = S * B * H * 2
    predicted = 4 * layer_input + 3 * sum(layer_body(shapes))
    assert _saved_bytes("full", n_layers=4, limit=1) == predicted
