"""ZeRO-3 (Rajbhandari et al. 2020's P_os+g+p; PyTorch's FSDP): the 16-bit parameters are sharded
over the replicas too, in the gradient buffers' buckets, and gathered unit by unit as a chunk
runs.

A unit is a module whose forward reads only the parameters below it: each transformer block,
the embedding, the final norm, the head, and the chunk itself for the parameters it reads
directly (GPT's position table). The buckets are cut at unit boundaries
(`GradBuffer.unit_of`), so a unit is one or more whole buckets. Around each unit:

- forward: a pre-hook gathers the unit's buckets and waits for them, then starts the next
  unit's gathers (the prefetch, in flight while this unit computes); a post-hook releases the
  buckets once every unit that uses them has run (GPT's head reads the tied embedding: that
  bucket stays until the head is done);
- backward: the post-hook hooks the unit's outputs, so that their gradient's arrival (just
  before the unit's backward starts) gathers the unit again and starts the gathers of the unit
  before it. A bucket is released again by its gradient buffer once all its gradients are in
  (every op that reads a weight has then computed its input gradient), or at the end of the
  backward (`GradBuffer.end_backward`).
- recompute (`train.recompute`): the rerun of a unit's forward in backward finds it gathered
  for its backward, and neither prefetches nor releases.
- `keep` (`parallel.reshard_after_forward=false`, FSDP2's option of that name): nothing is
  released until the step's gradients are all reduced (`GradBuffer.finish_sync`), so each
  bucket is gathered once a step, by the first micro-batch's forward, and the later
  micro-batches of a pipeline stage find their parameters in place: the stage's full
  parameters held for the step against 2m gathers of them.

The hooks run eagerly in a compiled block (`eager_only`: graph breaks at its start and end).
Every replica runs the same units in the same order, so every group issues its gathers in one
order, as NCCL requires; a gather's output is read only after its `wait()` (a stream wait on
NCCL). The hooks need only what `ShardedBuffer` names, so this module does not depend on the
gradient buffer's."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from megalite.eager_boundary import eager_only
from megalite.tensor_parallel.random import replaying


class ShardedBuffer(Protocol):
    """What the unit hooks ask of a ZeRO-3 gradient buffer (`GradBuffer`)."""

    bucket_of: dict[nn.Parameter, Any]

    def gather_params(self, bucket: Any) -> None: ...

    def wait_param_gather(self, bucket: Any) -> None: ...

    def release_params(self, bucket: Any) -> None: ...


def has_forward(module: nn.Module) -> bool:
    """Whether the module runs a forward of its own (a container such as ModuleDict does not)."""
    return type(module).forward is not nn.Module.forward


def parameter_units(chunk: nn.Module) -> list[nn.Module]:
    """The chunk's units in forward order: the chunk itself (for the parameters no other unit
    holds), then each module with a forward and parameters, found below containers without a
    forward (the blocks' ModuleDict) in the order the model registers them, which is the order
    its forward runs them."""
    units = [chunk]

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if not has_forward(child):
                visit(child)
            elif any(True for _ in child.parameters()):
                units.append(child)

    visit(chunk)
    return units


def _unit_params(units: list[nn.Module]) -> list[list[nn.Parameter]]:
    """The parameters each unit's forward reads: a unit's own subtree's (a tied weight is in
    both units that hold it); the chunk's, those of no other unit. No units: none."""
    if not units:
        return []
    held = [list(unit.parameters()) for unit in units[1:]]
    elsewhere = {id(p) for params in held for p in params}
    return [[p for p in units[0].parameters() if id(p) not in elsewhere], *held]


def unit_index(units: list[nn.Module]) -> dict[nn.Parameter, int]:
    """Each parameter's unit (the first that holds it), by which the buckets are cut."""
    found: dict[nn.Parameter, int] = {}
    for index, params in enumerate(_unit_params(units)):
        for param in params:
            found.setdefault(param, index)
    return found


def _tensors(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's output (a tensor, or a tuple or list of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)


class ShardedUnits:
    """The hooks that gather, prefetch and release one chunk's units (see the module's
    docstring). `buffers`: the chunk's ZeRO-3 buffers."""

    def __init__(
        self, units: list[nn.Module], buffers: Sequence[ShardedBuffer], keep: bool = False
    ) -> None:
        self.keep = keep
        self.buckets: list[list[tuple[ShardedBuffer, Any]]] = []
        for params in _unit_params(units):
            found: dict[int, tuple[ShardedBuffer, Any]] = {}
            for buffer in buffers:
                for param in params:
                    if (bucket := buffer.bucket_of.get(param)) is not None:
                        found[id(bucket)] = (buffer, bucket)
            # buckets lie in backward order: forward order is by descending start
            self.buckets.append(sorted(found.values(), key=lambda pair: -pair[1].start))
        self.uses: dict[int, int] = {}
        """Units whose forward reads each bucket (by id)."""
        for pairs in self.buckets:
            for _, bucket in pairs:
                self.uses[id(bucket)] = self.uses.get(id(bucket), 0) + 1
        self.left = dict(self.uses)
        """Of those, the units yet to run in the current forward."""
        for index, unit in enumerate(units):
            unit.register_forward_pre_hook(functools.partial(self._before_forward, index))
            unit.register_forward_hook(functools.partial(self._after_forward, index))

    def _gather(self, index: int) -> None:
        """Unit `index`'s parameters, here: gathered (if they are not) and waited for."""
        for buffer, bucket in self.buckets[index]:
            buffer.gather_params(bucket)
        for buffer, bucket in self.buckets[index]:
            buffer.wait_param_gather(bucket)

    def _prefetch(self, index: int) -> None:
        """Start unit `index`'s gathers (if it exists), to land while the current unit
        computes."""
        if 0 <= index < len(self.buckets):
            for buffer, bucket in self.buckets[index]:
                buffer.gather_params(bucket)

    @eager_only
    def _before_forward(self, index: int, *_: Any) -> None:
        """Gather the unit; prefetch the next, unless this is recompute's rerun in backward
        (the unit was gathered for its backward, and the next one's is done)."""
        self._gather(index)
        if not replaying():
            self._prefetch(index + 1)

    @eager_only
    def _after_forward(self, index: int, _module: nn.Module, _args: Any, output: Any) -> None:
        """Release the buckets no later unit of this forward reads (unless they are kept for
        the step); hook the outputs, whose gradient marks the start of this unit's backward.
        Recompute's rerun does neither: its backward, which follows, still reads the
        parameters."""
        if replaying():
            return
        for buffer, bucket in [] if self.keep else self.buckets[index]:
            self.left[id(bucket)] -= 1
            if self.left[id(bucket)] == 0:
                buffer.release_params(bucket)
                self.left[id(bucket)] = self.uses[id(bucket)]
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(functools.partial(self._before_backward, index))

    @eager_only
    def _before_backward(self, index: int, _grad: torch.Tensor) -> None:
        """Gather the unit for its backward and start the gathers of the unit before it (not
        the chunk's own, unit 0: its gradient is the first to arrive, so it is gathered
        already)."""
        self._gather(index)
        if index > 1:
            self._prefetch(index - 1)
