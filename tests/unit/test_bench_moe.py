"""The MoE benchmark (`megalite.benchmarks.moe`) at tiny sizes: its grouped GEMM table has a row
per expert count, count distribution and projection, on the CPU's reference and, in a fresh
process (the interpreter must be on before Triton is imported), under --cpu-smoke."""

import os
import subprocess
import sys

import torch

from megalite.benchmarks import moe

TINY_STEP = [
    "model.n_layers=2",
    "model.hidden=32",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_hidden=48",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    "model.seq_len=32",
    "train.micro_batch_size=2",
]
CASES = [
    f"E {experts} {kind} {gemm}"
    for experts in (2, 3)
    for kind in ("balanced", "skewed")
    for gemm in ("up (8->12)", "down (12->8)")
]


def test_expert_counts():
    assert moe.expert_counts(10, 3, skewed=False) == [4, 3, 3]
    skewed = moe.expert_counts(100, 4, skewed=True)
    assert sum(skewed) == 100 and skewed == sorted(skewed, reverse=True) and skewed[0] > 40


def test_cpu_run_prints_a_row_per_case(capsys, monkeypatch):
    """Without a GPU and without --cpu-smoke: grouped_mm's reference against the loop."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MEGALITE_KERNELS", "auto")  # main sets it; restored after the test
    argv = ["--tokens", "6", "--hidden", "8", "--ffn", "12", "--experts", "2", "3"]
    assert moe.main([*argv, "--repeats", "2", "--eps"]) == 0
    out = capsys.readouterr().out
    assert "grouped_mm runs torch._grouped_mm" in out and "fwd+bwd TFLOP/s grouped" in out
    rows = [line for line in out.splitlines() if line.startswith("E ")]
    assert [row.split("  ")[0].strip() for row in rows] == CASES


def test_step_table_has_a_row_per_ep(builtin_corpus):
    """gloo ranks in a fresh process (no interpreter, no GPU): one row per ep, the same model
    in each layout, so the same last loss."""
    step = ["--ranks", "2", "--eps", "1", "2", "--steps", "2", "--step-overrides", *TINY_STEP]
    argv = ["--tokens", "6", "--hidden", "8", "--ffn", "12", "--experts", "2", *step]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "megalite.benchmarks.moe", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [line.split() for line in result.stdout.splitlines() if line[:2] in ("1 ", "2 ")]
    assert [row[:2] for row in steps] == [["1", "2"], ["2", "1"]]
    assert steps[0][-1] == steps[1][-1]


def test_cpu_smoke_runs_the_kernel():
    argv = ["--tokens", "6", "--hidden", "8", "--ffn", "12", "--experts", "2", "3"]
    command = [sys.executable, "-m", "megalite.benchmarks.moe", "--cpu-smoke", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grouped_mm runs the Triton kernel" in result.stdout
    for case in CASES:
        assert case in result.stdout
