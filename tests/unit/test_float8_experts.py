"""The experts' float8 grouped GEMMs (megalite/float8/experts.py) against a float64 reference
that casts each operand as the recipe says and multiplies group by group: forward, dx and dW;
rows of two sources (two ep ranks' micro-batches) each get their own tensorwise scale, and a
dropped row's magnitude scales nothing else."""

import pytest
import torch

from megalite.float8.experts import ExpertRows, ExpertSplits, float8_grouped_mm
from megalite.float8.scaling import E4M3, RECIPES, amax_to_scale, cast

NONE = ExpertSplits((), (), (), ())
COUNTS = torch.tensor([5, 0, 7, 4])


def _fake(t: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor, power_of_2: bool = True):
    scale = amax_to_scale(amax.float(), dtype, power_of_2)
    return cast(t, scale, dtype).double() / scale.double()


def _grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([xg @ wg.t() for xg, wg in zip(x.split(counts.tolist()), w)])


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 24, generator=g, requires_grad=True)
    w = torch.randn(4, 40, 24, generator=g, requires_grad=True)
    return x, w, torch.randn(16, 40, generator=g)


def test_tensorwise_casts_each_operand_with_one_scale():
    recipe = RECIPES["tensorwise"]
    x, w, dy = _inputs()
    y = float8_grouped_mm(x, w, COUNTS, ExpertRows(None), NONE, recipe)
    y.backward(dy)
    xd, wd = x.detach(), w.detach()
    xq, wq = _fake(xd, E4M3, xd.abs().max()), _fake(wd, E4M3, wd.abs().max())
    dyq = _fake(dy, recipe.grad_dtype, dy.abs().max())
    assert torch.allclose(y.double(), _grouped(xq, wq, COUNTS), rtol=1e-5, atol=1e-5)
    assert torch.allclose(x.grad.double(), _grouped(dyq, wq.transpose(1, 2), COUNTS), atol=1e-4)
    dw = [g.t() @ xg for g, xg in zip(dyq.split(COUNTS.tolist()), xq.split(COUNTS.tolist()))]
    assert torch.allclose(w.grad.double(), torch.stack(dw), atol=1e-4)


def test_rowwise_casts_along_each_gemms_contracted_dim():
    recipe = RECIPES["rowwise"]
    x, w, dy = _inputs(1)
    y = float8_grouped_mm(x, w, COUNTS, ExpertRows(None), NONE, recipe)
    y.backward(dy)
    xd, wd = x.detach(), w.detach()
    xq = _fake(xd, E4M3, xd.abs().amax(1, keepdim=True))
    wq = _fake(wd, E4M3, wd.abs().amax(2, keepdim=True))
    assert torch.allclose(y.double(), _grouped(xq, wq, COUNTS), rtol=1e-5, atol=1e-5)
    dyq = _fake(dy, E4M3, dy.abs().amax(1, keepdim=True))
    w_cols = _fake(wd, E4M3, wd.abs().amax(1, keepdim=True))  # per (expert, column) over N
    assert torch.allclose(x.grad.double(), _grouped(dyq, w_cols.transpose(1, 2), COUNTS), atol=1e-4)
    dw = []
    for g, xg in zip(dy.split(COUNTS.tolist()), xd.split(COUNTS.tolist())):
        if g.shape[0] == 0:
            dw.append(torch.zeros(40, 24, dtype=torch.float64))
            continue
        gq = _fake(g, E4M3, g.abs().amax(0, keepdim=True))  # per feature over the group's rows
        dw.append(gq.t() @ _fake(xg, E4M3, xg.abs().amax(0, keepdim=True)))
    assert torch.allclose(w.grad.double(), torch.stack(dw), atol=1e-4)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_source_is_scaled_as_its_own_micro_batch(recipe):
    """Rows of source 1 are 2^12 times smaller than source 0's; row 15 is dropped (source 2)
    and 2^12 times larger: the result on source 1's rows is that of source 1 run alone."""
    x, w, dy = _inputs(2)
    source = torch.tensor([0, 1] * 7 + [1, 2])
    with torch.no_grad():
        x[source == 1] *= 2.0**-12
        x[source == 2] *= 2.0**12
    rows = ExpertRows(source, sources=2)
    y = float8_grouped_mm(x, w, COUNTS, rows, NONE, RECIPES[recipe])
    alone = x.detach().clone()
    alone[source != 1] = 0  # source 1 alone: its own amax sets the scale
    y_alone = float8_grouped_mm(alone, w.detach(), COUNTS, ExpertRows(None), NONE, RECIPES[recipe])
    assert torch.equal(y[source == 1], y_alone[source == 1])
    y.backward(dy)
    assert torch.isfinite(x.grad).all() and torch.isfinite(w.grad).all()
