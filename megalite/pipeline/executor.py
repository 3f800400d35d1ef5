"""Runs one rank's schedule: a loop over actions, with no schedule logic of its own.

Forward of micro-batch m on local chunk c feeds it token ids (first virtual stage) or the
activation received from the previous stage, and keeps (input, output) until the backward.
Sends are asynchronous; a receive blocks where the schedule lists it, and that waiting time is
the measured pipeline bubble. An output that was sent on is freed as soon as its send completes
(only its autograd graph is needed for the backward; Megatron-LM's deallocate_output_tensor).
With pp = 1 the schedule holds only forwards and backwards: plain gradient accumulation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from megalite import comm
from megalite.optimizer.grad_buffer import GradBuffer
from megalite.parallel_state import ParallelState
from megalite.pipeline.schedule import Action, Op, peer_of, virtual_stage


@dataclass
class StepTimes:
    compute_s: float = 0.0
    wait_s: float = 0.0
    peak_in_flight: int = 0
    """Most (micro-batch, chunk) activations held at once (what the simulator predicts)."""

    @property
    def bubble_fraction(self) -> float:
        """Share of the schedule spent waiting on receives."""
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else 0.0


@dataclass
class MicroBatch:
    inputs: torch.Tensor
    """Token ids (b, s)."""
    targets: torch.Tensor
    """Next-token ids (b, s)."""


@dataclass
class _Step:
    """What one run of a schedule keeps between actions."""

    micro_batches: list[MicroBatch]
    loss_weight: float
    loss_scale: float
    device: torch.device
    times: StepTimes = field(default_factory=StepTimes)
    received: dict = field(default_factory=dict)
    """(op, micro-batch, chunk) -> received activation or gradient."""
    posted: dict = field(default_factory=dict)
    """(op, micro-batch, chunk) -> receive posted early, together with a send."""
    saved: dict = field(default_factory=dict)
    """(micro-batch, chunk) -> (input, output) kept from forward until backward."""
    input_grads: dict = field(default_factory=dict)
    """(micro-batch, chunk) -> gradient of the chunk's input, until it is sent."""
    in_flight_sends: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.loss_total = torch.zeros((), dtype=torch.float32, device=self.device)


