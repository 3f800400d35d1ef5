"""The ring's arithmetic on the Triton kernels (interpreted on CPU): a rank's two chunks against
every holder's chunks, merged by their LSE, forward and backward, equal float64 causal attention
of the whole window restricted to the rank's rows; with and without packed documents, and with
a sliding window shorter than a chunk (whose blocks before every query's window are skipped). The
process-level ring (p2p between gloo ranks) runs in tests/distributed/test_context_parallel.py."""

import math

import pytest
import torch

from megalite.context_parallel.attention import _Attention, _fresh
from megalite.context_parallel.layout import (
    SequenceLayout,
    document_starts,
    local_chunks,
    shard_sequence,
)

SEQ, CP, EOS, HD = 92, 2, 3, 16  # chunks of 23 tokens: no multiple of any block


def window_attention(q, k, v, doc_start, window=None):
    """Causal attention of whole windows, documents masked where doc_start is given, keys
    within `window` of their query where it is."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    pos = torch.arange(q.shape[1])
    visible = (pos[None, :] <= pos[:, None])[None, None]
    if window is not None:
        visible = visible & (pos[None, :] > pos[:, None] - window)[None, None]
    if doc_start is not None:
        visible = visible & (pos[None, None, None, :] >= doc_start[:, None, :, None])
    probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("documents, window", [(False, None), (True, None), (True, 10)])
@pytest.mark.parametrize("cp_rank", [0, 1])
def test_ring_blocks_on_the_kernel(documents, window, cp_rank, rel_err):
    gen = torch.Generator().manual_seed(7 + cp_rank)
    q = torch.randn(2, SEQ, 4, HD, generator=gen)
    k, v = torch.randn(2, SEQ, 2, HD, generator=gen), torch.randn(2, SEQ, 2, HD, generator=gen)
    inputs = torch.randint(EOS + 1, 50, (2, SEQ), generator=gen)
    inputs[0, [10, 22, 23, 60]] = EOS  # documents ending inside, at and across chunk boundaries
    inputs[1, 45] = EOS
    eos = EOS if documents else None
    layout = SequenceLayout.build(SEQ, CP, cp_rank, torch.device("cpu"), inputs, eos)
    mine = local_chunks(SEQ, CP, cp_rank)
    held = [local_chunks(SEQ, CP, holder) for holder in range(CP)]

    blocks = _Attention(layout, 1 / math.sqrt(HD), window)
    out, lse = _fresh(shard_sequence(q, mine))
    q_local = shard_sequence(q, mine)
    for chunks in held:
        blocks.forward(
            q_local, shard_sequence(k, chunks), shard_sequence(v, chunks), chunks, out, lse
        )
    dout = torch.randn(out.shape, generator=gen)
    dq, delta = torch.zeros_like(out), (dout * out).sum(-1).transpose(1, 2)
    dkv = []
    for chunks in held:
        k_h, v_h = shard_sequence(k, chunks), shard_sequence(v, chunks)
        grads = torch.zeros(2, *k_h.shape)
        blocks.backward(dout, q_local, k_h, v_h, out, lse, delta, chunks, dq, grads)
        dkv.append(grads)

    q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
    doc_start = document_starts(inputs, EOS) if documents else None
    expected = shard_sequence(window_attention(q64, k64, v64, doc_start, window), mine)
    (expected * dout.double()).sum().backward()
    assert rel_err(out, expected.detach()) < 1e-4
    assert rel_err(dq, shard_sequence(q64.grad, mine)) < 1e-4
    for chunks, grads in zip(held, dkv):  # each holder's dK/dV from this rank's queries
        assert rel_err(grads[0], shard_sequence(k64.grad, chunks)) < 1e-4
        assert rel_err(grads[1], shard_sequence(v64.grad, chunks)) < 1e-4
