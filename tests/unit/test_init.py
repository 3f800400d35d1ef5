"""Layout-independent initialisation: a rank that draws only its own shard gets bit for bit the
weights that the single process draws in full, for every parameter of GPT and Llama, at tp 2
and 4 with pp 2 (GPT's tied head on the last stage, Llama's GQA K/V replicated when
n_kv_heads < tp, padded vocabulary rows); it draws no more than its shard; and a run that
resumes or starts from `checkpoint.init_from` draws nothing."""

import megalite.models.factory as factory
import pytest
import torch
from megalite.models.factory import model_class
from megalite.models.layers import BuildContext
from run_configs import TWO_LAYERS

from megalite.config import load_config
from megalite.parallel_dims import ParallelDims
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import (
    ParamMeta,
    TPRandom,
    global_tensors,
    init_parameters,
    normal_init,
)
from megalite.tensor_parallel.random import draw_shard, seed_dropout, slices_per_block
from megalite.training.loop import train

SEED = 11
VALUES_PER_BLOCK = 1024  # 16 slices of width 64: block boundaries fall inside tiny shards


def _model_config(arch: str):
    # vocab 90 pads to 96 rows at tp 1 and 128 at tp 2 and 4 (whose last shard is all padding);
    # ffn 96 gives tp-4 shards of 24 slices, which start and end inside blocks.
    kv = ["model.n_kv_heads=2"] if arch == "llama" else []
    overrides = [
        f"model.arch={arch}",
        "model.n_layers=2",
        "model.hidden=64",
        "model.n_heads=4",
        "model.ffn_hidden=96",
        "model.vocab_size=90",
        "model.vocab_round_to=32",
        "model.seq_len=16",
        *kv,
    ]
    return load_config(None, overrides).model


def _rank_params(arch: str, tp_size: int, tp_rank: int, pp_size: int) -> dict[str, torch.Tensor]:
    """Global name -> initialised local tensor over one rank's pipeline stages (layer i on
    stage i), built without process groups: construction and init need none. Fused q/k/v and
    gate/up are compared by their parts: each must equal the tensor drawn before fusing."""
    cfg = _model_config(arch)
    params = {}
    for pp_rank in range(pp_size):
        cpu = torch.device("cpu")
        dims = ParallelDims.for_world(tp_size * pp_size, tp=tp_size, pp=pp_size)
        ps = ParallelState(dims, dims.rank_of(tp=tp_rank, pp=pp_rank), cpu)
        ctx = BuildContext(cfg, ps, TPRandom(SEED, ps))
        layers = range(pp_rank, cfg.n_layers, pp_size)
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        chunk = model_class(arch)(ctx, layers, has_embedding=first, has_head=last)
        init_parameters(chunk, SEED, ps, VALUES_PER_BLOCK)
        params.update(global_tensors(dict(chunk.named_parameters())))
    return params


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_shard_only_init_equals_the_single_process_weights(arch, tp_size):
    full = _rank_params(arch, 1, 0, 1)  # each tensor drawn in full, block after block
    kinds = set()
    for tp_rank in range(tp_size):
        local = _rank_params(arch, tp_size, tp_rank, 2)
        assert {p.meta.tied_name or n for n, p in local.items()} == set(full)
        for name, param in local.items():
            meta = param.meta
            reference = full[meta.tied_name or name]
            expected = torch.zeros(meta.global_shape)  # this layout's padding of the vocabulary
            rows = meta.init_rows or meta.global_shape[0]
            expected[:rows] = reference[:rows]
            if meta.tp_split_dim is not None:
                expected = expected.chunk(tp_size, meta.tp_split_dim)[tp_rank]
            assert torch.equal(param.detach(), expected), name
            kinds.add("split" if meta.tp_split_dim is not None else "replicated")
            if meta.init_rows is not None and meta.global_shape[0] > reference.shape[0]:
                kinds.add("padded deeper than tp 1")
            kinds |= {"tied copy"} if meta.tied_name else set()
            if name.endswith(("wk.weight", "wv.weight")) and meta.tp_split_dim is None:
                kinds.add("GQA K/V replicated")
    assert {"split", "replicated"} <= kinds
    assert "padded deeper than tp 1" in kinds
    assert ("tied copy" in kinds) == (arch == "gpt")
    assert ("GQA K/V replicated" in kinds) == (arch == "llama" and tp_size == 4)


def _counted(std: float = 1.0):
    """A normal init that records how many values each call draws."""
    drawn: list[int] = []
    normal = normal_init(std)

    def init(block: torch.Tensor, generator: torch.Generator) -> None:
        drawn.append(block.numel())
        normal(block, generator)

    return init, drawn


