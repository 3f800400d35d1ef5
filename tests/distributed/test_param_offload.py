"""ZeRO-3 parameter offload (zero 3 with optim.offload=cpu, ZeRO-Infinity's CPU tier): the owned
parameters live in host memory, where the update writes them, and each gather brings its piece
up. Equivalence with the single process at dp 4 (and tp 2 + SP x dp 2 in `test_zero3.py`); bit
for bit what zero 3 with the parameters on the device computes, in fp32 and bf16; and what a
rank holds where, as `megalite estimate` counts it: between steps no parameter on the device,
the owned pieces on the host, no staging for the way up."""

import pytest
import torch
from equivalence import TINY, assert_equivalent

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.memory import live_bytes, live_devices
from megalite.training.setup import build_run
from megalite.training.step import train_step

LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
ZERO3 = ("parallel.zero=3", "parallel.bucket_mb=0.05")
OFFLOAD = ("optim.offload=cpu",)
LIVE_PARTS = {
    "params": "parameters",
    "offloaded params": "offloaded parameters",
    "buffers": "buffers",
    "grads": "gradients",
    "optimizer": "optimizer",
}
"""`live_bytes`'s names for the estimate's parts."""


def test_parameter_offload_matches_single_process(builtin_corpus, tmp_path):
    assert_equivalent(4, LLAMA, (*ZERO3, *OFFLOAD), tmp_path)


def _config(precision: str, offload: bool):
    extra = OFFLOAD if offload else ()
    return load_config(None, [*TINY, *LLAMA, *ZERO3, f"train.precision={precision}", *extra])


def _three_steps(precision: str) -> dict:
    """Three steps at zero 3 with the parameters on the host and on the device: the losses,
    the owned parameters after, and (offloaded) where everything lives."""
    found: dict = {}
    for offload in (False, True):
        cfg = _config(precision, offload)
        run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu")))
        generator = torch.Generator().manual_seed(run.ps.coord("dp"))
        losses = []
        for _ in range(3):
            tokens = torch.randint(0, 500, (2, cfg.model.seq_len + 1), generator=generator)
            losses.append(train_step(run, tokens, 3e-3).loss)
        (buffer,) = run.buffers
        found[offload] = {"losses": losses, "owned": buffer.params_owned.clone()}
        if offload:
            found["live"] = live_bytes(run)
            found["devices"] = live_devices(run)
            found["in arena"] = (
                buffer.params_owned.untyped_storage().data_ptr()
                == buffer.host_params.storage.data_ptr()
            )
            found["uploads"] = [u for u in run.optimizer.placement.outgoing if u is not None]
    return found


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_offloaded_parameters_are_the_same_update_and_held_where_the_estimate_says(precision):
    """The same losses and owned parameters, exactly, with the parameters on the host as on the
    device. Offloaded, between steps the device holds no parameter (nothing is gathered), the
    host holds the owned pieces in an arena of their own, the optimizer stages nothing for the
    way up, and every part is the estimate's, to the byte, on the device it names."""
    stage = estimate_layout(_config(precision, True), 4, device="cpu").stages[0]
    parts = {part.name: part for part in stage.parts}
    for found in run_ranks(4, _three_steps, precision):
        assert found[True]["losses"] == found[False]["losses"]
        assert torch.equal(found[True]["owned"], found[False]["owned"])
        assert found["in arena"] and found["uploads"] == []
        assert found["live"] == {n: stage.part(p) for n, p in LIVE_PARTS.items()}
        assert found["devices"] == {n: parts[p].device for n, p in LIVE_PARTS.items()}
    assert stage.part("parameters") == 0 and stage.part("offloaded parameters") > 0
    assert parts["offloaded parameters"].device == "host"
