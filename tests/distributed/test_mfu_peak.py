"""The peak behind MFU on CPU is a property of the machine, not of the run: ranks starting
together measure it once, and runs on 8, 1 and 2 ranks (pp 2; dp 2 while every core is busy)
all divide by that same figure, read back from their metrics as tflops / mfu; MFU stays in
(0, 1]. The rows also carry the straggler's step time and the worst rank's peak memory."""

import json
import multiprocessing as mp
from pathlib import Path

import pytest

import megalite.hardware as flops
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.training.loop import train

TINY = (
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",
    "model.seq_len=32",
    "train.steps=2",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
    "train.eval_interval=1000",
    "train.log_interval=1",
    "checkpoint.interval=0",
    "logging.progress=false",
)


def _train(overrides: tuple[str, ...]) -> None:
    train(load_config(None, list(overrides)))


def _spin() -> None:
    while True:
        pass


def rows_of(world_size: int, layout: tuple[str, ...], out_dir: Path, data: tuple) -> list[dict]:
    run_ranks(world_size, _train, (*TINY, *data, *layout, f"train.out_dir={out_dir}"))
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def counted_measurements(tmp_path, monkeypatch):
    """A fresh machine-wide cache, and a file with a line per measurement of the peak (forked
    ranks inherit the counting wrapper)."""
    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path / "cache"))
    flops.peak_flops.cache_clear()  # forked ranks must not inherit this process's answer
    log = tmp_path / "measurements"
    log.touch()
    measure = flops.measure_cpu_peak_flops

    def counting(precision: str) -> float:
        with open(log, "a") as f:
            f.write(precision + "\n")
        return measure(precision)

    monkeypatch.setattr(flops, "measure_cpu_peak_flops", counting)
    yield log
    flops.peak_flops.cache_clear()


def test_mfu_divides_by_the_machine_peak_in_every_layout(
    builtin_corpus, tmp_path, counted_measurements
):
    prefix, tokenizer = builtin_corpus
    data = (f"data.source={prefix}", f"data.tokenizer={tokenizer}")
    runs = {"8 ranks": rows_of(8, (), tmp_path / "dp8", data)}
    assert counted_measurements.read_text().split() == ["fp32"]  # 8 ranks started, one measured
    peaks = json.loads((tmp_path / "cache" / flops.PEAK_CACHE_FILE).read_text())
    assert list(peaks) == [flops.cpu_peak_key("fp32")]
    machine_peak = peaks[flops.cpu_peak_key("fp32")]

    runs["1 rank"] = rows_of(1, (), tmp_path / "one", data)
    runs["pp 2"] = rows_of(2, ("parallel.pp=2",), tmp_path / "pp2", data)
    spinner = mp.get_context("fork").Process
    busy = [spinner(target=_spin, daemon=True) for _ in range(flops.cpu_cores())]
    for proc in busy:
        proc.start()
    try:
        runs["dp 2, cores busy"] = rows_of(2, (), tmp_path / "dp2", data)
    finally:
        for proc in busy:
            proc.kill()
            proc.join()

    assert counted_measurements.read_text().split() == ["fp32"]  # never measured again
    for layout, rows in runs.items():
        assert [row["step"] for row in rows] == [1, 2], layout
        for row in rows:
            assert 0 < row["mfu"] <= 1, layout
            assert row["tflops"] * 1e12 / row["mfu"] == pytest.approx(machine_peak, rel=1e-9)
            assert row["step_time_max_s"] >= row["step_time_median_s"] > 0, layout
            assert row["peak_rss_bytes"] > 0, layout
    assert {row["slowest_rank"] for row in runs["8 ranks"]} <= set(range(8))
