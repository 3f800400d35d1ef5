"""`grouped_weight_grad`, the experts' dW on its own for their float8 backward: the Triton
kernel (interpreted on CPU), torch's grouped GEMM and the masked loop each equal float64 group
by group, empty groups included."""

import pytest
import torch
from megalite.kernels import grouped_weight_grad

COUNTS = [0, 21, 0, 40, 3]


def _float64(dy: torch.Tensor, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    dy, x = dy.detach().double(), x.detach().double()
    pieces = zip(dy.split(counts), x.split(counts))
    return torch.stack([d.t() @ xs for d, xs in pieces])


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("features", [(37, 70), (64, 96)], ids=["ragged", "aligned"])
def test_matches_float64(backend, features, randn, rel_err, tolerance, monkeypatch):
    monkeypatch.setenv("MEGALITE_KERNELS", backend)
    in_features, out_features = features
    x = randn(sum(COUNTS), in_features).detach()
    dy = randn(sum(COUNTS), out_features).detach()
    counts = torch.tensor(COUNTS, device=x.device)
    got = grouped_weight_grad(dy, x, counts)
    assert got.shape == (len(COUNTS), out_features, in_features)
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # an empty group: exact zeros
    assert rel_err(got, _float64(dy, x, COUNTS)) < tolerance[torch.float32]
