"""The float8 convergence benchmark (`megalite.benchmarks.fp8_convergence`) at a tiny size: a
row per run with its gap to the baseline, the loss figure of all runs, and a refusal to write
over an earlier comparison."""

import pytest

from megalite.benchmarks import fp8_convergence

TINY = [
    "model.n_layers=2",
    "model.hidden=32",
    "model.n_heads=2",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=2",
    "train.eval_interval=2",
    "train.eval_steps=1",
]


def test_a_tiny_comparison_prints_each_run_and_plots_them(builtin_corpus, tmp_path, capsys):
    out = tmp_path / "compare"
    argv = ["--config", "", "--steps", "3", "--out", str(out), *TINY]
    status = fp8_convergence.main(argv)
    printed = capsys.readouterr().out
    for run in ("baseline", "fp8 tensorwise", "fp8 rowwise"):
        assert run in printed
    assert printed.count(" %") == 2  # each float8 run's gap to the baseline
    assert (out / "plots" / "loss.png").is_file()
    assert status in (0, 1)
    with pytest.raises(SystemExit, match="exists"):
        fp8_convergence.main(argv)
