"""Causal attention over sequences cut into chunks: context parallelism and document masks.

Each rank holds some chunks of every window (`layout.SequenceLayout`): its queries, keys and
values are those chunks' rows. A query chunk needs the keys of every chunk at or before it, so
the attention of a rank's queries is assembled from blocks: one (query chunk, key chunk) pair
at a time, each computed by the attention kernel with the two chunks' window offsets (which
apply the causal mask across chunks, and the document mask) and returning its rows' log-sum-
exp (LSE). Blocks of the same rows merge exactly (FlashAttention's online softmax, one level
up): with l = logaddexp(l1, l2), o = exp(l1 - l) o1 + exp(l2 - l) o2. Backward rebuilds each
block's probabilities from the final LSE, so each block's dQ, dK, dV add up.

Two ways to reach the other ranks' keys and values (`parallel.cp_comm`):

* ``p2p``, ring attention (Liu et al. 2023; Megatron-LM's context parallelism): cp steps; at
  step t a rank computes against the K/V that started on rank (r - t) while passing it on to
  rank r + 1 and receiving the next from r - 1, so the transfer overlaps the step's compute.
  Backward sends K/V around again, and with each block the dK/dV summed so far; after cp steps
  every block's gradient is back with its owner.
* ``allgather`` (Llama 3): all-gather the whole window's K/V, compute, and reduce-scatter dK/dV
  back to their owners. One collective each way, not overlapped; cheap when there are few kv
  heads. Backward gathers again rather than keeping the whole window's K/V alive.

Memory: both keep only q, k, v, the output and the LSE of the local rows (as the flash kernel
does): activation memory falls as 1/cp.

A sliding window (`model.sliding_window`) is one more bound the kernel applies from the blocks'
offsets; a pair of chunks whose every key lies before every query's window is skipped like a
key chunk after the queries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from megalite import comm
from megalite.context_parallel.layout import SequenceLayout, local_chunks
from megalite.eager_boundary import eager_only
from megalite.kernels import attention_block_backward, attention_block_forward

Chunks = tuple[tuple[int, int], ...]


def _blocks(
    q_chunks: Chunks, k_chunks: Chunks, window: int | None = None
) -> Iterator[tuple[slice, slice, int, int]]:
    """(local query rows, local key rows, query offset, key offset) of every pair of chunks in
    which some query sees some key (a key chunk wholly after the query chunk is skipped, and
    with a window one wholly before the first query's window)."""
    q_local = 0
    for q_start, q_len in q_chunks:
        k_local = 0
        for k_start, k_len in k_chunks:
            before_window = window is not None and k_start + k_len - 1 <= q_start - window
            if k_start <= q_start + q_len - 1 and not before_window:
                yield (
                    slice(q_local, q_local + q_len),
                    slice(k_local, k_local + k_len),
                    q_start,
                    k_start,
                )
            k_local += k_len
        q_local += q_len


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out, block_lse) -> None:
    """Fold a block's (out, lse) of rows `rows` into the running fp32 (out, lse), in place."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    # rows not yet seen (lse -inf) take the block's values; every row sees itself on its own rank
    keep = torch.exp(old_lse - new_lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    take = torch.exp(block_lse - new_lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * keep + block_out.float() * take
    lse[:, :, rows] = new_lse


class _Attention:
    """The blocks of a rank's queries against one holder's keys, forward and backward; `window`:
    a sliding window (None: all earlier keys)."""

    def __init__(self, layout: SequenceLayout, scale: float, window: int | None = None) -> None:
        self.layout, self.scale, self.window = layout, scale, window

    def _doc(self, rows: slice) -> torch.Tensor | None:
        doc = self.layout.doc_start
        return None if doc is None else doc[:, rows]

    def forward(self, q, k, v, k_chunks: Chunks, out, lse) -> None:
        for rows, keys, q_off, k_off in _blocks(self.layout.chunks, k_chunks, self.window):
            block_out, block_lse = attention_block_forward(
                q[:, rows], k[:, keys], v[:, keys], q_offset=q_off, k_offset=k_off,
                causal=True, doc_start=self._doc(rows), softmax_scale=self.scale,
                window=self.window,
            )  # fmt: skip
            _merge(out, lse, rows, block_out, block_lse)

    def backward(self, dout, q, k, v, out, lse, delta, k_chunks: Chunks, dq, dkv) -> None:
        """Add this holder's blocks' gradients: into dq (local rows) and dkv (its keys)."""
        for rows, keys, q_off, k_off in _blocks(self.layout.chunks, k_chunks, self.window):
            dq_b, dk_b, dv_b = attention_block_backward(
                dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
                q_offset=q_off, k_offset=k_off, causal=True, doc_start=self._doc(rows),
                softmax_scale=self.scale, delta=delta[:, :, rows], window=self.window,
            )  # fmt: skip
            dq[:, rows] += dq_b
            dkv[0][:, keys] += dk_b
            dkv[1][:, keys] += dv_b


class _Ring:
    """A rank's place in the cp ring: who it sends to and receives from, over the cp group's
    own communicator (its steps never queue behind another purpose's traffic)."""

    def __init__(self, ranks: tuple[int, ...], cp_rank: int, group: Any) -> None:
        self.size, self.rank, self.group = len(ranks), cp_rank, group
        self.next, self.prev = ranks[(cp_rank + 1) % self.size], ranks[(cp_rank - 1) % self.size]

    def holder(self, step: int) -> int:
        """The cp rank whose K/V this rank holds at `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: torch.Tensor) -> tuple[comm.P2PBatch | None, torch.Tensor]:
        """Start sending `tensor` to the next rank and receiving its like from the previous."""
        received = torch.empty_like(tensor)
        return comm.post_p2p([(tensor, self.next)], [(received, self.prev)], self.group), received


def _fresh(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, d = q.shape
    out = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    return out, torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)


class RingAttention(torch.autograd.Function):
    """Ring attention over the cp ranks (`ranks`, this one `cp_rank`, their `group`) of the
    `blocks` of a layout; cp 1 is the plain case."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: _Attention, ranks: tuple[int, ...], cp_rank: int,
                group: Any):  # fmt: skip
        ring, layout = _Ring(ranks, cp_rank, group), blocks.layout
        out, lse = _fresh(q)
        kv = torch.stack([k, v])  # one message per step
        for step in range(ring.size):
            last = step == ring.size - 1
            pending, incoming = (None, None) if last else ring.pass_on(kv)
            chunks = local_chunks(layout.seq_len, ring.size, ring.holder(step))
            blocks.forward(q, kv[0], kv[1], chunks, out, lse)
            if pending is not None:
                pending.wait()
                kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.blocks = ring, blocks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, blocks = ctx.ring, ctx.blocks
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (b, h, s)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grads_pending, grads_incoming = None, None
        for step in range(ring.size):
            last = step == ring.size - 1
            pending, incoming = (None, None) if last else ring.pass_on(kv)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
            chunks = local_chunks(ctx.blocks.layout.seq_len, ring.size, ring.holder(step))
            blocks.backward(dout, q, kv[0], kv[1], out, lse, delta, chunks, dq, dkv)
            if grads_pending is not None:  # what the ranks before added to this block's dK/dV
                grads_pending.wait()
                dkv += grads_incoming
            if ring.size > 1:  # on to the next holder; from the last, home to the owner
                grads_pending, grads_incoming = ring.pass_on(dkv)
            if pending is not None:
                pending.wait()
                kv = incoming
        if grads_pending is not None:
            grads_pending.wait()
            dkv = grads_incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), *[None] * 4