@pytest.mark.parametrize(
    ("shape", "split_dim", "init_rows"),
    [((256, 64), 0, None), ((64, 96), 1, None), ((128, 64), 0, 90), ((256, 4), 0, 97)],
)
def test_a_rank_draws_only_the_blocks_its_shard_overlaps(shape, split_dim, init_rows):
    tp_size = 4
    init, drawn = _counted()
    meta = ParamMeta(shape, init, tp_split_dim=split_dim, init_rows=init_rows)
    full = draw_shard(meta, "w", SEED, 0, 1, VALUES_PER_BLOCK)
    slice_numel = full.numel() // shape[split_dim]
    block = slices_per_block(slice_numel, VALUES_PER_BLOCK) * slice_numel
    for tp_rank in range(tp_size):
        drawn.clear()  # after the loop: what the last rank drew
        shard = draw_shard(meta, "w", SEED, tp_rank, tp_size, VALUES_PER_BLOCK)
        assert torch.equal(shard, full.chunk(tp_size, split_dim)[tp_rank])
        real = shard.count_nonzero().item()  # the drawn values that were kept
        assert real <= sum(drawn) < real + 2 * block
        assert max(drawn, default=0) <= block
    if init_rows is not None:
        assert drawn == []  # the last vocabulary shard is all padding: nothing to draw
        # (97 of 256 rows: shards 2 and 3 are padding inside the block of the real rows)


def test_replicated_and_split_forms_of_one_weight_start_equal():
    """GQA's K/V weight is split over tp when n_kv_heads >= tp and replicated otherwise."""
    split = ParamMeta((128, 64), normal_init(1.0), tp_split_dim=0)
    replicated = ParamMeta((128, 64), normal_init(1.0), tp_grad_reduce=True)
    whole = draw_shard(replicated, "layers.0.attn.wk.weight", SEED, 3, 4, VALUES_PER_BLOCK)
    pieces = [
        draw_shard(split, "layers.0.attn.wk.weight", SEED, r, 2, VALUES_PER_BLOCK) for r in (0, 1)
    ]
    assert torch.equal(whole, torch.cat(pieces))


# ------------------------------------------------------------------ nothing drawn when loading


def _run_config(out_dir, *extra: str):
    overrides = [*TWO_LAYERS, "train.steps=2", "checkpoint.interval=2"]
    return load_config(None, [*overrides, f"train.out_dir={out_dir}", *extra])


def test_resume_and_init_from_draw_no_random_weights(tmp_path, builtin_corpus, monkeypatch):
    calls = []

    def counting_init(*args, **kwargs):
        calls.append(1)
        init_parameters(*args, **kwargs)

    monkeypatch.setattr(factory, "init_parameters", counting_init)
    train(_run_config(tmp_path / "run"))
    assert calls  # a fresh run draws its weights
    calls.clear()

    resumed = train(_run_config(tmp_path / "run", "train.steps=3"))
    assert resumed["step"] == 3 and not calls
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    started = train(_run_config(tmp_path / "fine-tune", f"checkpoint.init_from={checkpoint}"))
    assert started["step"] == 2 and not calls
    # a run directory, as `--checkpoint` takes one: its newest good checkpoint, which the new
    # run's config names
    started = train(_run_config(tmp_path / "again", f"checkpoint.init_from={tmp_path / 'run'}"))
    assert started["step"] == 2 and not calls
    saved = load_config(tmp_path / "again" / "config.yaml", [])
    assert saved.checkpoint.init_from == str(tmp_path / "run" / "checkpoints" / "step_000003")


def test_each_pipeline_stage_drops_its_own_elements():
    """Seeded alike, every stage drew the same dropout masks: a later stage's layers repeated
    an earlier stage's. Each stage has seeds of its own (Megatron-LM's seed + 100 * pp rank);
    within a stage the tp ranks share the default stream (replicated activations drop alike)
    and differ in the split activations' stream."""

    def draws(tp_rank: int, pp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        dims = ParallelDims.for_world(4, tp=2, pp=2)
        ps = ParallelState(dims, dims.rank_of(tp=tp_rank, pp=pp_rank), torch.device("cpu"))
        seed_dropout(1234, ps)
        replicated = torch.rand(64)
        with TPRandom(1234, ps).fork():
            split = torch.rand(64)
        return replicated, split

    (shared, own), (shared_tp1, own_tp1) = draws(0, 0), draws(1, 0)
    assert torch.equal(shared, shared_tp1) and not torch.equal(own, own_tp1)
    shared_pp1, own_pp1 = draws(0, 1)
    assert not torch.equal(shared, shared_pp1) and not torch.equal(own, own_pp1)
