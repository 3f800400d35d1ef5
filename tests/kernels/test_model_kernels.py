"""A training step with the Triton kernels forced on (run by the interpreter on CPU) gives the
reference path's loss and gradients, for GPT (flash attention, fused bias-GELU, LayerNorm with
the residual add) and Llama (flash attention with grouped-query heads, fused SwiGLU, RMSNorm with
the residual add, rotary q and k in one pass), in 32 and 16 bits, under recompute, and with every
block compiled (`train.compile`: attention an operator of the block's graph, the other Triton
kernels, forced, opaque calls inside it)."""

import importlib

import pytest
import torch
from megalite.kernels import cross_entropy, dispatch
from megalite.kernels.gelu import BiasGeluFunction
from megalite.kernels.norms import AddNormFunction
from megalite.kernels.rotary import RotaryFunction
from megalite.kernels.swiglu import SwiGLUFunction
from megalite.models.factory import build_chunks

from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.profiling.activations import Shapes, layer_body
from megalite.profiling.memory import SavedActivationTracker
from megalite.tensor_parallel import TPRandom
from megalite.training.compile import compile_blocks, compiled_graphs

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
MODELS = {
    "gpt": ["model.arch=gpt"],
    "llama": ["model.arch=llama", "model.n_kv_heads=2"],
}
N_LAYERS = 2
# Where each Triton kernel a block runs is launched from: its autograd Function, but attention
# by its forward (inside a compiled block an operator calls it, not the Function)
FLASH = (importlib.import_module("megalite.kernels.flash_attention"), "_flash_forward")
BIAS_GELU, SWIGLU = (BiasGeluFunction, "apply"), (SwiGLUFunction, "apply")
ADD_NORM, ROTARY = (AddNormFunction, "apply"), (RotaryFunction, "apply")
# The launches of each block (the final norm is one more AddNorm)
PER_BLOCK = {
    "gpt": {FLASH: 1, BIAS_GELU: 1, ADD_NORM: 2},
    "llama": {FLASH: 1, SWIGLU: 1, ADD_NORM: 2, ROTARY: 1},
}


def _config(arch: str, *overrides: str):
    sizes = [f"model.n_layers={N_LAYERS}", "model.hidden=64", "model.n_heads=4"]
    sizes += ["model.vocab_size=300", "model.seq_len=40"]  # 40: not a multiple of a block
    return load_config(None, [*MODELS[arch], *sizes, *overrides])


def _loss_and_grads(arch: str, dtype: torch.dtype, recompute: str = "none", compiled=False):
    cfg = _config(arch, f"train.recompute={recompute}")
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(3, ps))
    model.to(dtype)
    if compiled:
        compile_blocks([model], trace_linears=True)
    tokens = torch.randint(0, 300, (2, 41), generator=torch.Generator().manual_seed(11))
    loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.double() for n, p in model.named_parameters()}


