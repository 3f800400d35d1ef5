"""End to end through the real command line, `python -m megalite ...` in subprocesses: training
both architectures (each run ending with its summary line), sampling from a run directory,
resuming after a crash, and the one-line errors for bad input (usage errors in-process, through
`cli.main`).

Independent commands run concurrently (each with one thread) to keep the wall time down."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.cli import main

VOCAB = 500
TIMEOUT_S = 240

TINY = [
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    f"model.vocab_size={VOCAB}",
    "model.seq_len=32",
    "train.precision=fp32",
    "train.device=cpu",
    "train.eval_steps=2",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.warmup_steps=2",
    "logging.progress=false",
]


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "megalite", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} timed out after {TIMEOUT_S}s\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_all(*commands: list[str]) -> list[subprocess.CompletedProcess]:
    return [finish(p) for p in [start(*c) for c in commands]]


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"{result.args}\n{result.stdout}\n{result.stderr}"
    return result


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def train_command(out_dir: Path, *extra: str) -> list[str]:
    return ["train", *TINY, f"train.out_dir={out_dir}", *extra]


def resume_command(out_dir: Path) -> list[str]:
    return train_command(
        out_dir,
        "train.steps=20",
        "train.micro_batch_size=2",
        "train.global_batch_size=4",
        "train.eval_interval=100",  # more than steps: never evaluates
        "checkpoint.interval=5",
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, builtin_corpus):
    """Three training runs started at once: 15 steps of gpt and of llama with an evaluation at
    the end, and a 20-step gpt run saving every 5 steps for the resume test."""
    root = tmp_path_factory.mktemp("cli")
    common = [
        "train.steps=15",
        "train.micro_batch_size=4",
        "train.global_batch_size=8",
        "train.eval_interval=15",
    ]
    dirs = {"gpt": root / "gpt", "llama": root / "llama", "resume": root / "resume"}
    results = run_all(
        train_command(dirs["gpt"], "model.arch=gpt", *common),
        train_command(dirs["llama"], "model.arch=llama", "model.n_kv_heads=2", *common),
        resume_command(dirs["resume"]),
    )
    return {name: (dirs[name], result) for name, result in zip(dirs, results)}


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_train_logs_metrics_and_the_loss_falls(runs, arch):
    out_dir, result = runs[arch]
    ok(result)
    rows = metrics(out_dir)
    summary = result.stdout.splitlines()[-1]
    assert summary.startswith(
        f"trained to step 15 (15 steps in this run): loss {rows[-1]['loss']:.4f}, "
        f"val_loss {rows[-1]['val_loss']:.4f} (ppl "
    )
    assert summary.endswith(f"tokens/s; checkpoint {out_dir / 'checkpoints' / 'step_000015'}")
    assert [r["step"] for r in rows] == list(range(1, 16))
    for row in rows:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s"):
            assert key in row and math.isfinite(row[key]), (key, row)
        assert row["tokens_per_sec"] > 0 and row["step_time_s"] > 0
    assert "val_loss" in rows[-1] and math.isfinite(rows[-1]["val_loss"])
    assert all("val_loss" not in r for r in rows[:-1])  # eval_interval=15: only at the end
    losses = [r["loss"] for r in rows]
    assert abs(losses[0] - math.log(VOCAB)) < 0.1  # an untrained model is near uniform
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    assert rows[-1]["val_loss"] < losses[0]
    saved = json.loads((out_dir / "checkpoints" / "step_000015" / "manifest.json").read_text())
    assert saved["trainer"]["config"]["model"]["arch"] == arch


def test_generate_is_greedy_and_deterministic(runs):
    """The run directory and the `latest` pointer both name the newest checkpoint."""
    out_dir, result = runs["gpt"]
    ok(result)
    prompt = "And God said"

    def command(checkpoint: Path) -> list[str]:
        options = ["--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
        return ["generate", "--checkpoint", str(checkpoint), *options]

    latest = out_dir / "checkpoints" / "latest"
    first, second = (ok(r) for r in run_all(command(out_dir), command(latest)))
    assert first.stdout.startswith(prompt)
    assert len(first.stdout.strip()) > len(prompt)
    assert first.stdout == second.stdout


def test_no_evaluation_when_eval_interval_exceeds_steps(runs):
    out_dir, result = runs["resume"]
    ok(result)
    rows = metrics(out_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all("val_loss" not in r and "val_ppl" not in r for r in rows)
    # Without evaluation and without a progress bar the run still ends with one summary line.
    (summary,) = result.stdout.splitlines()
    assert summary.startswith(
        f"trained to step 20 (20 steps in this run): loss {rows[-1]['loss']:.4f}, "
    )
    assert summary.endswith(f" tokens/s; checkpoint {out_dir / 'checkpoints' / 'step_000020'}")


def test_resume_after_interrupt_repeats_the_losses_exactly(runs):
    out_dir, result = runs["resume"]
    ok(result)
    root = out_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_000010",
        "step_000015",
        "step_000020",
    ]
    uninterrupted = metrics(out_dir)
    # A crash after step 10: the later checkpoints never got written.
    for name in ("step_000015", "step_000020"):
        for file in (root / name).iterdir():
            file.unlink()
        (root / name).rmdir()
    (root / "latest").write_text("step_000010")

    (again,) = run_all(resume_command(out_dir))
    ok(again)
    assert "resumed from" in again.stdout and "at step 10" in again.stdout
    rows = metrics(out_dir)  # the rows of steps 11-20 replaced by the resumed run's, not repeated
    assert [r["step"] for r in rows] == [r["step"] for r in uninterrupted]
    resumed = rows[10:]
    assert [r["step"] for r in resumed] == list(range(11, 21))
    for before, after in zip(uninterrupted[10:], resumed):
        assert (after["step"], after["loss"]) == (before["step"], before["loss"])
        assert after["lr"] == before["lr"] and after["grad_norm"] == before["grad_norm"]
    assert (root / "latest").read_text() == "step_000020"


def test_bad_input_is_one_error_line_with_exit_code_2(tmp_path):
    missing = tmp_path / "missing.yaml"
    unknown, no_file, no_weights = run_all(
        ["train", *TINY, f"train.out_dir={tmp_path / 'a'}", "model.n_layer=2"],
        ["train", "--config", str(missing), f"train.out_dir={tmp_path / 'b'}"],
        ["train", *TINY, f"train.out_dir={tmp_path / 'c'}", f"checkpoint.init_from={missing}"],
    )
    for result in (unknown, no_file, no_weights):
        assert result.returncode == 2, result
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
    assert "'model.n_layer'" in unknown.stderr and "did you mean model.n_layers" in unknown.stderr
    assert f"config file {missing} not found" in no_file.stderr
    assert f"checkpoint.init_from={missing}: no such directory" in no_weights.stderr
    assert not any((tmp_path / d).exists() for d in "abc")


def test_config_errors_come_before_torch_is_loaded():
    """A typo in a config key is reported without paying for `import torch` (seconds)."""
    probe = (
        "import sys; from megalite.cli import main; "
        "code = main(['train', 'train.stepz=3']); print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.stdout.split() == ["2", "False"], result
    assert "unknown config key 'train.stepz'" in result.stderr


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_export_hf_gives_the_same_logits_in_transformers(runs, arch, tmp_path):
    """The exported directory loads with AutoModelForCausalLM and computes megalite's logits
    (Llama here has grouped-query attention: 4 heads, 2 kv heads), AutoTokenizer encodes as
    megalite does, and exporting again onto it is refused and leaves it as it was. The export
    is given the run directory (gpt) or its checkpoints/ directory (llama): both mean step 15."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megalite.checkpoint.sharded import Checkpoint

    out_dir, result = runs[arch]
    ok(result)
    checkpoint, hf_dir = out_dir / "checkpoints" / "step_000015", tmp_path / "hf"
    given = out_dir if arch == "gpt" else out_dir / "checkpoints"
    exported = ok(finish(start("export-hf", "--checkpoint", str(given), "--out", str(hf_dir))))
    assert f"wrote {hf_dir}" in exported.stdout
    assert {"config.json", "model.safetensors", "tokenizer.model"} <= {
        p.name for p in hf_dir.iterdir()
    }

    saved = Checkpoint(checkpoint)
    ours, tokenizer = saved.model(), saved.tokenizer
    text = "In the beginning God created\n\nthe heaven  and the earth: 1611, é ü 漢字"
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert hf_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text)
    assert hf_tokenizer.decode(tokenizer.encode(text)) == text
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = ours(ids), theirs(ids).logits
    assert got.shape == expected.shape == (2, 32, VOCAB)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5

    before = {p.name: p.stat().st_mtime_ns for p in hf_dir.iterdir()}
    again = finish(start("export-hf", "--checkpoint", str(checkpoint), "--out", str(hf_dir)))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: {hf_dir} already exists: choose another --out, or remove it first"
    ]
    assert {p.name: p.stat().st_mtime_ns for p in hf_dir.iterdir()} == before


