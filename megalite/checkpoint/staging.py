"""Host copies of the tensors a checkpoint writes, so that the files can be written while
training goes on: the copy is all a step waits for. The buffers are kept and reused from one
save to the next (pinned on CUDA, where allocating pinned memory is slow and copies into it are
fast), as `torch.distributed.checkpoint`'s staging does; a save must have finished writing
before the next one stages into the same buffers (`saver.CheckpointSaver` sees to it)."""

from __future__ import annotations

import torch


class HostStaging:
    """Reusable host buffers, one per (file, key) a rank writes."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def stage(
        self, files: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of `files` (file -> key -> tensor) in host buffers that nothing else
        writes; returns once every copy is done."""
        staged: dict[str, dict[str, torch.Tensor]] = {}
        on_cuda = False
        for file, tensors in files.items():
            staged[file] = {}
            for key, tensor in tensors.items():
                buffer = self._buffer((file, key), tensor)
                buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                on_cuda |= tensor.is_cuda
                staged[file][key] = buffer
        if on_cuda:
            torch.cuda.synchronize()
        return staged

    def _buffer(self, name: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            pin = like.is_cuda and torch.cuda.is_available()
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[name] = buffer
        return buffer
