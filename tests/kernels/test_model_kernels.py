"""A training step with the Triton kernels forced on (run by the interpreter on CPU) gives the
reference path's loss and gradients, for GPT (flash attention, fused bias-GELU) and Llama
(flash attention with grouped-query heads, fused SwiGLU); also with every block compiled
(`train.compile`), where the Triton launches run as opaque ops inside the compiled blocks."""

import pytest
import torch
from megalite.models import build_chunks

from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom
from megalite.training.compile import compile_blocks

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
MODELS = {
    "gpt": ["model.arch=gpt"],
    "llama": ["model.arch=llama", "model.n_kv_heads=2"],
}


def _loss_and_grads(arch: str, dtype: torch.dtype, compiled: bool = False):
    cfg = load_config(
        None,
        [
            *MODELS[arch],
            "model.n_layers=2",
            "model.hidden=64",
            "model.n_heads=4",
            "model.vocab_size=300",
            "model.seq_len=40",
        ],  # 40: not a multiple of the block size
    )
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(3, ps))
    model.to(dtype)
    if compiled:
        compile_blocks([model])
    tokens = torch.randint(0, 300, (2, 41), generator=torch.Generator().manual_seed(11))
    loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize(
    ("dtype", "compiled"),
    [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
    ids=["fp32", "bf16", "fp32-compiled"],
)
def test_model_step_with_kernels_matches_reference(arch, dtype, compiled, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", "torch")
    ref_loss, ref_grads = _loss_and_grads(arch, dtype)
    monkeypatch.setenv("MEGALITE_KERNELS", "triton")
    loss, grads = _loss_and_grads(arch, dtype, compiled)
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
