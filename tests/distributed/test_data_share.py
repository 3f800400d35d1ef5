"""Each rank reads from the token files only the samples it consumes: its data-parallel slice
of every global batch, and of those windows the inputs on the first pipeline stage, the targets
on the last, nothing on a middle stage (every tp rank of a stage reads the same share). The
bytes read are counted per rank in training and in evaluation, at toy sizes and at the shipped
gpt-tiny config's, and the losses still equal the single process's."""

import json
from pathlib import Path

import pytest
from equivalence import TINY, assert_same_losses, reference

from megalite.config import load_config
from megalite.data import TokenDataset, token_dtype
from megalite.launch import run_ranks
from megalite.training.hooks import due
from megalite.training.loop import train

EVAL = ("train.eval_interval=5", "train.eval_steps=2")  # two evaluations in ten steps


def _train_counting_reads(config: str | None, overrides: tuple[str, ...], out_dir: str) -> dict:
    """Train, counting the token bytes this rank reads from each split's files."""
    read = {"train": 0, "val": 0}
    real_get_batch = TokenDataset.get_batch

    def get_batch(self, *args):
        out = real_get_batch(self, *args)
        read[self.split] += out.numel() * self.tokens.dtype.itemsize
        return out

    TokenDataset.get_batch = get_batch  # in this forked rank only
    train(load_config(config, [*overrides, f"train.out_dir={out_dir}"]))
    return read


def expected_reads(rank: int, tp: int, pp: int, dp: int, cfg) -> dict:
    """The bytes the rank's share takes: its dp slice of each batch, inputs (seq tokens of a
    window) on the first stage, targets (seq) on the last, both (one seq + 1 window) on a lone
    stage, nothing in between. Ranks are ordered tp fastest, then dp, then pp."""
    t, seq = cfg.train, cfg.model.seq_len
    pp_rank = rank // (dp * tp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    width = seq + 1 if first and last else seq if first or last else 0
    evaluations = sum(due(step, t.eval_interval, t.steps) for step in range(1, t.steps + 1))
    evaluations *= t.eval_interval <= t.steps  # an interval beyond the run: no evaluation
    per_batch = t.global_batch_size // dp * width * token_dtype(cfg.model.vocab_size).itemsize
    return {"train": t.steps * per_batch, "val": evaluations * t.eval_steps * per_batch}


def assert_reads_only_its_share(world_size, overrides, out_dir: Path, config=None) -> list:
    """Train on `world_size` ranks; check every rank's bytes read; return the (loss, grad
    norm) of each step."""
    reads = run_ranks(world_size, _train_counting_reads, config, overrides, str(out_dir))
    cfg = load_config(config, list(overrides))
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    for rank, read in enumerate(reads):
        expected = expected_reads(rank, tp, pp, world_size // (tp * pp), cfg)
        assert read == expected, f"rank {rank} read {read}, its share is {expected}"
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["loss"], row["grad_norm"]) for row in rows]


@pytest.mark.parametrize(
    "world_size, layout",
    [
        (8, ("parallel.tp=2", "parallel.pp=2")),  # dp 2 x pp 2 x tp 2
        (4, ("parallel.pp=4",)),  # two middle stages read nothing
        (4, ("parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved")),  # dp 2
    ],
    ids=["tp2-pp2-dp2", "pp4", "pp2-vpp2-dp2"],
)
def test_each_rank_reads_only_its_share(builtin_corpus, tmp_path, world_size, layout):
    overrides = TINY + EVAL + ("model.arch=gpt",)
    losses = assert_reads_only_its_share(world_size, overrides + layout, tmp_path)
    ref_losses, _ = reference(overrides)
    assert_same_losses(losses, ref_losses)


def test_shipped_gpt_tiny_reads_only_its_share(builtin_corpus_8000, tmp_path):
    """configs/gpt-tiny.yaml (seq 256, vocab 8000) on dp 2 x pp 2: two steps, one evaluation."""
    config = "configs/gpt-tiny.yaml"
    overrides = (
        "train.steps=2",
        "train.micro_batch_size=2",
        "train.log_interval=1",
        "train.eval_interval=2",
        "train.eval_steps=1",
        "train.precision=fp32",
        "checkpoint.interval=0",
        "logging.wandb=false",
        "logging.progress=false",
    )
    losses = assert_reads_only_its_share(4, overrides + ("parallel.pp=2",), tmp_path, config)
    ref_losses, _ = reference(overrides, config)
    assert_same_losses(losses, ref_losses)