def _run_backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    """Backward through `output`'s graph even if its storage was freed after sending it on."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), False, False, (), True, True
    )


@dataclass
class PipelineExecutor:
    chunks: list[nn.Module]
    """This rank's model chunks, by local chunk index."""
    ps: ParallelState
    vpp: int
    activation_shape: tuple[int, ...]
    """(micro batch, local seq, hidden) of the tensors exchanged between stages."""
    dtype: torch.dtype
    buffers_of_chunk: list[list[GradBuffer]] = field(default_factory=list)
    """Gradient buffers of each chunk, told to start their dp reduction before the chunk's
    last backward."""

    def __post_init__(self) -> None:
        n_stages = self.ps.pp_size * self.vpp
        stages = [virtual_stage(self.ps.pp_rank, c, self.ps.pp_size) for c in range(self.vpp)]
        self.is_first = [s == 0 for s in stages]
        self.is_last = [s == n_stages - 1 for s in stages]

    def _peer(self, action: Action) -> int:
        peer_rank, _ = peer_of(action, self.ps.pp_rank, self.ps.pp_size, self.vpp)
        return self.ps.pp_ranks[peer_rank]

    def run(
        self,
        schedule: list[Action],
        micro_batches: list[MicroBatch],
        loss_weight: float,
        loss_scale: float = 1.0,
    ) -> tuple[torch.Tensor, StepTimes]:
        """Run the actions of `schedule` (forward-only ones for evaluation, under no_grad);
        returns the sum over this rank's micro-batches of loss_weight * token-loss sum (zero off
        the last stage) and the timings."""
        step = _Step(micro_batches, loss_weight, loss_scale, self.ps.device)
        last_backward = {a.chunk: i for i, a in enumerate(schedule) if a.op is Op.BACKWARD}
        for index, action in enumerate(schedule):
            if action.op in (Op.RECV_FORWARD, Op.RECV_BACKWARD):
                start = time.perf_counter()
                self._receive(step, action)
                step.times.wait_s += time.perf_counter() - start
            elif action.op.is_send:
                following = schedule[index + 1] if index + 1 < len(schedule) else None
                self._send(step, action, following)
            else:
                start = time.perf_counter()
                if action.op is Op.FORWARD:
                    step.loss_total += self._forward(step, action)
                    step.times.peak_in_flight = max(step.times.peak_in_flight, len(step.saved))
                else:
                    if index == last_backward[action.chunk]:
                        for buffer in self.buffers_of_chunk[action.chunk]:
                            buffer.start_sync()
                    self._backward(step, action)
                step.times.compute_s += time.perf_counter() - start
            step.in_flight_sends = self._free_sent(step.in_flight_sends)
        for work, _ in step.in_flight_sends:
            work.wait()
        return step.loss_total, step.times

    def _receive(self, step: _Step, action: Action) -> None:
        """Wait for a receive, posted now or earlier together with a send."""
        key = (action.op, action.microbatch, action.chunk)
        work, buffer, _ = step.posted.pop(key, None) or self._post(receive=action)
        work.wait()
        step.received[key] = buffer

    def _send(self, step: _Step, action: Action, following: Action | None) -> None:
        """Start a send; a receive listed right after it is posted in the same batch (NCCL
        runs all p2p between two ranks on one stream, so the two must not wait on each other)."""
        key = (action.microbatch, action.chunk)
        if action.op is Op.SEND_FORWARD:
            held = step.saved[key] if torch.is_grad_enabled() else step.saved.pop(key)
            output = held[1]
            message = output.detach().contiguous()  # SP shards can be strided views
        else:
            output, message = None, step.input_grads.pop(key).contiguous()
        if following is not None and following.op in (Op.RECV_FORWARD, Op.RECV_BACKWARD):
            posts = self._post(receive=following, send=(message, self._peer(action)))
            step.posted[(following.op, following.microbatch, following.chunk)] = posts
        else:
            posts = self._post(send=(message, self._peer(action)))
        step.in_flight_sends.append((posts[2], output))

    def _post(self, receive: Action | None = None, send: tuple[torch.Tensor, int] | None = None):
        """Post a receive (into a fresh buffer) and/or a send as one batch; returns
        (receive handle, buffer, send handle), with None for what was not posted."""
        buffer = None
        recvs = []
        if receive is not None:
            buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.ps.device)
            recvs = [(buffer, self._peer(receive))]
        works = comm.post_p2p([send] if send is not None else [], recvs)
        send_work = works[0] if send is not None else None
        recv_work = works[-1] if receive is not None else None
        return recv_work, buffer, send_work

    def _forward(self, step: _Step, action: Action) -> torch.Tensor:
        mb, c = action.microbatch, action.chunk
        batch = step.micro_batches[mb]
        if self.is_first[c]:
            inputs = batch.inputs
        else:
            received = step.received.pop((Op.RECV_FORWARD, mb, c))
            inputs = received.requires_grad_(torch.is_grad_enabled())
        output = self.chunks[c](inputs, batch.targets if self.is_last[c] else None)
        if self.is_last[c]:
            output = output * step.loss_weight  # the token-loss sum: this micro-batch's share
        if torch.is_grad_enabled():
            step.saved[(mb, c)] = (None if self.is_first[c] else inputs, output)
        else:
            step.saved[(mb, c)] = (None, output.detach())  # kept only until it is sent on
        return output.detach() if self.is_last[c] else output.new_zeros((), dtype=torch.float32)

    def _backward(self, step: _Step, action: Action) -> None:
        mb, c = action.microbatch, action.chunk
        inputs, output = step.saved.pop((mb, c))
        if self.is_last[c]:
            (output * step.loss_scale).backward()
        else:
            _run_backward(output, step.received.pop((Op.RECV_BACKWARD, mb, c)))
        if inputs is not None:
            step.input_grads[(mb, c)] = inputs.grad

    @staticmethod
    def _free_sent(in_flight: list) -> list:
        """Drop finished sends; free the storage of outputs whose send has completed."""
        pending = []
        for work, output in in_flight:
            if work.is_completed():
                if output is not None:
                    output.data = torch.empty(0, dtype=output.dtype, device=output.device)
            else:
                pending.append((work, output))
        return pending
