"""On first use the builtin corpus is tokenized once per node, by local rank 0, while the other
ranks wait, rather than by every rank at once."""

from pathlib import Path

from equivalence import TINY

from megalite.config import load_config
from megalite.data import builtin
from megalite.launch import run_ranks
from megalite.training.loop import open_data


def _open_and_count(cache: str) -> tuple[int, int]:
    builds = []
    real_build = builtin._build

    def counting_build(build_dir: Path, vocab_size: int) -> None:
        builds.append(vocab_size)
        real_build(build_dir, vocab_size)

    builtin._build = counting_build
    data = open_data(load_config(None, [*TINY, "data.source=builtin"]), cache_dir=Path(cache))
    return len(builds), data.train.sizes[0]


def test_local_rank_zero_builds_the_builtin_cache_alone(tmp_path):
    results = run_ranks(3, _open_and_count, str(tmp_path))
    assert [builds for builds, _ in results] == [1, 0, 0]
    assert len({windows for _, windows in results}) == 1 and results[0][1] > 0


def _open_unbuildable(cache: str) -> str:
    from megalite.data import DataError

    try:
        open_data(load_config(None, [*TINY, "model.vocab_size=1000000"]), cache_dir=Path(cache))
    except DataError as error:
        return f"{'echo' if error.same_on_every_rank else 'own'}: {error}"
    return "opened"


def test_a_cache_that_cannot_be_built_stops_every_rank_with_the_fix(tmp_path):
    """Local rank 0 fails to build it: every rank stops with a DataError (rank 0 its own, naming
    model.vocab_size; the others an echo that only rank 0 would print), none left waiting."""
    own, echo = run_ranks(2, _open_unbuildable, str(tmp_path))
    assert own.startswith("own: the builtin corpus cannot train a tokenizer of model.vocab_size")
    assert echo == "echo: the builtin corpus could not be made (a node's first rank says why)"
