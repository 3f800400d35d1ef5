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
