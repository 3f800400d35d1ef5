"""Checkpoint files are named by axis, from the rank grid: today's axes give exactly the names
every earlier checkpoint (formats v1-v4) carries, so those still load, and an axis added to the
grid shows in the names without a change to the checkpoint code."""

import json
from pathlib import Path

from megalite.checkpoint.sharded import optimizer_file, weights_file
from megalite.parallel_dims import ParallelDims

FIXTURES = Path(__file__).parents[1] / "fixtures" / "prefusion"


def test_todays_axes_give_todays_names():
    dims = ParallelDims.for_world(16, tp=2, pp=2)
    rank = dims.rank_of(tp=1, dp=3)
    assert weights_file(dims, rank) == "model_tp01_pp00.safetensors"
    assert optimizer_file(dims, rank) == "optim_tp01_pp00_dp03.safetensors"


def test_the_fixtures_files_are_the_names_the_grid_gives_their_layout():
    """Saved at tp 2 x dp 2 with ZeRO-1 by the code before the grid named files by axis:
    dp rank 0 of each tp rank wrote the weights, every rank its optimizer state."""
    for manifest_path in FIXTURES.glob("*/step_*/manifest.json"):
        manifest = json.loads(manifest_path.read_text())
        dims = ParallelDims.for_world(manifest["world_size"], tp=2)
        assert manifest["layout"] == dims.layout()
        ranks = range(dims.world_size)
        named = {weights_file(dims, r) for r in ranks if dims.coords(r)["dp"] == 0}
        named |= {optimizer_file(dims, r) for r in ranks}
        saved = {f for f in manifest["files"] if f.startswith(("model_", "optim_"))}
        assert saved == named, manifest_path


def test_expert_weights_are_named_by_the_experts_grid():
    """With expert parallelism the dense weights keep their files; each (tp, ep, pp) piece of
    the experts has its own, and the optimizer files stay one per rank."""
    dims = ParallelDims.for_world(16, ep=2, tp=2, pp=2)
    rank = dims.rank_of(tp=1, dp=3, pp=1)  # dp 3 = edp 1 x ep 2 + ep 1
    assert weights_file(dims, rank) == "model_tp01_pp01.safetensors"
    assert weights_file(dims.expert_dims, rank) == "model_tp01_ep01_pp01.safetensors"
    assert optimizer_file(dims, rank) == "optim_tp01_pp01_dp03.safetensors"
    names = {optimizer_file(dims, r) for r in range(dims.world_size)}
    assert len(names) == dims.world_size  # one file per rank
    experts = {weights_file(dims.expert_dims, r) for r in range(dims.world_size)}
    assert len(experts) == 8  # per expert replica
