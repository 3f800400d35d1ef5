"""What the kernel tests compare with: relative errors against float64 and the
log-sum-exp's rows without a visible key, and the backend a test forces."""

import torch


def rel(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64.

    The norm is floored at 1 so an exactly-zero reference (for example dq and dk at seq 1,
    where softmax over one key has no gradient) is judged by absolute error instead.
    """
    diff = (actual.double() - expected.double()).norm().item()
    return diff / max(expected.double().norm().item(), 1.0)


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """float64 copies that collect their own gradients: the reference's inputs."""
    return [t.detach().double().requires_grad_() for t in tensors]


def lse_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """-inf exactly where expected; relative error on the finite entries."""
    dead = expected == float("-inf")
    assert torch.equal(actual == float("-inf"), dead), "rows without a visible key differ"
    return rel(actual[~dead], expected[~dead]) if (~dead).any() else 0.0


def use(backend: str, monkeypatch) -> None:
    """Force `backend` (triton or torch) for the kernels the test calls."""
    monkeypatch.setenv("MEGALITE_KERNELS", backend)
