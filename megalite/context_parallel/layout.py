"""What a rank holds of each sequence: which pieces of the window (context parallelism), at which
positions, and where each token's document begins (document masking).

Context parallelism (cp ranks) cuts every window of `seq_len` tokens into 2*cp chunks of equal
length; rank i holds chunks i and 2cp-1-i. Under the causal mask a chunk's work grows with its
index, so pairing an early chunk with a late one gives every rank the same work (Megatron-LM's
and Llama 3's load balancing). A rank's tokens are its two chunks side by side.

Document masking: a window packs several documents. The token after an end-of-document token
starts a new document, which sees nothing before it; with `reset_positions` its positions start
again at 0. `doc_start[b, i]` is the window position where local token i's document begins:
attention lets token i see key position j only if doc_start[b, i] <= j <= its own position.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from megalite import comm


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, ...]:
    """The chunks of the 2*cp a rank holds, in the order it holds them (one chunk when cp is 1)."""
    return (0,) if cp == 1 else (cp_rank, 2 * cp - 1 - cp_rank)


def local_chunks(seq_len: int, cp: int, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """(window start, length) of each piece a rank holds, in its local order."""
    if cp == 1:
        return ((0, seq_len),)
    size = seq_len // (2 * cp)
    return tuple((chunk * size, size) for chunk in chunk_ids(cp, cp_rank))


def shard_sequence(
    x: torch.Tensor, chunks: tuple[tuple[int, int], ...], dim: int = 1
) -> torch.Tensor:
    """This rank's tokens of whole windows `x` (sequence along `dim`): its chunks side by side."""
    if len(chunks) == 1 and chunks[0] == (0, x.shape[dim]):
        return x
    return torch.cat([x.narrow(dim, start, length) for start, length in chunks], dim=dim)


def gather_windows(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole windows (b, s, ...) from every cp rank's chunks of them (b, s/cp, ...), in
    window order: `shard_sequence` undone over the group. Forward only (no gradient)."""
    cp = comm.size(group)
    if cp == 1:
        return local
    flat = local.contiguous().flatten()
    gathered = flat.new_empty(cp * flat.numel())
    comm.all_gather_flat(gathered, flat, group)
    pieces = gathered.view(cp, *local.shape)
    seq_len = cp * local.shape[1]
    windows = local.new_empty((local.shape[0], seq_len, *local.shape[2:]))
    for rank, piece in enumerate(pieces):
        at = 0
        for start, length in local_chunks(seq_len, cp, rank):
            windows[:, start : start + length] = piece[:, at : at + length]
            at += length
    return windows


def document_starts(inputs: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(b, s) window position where each token's document begins: one past the last
    end-of-document token before it, 0 if none."""
    b, s = inputs.shape
    after_eos = torch.arange(1, s + 1, device=inputs.device).expand(b, s) * (inputs == eos_id)
    starts = after_eos.cummax(dim=1).values  # one past the latest eos at or before i
    return torch.cat([starts.new_zeros(b, 1), starts[:, :-1]], dim=1)  # ... strictly before i


@dataclass
class SequenceLayout:
    """One micro-batch's sequences as this rank holds them (every pipeline stage has it)."""

    seq_len: int
    """Tokens of a whole window."""
    chunks: tuple[tuple[int, int], ...]
    """(window start, length) of the pieces this rank holds, in local order."""
    positions: torch.Tensor
    """(1 or b, local tokens) position of each local token (the model's position ids)."""
    doc_start: torch.Tensor | None = None
    """(b, local tokens) window position where each local token's document begins; None when
    documents are not masked."""

    @classmethod
    def build(
        cls,
        seq_len: int,
        cp: int,
        cp_rank: int,
        device: torch.device,
        inputs: torch.Tensor | None = None,
        eos_id: int | None = None,
        reset_positions: bool = True,
    ) -> SequenceLayout:
        """The layout of windows whose whole token ids are `inputs` (b, seq_len); with `eos_id`
        their documents are masked (then `inputs` are needed), else only cp cuts them."""
        chunks = local_chunks(seq_len, cp, cp_rank)
        window = torch.arange(seq_len, device=device)[None]
        if eos_id is None:
            return cls(seq_len, chunks, shard_sequence(window, chunks))
        if inputs is None:
            raise ValueError("document masking needs the windows' token ids on every stage")
        starts = document_starts(inputs.to(device), eos_id)
        positions = window - starts if reset_positions else window
        local = shard_sequence(starts, chunks).to(torch.int32)
        return cls(seq_len, chunks, shard_sequence(positions, chunks), local)

    @property
    def plain(self) -> bool:
        """The whole window, no document mask: plain causal attention over the local tokens."""
        return self.doc_start is None and self.chunks == ((0, self.seq_len),)

    def rows(self, start: int, count: int) -> SequenceLayout:
        """The layout of windows [start, start + count) (a micro-batch of a rank's share)."""

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return t if t is None or t.shape[0] == 1 else t[start : start + count]

        return replace(self, positions=cut(self.positions), doc_start=cut(self.doc_start))


@dataclass(frozen=True)
class SequenceCut:
    """How a run cuts its windows for this rank: its cp place and, with document masking, the
    end-of-document token. Turns whole windows into this rank's tokens and their layout."""

    seq_len: int
    cp: int = 1
    cp_rank: int = 0
    eos_id: int | None = None
    """The end-of-document token when documents are masked; None when they are not."""
    reset_positions: bool = True
    device: torch.device = torch.device("cpu")
    """Where the layouts live: the rank's device, also on a stage that read no tokens."""

    @property
    def plain(self) -> bool:
        """Whole windows, one document each: nothing to cut, no layout to carry."""
        return self.cp == 1 and self.eos_id is None

    @property
    def needs_inputs(self) -> bool:
        """Whether every pipeline stage needs the windows' token ids (to find the documents)."""
        return self.eos_id is not None

    def shard(self, windows: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's tokens of (b, seq_len) windows (inputs or targets)."""
        if windows is None:
            return None
        return shard_sequence(windows, local_chunks(self.seq_len, self.cp, self.cp_rank))

    def layout(self, inputs: torch.Tensor | None) -> SequenceLayout | None:
        """The layout of the windows whose whole inputs are `inputs` (None when plain)."""
        if self.plain:
            return None
        return SequenceLayout.build(
            self.seq_len,
            self.cp,
            self.cp_rank,
            self.device,
            inputs,
            self.eos_id,
            self.reset_positions,
        )
