"""The order in which training windows are visited, identical on every rank and every layout.

Think of one endless stream of window indices per corpus: epoch 0's permutation, then epoch
1's, and so on, each drawn from a generator seeded by (seed, corpus, epoch). With one corpus,
global batch k is items [k * G, (k + 1) * G) of that stream, so a batch may straddle an epoch
boundary and nothing is dropped. A blend of corpora (`megalite.data.blend`) interleaves their
streams in fixed proportions. Either way the batches depend only on the seed, the corpora's
sizes and weights, and G: never on the tensor/pipeline/data-parallel layout, which is what lets
any layout reproduce the single-process loss curve. Resuming needs one number, the count of
windows already consumed (Megatron-LM's consumed samples): a run resumed with another global
batch size cuts the rest of the same stream into batches of its own size.
"""

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from megalite.data.blend import Interleave
from megalite.data.errors import DataError


def _epoch_seed(seed: int, corpus: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, corpus, epoch); hashing keeps distinct ones apart.
    The first corpus keeps the key it had before blends existed, so its order is unchanged."""
    key = f"{seed}:{epoch}" if corpus == 0 else f"{seed}:corpus{corpus}:{epoch}"
    digest = hashlib.sha256(f"megalite-sampler:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class CorpusOrder:
    """One corpus's endless stream of window indices: a fresh permutation every epoch."""

    def __init__(self, num_windows: int, seed: int, corpus: int = 0) -> None:
        self.num_windows, self.seed, self.corpus = num_windows, seed, corpus
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def windows(self, draws: np.ndarray) -> np.ndarray:
        """The window index of each draw number (position in this corpus's stream)."""
        epochs, offsets = np.divmod(draws, self.num_windows)
        out = np.empty_like(draws)
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            out[here] = self._permutation(epoch)[offsets[here]]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order, kept as an array (a list of 10M ints would take ~400 MB)."""
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.corpus, epoch))
            self._perm = torch.randperm(self.num_windows, generator=generator).numpy()
            self._perm_epoch = epoch
        return self._perm


class GlobalBatchSampler:
    """An infinite sequence of global batches of (corpus, window index) pairs."""

    def __init__(
        self,
        num_windows: int | Sequence[int],
        global_batch_size: int,
        seed: int,
        weights: Sequence[float] | None = None,
    ) -> None:
        sizes = [num_windows] if isinstance(num_windows, int) else list(num_windows)
        weights = [1.0] * len(sizes) if weights is None else list(weights)
        if min(sizes, default=0) < 1 or global_batch_size < 1 or len(weights) != len(sizes):
            raise ValueError(
                f"need corpora of >= 1 window with one weight each and global_batch_size >= 1, "
                f"got {sizes}, {weights}, {global_batch_size}"
            )
        self.num_windows, self.weights = sizes, weights
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.consumed_samples = 0
        self.interleave = Interleave(weights)
        self.orders = [CorpusOrder(n, seed, corpus) for corpus, n in enumerate(sizes)]

    def next_batch(self) -> list[tuple[int, int]]:
        """The next global batch: `global_batch_size` (corpus, window index) pairs."""
        start = self.consumed_samples
        corpus, draws = self.interleave(np.arange(start, start + self.global_batch_size))
        windows = np.empty_like(draws)
        for c, order in enumerate(self.orders):
            here = corpus == c
            if here.any():
                windows[here] = order.windows(draws[here])
        self.consumed_samples += self.global_batch_size
        return list(zip(corpus.tolist(), windows.tolist()))

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "num_windows": self.num_windows,
            "weights": self.weights,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after `state["consumed_samples"]` windows of the same stream, in batches of
        this run's size (a batch-size ramp, or a resume on fewer GPUs with a smaller batch).

        A different seed or different data would silently change which data the resumed run
        sees, so that is an error rather than a best effort.
        """
        state = {"weights": [1.0], **state}  # checkpoints from before blends: one corpus
        if isinstance(state["num_windows"], int):
            state["num_windows"] = [state["num_windows"]]
        for key in ("num_windows", "weights", "seed"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint was made with {key}="
                    f"{state[key]} but this run has {key}={getattr(self, key)}; use the same "
                    "data and train.seed, or start a fresh run"
                )
        if "consumed_samples" in state:
            self.consumed_samples = int(state["consumed_samples"])
        else:  # checkpoints from before batch-size changes counted batches
            self.consumed_samples = int(state["consumed_batches"]) * state["global_batch_size"]
