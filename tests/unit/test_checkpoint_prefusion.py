"""Checkpoints written before q/k/v and gate/up became fused parameters still load: the fused
parameters are saved and loaded as their parts, under the names and cuts the separate linears
had (`tensor_parallel.layers.param_parts`), so the on-disk format did not change.

The fixtures were saved by the code before fusing (`tests/fixtures/prefusion/make_fixture.py`,
commit cf7a21b) at tp 2 x dp 2 with ZeRO-1: GPT (biases, k/v split over tp) and a Llama whose
one kv head is shared by both tp ranks (n_kv_heads < tp)."""

from pathlib import Path

import pytest
import torch

from megalite.checkpoint.sharded import Checkpoint, load_checkpoint
from megalite.checkpoint.writer import save_checkpoint
from megalite.config import build_config
from megalite.data import GlobalBatchSampler
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.training.loop import run_state
from megalite.training.setup import build_run

FIXTURES = Path(__file__).parents[1] / "fixtures" / "prefusion"
TOKENS = torch.arange(16).remainder(64).view(2, 8)  # as make_fixture.py
FUSED = {"gpt": "layers.0.attn.wqkv.weight", "llama": "layers.0.mlp.gate_up.weight"}


def _saved(arch: str) -> Path:
    (path,) = (FIXTURES / arch).glob("step_*")
    return path


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_prefusion_checkpoint_gives_the_logits_it_gave(arch):
    model = Checkpoint(_saved(arch)).model()
    names = dict(model.named_parameters())
    assert FUSED[arch] in names and "layers.0.attn.wq.weight" not in names  # fused now
    with torch.no_grad():
        logits = model(TOKENS)
    saved = torch.load(FIXTURES / f"{arch}_logits.pt", weights_only=True)
    # one GEMM for gate and up may round otherwise than two (measured: 9e-8 relative)
    assert ((logits - saved).norm() / saved.norm()).item() < 1e-6


def _resume_and_save(saved: str, root: str, tp: int) -> None:
    raw = Checkpoint(Path(saved)).config
    raw["parallel"]["tp"] = tp
    cfg = build_config(raw)
    ps = build_parallel_state(tp, 1, torch.device("cpu"))
    sampler = GlobalBatchSampler(50, 2, cfg.train.seed)
    state = run_state(build_run(cfg, ps, random_init=False), sampler)
    load_checkpoint(Path(saved), state)
    save_checkpoint(Path(root), state, keep=1)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 1])
def test_prefusion_checkpoint_resumes_and_saves_the_same_tensors(arch, tp, tmp_path):
    """Weights and Adam state (ZeRO-1 pieces that straddle the fused parts) load into the fused
    model at the saved layout and at another tp (Llama: a shared kv head becomes split), and
    are saved again exactly as they were."""
    old = Checkpoint(_saved(arch))
    run_ranks(2 * tp, _resume_and_save, str(old.path), str(tmp_path), tp)
    (path,) = tmp_path.glob("step_*")
    new = Checkpoint(path)
    names = set(old._manifest["tensors"])
    assert set(new._manifest["tensors"]) == names
    for name in names:
        assert torch.equal(new.tensor(name), old.tensor(name)), name
