"""AdamW on the fp32 master copy of the parameter elements this rank owns.

With ZeRO-1 (Rajbhandari et al. 2020; Megatron-LM's distributed optimizer) each data-parallel
rank owns 1/dp of every gradient bucket: it keeps fp32 master weights and Adam moments for that
piece only (12 bytes per owned element), steps on it, and the updated values are all-gathered
back into the model, overlapped with the next forward (`GradBuffer.start_param_gather`). ZeRO-2
changes only where the gradients live: the owned pieces are the same. ZeRO-3 changes where the
16-bit parameters live: the step writes the owned pieces alone, which the next forward's unit
gathers bring (`data_parallel.zero3`). With ZeRO-0 a rank owns
every element, and this is plain mixed-precision AdamW. The update matches torch.optim.AdamW
(decoupled weight decay, bias-corrected moments).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from megalite import comm
from megalite.config import OptimConfig
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.optimizer.adamw import AdamW, NoiseSegment, tensor_key
from megalite.optimizer.clip import sums_of_squares
from megalite.optimizer.offload import OnDevice, OnHost
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import ParamMeta, global_tensors, param_parts

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
"""The optimizer state kept per owned element: fp32 master, moments in optim.state_dtype
(`optimizer.adamw`), on the device or, with optim.offload=cpu, the host (`optimizer.offload`)."""


@dataclass
class ShardState:
    """Optimizer state of one owned piece of a bucket (local coordinates of the piece)."""

    buffer: GradBuffer
    start: int
    """Where the piece starts in the buffer."""
    params: torch.Tensor
    """The piece of the model's parameters (a view)."""
    grads: torch.Tensor
    """Its reduced gradient (a view)."""
    master: torch.Tensor
    """fp32 master weights: the parameters themselves when they are fp32 and not offloaded."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay: list[tuple[int, int]]
    """Ranges where weight decay applies (matrices; not norms and biases)."""
    counted: list[tuple[int, int]]
    """Ranges this rank counts in the global grad norm: each element of the model exactly once
    (tp-replicated parameters on tp rank 0, tied copies on their owner)."""
    copies: list[tuple[int, int]]
    """The other ranges: copies the norm leaves out but the update applies."""
    noise: list[NoiseSegment]
    """The global tensors whose elements the piece holds, for bf16 moments' rounding noise."""


def _meetings(
    buffer: GradBuffer, start: int, end: int, names: dict[nn.Parameter, str]
) -> Iterator[tuple[str, ParamMeta, nn.Parameter, int, int, int]]:
    """Where each global tensor (a fused parameter's parts each by its own) meets
    buffer[start:end]: (its global name, its meta, the parameter holding it, lo, hi relative to
    start, and the index in the tensor's local piece, flattened, where the meeting begins)."""
    for param in buffer.params:
        p_start = buffer.offsets[param]
        for name, meta, part_lo, part_hi in param_parts(names[param], param):
            lo, hi = max(start, p_start + part_lo), min(end, p_start + part_hi)
            if lo < hi:
                yield name, meta, param, lo - start, hi - start, lo - p_start - part_lo


def _ranges(
    buffer: GradBuffer, start: int, end: int, names: dict[nn.Parameter, str], include
) -> list[tuple[int, int]]:
    """Where the global tensors `include` selects by their meta meet buffer[start:end],
    relative to start, with adjacent ranges merged."""
    ranges: list[tuple[int, int]] = []
    for _, meta, _, lo, hi, _ in _meetings(buffer, start, end, names):
        if include(meta):
            _append_merged(ranges, lo, hi)
    return sorted(ranges)


def _noise_segments(
    buffer: GradBuffer, start: int, end: int, names: dict[nn.Parameter, str], ps: ParallelState
) -> list[NoiseSegment]:
    """Where each global tensor (a tied copy: the one it copies) meets buffer[start:end], for
    the rounding noise of its elements."""
    segments = []
    for name, meta, _, lo, hi, index in _meetings(buffer, start, end, names):
        piece = meta.piece_in_global(ps.coord("tp"), ps.size("tp"))
        segments.append(NoiseSegment(lo, hi, tensor_key(meta.tied_name or name), index, piece))
    return segments


