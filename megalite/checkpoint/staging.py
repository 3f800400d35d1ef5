"""Host copies of the tensors a checkpoint writes, so that the files can be written while
training goes on: the copy is all a step waits for. The copies live in one arena per rank, kept
and reused from one save to the next, as `torch.distributed.checkpoint`'s staging does; a save
must have finished writing before the next one stages into it (`saver.CheckpointSaver` sees to
it).

The arena is one `host_memory.HostArena`, page-locked on CUDA so that the device-to-host copies
run at full speed."""

from __future__ import annotations

import torch

from megalite.host_memory import HostArena

Layout = tuple[tuple[str, str, tuple[int, ...], torch.dtype], ...]


class HostStaging:
    """A reusable host arena holding a copy of every (file, key) tensor a rank writes."""

    def __init__(self) -> None:
        self._layout: Layout = ()
        self._views: list[torch.Tensor] = []
        self.arena: HostArena | None = None
        """The one allocation every staged tensor is a view of."""

    def stage(
        self, files: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of `files` (file -> key -> tensor) in the arena, which nothing else writes;
        returns once every copy is done."""
        layout = tuple(
            (file, key, tuple(t.shape), t.dtype)
            for file, tensors in files.items()
            for key, t in tensors.items()
        )
        on_cuda = any(t.is_cuda for tensors in files.values() for t in tensors.values())
        if layout != self._layout:
            self.arena, self._views = None, []  # freed before the new one is allocated
            sizes = [(torch.Size(shape).numel(), dtype) for *_, shape, dtype in layout]
            self.arena = HostArena(sizes, pin=on_cuda and torch.cuda.is_available())
            self._layout = layout
            self._views = [
                view.view(shape) for view, (*_, shape, _) in zip(self.arena.views, layout)
            ]
        staged: dict[str, dict[str, torch.Tensor]] = {file: {} for file in files}
        views = iter(self._views)
        for file, tensors in files.items():
            for key, tensor in tensors.items():
                view = next(views)
                view.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
                staged[file][key] = view
        if on_cuda:
            torch.cuda.synchronize()
        return staged
