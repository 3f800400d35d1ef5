"""Where the optimizer state lives, and the copies that placement needs (ZeRO-Offload, Ren et al.
2021, with Megatron's bucket-by-bucket overlap).

`OnDevice`: master weights and Adam moments on the run's device; the update reads the reduced
gradient in place and copies the master weights into 16-bit parameters.

`OnHost` (`optim.offload=cpu`): they live in host memory and the update runs on the CPU, on the
cores of this host shared among its ranks (`update_threads`). Each owned piece has an fp32
staging buffer for its gradient, and one in the parameter dtype for the way back when
parameters are 16-bit (so the upload moves 2 bytes per element; fp32 parameters go up straight
from their master weights). Those buffers are all the copy engine touches, so they alone are
pinned, in one `HostArena` per rank; the moments and 16-bit parameters' masters, which only
the CPU reads, stay in ordinary memory (as DeepSpeed's offload keeps them). All gradient copies
down are queued at once on a side stream, one event per piece; the CPU updates piece k as soon
as its event fires, while the copy engine is still bringing pieces k+1.. down, and queues piece
k's parameters back up on the same stream, so they travel while piece k+1 is updated. The
compute stream waits for the side stream only before the parameter all-gather. On a CPU-only
machine host and device are one: the same code runs, with synchronous copies and no pinning.

Under ZeRO-3 the owned parameters themselves live on the host (`GradBuffer.offload_params`):
the update writes them there, in place when they are fp32 (they are their own masters), and
nothing goes up after it; each gather brings its piece up instead.
"""

from __future__ import annotations

import contextlib
import os

import torch

from megalite.hardware import cpu_cores
from megalite.host_memory import HostArena

HOST = torch.device("cpu")


def update_threads() -> int:
    """CPU threads for this rank's offloaded update. Under torchrun: the cores this process
    may run on (its affinity) shared among the ranks of this node (LOCAL_WORLD_SIZE), at least
    one; set explicitly, not left to OMP_NUM_THREADS, which torchrun sets to 1 for every rank
    and which would leave the update, the CPU's whole share of the step, on one core. Without
    LOCAL_WORLD_SIZE (one process, or ranks forked by `megalite.launch.run_ranks`), the count
    the process runs with: a forked child must not start more OpenMP threads than it has, or
    libgomp hangs once the parent has used its own pool."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value is None:
        return torch.get_num_threads()
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={value!r} is not a positive integer: set it to the number of "
            "ranks on this node (torchrun does) or unset it"
        )
    return max(1, cpu_cores() // int(value))


class OnDevice:
    """Optimizer state on the run's device."""

    offloaded = False

    def __init__(self, device: torch.device) -> None:
        self.state_device = device
        self._grads: list[torch.Tensor] = []

    def master_of(self, i: int, params: torch.Tensor) -> torch.Tensor:
        """The fp32 master copy of piece i's parameters: the parameters themselves if fp32."""
        return params if params.dtype == torch.float32 else params.float()

    def staging(self) -> list[torch.Tensor]:
        """Buffers this placement holds besides the state (for memory accounting)."""
        return []

    def gradients_down(self, grads: list[torch.Tensor]) -> None:
        """Start an update: start bringing each piece's reduced gradient to the state (here:
        already there)."""
        self._grads = grads

    def gradient(self, i: int) -> torch.Tensor:
        """Piece i's gradient where the state lives, once it has arrived."""
        return self._grads[i]

    def parameters_up(self, i: int, master: torch.Tensor, params: torch.Tensor) -> None:
        """Start writing piece i's updated master weights into the model's parameters."""
        if master is not params:
            params.copy_(master)

    def finish(self) -> None:
        """End an update: make the device's compute wait for every parameter written back."""


class OnHost(OnDevice):
    """Optimizer state in host memory, updated by the CPU (`optim.offload=cpu`)."""

    offloaded = True

    def __init__(
        self, device: torch.device, pieces: list[torch.Tensor], on_host: list[bool]
    ) -> None:
        """`pieces`: the model's parameters of each owned piece (views on the device, or on the
        host where `on_host` says so: ZeRO-3's offloaded parameters)."""
        super().__init__(device)
        self.device, self.state_device = device, HOST
        pin = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if pin else None
        self.on_host = on_host
        # Per piece, what the copy engine moves: the gradient down, the parameters up (from
        # the master weights themselves when they are fp32), unless they live here
        up = [p for p, here in zip(pieces, on_host) if not here]
        sizes = [(p.numel(), torch.float32) for p in pieces] + [(p.numel(), p.dtype) for p in up]
        self.arena = HostArena(sizes, pin)
        self.host_grads = self.arena.views[: len(pieces)]
        outgoing = iter(self.arena.views[len(pieces) :])
        self.outgoing = [None if here else next(outgoing) for here in on_host]
        self.uploads = [
            None if p.dtype == torch.float32 else u for p, u in zip(pieces, self.outgoing)
        ]
        self.arrived: list[torch.cuda.Event | None] = [None] * len(pieces)
        self.threads = update_threads()
        self._threads_before = torch.get_num_threads()

    def _side_stream(self):
        return torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()

    def master_of(self, i: int, params: torch.Tensor) -> torch.Tensor:
        if self.on_host[i]:  # the parameters live here: fp32 ones are their own masters
            return super().master_of(i, params)
        if self.uploads[i] is None:  # fp32 parameters go up from here: pinned
            return self.outgoing[i].copy_(params)
        return torch.empty(params.numel(), dtype=torch.float32, device=HOST).copy_(params)

    def staging(self) -> list[torch.Tensor]:
        return self.host_grads + [u for u in self.uploads if u is not None]

    def gradients_down(self, grads: list[torch.Tensor]) -> None:
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        if self.stream:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # grads are final
        with self._side_stream():
            for i, (host, grad) in enumerate(zip(self.host_grads, grads)):
                host.copy_(grad, non_blocking=True)
                if self.stream:  # a blocking event: its waiter sleeps, leaving the update its core
                    self.arrived[i] = torch.cuda.Event(blocking=True)
                    self.arrived[i].record(self.stream)

    def gradient(self, i: int) -> torch.Tensor:
        if self.arrived[i] is not None:
            self.arrived[i].synchronize()
        return self.host_grads[i]

    def parameters_up(self, i: int, master: torch.Tensor, params: torch.Tensor) -> None:
        if self.on_host[i]:  # written where they live; each gather brings them up
            super().parameters_up(i, master, params)
            return
        source = master if self.uploads[i] is None else self.uploads[i].copy_(master)
        with self._side_stream():
            params.copy_(source, non_blocking=True)

    def finish(self) -> None:
        if self.stream:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.set_num_threads(self._threads_before)
