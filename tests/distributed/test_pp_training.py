"""Pipeline-parallel training equals the single-process run: every schedule, pp in {2, 4},
vpp in {1, 2}, GPT (tied embeddings across the first and last stage) and Llama, a partial
micro-batch group, pp = 2 combined with tp = 2 and sequence parallelism, and every schedule
again, evaluation included, with p2p that blocks as NCCL's does."""

import pytest
import torch
from equivalence import EVAL, TINY, assert_equivalent, assert_same_val_losses

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.pipeline.executor import PipelineExecutor
from megalite.pipeline.schedule import Op, build_schedule
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


EIGHT_MICROBATCHES = ("train.micro_batch_size=1",)  # m = 2 pp: the interleaved steady state


@pytest.mark.parametrize(
    "pp,vpp,schedule",
    [
        (2, 1, "gpipe"),
        (2, 1, "1f1b"),
        (2, 2, "interleaved"),
        (4, 1, "gpipe"),
        (4, 1, "1f1b"),
        (4, 2, "interleaved"),
        (2, 3, "interleaved"),
        (4, 3, "interleaved"),
    ],
)
def test_pp_with_nccl_blocking_p2p(builtin_corpus, tmp_path, pp, vpp, schedule):
    """p2p as NCCL runs it (one work per batch; a send completes only when the receiver has
    posted the receive; a rank's batches run one after another): training and evaluation (which
    runs the forwards of a GPipe list, vpp 2 in the interleaved cases) still equal the single
    process. Receives listed right before their compute (the executor's order until issue 13)
    hang here with vpp 2; receives taken from the handles of a batch's ops one by one (until
    issue 22) find no handle on NCCL, and the first backward fails."""
    layers = (f"model.n_layers={max(4, pp * vpp)}",)  # a layer per chunk at least
    model = GPT + EVAL + EIGHT_MICROBATCHES + layers
    layout = (f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}")
    assert_equivalent(pp, model, layout, tmp_path)
    assert_same_val_losses(model, tmp_path)


def test_pp_with_gloo_p2p(builtin_corpus, tmp_path, gloo_as_it_is):
    """gloo's own p2p, one work per op (the rest of the suite runs NCCL's one work per batch):
    the executor's batches are ready when all their works are, whichever shape comes back."""
    layout = ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved")
    assert_equivalent(2, GPT + EIGHT_MICROBATCHES, layout, tmp_path)


def _peaks(schedule, pp, num_microbatches):
    overrides = [
        *TINY,
        f"parallel.pp={pp}",
        f"parallel.schedule={schedule}",
        f"train.global_batch_size={2 * num_microbatches}",
    ]
    cfg = load_config(None, overrides)
    ps = build_parallel_state(1, pp, torch.device("cpu"))
    run = build_run(cfg, ps)
    torch.manual_seed(0)
    metrics = train_step(run, torch.randint(0, 500, (2 * num_microbatches, 33)), 1e-3)
    return metrics.times.peak_in_flight, metrics.bubble_fraction


def _storage_of_sent_outputs(pp: int, num_microbatches: int) -> list[int]:
    """Bytes still held by each sent output right after its send was posted."""
    held = []
    post = PipelineExecutor._post

    def post_and_look(self, step, batch):
        post(self, step, batch)
        for action in batch:
            if action.op is Op.SEND_FORWARD:
                output = step.saved[(action.microbatch, action.chunk)][1]
                held.append(output.untyped_storage().nbytes())

    PipelineExecutor._post = post_and_look  # in this forked rank only
    _peaks("1f1b", pp, num_microbatches)
    return held


def test_sent_outputs_are_freed_when_the_send_is_posted():
    """Only the autograd graph of a sent output is needed for its backward: its storage goes as
    soon as the send is posted (the communication library holds the message)."""
    held_by_rank = run_ranks(2, _storage_of_sent_outputs, 2, 4)
    assert held_by_rank == [[0, 0, 0, 0], []]  # rank 0 sends 4 activations, rank 1 none


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activations_held_match_the_simulator(schedule):
    """The executor frees a micro-batch's activations after its backward: the number it holds
    at once is the simulator's peak (1F1B: pp - rank; GPipe: every micro-batch)."""
    pp, m = 2, 6
    measured = run_ranks(pp, _peaks, schedule, pp, m)
    simulated = simulate([build_schedule(schedule, pp, r, m) for r in range(pp)], pp, 1)
    assert [peak for peak, _ in measured] == simulated.peak_in_flight
    assert simulated.peak_in_flight == ([2, 1] if schedule == "1f1b" else [6, 6])
    # Measured and reported on every rank alike: idle time relative to compute, which is
    # positive with pp > 1 and may exceed 1 when the machine is loaded.
    bubbles = [bubble for _, bubble in measured]
    assert bubbles[0] > 0 and bubbles == [bubbles[0]] * pp
