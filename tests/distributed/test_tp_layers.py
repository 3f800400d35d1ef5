"""Each tensor-parallel layer equals its dense counterpart (outputs, input and weight gradients,
relative error < 1e-5 in fp32 against float64), with and without sequence parallelism; the
collectives of one transformer layer move the bytes theory predicts; dropout masks agree over
tp ranks exactly where activations are replicated."""

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from equivalence import relative_error
from megalite.models.gpt.model import GPT
from megalite.models.layers import BuildContext, dropout
from megalite.models.llama.model import Llama
from torch.utils.checkpoint import checkpoint

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPRandom,
    VocabParallelEmbedding,
    VocabParallelOutput,
    init_parameters,
    normal_init,
    sequence_shard,
    vocab_parallel_head_loss,
)
from megalite.tensor_parallel.mappings import (
    all_gather_sequence,
    all_gather_sequence_together_start,
    reduce_scatter_sequence,
)

B, S, H, OUT = 2, 8, 16, 24
TOL = 1e-5


def _state(tp):
    return build_parallel_state(tp, 1, torch.device("cpu"))


def _dense(*tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _seq_shard(t, ps, sp):
    return sequence_shard(t, ps.group("tp")) if sp else t


def _sequence_collectives(tp):
    """Each rank's SP shard of a (3, 8, 5) tensor (3 samples: shards straddle them at tp 2 and
    4), the all-gather of the shards, the reduce-scatter of rank-scaled copies, and the layout
    copies the collectives made."""
    ps = _state(tp)
    torch.manual_seed(0)
    full = torch.randn(3, 8, 5)
    shard = sequence_shard(full, ps.group("tp"))
    with comm.observe(_CopyCounter()) as copies:
        gathered = all_gather_sequence(shard, ps.group("tp"))
        reduced = reduce_scatter_sequence(full * (ps.coord("tp") + 1), ps.group("tp"))
        together = all_gather_sequence_together_start([shard, 2 * shard], ps.group("tp")).wait()
    return full, shard, gathered, reduced, together, copies.count


class _CopyCounter(comm.CommObserver):
    def __init__(self):
        self.count = 0

    def layout_copy(self):
        self.count += 1
        return contextlib.nullcontext()


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_shards_are_contiguous_runs_of_tokens(tp):
    """Rank r's SP shard is the r-th contiguous 1/t of the micro-batch's b*s tokens, shaped
    (b, s/t, h); the all-gather and the reduce-scatter move it with no layout copy, at a
    micro-batch that does not divide over the ranks as well."""
    results = run_ranks(tp, _sequence_collectives, tp)
    scale = sum(range(1, tp + 1))
    for rank, (full, shard, gathered, reduced, together, copies) in enumerate(results):
        tokens = full.view(-1, 5)
        run = 3 * 8 // tp
        assert shard.shape == (3, 8 // tp, 5)
        assert torch.equal(shard.reshape(-1, 5), tokens[rank * run : (rank + 1) * run])
        assert torch.equal(gathered, full) and gathered.is_contiguous()
        assert torch.allclose(reduced, scale * shard) and reduced.is_contiguous()
        assert torch.equal(together[0], full) and torch.equal(together[1], 2 * full)
        assert copies == 0


def _column(tp, sp):
    ps = _state(tp)
    torch.manual_seed(0)  # the same full tensors on every rank
    w, bias, x, g = (
        torch.randn(OUT, H),
        torch.randn(OUT),
        torch.randn(B, S, H),
        torch.randn(B, S, OUT),
    )
    layer = ColumnParallelLinear(H, OUT, ps, bias=True, init=normal_init(1.0), sequence_parallel=sp)
    layer.weight.data.copy_(w.chunk(tp, 0)[ps.coord("tp")])
    layer.bias.data.copy_(bias.chunk(tp, 0)[ps.coord("tp")])
    x_in = _seq_shard(x, ps, sp).clone().requires_grad_()
    y = layer(x_in)  # (b, s, out/tp)
    (y * g.chunk(tp, -1)[ps.coord("tp")]).sum().backward()

    wd, bd, xd = _dense(w, bias, x)
    yd = F.linear(xd, wd, bd)
    (yd * g.double()).sum().backward()
    r = ps.coord("tp")
    return {
        "out": relative_error(y.double(), yd.chunk(tp, -1)[r]),
        "dx": relative_error(x_in.grad.double(), _seq_shard(xd.grad, ps, sp)),
        "dw": relative_error(layer.weight.grad.double(), wd.grad.chunk(tp, 0)[r]),
        "db": relative_error(layer.bias.grad.double(), bd.grad.chunk(tp, 0)[r]),
    }


def _row(tp, sp):
    ps = _state(tp)
    torch.manual_seed(0)
    w, bias, x, g = (
        torch.randn(OUT, H),
        torch.randn(OUT),
        torch.randn(B, S, H),
        torch.randn(B, S, OUT),
    )
    layer = RowParallelLinear(H, OUT, ps, bias=True, init=normal_init(1.0), sequence_parallel=sp)
    layer.weight.data.copy_(w.chunk(tp, 1)[ps.coord("tp")])
    layer.bias.data.copy_(bias)
    x_in = x.chunk(tp, -1)[ps.coord("tp")].clone().requires_grad_()  # input already split
    y = layer(x_in)  # (b, s, out), or (b, s/tp, out) under SP
    (y * _seq_shard(g, ps, sp)).sum().backward()
    bias_grad = layer.bias.grad.clone()
    if layer.bias.meta.tp_grad_reduce:  # what finalize_grads does for partial gradients
        dist.all_reduce(bias_grad, group=ps.group("tp"))

    wd, bd, xd = _dense(w, bias, x)
    yd = F.linear(xd, wd, bd)
    (yd * g.double()).sum().backward()
    r = ps.coord("tp")
    return {
        "out": relative_error(y.double(), _seq_shard(yd, ps, sp)),
        "dx": relative_error(x_in.grad.double(), xd.grad.chunk(tp, -1)[r]),
        "dw": relative_error(layer.weight.grad.double(), wd.grad.chunk(tp, 1)[r]),
        "db": relative_error(bias_grad.double(), bd.grad),
    }


def _embedding(tp, sp):
    ps = _state(tp)
    vocab = 50  # padded to a multiple of tp * 4 rows
    layer = VocabParallelEmbedding(
        vocab, H, ps, round_to=4, init=normal_init(1.0), sequence_parallel=sp
    )
    torch.manual_seed(0)
    padded = layer.rows_per_rank * tp
    w, ids, g = torch.randn(padded, H), torch.randint(0, vocab, (B, S)), torch.randn(B, S, H)
    layer.weight.data.copy_(w.chunk(tp, 0)[ps.coord("tp")])
    y = layer(ids)
    (y * _seq_shard(g, ps, sp)).sum().backward()
    (wd,) = _dense(w)
    yd = F.embedding(ids, wd)
    (yd * g.double()).sum().backward()
    return {
        "out": relative_error(y.double(), _seq_shard(yd, ps, sp)),
        "dw": relative_error(layer.weight.grad.double(), wd.grad.chunk(tp, 0)[ps.coord("tp")]),
    }


def _head_loss(tp, sp, tokens=(B, S), vocab=45):
    """The LM head with its fused loss against x @ W^T and cross-entropy over the real
    vocabulary, in float64. Padding columns must never be predicted nor get a gradient."""
    ps = _state(tp)
    layer = VocabParallelOutput(
        vocab, H, ps, round_to=4, init=normal_init(1.0), sequence_parallel=sp
    )
    torch.manual_seed(0)
    rows = layer.weight.shape[0]
    (b, s) = tokens
    x, w, targets = torch.randn(b, s, H), torch.randn(rows * tp, H), torch.randint(0, vocab, (b, s))
    w[vocab:] = 0.0  # padded rows are zero, as initialised
    layer.weight.data.copy_(w.chunk(tp, 0)[ps.coord("tp")])
    x_in = _seq_shard(x, ps, sp).clone().requires_grad_()
    loss = layer(x_in, targets)
    (loss * 0.37).backward()  # a scalar upstream gradient reaches both input gradients
    with torch.no_grad():  # the evaluation path computes the same loss without gradients
        eval_loss = layer(x_in, targets)

    xd, wd = _dense(x, w)
    logits = F.linear(xd, wd[:vocab])
    lossd = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    (lossd * 0.37).backward()
    return {
        "out": relative_error(loss.double(), lossd),
        "eval": relative_error(eval_loss.double(), lossd),
        "dx": relative_error(x_in.grad.double(), _seq_shard(xd.grad, ps, sp)),
        "dw": relative_error(layer.weight.grad.double(), wd.grad.chunk(tp, 0)[ps.coord("tp")]),
        "dpad": float(layer.weight.grad[max(0, vocab - ps.coord("tp") * rows) :].abs().sum()),
    }


@pytest.mark.parametrize(
    "tp, sp", [(1, False), (2, False), (2, True), (4, False), (4, True)], ids=str
)
@pytest.mark.parametrize(
    "case",
    [
        dict(),  # 45 words padded to 48 rows
        dict(vocab=5),  # padded to 4 rows per rank: at tp = 4, ranks 2 and 3 hold only padding
        dict(tokens=(3, 100)),  # 300 tokens: two chunks of at least 256, the last partial
    ],
    ids=["padded", "padding-only-ranks", "chunks"],
)
def test_head_loss_matches_dense(tp, sp, case):
    for rank, errors in enumerate(run_ranks(tp, functools.partial(_head_loss, **case), tp, sp)):
        assert errors.pop("dpad") == 0.0, f"rank {rank}: padded rows got a gradient"
        assert all(e < TOL for e in errors.values()), f"rank {rank}: {errors}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_head_loss_in_16_bit(dtype):
    """16-bit inputs: logits and softmax in fp32, a 16-bit GEMM per chunk summed in fp32; the
    gradients come back in the input dtype, close to float64, even for a large upstream
    gradient (fp16 keeps the unscaled weight gradient in fp32)."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 100, H), torch.randn(40, H)
    targets = torch.randint(0, 37, (3, 100))
    xh, wh = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    loss = vocab_parallel_head_loss(xh, wh, targets, None, 0, 37)
    (loss * 1000.0).backward()
    xd, wd = _dense(xh.float(), wh.float())
    lossd = F.cross_entropy(F.linear(xd, wd[:37]).flatten(0, 1), targets.flatten(), reduction="sum")
    (lossd * 1000.0).backward()
    assert loss.dtype == torch.float32 and xh.grad.dtype == wh.grad.dtype == dtype
    assert relative_error(loss.double(), lossd) < 1e-3  # 16-bit logits
    assert relative_error(xh.grad.double(), xd.grad) < 2e-2
    assert relative_error(wh.grad.double(), wd.grad) < 2e-2
    assert wh.grad[37:].abs().sum() == 0


def _layer_traffic(arch, tp, sp, recompute=False):
    """Collectives of one transformer layer's forward and backward (`recompute`: the layer run
    under activation checkpointing, its forward again inside backward)."""
    ps = _state(tp)
    overrides = [f"model.arch={arch}", "model.hidden=32", "model.n_heads=4", "model.seq_len=16"]
    cfg = load_config(None, overrides)
    ctx = BuildContext(cfg.model, ps, TPRandom(0, ps), sequence_parallel=sp)
    chunk = (GPT if arch == "gpt" else Llama)(ctx, range(1), has_embedding=False, has_head=False)
    init_parameters(chunk, 0, ps)
    torch.manual_seed(0)
    x = _seq_shard(torch.randn(B, 16, 32), ps, sp).requires_grad_()
    with comm.record_collectives() as forward:
        y = checkpoint(chunk, x, use_reentrant=False) if recompute else chunk(x)
    with comm.record_collectives() as backward:
        y.sum().backward()
    return [(r.op, r.bytes, r.group_size) for r in forward], [(r.op, r.bytes) for r in backward]


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_layer_collectives_match_theory(arch, sp):
    """Without SP: 2 all-reduces forward and 2 backward of the (b, s, h) activation. With SP the
    same bytes move forward as all-gathers and reduce-scatters (one all-reduce = one
    reduce-scatter + one all-gather in a ring); backward gathers each column-parallel input
    again (Megatron keeps the shard, not the gathered input): per sublayer the row-parallel
    output gradient and the column input again, in one all-gather of both, then the column
    input's gradient reduce-scattered."""
    tp = 2
    full = B * 16 * 32 * 4  # bytes of the (b, s, h) fp32 activation
    forward, backward = run_ranks(tp, _layer_traffic, arch, tp, sp)[0]
    if not sp:
        assert forward == [("all_reduce", full, tp)] * 2
        assert backward == [("all_reduce", full)] * 2
    else:
        assert forward == [("all_gather", full, tp), ("reduce_scatter", full, tp)] * 2
        assert backward == [("all_gather", 2 * full), ("reduce_scatter", full)] * 2

    def wire(ops):  # bytes each rank sends in a ring implementation
        per_op = {
            "all_reduce": 2 * (tp - 1) / tp,
            "all_gather": (tp - 1) / tp,
            "reduce_scatter": (tp - 1) / tp,
        }
        return sum(per_op[op[0]] * op[1] for op in ops)

    assert wire(forward) == 2 * 2 * (tp - 1) / tp * full
    assert wire(backward) == (2 * 2 + (2 if sp else 0)) * (tp - 1) / tp * full


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_sp_backward_gathers_both_inputs_once_under_recompute(arch):
    """Under activation checkpointing the row-parallel backward unpacks its partner's saved
    input from the recomputed region (an input recompute lets be unpacked only once): the
    backward is the forward again, then one all-gather of both and one reduce-scatter per
    sublayer (that training with it equals the single process: test_tp_training)."""
    tp = 2
    full = B * 16 * 32 * 4
    forward, backward = run_ranks(tp, _layer_traffic, arch, tp, True, True)[0]
    assert [(op, size) for op, size, _ in forward] == [
        ("all_gather", full),
        ("reduce_scatter", full),
    ] * 2
    recomputed = [("all_gather", full), ("reduce_scatter", full)] * 2
    assert backward == recomputed + [("all_gather", 2 * full), ("reduce_scatter", full)] * 2


def _dropout_masks(tp):
    ps = _state(tp)
    cfg = load_config(None, ["model.hidden=32", "model.n_heads=4", "model.dropout=0.5"])
    ctx = BuildContext(cfg.model, ps, TPRandom(7, ps))
    torch.manual_seed(7)
    x = torch.ones(4, 64)
    replicated = dropout(x, 0.5, True, ctx, split=False)
    split = dropout(x, 0.5, True, ctx, split=True)
    masks = []
    for mask in (replicated, split):
        gathered = [torch.empty_like(mask) for _ in range(tp)]
        dist.all_gather(gathered, mask, group=ps.group("tp"))
        masks.append(gathered)
    return masks


def test_dropout_masks_follow_the_sharding():
    replicated, split = run_ranks(2, _dropout_masks, 2)[0]
    assert torch.equal(replicated[0], replicated[1]), "replicated activations need equal masks"
    assert not torch.equal(split[0], split[1]), "split activations need different masks"
    again = run_ranks(2, _dropout_masks, 2)[0]
    assert all(torch.equal(a, b) for a, b in zip(replicated + split, again[0] + again[1]))
