"""Host memory that the copy engine reads and writes (offloaded optimizer state, checkpoint
staging): one allocation per owner, page-locked in place on CUDA.

Why one allocation, locked where it lies: torch's pinned (host caching) allocator rounds every
request up to a power of two (CachingHostAllocator.h, `PowerOf2Ceil`), which costs up to 2x,
per tensor or for one arena alike; `cudaHostRegister` of ordinary memory (what torch's own
checkpoint stager does) costs exactly the bytes asked for.
"""

from __future__ import annotations

import weakref

import torch

ALIGNMENT = 64
"""Bytes at whose multiples each view of a `HostArena` starts: a cache line (torch's CPU
allocator aligns the arena itself to one), so no two views share a line and vector loads start
aligned. More would buy the copy engine nothing."""


def arena_layout(sizes: list[tuple[int, torch.dtype]]) -> tuple[list[int], int]:
    """Byte offsets of tensors of the given (numel, dtype) laid one after another, each at a
    multiple of ALIGNMENT, and the bytes of the whole (the sum of the aligned sizes)."""
    offsets, total = [], 0
    for numel, dtype in sizes:
        offsets.append(total)
        total += -(-numel * dtype.itemsize // ALIGNMENT) * ALIGNMENT
    return offsets, total


class HostArena:
    """Host memory for tensors of the given (numel, dtype), in one allocation: `views` (1-D),
    in order, at the offsets `arena_layout` gives. With `pin` (CUDA only), the allocation is
    page-locked where it lies and unlocked when it is freed."""

    def __init__(self, sizes: list[tuple[int, torch.dtype]], pin: bool) -> None:
        offsets, self.nbytes = arena_layout(sizes)
        self.storage = torch.UntypedStorage(self.nbytes, device="cpu")
        if pin and self.nbytes:
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.pin_memory(self.storage.data_ptr(), self.nbytes)
            unpin = weakref.finalize(
                self.storage, _pin_memory_utils.unpin_memory, self.storage.data_ptr()
            )
            unpin.atexit = False  # not after the CUDA context is gone
        memory = torch.empty(0, dtype=torch.uint8).set_(self.storage)
        self.views = [
            memory[at : at + numel * dtype.itemsize].view(dtype)
            for at, (numel, dtype) in zip(offsets, sizes)
        ]
