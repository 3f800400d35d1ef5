"""Blends of prepared corpora: `data.source` parsing, proportions that hold over every prefix of
the stream and over a long draw, and an order that depends only on the seed and batch size and
resumes exactly."""

import json

import numpy as np
import pytest
import torch

from megalite.data import (
    BlendedDataset,
    DataError,
    GlobalBatchSampler,
    TokenDataset,
    builtin_corpus_text,
    parse_source,
    prepare_corpus,
    train_tokenizer,
)
from megalite.data.blend import Interleave
from megalite.data.tokenizer import Tokenizer


def test_source_is_one_prefix_or_weight_prefix_pairs():
    assert parse_source("data/web") == [(1.0, "data/web")]
    assert parse_source("0.7 data/web  0.3 data/books") == [(0.7, "data/web"), (0.3, "data/books")]
    with pytest.raises(DataError, match="odd number of words"):
        parse_source("0.7 data/web 0.3")
    with pytest.raises(DataError, match="'web' is not a number"):
        parse_source("web 0.7 books 0.3")
    with pytest.raises(DataError, match="weight -1 of data/b must be > 0"):
        parse_source("1 data/a -1 data/b")


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1, 2], [0.05, 0.9, 0.05], [3.3, 1]])
def test_every_prefix_holds_each_corpus_within_one_sample(weights):
    interleave = Interleave(weights)
    share = np.array(interleave.weights)  # the weights rounded to 1/10,000
    assert np.allclose(share, np.array(weights) / sum(weights), atol=1 / 10_000)
    corpus, draws = interleave(np.arange(5 * interleave.period + 17))
    for c in range(len(weights)):
        mine = corpus == c
        drawn = np.cumsum(mine)  # samples of corpus c in each prefix
        expected = share[c] * np.arange(1, len(corpus) + 1)
        assert np.abs(drawn - expected).max() <= 1.0 + 1e-9
        assert np.array_equal(draws[mine], np.arange(mine.sum()))  # each draw once, in order


def test_a_long_draw_honours_the_weights_and_reports_them():
    sampler = GlobalBatchSampler([50, 7, 1000], 32, seed=3, weights=[0.5, 0.2, 0.3])
    corpora = [c for _ in range(500) for c, _ in sampler.next_batch()]
    drawn = np.bincount(corpora) / len(corpora)
    assert np.allclose(drawn, [0.5, 0.2, 0.3], atol=1 / len(corpora))
    assert sampler.interleave.weights == [0.5, 0.2, 0.3]
    # A small corpus drawn often is reshuffled each time it is exhausted: all windows appear.
    small = [w for c, w in GlobalBatchSampler([50, 7], 7, 3, [0.5, 0.5]).next_batch() if c == 1]
    assert len(small) in (3, 4) and len(set(small)) == len(small)


def test_blend_order_depends_on_seed_and_batch_size_only_and_resumes():
    def stream(batch_size, seed, batches):
        sampler = GlobalBatchSampler([40, 25], batch_size, seed, weights=[0.6, 0.4])
        return [pair for _ in range(batches) for pair in sampler.next_batch()]

    assert stream(8, 1, 20) == stream(16, 1, 10)  # the same stream, cut differently
    assert stream(8, 1, 20) != stream(8, 2, 20)
    first = GlobalBatchSampler([40, 25], 8, 1, weights=[0.6, 0.4])
    for _ in range(7):
        first.next_batch()
    resumed = GlobalBatchSampler([40, 25], 8, 1, weights=[0.6, 0.4])
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [p for _ in range(5) for p in resumed.next_batch()] == stream(8, 1, 12)[56:]
    other = GlobalBatchSampler([40, 25], 8, 1, weights=[0.5, 0.5])
    with pytest.raises(DataError, match=r"weights=\[0.6, 0.4\] but this run has weights"):
        other.load_state_dict(first.state_dict())


def test_blended_dataset_reads_each_corpus_and_evaluates_in_order(tmp_path):
    (tmp_path / "t.txt").write_text(builtin_corpus_text()[:100_000])
    tok = Tokenizer(train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 400))
    for name, text in (("a", "alpha beta\n"), ("b", "gamma delta\n")):
        (tmp_path / f"{name}.txt").write_text(text * 400)
        prepare_corpus([tmp_path / f"{name}.txt"], tok, tmp_path / name, progress=False)
    a, b = (TokenDataset(tmp_path / n, 16, "train") for n in "ab")
    blend = BlendedDataset([a, b], [0.75, 0.25])
    batch = blend.get_batch([(0, 3), (1, 0), (0, 0)])
    assert batch.equal(torch.cat([a.get_batch([3]), b.get_batch([0]), a.get_batch([0])]))
    first = blend.evaluation_pairs(0, 8)
    corpus, _ = blend.interleave(np.arange(8))
    assert [c for c, _ in first] == corpus.tolist() and corpus.tolist().count(1) == 2
    assert first == blend.evaluation_pairs(0, 8)
    assert blend.sizes == [len(a), len(b)] and blend.tokenizer_path == a.tokenizer_path


class CountingTokens:
    """A corpus's token memmap that counts the tokens read through it."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens, self.read = tokens, 0

    def __getitem__(self, index):
        out = self.tokens[index]
        self.read += out.size
        return out


def test_a_rank_reads_only_the_halves_of_the_windows_it_consumes(tmp_path):
    """inputs (first pipeline stage) and targets (last) are the two shifted halves of the same
    windows, each read alone; both together cost one window; neither costs nothing."""
    (tmp_path / "t.txt").write_text(builtin_corpus_text()[:100_000])
    tok = Tokenizer(train_tokenizer([tmp_path / "t.txt"], tmp_path / "tok", 400))
    for name in "ab":
        (tmp_path / f"{name}.txt").write_text(builtin_corpus_text()[:30_000])
        prepare_corpus([tmp_path / f"{name}.txt"], tok, tmp_path / name, progress=False)
    seq = 16
    a, b = (TokenDataset(tmp_path / n, seq, "train") for n in "ab")
    blend = BlendedDataset([a, b], [0.5, 0.5])
    pairs = [(0, 5), (1, 2), (0, 1)]
    windows = blend.get_batch(pairs)
    for dataset in (a, b):
        dataset.tokens = CountingTokens(dataset.tokens)
    reads = {}
    for inputs, targets in ((True, True), (True, False), (False, True), (False, False)):
        before = a.tokens.read + b.tokens.read
        batch = blend.read(pairs, inputs=inputs, targets=targets)
        reads[inputs, targets] = a.tokens.read + b.tokens.read - before
        assert batch.size == 3
        assert (batch.inputs is not None) == inputs and (batch.targets is not None) == targets
        if inputs:
            assert batch.inputs.equal(windows[:, :-1])
        if targets:
            assert batch.targets.equal(windows[:, 1:])
    assert reads == {
        (True, True): 3 * (seq + 1),
        (True, False): 3 * seq,
        (False, True): 3 * seq,
        (False, False): 0,
    }
