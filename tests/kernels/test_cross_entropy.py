"""The fused softmax cross-entropy of the LM head's chunks (Triton, interpreted on CPU) against
float64: the loss and its gradient, for rows whose vocabulary is one rank's or split over two
gloo ranks (the last one holding padding, or only padding), with row counts and vocabularies
that are not multiples of the kernels' blocks."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megalite.kernels.cross_entropy import (
    GRAD_BLOCK,
    STATS_BLOCK,
    Columns,
    softmax_cross_entropy,
    softmax_cross_entropy_reference,
)

from megalite.launch import run_ranks

DEVICE = os.environ.get("MEGALITE_KERNEL_TEST_DEVICE", "cpu")  # as conftest.py reads it

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _float64(logits: torch.Tensor, targets: torch.Tensor, vocab: int):
    """Loss sum and d loss / d logits over the real columns, in float64."""
    real = logits[:, :vocab].double().detach().requires_grad_()
    loss = F.cross_entropy(real, targets, reduction="sum")
    (grad,) = torch.autograd.grad(loss, real)
    return loss.detach(), grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows, cols, vocab",
    [(37, 1000, 997), (1, 129, 129), (5, STATS_BLOCK + 3, STATS_BLOCK + 1), (3, GRAD_BLOCK, 600)]
    + [(2, 50304, 50257)],  # GPT-2's vocabulary, padded as the shipped configs pad it
)
def test_one_rank_matches_float64(rows, cols, vocab, dtype, randn, rel_err, tolerance):
    logits = randn(rows, cols, dtype=dtype, scale=4.0).detach()
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(rows))
    expected_loss, expected_grad = _float64(logits, targets.to(logits.device), vocab)
    loss, grad = softmax_cross_entropy(
        logits.clone(), targets.to(logits.device), Columns(vocab), True
    )
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == (rows, cols)
    assert rel_err(loss, expected_loss) < tolerance[dtype]
    assert rel_err(grad[:, :vocab], expected_grad) < tolerance[dtype]
    assert grad[:, vocab:].abs().sum() == 0  # the padding gets no gradient
    no_grad, none = softmax_cross_entropy(
        logits.clone(), targets.to(logits.device), Columns(vocab), False
    )
    assert none is None and rel_err(no_grad, expected_loss) < tolerance[dtype]


def test_kernel_equals_its_reference(randn, rel_err, monkeypatch):
    """The Triton path and the eager reference agree closely in fp32 (the reference is what
    runs on CPU and wherever Triton does not)."""
    logits = randn(20, 700, scale=8.0).detach()
    targets = torch.randint(0, 650, (20,), generator=torch.Generator().manual_seed(1))
    targets = targets.to(logits.device)
    fused = softmax_cross_entropy(logits.clone(), targets, Columns(650), True)
    reference = softmax_cross_entropy_reference(logits.clone(), targets, Columns(650), True)
    assert rel_err(fused[0], reference[0]) < 1e-6
    assert rel_err(fused[1], reference[1]) < 1e-6


def test_strided_targets_are_read_through_their_stride(randn, rel_err, tolerance):
    """The targets as a column of a (rows, 2) tensor (stride 2): each row's own target."""
    logits = randn(6, 40).detach()
    pairs = torch.randint(0, 40, (6, 2), generator=torch.Generator().manual_seed(2))
    targets = pairs.to(logits.device)[:, 1]
    expected_loss, expected_grad = _float64(logits, targets, 40)
    loss, grad = softmax_cross_entropy(logits.clone(), targets, Columns(40), True)
    assert rel_err(loss, expected_loss) < tolerance[torch.float32]
    assert rel_err(grad, expected_grad) < tolerance[torch.float32]


def _split_over_two_ranks(vocab: int, padded: int, dtype: torch.dtype, device: str):
    """This rank's loss and gradient for its half of the padded vocabulary, and float64's."""
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(5)
    logits = (torch.randn(29, padded, generator=generator) * 4.0).to(dtype).to(device)
    targets = torch.randint(0, vocab, (29,), generator=generator).to(device)
    expected_loss, expected_grad = _float64(logits, targets, vocab)
    width = padded // 2
    start = rank * width
    mine = logits[:, start : start + width].contiguous()
    real_cols = max(0, min(width, vocab - start))
    local = targets - start
    local = torch.where((local >= 0) & (local < real_cols), local, -1)

    columns = Columns(
        real_cols,
        reduce_max=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX),
        reduce_sum=lambda t: dist.all_reduce(t),
    )
    loss, grad = softmax_cross_entropy(mine, local, columns, True)
    full = torch.zeros(29, padded, dtype=torch.float64)
    full[:, :vocab] = expected_grad.cpu()
    return (
        loss.cpu(),
        expected_loss.cpu(),
        grad.cpu(),
        full[:, start : start + width],
    )


@pytest.mark.skipif(
    DEVICE != "cpu",
    reason="forked gloo ranks cannot use the parent's CUDA context; the split is the reductions "
    "around the kernels, the same on any device, and runs in the CPU suite",
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1000, 500], ids=["padding-on-last", "last-only-padding"])
def test_vocabulary_split_over_two_ranks_matches_float64(vocab, dtype, rel_err, tolerance, device):
    """Rank 1 holds 488 real columns and 24 of padding, or (vocab 500) only padding: its max
    is -inf, and it still adds nothing to the sum and gets a zero gradient."""
    for loss, expected_loss, grad, expected_grad in run_ranks(
        2, _split_over_two_ranks, vocab, 1024, dtype, str(device)
    ):
        assert rel_err(loss, expected_loss) < tolerance[dtype]
        assert rel_err(grad, expected_grad) < tolerance[dtype]