def _count_launches(monkeypatch: pytest.MonkeyPatch, launch_points) -> dict:
    """Count the calls of each (owner, attribute) that launches a Triton forward."""
    counts = dict.fromkeys(launch_points, 0)

    def counted(point, original):
        def launch(*args, **kwargs):
            counts[point] += 1
            return original(*args, **kwargs)

        return launch

    for point in launch_points:
        monkeypatch.setattr(*point, counted(point, getattr(*point)))
    return counts


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize(
    ("dtype", "recompute", "compiled"),
    [(torch.float32, "none", False), (torch.bfloat16, "none", False)]
    + [(torch.float16, "none", False), (torch.float32, "full", False)]
    + [(torch.float32, "full", True)],
    # compiled without recompute: `test_compiled_block_with_triton_attention_is_one_graph`
    ids=["fp32", "bf16", "fp16", "fp32-full-recompute", "fp32-recompute-compiled"],
)
def test_model_step_with_kernels_matches_reference(arch, dtype, recompute, compiled, monkeypatch):
    # float64 through the PyTorch references is the truth both precisions are judged against
    # (16-bit runs of the two paths differ from each other by their own rounding; and the Triton
    # interpreter rounds fp32 -> bf16 toward zero, where a GPU rounds to nearest)
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    ref_loss, ref_grads = _loss_and_grads(arch, torch.float64, recompute)
    monkeypatch.setenv("MEGALITE_KERNELS", "triton")
    launches = _count_launches(monkeypatch, PER_BLOCK[arch])
    heads = []  # the LM head's softmax cross-entropy: one chunk of 80 tokens
    fused_loss = cross_entropy._fused
    monkeypatch.setattr(cross_entropy, "_fused", lambda *a: heads.append(1) or fused_loss(*a))
    loss, grads = _loss_and_grads(arch, dtype, recompute, compiled)
    forwards = 2 if recompute == "full" else 1  # full recompute runs each block forward again
    expected = {f: n * N_LAYERS * forwards for f, n in PER_BLOCK[arch].items()}
    expected[ADD_NORM] += 1  # the final norm
    assert launches == expected and heads == [1]  # every kernel took the Triton path
    tol = TOLERANCE[dtype]
    assert abs(loss - ref_loss) < tol * ref_loss
    errors = {}
    for name, want in ref_grads.items():
        if name.endswith("attn.wk.bias"):
            # softmax cancels a key bias: its exact gradient is zero and both paths give only
            # rounding noise, which must stay negligible next to the value bias's gradient
            scale = ref_grads[name.replace("wk", "wv")].norm()
            assert grads[name].norm() < tol * scale and want.norm() < tol * scale
            continue
        errors[name] = ((grads[name] - want).norm() / want.norm()).item()
    assert max(errors.values()) < tol, errors


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_compiled_block_with_triton_attention_is_one_graph(arch, monkeypatch):
    """As on a GPU under `auto` (Triton for attention, references for the elementwise kernels
    inside the compiled region) with traced linears (tp 1): one graph serves every block, with
    no break, and attention still runs the Triton kernels (its operator, once per block)."""
    import torch._dynamo as dynamo
    import torch._dynamo.utils as dynamo_utils

    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    ref_loss, ref_grads = _loss_and_grads(arch, torch.float64)
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")
    monkeypatch.setattr(dispatch, "kernel_backend", lambda *tensors: "triton")  # as on a GPU
    launches = _count_launches(monkeypatch, [FLASH])
    dynamo.reset()
    breaks_before, graphs_before = (
        sum(dynamo_utils.counters["graph_break"].values()),
        compiled_graphs(),
    )
    loss, grads = _loss_and_grads(arch, torch.float32, compiled=True)
    graph_breaks = sum(dynamo_utils.counters["graph_break"].values()) - breaks_before
    assert (compiled_graphs() - graphs_before, graph_breaks) == (1, 0)
    assert launches == {FLASH: N_LAYERS}
    tol = TOLERANCE[torch.float32]
    assert abs(loss - ref_loss) < tol * ref_loss
    for name, want in ref_grads.items():
        if not name.endswith("attn.wk.bias"):  # zero exactly: rounding noise on both sides
            assert (grads[name] - want).norm() < tol * want.norm(), name


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_on_gpu_counts_what_the_triton_kernels_save(arch, precision):
    """The estimator's GPU figure for one layer (`Shapes(device="cuda")`: Triton kernels) is
    what a block saves with the Triton kernels, to the byte: its input and its body."""
    cfg = _config(arch, f"train.precision={precision}", "train.micro_batch_size=2")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(3, ps))
    model.to(dtype)
    x = torch.randn(2, 40, 64, dtype=dtype, requires_grad=True)
    with SavedActivationTracker(exclude=[*model.parameters(), *model.buffers()]) as saved:
        out = model.layers["0"](x)
    shapes = Shapes(cfg, element=x.element_size(), device="cuda")
    assert out.requires_grad  # its graph holds what the block saved
    assert saved.current == x.numel() * x.element_size() + sum(layer_body(shapes))
