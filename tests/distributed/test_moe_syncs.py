"""What a steady-state MoE forward and backward makes the host wait for, counted on CPU by name
as a GPU would wait (issue 47): nothing without expert parallelism, dropless or under a
capacity, either router; across ep ranks one device-to-host copy per MoE layer and
micro-batch, the split sizes the token all-to-all takes on the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from megalite.models.layers import BuildContext
from megalite.models.moe import MoE
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.tensor_parallel import TPRandom
from megalite.tensor_parallel.random import init_parameters

aten = torch.ops.aten

READ_BACK = frozenset(
    (aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default)
)
"""Ops whose result is a host value: .item(), int(), bool(), torch.equal."""

VALUE_SIZED = frozenset(
    (aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
     aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default)
)  # fmt: skip
"""Ops whose output's size the host learns from the values (bincount: from their maximum)."""


def _waits(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this ATen call would make the host wait for a GPU's queue."""
    if func in READ_BACK or func in VALUE_SIZED:
        return True
    if func is aten.repeat_interleave.Tensor:  # sized by the repeats' sum, unless told
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is aten._to_copy.default:  # to the host
        device = kwargs.get("device")
        return device is not None and device.type == "cpu" and args[0].device.type != "cpu"
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and args[1].device.type != "cpu"
    return False


class HostSyncs:
    """Inside: the name of each call that would make the host wait for a GPU, in order, in
    `names`. ATen calls are seen as they dispatch (`_waits`); ``Tensor.tolist`` reads a CPU
    tensor's memory without dispatching anything, so it is seen as the Python call it is."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._modes = (_Dispatched(self.names.append), _Called(self.names.append))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Dispatched(TorchDispatchMode):
    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _waits(func, args, kwargs):
            self.record(str(func))
        return func(*args, **kwargs)


class _Called(TorchFunctionMode):
    def __init__(self, record: Callable[[str], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(
        self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        if func is torch.Tensor.tolist:
            self.record("Tensor.tolist")
        return func(*args, **(kwargs or {}))


def test_the_count_sees_each_kind_of_sync():
    """So that a count of none means none: each way the MoE path used to wait, and the others."""
    counts, x = torch.tensor([2, 0, 1]), torch.randn(3, 4)
    with HostSyncs() as syncs:
        counts.tolist()
        int(counts[0])
        torch.arange(3).repeat_interleave(counts)
        x[x > 0]
        torch.equal(x, x)
        torch.arange(3).repeat_interleave(counts, output_size=3)  # told its size: no wait
        x[counts]  # indexed by position: no wait
    assert syncs.names == [
        "Tensor.tolist",
        "aten._local_scalar_dense.default",
        "aten.repeat_interleave.Tensor",
        "aten.index.Tensor",
        "aten.equal.default",
    ]


MIXTRAL_TINY = (  # configs/mixtral-tiny.yaml's MoE widths, over 2 x 64 tokens
    "model.arch=mixtral",
    "model.hidden=256",
    "model.ffn_hidden=512",
    "model.n_heads=4",
    "model.moe_experts=8",
    "model.moe_top_k=2",
    "model.seq_len=64",
)
ROUTINGS = {
    "dropless": (),
    "capacity 1.0": ("model.moe_capacity_factor=1.0",),
    "capacity 0.5, deepseek": (
        "model.moe_capacity_factor=0.5",
        "model.moe_router=sigmoid",
        "model.moe_shared_experts=1",
        "model.moe_z_loss_coef=0.001",
    ),
}


def _syncs_of_a_step(ps: ParallelState, overrides: tuple[str, ...]) -> list[str]:
    """The host syncs of one MoE layer's forward and backward on this rank's 2 x 64 tokens,
    after one such step uncounted (the steady state)."""
    cfg = load_config(None, [*MIXTRAL_TINY, *overrides]).model
    moe = MoE(BuildContext(cfg, ps, TPRandom(0, ps)))
    init_parameters(moe, 0, ps)
    x = torch.randn(2, cfg.seq_len, cfg.hidden, generator=torch.Generator().manual_seed(ps.rank))
    x.requires_grad_()
    moe(x).sum().backward()
    with HostSyncs() as syncs:
        moe(x).sum().backward()
    assert moe.dropped.item() > 0 or cfg.moe_capacity_factor in (None, 1.0)
    return syncs.names


@pytest.mark.parametrize("routing", ROUTINGS)
def test_without_expert_parallelism_nothing_waits(routing):
    assert _syncs_of_a_step(ParallelState.single(), ROUTINGS[routing]) == []


def _syncs_at_ep(ep: int, overrides: tuple[str, ...]) -> list[str]:
    return _syncs_of_a_step(build_parallel_state(1, 1, torch.device("cpu"), ep=ep), overrides)


@pytest.mark.parametrize("routing", ["dropless", "capacity 0.5, deepseek"])
def test_across_ep_ranks_one_copy_of_the_counts(routing):
    """At ep 2 the counts come to the host once per layer and micro-batch, the send and
    receive sizes in one copy; backward reuses them."""
    for syncs in run_ranks(2, _syncs_at_ep, 2, ROUTINGS[routing]):
        assert syncs == ["Tensor.tolist"]
