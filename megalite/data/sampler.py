"""The order in which training windows are visited, identical on every rank and every layout.

Think of one endless stream of window indices: epoch 0's permutation, then epoch 1's, and so
on, each drawn from a generator seeded by (seed, epoch). Global batch k is items
[k * G, (k + 1) * G) of that stream, so a batch may straddle an epoch boundary and nothing is
dropped. The stream depends only on (seed, num_windows) and the batches only on G as well:
never on the tensor/pipeline/data-parallel layout, which is what lets any layout reproduce the
single-process loss curve. Resuming needs one number, the count of batches already consumed.
"""

import hashlib

import torch

from megalite.data.errors import DataError


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed from (seed, epoch); hashing keeps distinct pairs apart."""
    digest = hashlib.sha256(f"megalite-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GlobalBatchSampler:
    """An infinite sequence of global batches (lists of window indices)."""

    def __init__(self, num_windows: int, global_batch_size: int, seed: int) -> None:
        if num_windows < 1 or global_batch_size < 1:
            raise ValueError(
                f"need num_windows >= 1 and global_batch_size >= 1, got "
                f"{num_windows}, {global_batch_size}"
            )
        self.num_windows = num_windows
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.consumed_batches = 0
        self._perm_epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self.consumed_batches * self.global_batch_size // self.num_windows

    def next_batch(self) -> list[int]:
        """The next global batch of `global_batch_size` window indices."""
        position = self.consumed_batches * self.global_batch_size
        batch: list[int] = []
        while len(batch) < self.global_batch_size:
            epoch, offset = divmod(position + len(batch), self.num_windows)
            take = min(self.global_batch_size - len(batch), self.num_windows - offset)
            batch.extend(self._permutation(epoch)[offset : offset + take].tolist())
        self.consumed_batches += 1
        return batch

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order, kept as a tensor (a list of 10M ints would take ~400 MB)."""
        if epoch != self._perm_epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_windows, generator=generator)
            self._perm_epoch = epoch
        return self._perm

    def state_dict(self) -> dict:
        return {
            "consumed_batches": self.consumed_batches,
            "num_windows": self.num_windows,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue after `state["consumed_batches"]` batches of the same stream.

        A different seed, batch size or dataset size would silently change which data the
        resumed run sees, so that is an error rather than a best effort.
        """
        for key in ("num_windows", "global_batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data order: the checkpoint was made with {key}="
                    f"{state[key]} but this run has {key}={getattr(self, key)}; use the same "
                    "data, train.global_batch_size and train.seed, or start a fresh run"
                )
        self.consumed_batches = int(state["consumed_batches"])
