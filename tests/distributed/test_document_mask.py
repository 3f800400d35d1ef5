"""Document masking (`data.document_mask`): a packed window's loss is the sum of its documents'
losses, each run alone from position 0, and so are the gradients; with and without context
parallelism. The documents are ragged: lengths 1, lengths that are no multiple of any block,
a document cut by the window's end, one that starts on a chunk boundary."""

import pytest
import torch
from equivalence import relative_error
from megalite.models.factory import build_chunks

from megalite import comm
from megalite.config import load_config
from megalite.context_parallel.layout import document_starts
from megalite.data.dataset import TokenBatch
from megalite.launch import run_ranks
from megalite.parallel_state import ParallelState, build_parallel_state
from megalite.tensor_parallel import TPRandom
from megalite.training.setup import build_run
from megalite.training.step import eval_loss

EOS, SEQ = 3, 64
MODEL = (
    "model.n_layers=2",
    "model.hidden=32",
    "model.n_heads=4",
    "model.vocab_size=97",
    f"model.seq_len={SEQ}",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "data.document_mask=true",
)
# End-of-document tokens per window (input positions): ragged documents, a document of one
# token (positions 20, 21), one ending on the last input, none at all in the last window.
EOS_AT = ([5, 20, 21, 47], [15, 31, 63], [0, 33, 34, 50, 61], [])


def packed_windows() -> torch.Tensor:
    """(4, SEQ + 1) windows of random tokens with EOS at `EOS_AT` and nowhere else."""
    seed = torch.Generator().manual_seed(0)
    windows = torch.randint(EOS + 1, 97, (len(EOS_AT), SEQ + 1), generator=seed)
    for row, positions in enumerate(EOS_AT):
        windows[row, positions] = EOS
    return windows


def documents(windows: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, targets) of every document of every window: a document ends with its EOS."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    starts = document_starts(inputs, EOS)
    docs = []
    for row in range(inputs.shape[0]):
        begin = starts[row].unique().tolist()
        for a, b in zip(begin, [*begin[1:], SEQ]):
            docs.append((inputs[row : row + 1, a:b], targets[row : row + 1, a:b]))
    return docs


def test_document_starts_follow_the_eos_tokens():
    inputs = torch.tensor([[7, 3, 8, 9, 3, 3, 5], [3, 4, 4, 4, 4, 4, 4]])
    assert document_starts(inputs, 3).tolist() == [[0, 0, 2, 2, 2, 5, 6], [0, 1, 1, 1, 1, 1, 1]]


def _losses_and_grads(cfg, ps):
    """Packed (the run's eval loss and the chunk's gradients) against one document at a time."""
    run = build_run(cfg, ps, eos_id=EOS)
    windows = packed_windows()
    packed = eval_loss(run, TokenBatch.of_windows(windows))
    (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps))  # plain .grad, same weights
    cut = run.sequence_cut
    layout = cut.layout(windows[:, :-1])
    model(cut.shard(windows[:, :-1]), cut.shard(windows[:, 1:]), layout).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for grad in grads.values():  # each cp rank took the loss of its own chunks
        comm.all_reduce(grad, ps.group("cp"))
    model.zero_grad(set_to_none=True)
    alone = torch.zeros(())
    for inputs, targets in documents(windows):  # no layout: plain causal attention, from 0
        loss = model(inputs, targets)
        loss.backward()
        alone += loss.detach()
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    return packed, (alone / windows[:, :-1].numel()).item(), grads, ref_grads


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_packed_window_is_its_documents_one_by_one(arch):
    cfg = load_config(None, [*MODEL, f"model.arch={arch}"])
    packed, alone, grads, ref_grads = _losses_and_grads(cfg, ParallelState.single())
    assert packed == pytest.approx(alone, rel=1e-5)
    for name, grad in grads.items():
        assert relative_error(grad, ref_grads[name]) < 1e-5, name


def _on_cp_ranks(overrides):
    cfg = load_config(None, [*MODEL, *overrides])
    ps = build_parallel_state(1, 1, torch.device("cpu"), cp=cfg.parallel.cp)
    packed, alone, grads, ref_grads = _losses_and_grads(cfg, ps)
    return packed, alone, {n: relative_error(g, ref_grads[n]) for n, g in grads.items()}


@pytest.mark.parametrize(
    "world,overrides",
    [
        (2, ("model.arch=llama", "parallel.cp=2")),
        (4, ("parallel.cp=4", "parallel.cp_comm=allgather")),
    ],
    ids=["llama-cp2-ring", "gpt-cp4-allgather"],
)
def test_packed_window_under_context_parallelism(world, overrides):
    """The window's chunks on cp ranks: the documents cross chunk boundaries (EOS at 15, 31
    and 47 end chunks at cp 2 and cp 4)."""
    for packed, alone, errors in run_ranks(world, _on_cp_ranks, overrides):
        assert packed == pytest.approx(alone, rel=1e-5)
        assert max(errors.values()) < 1e-5, errors
