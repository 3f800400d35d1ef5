"""Pipeline-parallel training equals the single-process run: every schedule, pp in {2, 4},
vpp in {1, 2}, GPT (tied embeddings across the first and last stage) and Llama, a partial
micro-batch group, and pp = 2 combined with tp = 2 and sequence parallelism."""

import pytest
import torch
from equivalence import TINY, assert_equivalent
from multiproc import run_ranks

from megalite.config import load_config
from megalite.parallel_state import build_parallel_state
from megalite.pipeline.schedule import build_schedule
from megalite.pipeline.simulate import simulate
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
EIGHT_LAYERS = ("model.n_layers=8",)  # pp * vpp = 8 chunks need 8 layers


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize(
    "pp,vpp,schedule",
    [
        (2, 1, "gpipe"),
        (2, 1, "1f1b"),
        (2, 2, "interleaved"),
        (4, 1, "1f1b"),
        (4, 1, "gpipe"),
        (4, 2, "interleaved"),
    ],
)
def test_pp_matches_single_process(builtin_corpus, tmp_path, model, pp, vpp, schedule):
    layers = EIGHT_LAYERS if pp * vpp > 4 else ()
    layout = (f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}")
    assert_equivalent(pp, model + layers, layout, tmp_path)


def test_interleaved_with_a_partial_microbatch_group(builtin_corpus, tmp_path):
    """m = 5 micro-batches in groups of N = 3: the last group has 2 >= pp micro-batches."""
    batch = ("train.global_batch_size=10",)
    layout = (
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved",
        "parallel.microbatch_group_size=3",
    )
    assert_equivalent(2, GPT + batch, layout, tmp_path)


@pytest.mark.parametrize("model", [GPT, LLAMA], ids=["gpt", "llama"])
def test_pp_with_tp_and_sp(builtin_corpus, tmp_path, model):
    layout = ("parallel.pp=2", "parallel.tp=2", "parallel.sp=true")
    assert_equivalent(4, model, layout, tmp_path)


def _peaks(schedule, pp, num_microbatches):
    overrides = [
        *TINY,
        f"parallel.pp={pp}",
        f"parallel.schedule={schedule}",
        f"train.global_batch_size={2 * num_microbatches}",
    ]
    cfg = load_config(None, overrides)
    ps = build_parallel_state(1, pp, torch.device("cpu"))
    run = build_run(cfg, ps, num_microbatches)
    torch.manual_seed(0)
    metrics = train_step(run, torch.randint(0, 500, (2 * num_microbatches, 33)), 1e-3)
    return metrics.peak_in_flight, metrics.bubble_fraction


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activations_held_match_the_simulator(schedule):
    """The executor frees a micro-batch's activations after its backward: the number it holds
    at once is the simulator's peak (1F1B: pp - rank; GPipe: every micro-batch)."""
    pp, m = 2, 6
    measured = run_ranks(pp, _peaks, schedule, pp, m)
    simulated = simulate([build_schedule(schedule, pp, r, m) for r in range(pp)], pp, 1)
    assert [peak for peak, _ in measured] == simulated.peak_in_flight
    assert simulated.peak_in_flight == ([2, 1] if schedule == "1f1b" else [6, 6])
    assert all(0 < bubble < 1 for _, bubble in measured)  # measured and reported on every rank