def _meta_twin(param: nn.Parameter) -> torch.Tensor:
    """`param`'s shape and meta on the meta device: what checkpoints read of a ZeRO-3
    parameter, whose storage is released between uses (a view of it there would be refused)."""
    twin = torch.empty_like(param, device="meta")
    twin.meta = param.meta
    return twin


def _append_merged(ranges: list[tuple[int, int]], lo: int, hi: int) -> None:
    if ranges and ranges[-1][1] == lo:
        ranges[-1] = (ranges[-1][0], hi)
    else:
        ranges.append((lo, hi))


class DistributedOptimizer:
    def __init__(
        self,
        buffers: list[GradBuffer],
        names: dict[nn.Parameter, str],
        cfg: OptimConfig,
        ps: ParallelState,
    ) -> None:
        self.buffers, self.names, self.cfg, self.ps = buffers, names, cfg, ps
        self.states: list[ShardState] = []
        pieces = [
            (buffer, bucket, start, end, buffer.owned_params(bucket))
            for buffer in buffers
            for bucket, (start, end) in zip(buffer.buckets, buffer.owned_ranges)
        ]
        self.placement = (
            OnHost(
                ps.device,
                [params for *_, params in pieces],
                [buffer.offload_params for buffer, *_ in pieces],
            )
            if cfg.offload == "cpu"
            else OnDevice(ps.device)
        )
        largest = max((params.numel() for *_, params in pieces), default=0)
        self.adamw = AdamW(cfg, self.placement.state_device, largest)
        for i, (buffer, bucket, start, end, params) in enumerate(pieces):
            master = self.placement.master_of(i, params)
            self.states.append(
                ShardState(
                    buffer=buffer,
                    start=start,
                    params=params,
                    grads=buffer.owned_grads[bucket.owned],
                    master=master,
                    exp_avg=self.adamw.zeros(master.numel()),
                    exp_avg_sq=self.adamw.zeros(master.numel()),
                    decay=_ranges(buffer, start, end, names, lambda meta: meta.weight_decay),
                    **self._norm_ranges(buffer, start, end),
                    noise=_noise_segments(buffer, start, end, names, ps),
                )
            )
        self.adamw.noise_for({seg.tensor_key for state in self.states for seg in state.noise})
        self._norm_pieces = self._pieces_of_the_norm()

    def _pieces_of_the_norm(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The gradient ranges the norm sums, and the group of each as a one-hot row: its
        buffer's view's position among the grid's views (dense, experts), or the last group
        for the copies the norm leaves out (`grad_norm`)."""
        views = [view.weight_axes for view in self.ps.dims.views.values()]
        pieces, groups = [], []
        for state in self.states:
            for ranges, group in (
                (state.counted, views.index(state.buffer.weight_axes)),
                (state.copies, len(views)),
            ):
                pieces += [state.grads[start:end] for start, end in ranges]
                groups += [group] * len(ranges)
        group_of_piece = torch.tensor(groups, dtype=torch.int64)
        membership = torch.nn.functional.one_hot(group_of_piece, len(views) + 1)
        return pieces, membership.to(self.ps.device, torch.float64)

    def _norm_ranges(
        self, buffer: GradBuffer, start: int, end: int
    ) -> dict[str, list[tuple[int, int]]]:
        """`counted` and `copies` of a piece: each element counts once, a tensor not sharded
        over tp on tp rank 0 alone, an HSDP shard on its first copy alone."""
        if not buffer.first_copy:
            return {"counted": [], "copies": [(0, end - start)]}

        def counts(meta: ParamMeta) -> bool:
            sharded = meta.placement("tp").kind == "shard"
            return meta.tied_name is None and (sharded or self.ps.coord("tp") == 0)

        return {
            "counted": _ranges(buffer, start, end, self.names, counts),
            "copies": _ranges(buffer, start, end, self.names, lambda meta: not counts(meta)),
        }

    @property
    def sharded(self) -> bool:
        return any(b.sharded for b in self.buffers)

    @property
    def params_sharded(self) -> bool:
        """ZeRO-3: the full parameters are not resident between uses, only the owned pieces."""
        return any(b.params_sharded for b in self.buffers)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradient over every rank, a float64 scalar left on
        the device: no wait for it. Under ZeRO each rank counts its owned pieces, which
        partition the model over the world. Otherwise each rank counts all it holds, summed
        over the ranks holding one copy of its view of the model (its buffer's weight axes):
        the dense weights over tp x pp, the experts over tp x ep x pp, that is tp x pp and then
        the axes the experts' view adds (ep)."""
        # one sum per view (dense, experts), then the copies left out of the norm: the update
        # applies them too, so a non-finite one (on this rank alone, after the reductions)
        # makes the norm NaN
        views = [view.weight_axes for view in self.ps.dims.views.values()]
        sumsq = sums_of_squares(*self._norm_pieces)
        if self.sharded:
            comm.all_reduce(sumsq, self.ps.world_group)
        else:
            comm.all_reduce(sumsq, self.ps.group(*views[0]))
            for i, axes in enumerate(views[1:], start=1):  # this view's sum and those after it
                comm.all_reduce(sumsq[i:], self.ps.group(*(a for a in axes if a not in views[0])))
        return (sumsq[:-1].sum() + sumsq[-1] * 0).sqrt()  # NaN where a copy is not finite

    def found_non_finite(self) -> torch.Tensor:
        """Whether any rank's gradient has inf/nan (fp16 overflow), agreed over all ranks: a
        float32 flag (1.0: found) left on the device."""
        flag = torch.zeros((), dtype=torch.float32, device=self.ps.device)
        for buffer in self.buffers:
            flag = torch.maximum(flag, buffer.owned_grads.isfinite().logical_not().any().float())
        comm.all_reduce_max(flag, self.ps.world_group)
        return flag

    @torch.no_grad()
    def step(
        self, lr: float, grad_scale: torch.Tensor | float = 1.0, skip: torch.Tensor | None = None
    ) -> None:
        """One AdamW step on the owned elements (torch.optim.AdamW's update); gradients are
        multiplied by `grad_scale` (the clip coefficient divided by the loss scale), which the
        kernel applies as it reads them, with no scaled copy (it leaves the owned gradients so
        scaled). `skip`: a flag on the device (1.0: this step is skipped, weights, moments and
        step count stay as they were), so that the verdict need not reach the host first."""
        self.finish_param_gather()  # the last step's gather must not land on this update
        self.adamw.begin_step(grad_scale, skip)
        placement = self.placement
        # Piece by piece: under offload, piece k's update overlaps the copies of its neighbours.
        placement.gradients_down([state.grads for state in self.states])
        if placement.offloaded or self.adamw.state_dtype != torch.float32:
            for i, state in enumerate(self.states):
                grads = placement.gradient(i)
                moments = (state.exp_avg, state.exp_avg_sq)
                self.adamw.update(state.master, grads, *moments, state.decay, lr, state.noise)
                placement.parameters_up(i, state.master, state.params)
        else:  # fp32 moments beside the weights: every piece in one kernel call per decay
            pieces = [(s.master, s.grads, s.exp_avg, s.exp_avg_sq, s.decay) for s in self.states]
            self.adamw.update_in_place(pieces, lr)
            for i, state in enumerate(self.states):
                placement.parameters_up(i, state.master, state.params)
        placement.finish()
        for buffer in self.buffers:  # chunk order, each in forward order: the next forward's
            buffer.start_param_gather()

    @property
    def step_count(self) -> int:
        """Updates applied so far (skipped steps do not count): AdamW's bias-correction step.
        Read from the device (checkpoints)."""
        return int(self.adamw.step_tensor.item())

    def finish_param_gather(self) -> None:
        """Wait until every parameter updated by the last step has arrived on this rank (the
        next forward waits bucket by bucket; evaluation, checkpoints and the end of training
        read them all)."""
        for buffer in self.buffers:
            buffer.finish_param_gather()

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor the optimizer holds beside the model's, on `placement.state_device`:
        master copies (not the params themselves), moments, the update's scratch, offload
        staging. For memory accounting."""
        held = [self.adamw.scratch, *self.placement.staging()]
        for state in self.states:
            held += [state.exp_avg, state.exp_avg_sq]
            held += [state.master] if state.master is not state.params else []
        return held

    # ------------------------------------------------------------------ checkpoints

    def owned_pieces(
        self, first_copies: bool = False
    ) -> Iterator[tuple[str, torch.Tensor, int, int, dict[str, torch.Tensor]]]:
        """(name, tensor, lo, hi, {kind: state}) for every range [lo, hi) of a global tensor's
        local piece, flattened, whose optimizer state this rank holds, `kind` in STATE_KINDS.
        `tensor` is that piece, carrying its meta: a parameter, or a part of a fused one
        (`global_tensors`; under ZeRO-3 its shape alone, on the meta device), so checkpoints
        keep one state per global tensor, as before fusing.
        The state tensors are views: a checkpoint saves and restores exactly what this rank
        owns, with no gather over dp. `first_copies`: only the shards this rank holds the first
        copy of (HSDP keeps several; a checkpoint writes one)."""
        for state, name, piece, lo, hi, index in self._owned_ranges(first_copies):
            views = {kind: getattr(state, kind)[lo:hi] for kind in STATE_KINDS}
            yield name, piece, index, index + hi - lo, views

    def owned_weights(self) -> Iterator[tuple[str, torch.Tensor, int, torch.Tensor]]:
        """(name, tensor, lo, values) for the ranges of `owned_pieces(first_copies=True)`:
        `values` the 16-bit parameters there (a view). What a ZeRO-3 checkpoint writes of the
        weights, since no rank holds them whole between steps."""
        for state, name, piece, lo, hi, index in self._owned_ranges(first_copies=True):
            yield name, piece, index, state.params[lo:hi]

    def _owned_ranges(
        self, first_copies: bool = False
    ) -> Iterator[tuple[ShardState, str, torch.Tensor, int, int, int]]:
        """(state, name, tensor, lo, hi, index): where each global tensor meets an owned piece
        (`first_copies`: of which this rank holds the first copy), [lo, hi) in the piece's
        coordinates, starting at `index` of the tensor's local piece, flattened
        (`owned_pieces`)."""
        for state in self.states:
            if first_copies and not state.buffer.first_copy:
                continue
            end = state.start + state.master.numel()
            meetings = _meetings(state.buffer, state.start, end, self.names)
            for name, _, param, lo, hi, index in meetings:
                holder = _meta_twin(param) if state.buffer.params_sharded else param
                piece = global_tensors({self.names[param]: holder})[name]
                yield state, name, piece, lo, hi, index

    @torch.no_grad()
    def load_pieces(
        self, read: Callable[[str, torch.Tensor, str, int, int], torch.Tensor], step_count: int
    ) -> None:
        """Restore the owned state; `read(name, tensor, kind, lo, hi)` gives elements [lo, hi)
        of the global tensor's local piece's state, flattened (see `owned_pieces`): only the
        owned range is read, so a rank reads its share and host memory stays at one range.
        Collective over the data-parallel replicas: the parameters are then the masters, on
        every replica (a run resumed in fp32 from a bf16 one loaded bf16-rounded weights, and
        its masters, which are its parameters, only for the ranges it owns)."""
        self.finish_param_gather()
        self.adamw.step_tensor.fill_(step_count)
        for name, tensor, lo, hi, views in self.owned_pieces():
            for kind, view in views.items():
                view.copy_(read(name, tensor, kind, lo, hi))
        for state in self.states:
            if state.master is not state.params:
                state.params.copy_(state.master)
        for buffer in self.buffers:
            buffer.start_param_gather()
        self.finish_param_gather()