def test_a_usage_error_is_printed_by_rank_0_alone(monkeypatch, capsys):
    """torchrun starts every rank with the same command line: one usage error for the job."""
    for rank, printed in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            main(["train", "--confg", "configs/gpt-tiny.yaml"])
        assert exit_.value.code == 2
        assert ("unrecognized arguments: --confg" in capsys.readouterr().err) == printed


def test_overrides_may_stand_between_options(capsys):
    """`section.key=value` words after an option are overrides too, in command-line order; a
    word that is neither stays a usage error, and a command without overrides takes none."""
    estimate = ["estimate", "--config", "configs/gpt-tiny.yaml", "parallel.tp=2", "--world-size"]
    assert main([*estimate, "1", "model.n_layers=2", "parallel.tp=1"]) == 0
    assert "layout: tp=1 " in (out := capsys.readouterr().out) and "layers 0-1 " in out, out
    stray = [*estimate, "2", "parallel.tp=1", "stray"]
    for argv in (stray, ["generate", "--checkpoint", "x", "a=1"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and "unrecognized arguments:" in capsys.readouterr().err


def test_flags_out_of_range_are_usage_errors(capsys):
    for argv, said in [
        (["estimate", "--world-size", "0"], "--world-size: invalid positive int value: '0'"),
        (["estimate", "--world-size", "2", "--cuda-context", "-5"], "non-negative number"),
        (["generate", "--checkpoint", "x", "--top-k", "-1"], "invalid non-negative int value"),
        (["generate", "--checkpoint", "x", "--temperature", "-0.5"], "non-negative number"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_asked_for_where_there_is_none_is_a_config_error():
    from megalite.errors import ConfigError
    from megalite.parallel_state import choose_device

    with pytest.raises(ConfigError, match="CUDA is not available") as info:
        choose_device("cuda")
    assert info.value.same_on_every_rank  # printed once for the job


@pytest.mark.parametrize("kernels", ["bogus", "triton"])
def test_kernels_that_cannot_run_are_a_config_error(monkeypatch, kernels):
    """`MEGALITE_KERNELS` is input like the config: a value the kernels refuse here (an unknown
    one; triton on CPU tensors outside the interpreter) stops the run before any work with one
    `error:` line and exit code 2, not with a traceback in the first step."""
    from megalite.errors import ConfigError
    from megalite.parallel_state import choose_device

    monkeypatch.setenv("MEGALITE_KERNELS", kernels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # which would run triton on CPU
    with pytest.raises(ConfigError, match="MEGALITE_KERNELS") as info:
        choose_device("cpu")
    assert info.value.same_on_every_rank  # printed once for the job
