"""A new architecture is its own package plus one registration, and nothing else changes: the toy
GPT-J of tests/fixtures/toy_gptj (attention and MLP in parallel on one LayerNorm, a block
neither GPT nor Llama has), registered at run time, trains with `megalite train`, is estimated
by `megalite estimate` (its parameters as built, at tp 2 x pp 2 too, and the activations it
keeps as measured), exports with `megalite export-hf` to a transformers `GPTJForCausalLM` that
computes its logits, and comes back through `checkpoint.init_from` tensor for tensor."""

import json
from pathlib import Path

import pytest
import torch
from megalite.models.factory import build_chunks
from safetensors.torch import load_file

import megalite.training.loop as loop
from megalite import architectures
from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.cli import main
from megalite.config import load_config
from megalite.parallel_state import ParallelState
from megalite.profiling.estimate import estimate_layout
from megalite.profiling.memory import SavedActivationTracker
from megalite.profiling.parameters import chunk_parameters
from megalite.tensor_parallel import TPRandom
from megalite.training.setup import build_run
from megalite.training.step import micro_batches

FIXTURES = Path(__file__).parents[1] / "fixtures"
TOY = [
    "model.arch=toy-gptj",
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=1000",
    "logging.progress=false",
]


@pytest.fixture
def toy(monkeypatch):
    """The toy registered for this test only (the shipped list is restored afterwards)."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    import toy_gptj

    architectures.register(toy_gptj.ARCHITECTURE)
    yield
    architectures.unregister(toy_gptj.ARCHITECTURE.name)


def test_train_estimate_export_and_import(toy, builtin_corpus, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    assert main(["train", *TOY, "train.steps=2", f"train.out_dir={run}"]) == 0

    capsys.readouterr()
    assert main(["estimate", "--world-size", "1", "--device", "cpu", "--json", *TOY]) == 0
    (stage,) = json.loads(capsys.readouterr().out)["stages"]
    model = Checkpoint(resolve_checkpoint(run)).model()
    assert stage["parameters"] == sum(p.numel() for p in model.parameters())

    hf_dir = tmp_path / "hf"
    assert main(["export-hf", "--checkpoint", str(run), "--out", str(hf_dir)]) == 0
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(theirs).__name__ == "GPTJForCausalLM"
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(ids).logits, model.eval()(ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5

    # One step at learning rate 0 changes no weight: what comes back out is what went in.
    monkeypatch.setattr(loop, "learning_rate", lambda step, optim, total: 0.0)
    again = tmp_path / "again"
    init = [f"checkpoint.init_from={hf_dir}", "train.steps=1", f"train.out_dir={again}"]
    assert main(["train", *TOY, *init]) == 0
    assert main(["export-hf", "--checkpoint", str(again), "--out", str(tmp_path / "back")]) == 0
    before = load_file(hf_dir / "model.safetensors")
    after = load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_estimate_matches_the_built_model(toy):
    """Parameter names and sizes per chunk on every rank of tp 2 x pp 2, as built on the meta
    device; and the activations one CPU step keeps (with dropout: both branches' masks)."""
    cfg = load_config(None, [*TOY, "parallel.tp=2", "parallel.pp=2"])
    for tp_rank in range(2):
        for pp_rank in range(2):
            dims = cfg.parallel.dims(4)
            rank = dims.rank_of(tp=tp_rank, pp=pp_rank)
            ps = ParallelState(dims, rank, torch.device("meta"))
            chunks = build_chunks(cfg, ps, TPRandom(0, ParallelState.single()), random_init=False)
            for chunk in chunks:
                ids = [int(i) for i in chunk.layers]
                layers = range(ids[0], ids[-1] + 1)
                predicted = chunk_parameters(cfg, layers, chunk.has_embedding, chunk.has_head)
                built = [(name, p.numel()) for name, p in chunk.named_parameters()]
                assert [(p.name, p.numel) for p in predicted] == built

    cfg = load_config(None, [*TOY, "model.dropout=0.1"])
    training = build_run(cfg, ParallelState.single("cpu"))
    training.train(True)
    tokens = torch.randint(0, 500, (2, 33), generator=torch.Generator().manual_seed(0))
    held = [t for chunk in training.chunks for t in (*chunk.parameters(), *chunk.buffers())]
    with SavedActivationTracker(exclude=held) as saved:
        training.executor.run(training.schedule(1), micro_batches(tokens, 2), loss_weight=1e-3)
    (stage,) = estimate_layout(cfg, 1, device="cpu").stages
    kept = stage.part("activations") + stage.part("head weight grads")
    assert saved.peak == pytest.approx(kept, rel=0.05)
