"""Where the optimizer state lives, and the copies that placement needs (ZeRO-Offload, Ren et al.
2021, with Megatron's bucket-by-bucket overlap).

`OnDevice`: master weights and Adam moments on the run's device; the update reads the reduced
gradient in place and copies the master weights into 16-bit parameters.

`OnHost` (`optim.offload=cpu`): they live in host memory, pinned when the device is CUDA, and
the update runs on the CPU. Each owned piece has a pinned fp32 staging buffer for its gradient
(and one in the parameter dtype for the way back, when parameters are 16-bit, so the upload
moves 2 bytes per element). All gradient copies down are queued at once on a side stream, one
event per piece; the CPU updates piece k as soon as its event fires, while the copy engine is
still bringing pieces k+1.. down, and queues piece k's parameters back up on the same stream,
so they travel while piece k+1 is updated. The compute stream waits for the side stream only
before the parameter all-gather. On a CPU-only machine host and device are one: the same code
runs, with synchronous copies.
"""

from __future__ import annotations

import contextlib

import torch

HOST = torch.device("cpu")


class OnDevice:
    """Optimizer state on the run's device."""

    offloaded = False

    def __init__(self, device: torch.device) -> None:
        self.state_device = device
        self.pin = False
        self._grads: list[torch.Tensor] = []

    def master_of(self, params: torch.Tensor) -> torch.Tensor:
        """The fp32 master copy of a piece of parameters: the parameters themselves if fp32."""
        return params if params.dtype == torch.float32 else params.float()

    def staging(self) -> list[torch.Tensor]:
        """Buffers this placement holds besides the state (for memory accounting)."""
        return []

    def gradients_down(self, grads: list[torch.Tensor]) -> None:
        """Start bringing each piece's reduced gradient to the state (here: already there)."""
        self._grads = grads

    def gradient(self, i: int) -> torch.Tensor:
        """Piece i's gradient where the state lives, once it has arrived."""
        return self._grads[i]

    def parameters_up(self, i: int, master: torch.Tensor, params: torch.Tensor) -> None:
        """Start writing piece i's updated master weights into the model's parameters."""
        if master is not params:
            params.copy_(master)

    def finish(self) -> None:
        """Make the device's compute wait for every parameter written back."""


class OnHost(OnDevice):
    """Optimizer state in host memory, updated by the CPU (`optim.offload=cpu`)."""

    offloaded = True

    def __init__(self, device: torch.device, pieces: list[torch.Tensor]) -> None:
        """`pieces`: the model's parameters of each owned piece (views on the device)."""
        super().__init__(device)
        self.device, self.state_device = device, HOST
        self.pin = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.pin else None
        self.host_grads = [self._empty(p.numel(), torch.float32) for p in pieces]
        self.uploads = [
            None if p.dtype == torch.float32 else self._empty(p.numel(), p.dtype) for p in pieces
        ]
        self.arrived: list[torch.cuda.Event | None] = [None] * len(pieces)

    def _empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=self.pin)

    def _side_stream(self):
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    def master_of(self, params: torch.Tensor) -> torch.Tensor:
        return self._empty(params.numel(), torch.float32).copy_(params)

    def staging(self) -> list[torch.Tensor]:
        return self.host_grads + [u for u in self.uploads if u is not None]

    def gradients_down(self, grads: list[torch.Tensor]) -> None:
        if self.stream:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grads are final
        with self._side_stream():
            for i, (host, grad) in enumerate(zip(self.host_grads, grads)):
                host.copy_(grad, non_blocking=True)
                if self.stream:
                    self.arrived[i] = torch.cuda.Event()
                    self.arrived[i].record(self.stream)

    def gradient(self, i: int) -> torch.Tensor:
        if self.arrived[i] is not None:
            self.arrived[i].synchronize()
        return self.host_grads[i]

    def parameters_up(self, i: int, master: torch.Tensor, params: torch.Tensor) -> None:
        source = master if self.uploads[i] is None else self.uploads[i].copy_(master)
        with self._side_stream():
            params.copy_(source, non_blocking=True)

    def finish(self) -> None:
        if self.stream:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
