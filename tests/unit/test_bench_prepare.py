"""The data-preparation benchmark's corpus (`megalite.benchmarks.prepare.write_corpus`): as large
as asked, in whole books, whatever the size."""

import json

import pytest

from megalite.benchmarks.prepare import write_corpus
from megalite.data import builtin_corpus_text


@pytest.mark.parametrize("megabytes", [0.2, 6.0])  # below the corpus (4.1 MB), and past it
def test_corpus_is_the_size_asked_for_in_whole_books(tmp_path, megabytes):
    books = [b for b in builtin_corpus_text().split("\n\n") if b.strip()]
    size = write_corpus(tmp_path / "corpus.jsonl", megabytes)
    longest_line = max(len(json.dumps({"text": book})) + 1 for book in books)
    assert megabytes * 1e6 <= size < megabytes * 1e6 + longest_line
    with open(tmp_path / "corpus.jsonl") as f:
        texts = [json.loads(line)["text"] for line in f]
    assert texts == [books[i % len(books)] for i in range(len(texts))]
