"""A Hugging Face model in and out of megalite, as every architecture's conversion test runs
it: `checkpoint.init_from` computes transformers' logits (one step at learning rate 0 changes
no weight), `megalite export-hf` writes a model transformers loads to the same logits, and
importing that and exporting again gives bit-identical tensors."""

from pathlib import Path

import safetensors.torch
import torch

import megalite.training.loop as loop
from megalite.checkpoint.sharded import Checkpoint, resolve_checkpoint
from megalite.cli import main


def randomised(model, router: str = "gate.weight"):
    """`model` (eval mode) with every tensor drawn afresh, so that each one matters: norm weights
    around 1, the router's (the name ending in `router`) sharp enough to decide, the rest small."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.5 if name.endswith(router) else 0.1)
    return model.eval()


def assert_round_trip(original, overrides: list[str], tmp_path: Path, monkeypatch) -> Path:
    """Round-trip `original` (a transformers causal LM of vocabulary 500, seq 32) under the
    megalite `overrides` that describe it; returns the exported directory."""
    from transformers import AutoModelForCausalLM

    original.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with monkeypatch.context() as patch:
        patch.setattr(loop, "learning_rate", lambda step, optim, total: 0.0)
        run = tmp_path / "run"
        init = [f"checkpoint.init_from={tmp_path / 'hf'}", "train.steps=1"]
        assert main(["train", *overrides, *init, f"train.out_dir={run}"]) == 0
        ours = Checkpoint(resolve_checkpoint(run)).model()
        ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = original(ids).logits
            assert (ours(ids) - expected).abs().max().item() < 1e-4

        back = tmp_path / "back"
        assert main(["export-hf", "--checkpoint", str(run), "--out", str(back)]) == 0
        theirs = AutoModelForCausalLM.from_pretrained(back).eval()
        with torch.no_grad():
            assert (theirs(ids).logits - expected).abs().max().item() < 1e-4

        again = tmp_path / "again"
        init = [f"checkpoint.init_from={back}", "train.steps=1"]
        assert main(["train", *overrides, *init, f"train.out_dir={again}"]) == 0
        out = tmp_path / "back-again"
        assert main(["export-hf", "--checkpoint", str(again), "--out", str(out)]) == 0
    first = safetensors.torch.load_file(next(back.glob("*.safetensors")))
    second = safetensors.torch.load_file(next(out.glob("*.safetensors")))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    return back
