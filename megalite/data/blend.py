"""Blends: several prepared corpora drawn in fixed proportions, as Megatron's
`--data-path 0.7 a 0.3 b`, written `data.source="0.7 a 0.3 b"`.

Which corpus each sample of the blended stream comes from is a fixed pattern: the weights are
rounded to whole counts out of `RESOLUTION` (then reduced by their common divisor), and one
period of the pattern places corpus d counts[d] times, spread as evenly as possible (smooth
weighted round robin: each corpus is due at times (j + 1/2) / count, earliest first). The
pattern repeats forever, so position p of the stream is corpus pattern[p % period], and it is
that corpus's draw number (p // period) * count + (its rank within the period). Every prefix of
the stream holds each corpus within one sample of its share; no randomness is involved, so the
order of a blend, like that of one corpus, depends only on the seed and the global batch size.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from megalite.data.errors import DataError

RESOLUTION = 10_000
"""Weights are honoured to 1 part in this (the weights actually drawn are reported)."""


def parse_source(source: str) -> list[tuple[float, str]]:
    """'data/a' -> [(1.0, 'data/a')]; '0.7 data/a 0.3 data/b' -> [(0.7, ...), (0.3, ...)]."""
    words = source.split()
    if len(words) == 1:
        return [(1.0, words[0])]
    usage = (
        f"data.source={source!r}: a blend is pairs of weight and prepared prefix, "
        "e.g. data.source='0.7 data/web 0.3 data/books'"
    )
    if len(words) % 2:
        raise DataError(f"{usage} (got an odd number of words)")
    pairs = []
    for weight, prefix in zip(words[::2], words[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise DataError(f"{usage} ({weight!r} is not a number)") from None
        if not math.isfinite(value) or value <= 0:
            raise DataError(f"{usage} (weight {weight} of {prefix} must be > 0)")
        pairs.append((value, prefix))
    return pairs


class Interleave:
    """The corpus and the draw number of every position of a blended stream (see above)."""

    def __init__(self, weights: Sequence[float]) -> None:
        total = sum(weights)
        counts = [round(RESOLUTION * w / total) for w in weights]
        if min(counts) < 1:
            raise DataError(
                f"blend weights {list(weights)}: each must be at least 1/{RESOLUTION} of their "
                "sum; drop the corpus or raise its weight"
            )
        divisor = math.gcd(*counts)
        self.counts = np.array([c // divisor for c in counts], dtype=np.int64)
        self.period = int(self.counts.sum())
        self.pattern = np.empty(self.period, dtype=np.int64)
        self.rank = np.empty(self.period, dtype=np.int64)  # draw number within the period
        due = [(0.5 / c, corpus, 0) for corpus, c in enumerate(self.counts.tolist())]
        heapq.heapify(due)
        for position in range(self.period):
            _, corpus, draw = heapq.heappop(due)
            self.pattern[position], self.rank[position] = corpus, draw
            if draw + 1 < self.counts[corpus]:
                heapq.heappush(due, ((draw + 1.5) / self.counts[corpus], corpus, draw + 1))

    @property
    def weights(self) -> list[float]:
        """The proportions actually drawn (the requested ones, rounded)."""
        return (self.counts / self.period).tolist()

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, draw number within that corpus) of each stream position."""
        cycle, offset = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        corpus = self.pattern[offset]
        return corpus, cycle * self.counts[corpus] + self.rank[offset]
