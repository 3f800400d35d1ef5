"""Memory as measured: the published per-layer formula (Korthikanti et al. 2022), what one rank's
live tensors hold (`live_bytes`) and what autograd keeps for backward while a step runs
(`SavedActivationTracker`). `megalite.profiling.estimate` predicts the same quantities in closed
form; the tests hold one against the other.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from megalite.tensor_parallel.deferred import deferral_observers
from megalite.tensor_parallel.random import recompute_observers

if TYPE_CHECKING:
    from megalite.training.setup import Run


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    flash: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward with 16-bit activations and dropout
    (Korthikanti et al. 2022, table 2). A flash kernel drops the 5as/h attention term."""
    attention = 0.0 if flash or recompute == "selective" else 5 * a * s / h
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)  # only the layer input
    if sp:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """The storage itself (its C++ object), not its memory address: a ZeRO-3 bucket's storage
    is freed and allocated again around every use, at a new address, and its parameters are
    still its views."""
    return (tensor.device.type, tensor.untyped_storage()._cdata)


def live_tensors(run: Run) -> dict[str, list[torch.Tensor]]:
    """One rank's long-lived training state by part: the model's flat parameter buffers (bucket
    padding included; ZeRO-3: the owned pieces, and any bucket gathered at the moment) and
    non-parameter buffers (rotary tables), the fp32 gradient buffers (and the owned-gradient
    shards ZeRO-1 reduces into; ZeRO-2 keeps the shards alone, its bucket
    staging lives only inside a backward), and the optimizer's fp32 master copies (where params
    are 16-bit or offloaded), Adam moments (in optim.state_dtype), update scratch and offload
    staging; ZeRO-3's owned parameters on the host under optim.offload=cpu, where any buffer
    has them ("offloaded params"). What `live_bytes` counts, and what a benchmark moves off the
    device."""
    offloaded = [t for buffer in run.buffers for t in buffer.host_param_tensors()]
    return {
        "params": [t for buffer in run.buffers for t in buffer.param_tensors()],
        **({"offloaded params": offloaded} if offloaded else {}),
        "buffers": [b for chunk in run.chunks for b in chunk.buffers()],
        "grads": [t for buffer in run.buffers for t in buffer.gradient_tensors()],
        "optimizer": run.optimizer.state_tensors(),
    }


def live_bytes(run: Run) -> dict[str, int]:
    """Bytes of `live_tensors` by part (the model's buffers counted by storage: they may share
    one). `live_devices` says where each part lives."""
    parts = live_tensors(run)
    model_buffers = {_storage_key(b): b.untyped_storage().nbytes() for b in parts.pop("buffers")}
    return {part: sum(t.nbytes for t in tensors) for part, tensors in parts.items()} | {
        "buffers": sum(model_buffers.values())
    }


def live_devices(run: Run) -> dict[str, str]:
    """Where each part of `live_bytes` lives, as the estimator's `Part.device` names it: "gpu"
    (the run's device) or "host" (the optimizer's state under optim.offload=cpu, which is on
    the host even when host and device are one CPU)."""
    placement = run.optimizer.placement
    optimizer = "host" if placement.offloaded else "gpu"
    offloaded = {"offloaded params": "host"} if "offloaded params" in live_tensors(run) else {}
    return {"params": "gpu", "buffers": "gpu", "grads": "gpu", "optimizer": optimizer} | offloaded


class _Held:
    """What the pack hook hands autograd instead of the tensor: when autograd drops it (the
    node's backward ran, or the graph was freed), the tracker forgets one reference."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedActivationTracker:
    """Bytes of tensors saved for backward that are alive now (`current`) and at most (`peak`)
    while the block runs: distinct storages, parameters and module buffers excluded, the inputs
    that activation recompute keeps included (until the backward of the recomputed region
    starts), and so are the tensors a split backward's B keeps for its W (`deferred`). Wrap a
    whole `run.executor.run(...)` to get the peak over the micro-batches a schedule keeps in
    flight.

        with SavedActivationTracker(exclude=params) as saved:
            loss.backward()  # or a whole pipeline schedule
        saved.peak
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.excluded = {_storage_key(t) for t in exclude}
        self.current = 0
        self.peak = 0
        self._refs: dict[tuple[str, int], list[int]] = {}  # storage -> [references, bytes]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedActivationTracker:
        recompute_observers.append(self._observe_recompute)
        deferral_observers.append(self._observe_deferred)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        deferral_observers.remove(self._observe_deferred)
        recompute_observers.remove(self._observe_recompute)

    def _hold(self, tensor: torch.Tensor) -> tuple[str, int] | None:
        """Count one more reference to the tensor's storage; its key, or None if excluded."""
        key = _storage_key(tensor)
        if key in self.excluded:
            return None
        entry = self._refs.setdefault(key, [0, tensor.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return key

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.current -= entry[1]

    def _pack(self, tensor: torch.Tensor) -> _Held:
        held = _Held(tensor)
        key = self._hold(tensor)
        if key is not None:
            weakref.finalize(held, self._release, key)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _observe_deferred(self, work: object, tensors: tuple[torch.Tensor, ...]) -> None:
        """Deferred weight-gradient work keeps its tensors until it has run and is dropped."""
        for key in map(self._hold, tensors):
            if key is not None:
                weakref.finalize(work, self._release, key)

    def _observe_recompute(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        """Recompute keeps its inputs until backward reaches the region (its output's node)."""
        if output.grad_fn is None:
            return
        keys = [key for key in map(self._hold, inputs) if key is not None]
        released = False

        def release(*_: object) -> None:
            nonlocal released
            if not released:
                released = True
                for key in keys:
                    self._release(key)

        output.grad_fn.register_prehook(release)
