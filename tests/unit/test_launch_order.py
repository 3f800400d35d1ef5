"""CUDA_DEVICE_MAX_CONNECTIONS=1 under tensor parallelism, set before CUDA starts: the
overlapped TP/SP GEMMs rely on kernels starting in launch order (`keep_launch_order`)."""

import os

import pytest
import torch
from run_configs import ONE_LAYER

import megalite.training.loop as loop
from megalite.config import load_config
from megalite.errors import ConfigError, MegaliteError
from megalite.parallel_state import LAUNCH_ORDER_ENV, keep_launch_order


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv(LAUNCH_ORDER_ENV, raising=False)
    return monkeypatch


def test_tensor_parallelism_gets_one_hardware_queue(unset):
    keep_launch_order(1)
    assert LAUNCH_ORDER_ENV not in os.environ  # no TP: the driver's default
    keep_launch_order(2)
    assert os.environ[LAUNCH_ORDER_ENV] == "1"


def test_another_value_or_a_started_cuda_is_refused(unset):
    unset.setenv(LAUNCH_ORDER_ENV, "8")
    with pytest.raises(ConfigError, match="CUDA_DEVICE_MAX_CONNECTIONS=8 with parallel.tp=2"):
        keep_launch_order(2)
    unset.delenv(LAUNCH_ORDER_ENV)
    unset.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(MegaliteError, match="export it before starting the process"):
        keep_launch_order(4)


@pytest.mark.parametrize(
    "device,tp,expected", [("cuda", 2, "1"), ("cuda", 1, None), ("cpu", 2, None)]
)
def test_a_run_sets_it_before_joining_the_world(unset, device, tp, expected):
    """`setup_topology` on CUDA sets it before `init_distributed`, which starts CUDA; a CPU
    run or one without TP leaves the environment alone."""
    seen = []
    unset.setattr(loop, "choose_device", lambda requested: torch.device(device))
    unset.setattr(
        loop, "init_distributed", lambda *a: seen.append(os.environ.get(LAUNCH_ORDER_ENV))
    )
    unset.setattr(loop, "build_parallel_state", lambda *a, **k: None)
    unset.setenv("WORLD_SIZE", str(tp))
    loop.setup_topology(load_config(None, [*ONE_LAYER, f"parallel.tp={tp}"]))
    assert seen == [expected]
