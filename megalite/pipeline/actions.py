"""The steps of a pipeline schedule (`schedule`): what a rank computes or sends, for which
micro-batch and local chunk."""

from __future__ import annotations

import enum
from typing import NamedTuple


class Op(enum.Enum):
    """One kind of schedule step; the values are the short codes used in logs and tests."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or under a split backward its input gradient only
    WEIGHT = "W"  # the weight gradients a split backward's B deferred
    RECV_FORWARD = "RF"  # receive the input activation of (mb, chunk) from the previous stage
    SEND_FORWARD = "SF"  # send the output activation of (mb, chunk) to the next stage
    RECV_BACKWARD = "RB"  # receive the gradient of the output of (mb, chunk) from the next stage
    SEND_BACKWARD = "SB"  # send the gradient of the input of (mb, chunk) to the previous stage

    def __init__(self, code: str) -> None:
        # Plain attributes, not properties: simulations test these a million times.
        self.is_compute = code in ("F", "B", "W")
        self.is_send = code.startswith("S")

    # Members are singletons, so identity is their hash: C-fast, where Enum's hashes the name
    # in Python (simulations hash millions of Actions).
    __hash__ = object.__hash__


class Action(NamedTuple):
    """One step of a rank's schedule; `chunk` is the LOCAL chunk index on that rank."""

    op: Op
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.op.name}(mb={self.microbatch}, chunk={self.chunk})"