def _whole_window(pieces: torch.Tensor, seq_len: int) -> torch.Tensor:
    """(2, b, seq_len, ...) from every cp rank's (cp, 2, b, local, ...) pieces."""
    cp = pieces.shape[0]
    whole = pieces.new_empty((*pieces.shape[1:3], seq_len, *pieces.shape[4:]))
    for holder in range(cp):
        at = 0
        for start, length in local_chunks(seq_len, cp, holder):
            whole[:, :, start : start + length] = pieces[holder, :, :, at : at + length]
            at += length
    return whole


def _to_holders(whole: torch.Tensor, cp: int) -> torch.Tensor:
    """The inverse of `_whole_window`: (cp, 2, b, local, ...) pieces of a (2, b, seq, ...)."""
    seq_len = whole.shape[2]
    parts = [
        torch.cat([whole[:, :, s : s + n] for s, n in local_chunks(seq_len, cp, holder)], dim=2)
        for holder in range(cp)
    ]
    return torch.stack(parts)


class AllGatherAttention(torch.autograd.Function):
    """Every rank gathers the whole window's K/V over the cp `group` (Llama 3's choice)."""

    @staticmethod
    def forward(ctx, q, k, v, blocks: _Attention, group: Any):
        layout = blocks.layout
        kv = _gather_window(k, v, layout, group)
        out, lse = _fresh(q)
        blocks.forward(q, kv[0], kv[1], _all_chunks(layout.seq_len, comm.size(group)), out, lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.group = blocks, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, group = ctx.blocks.layout, ctx.group
        kv = _gather_window(k, v, layout, group)  # again: cheaper than keeping it
        delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        chunks = _all_chunks(layout.seq_len, comm.size(group))
        ctx.blocks.backward(dout, q, kv[0], kv[1], out, lse, delta, chunks, dq, dkv)
        mine = comm.reduce_scatter(_to_holders(dkv, comm.size(group)), group, dim=0)[0]
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None


def _all_chunks(seq_len: int, cp: int) -> Chunks:
    """The window's 2*cp chunks in order: the gathered keys, as blocks the causal mask can skip."""
    size = seq_len // (2 * cp)
    return tuple((i * size, size) for i in range(2 * cp))


def _gather_window(k, v, layout: SequenceLayout, group: Any) -> torch.Tensor:
    pieces = comm.all_gather(torch.stack([k, v]).unsqueeze(0), group, dim=0)
    return _whole_window(pieces, layout.seq_len)


@eager_only
def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SequenceLayout,
    ranks: tuple[int, ...],
    cp_rank: int,
    group: Any,
    comm_mode: str = "p2p",
    window: int | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's query rows over every key its layout (and a sliding
    `window`) lets them see.

    q (b, local, heads, hd), k/v (b, local, kv heads, hd): this rank's chunks of the windows;
    `ranks` the cp ring's global ranks (this one at `cp_rank`), `group` its process group;
    `comm_mode` p2p (ring) or allgather; `softmax_scale`: the scores' (None: 1 / sqrt(hd)).
    Returns (b, local, heads, hd)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    blocks = _Attention(layout, scale, window)
    if comm_mode == "allgather" and len(ranks) > 1:
        return AllGatherAttention.apply(q, k, v, blocks, group)
    return RingAttention.apply(q, k, v, blocks, ranks, cp_rank, group)
