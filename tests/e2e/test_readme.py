"""Every command the README shows, run the way a user types it, so the README cannot drift from
what works.

The commands are read from the README's ```bash blocks and run in order in one scratch
directory (later commands use what earlier ones wrote: the run that `generate` samples, the
tokenizer that `data prepare` uses). Each gets only the extra arguments in `SHORT` that keep it
quick on a 2-core CPU: step counts, sizes of benchmarks, the interpreter for the GPU kernel
benchmark. A README command missing from `SHORT` fails the first test, so a new command comes
with its test. The 8-rank torchrun example also records its collectives and checks that every
group agreed on them.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite import comm_trace
from megalite.launch import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420
TRAIN_SHORT = "train.steps=2 train.eval_steps=1 logging.progress=false"
SMALL_BENCH = "--hidden 64 --heads 2 --seq 32 --vocab 512"
PROFILE_SHORT = (
    "model.seq_len=64 train.micro_batch_size=2 train.global_batch_size=4 --warmup-steps 1 --steps 1"
)

SHORT = {
    "make train": f'ARGS="{TRAIN_SHORT}"',
    "make test": "",  # CI's own command (.ci/run): checked, not run inside the suite it runs
    "megalite train --config configs/gpt-tiny.yaml train.steps=50 optim.lr=1e-3": TRAIN_SHORT,
    'megalite generate --checkpoint runs/gpt-tiny --prompt "And God said"': "--max-new-tokens 8",
    "megalite export-hf --checkpoint runs/gpt-tiny --out hf/gpt-tiny": "",
    "megalite train --config configs/gpt-tiny.yaml checkpoint.init_from=hf/gpt-tiny "
    "train.out_dir=runs/from-hf": TRAIN_SHORT,
    "torchrun --nproc-per-node 8 -m megalite train --config configs/gpt-tiny.yaml "
    "parallel.tp=2 parallel.sp=true parallel.pp=2 parallel.zero=1 "
    "train.global_batch_size=16 train.out_dir=runs/3d": TRAIN_SHORT,
    "megalite data tokenizer --input corpus.txt --vocab-size 32000 --out data/tokenizer": "",
    "megalite data prepare --input corpus.jsonl --tokenizer data/tokenizer.model "
    "--out data/corpus": "",
    # GPT-2 124M at a fraction of its width: the point is the prepared data and the config.
    "megalite train --config configs/gpt2-124m.yaml data.source=data/corpus "
    "model.vocab_size=32000": "train.steps=1 train.micro_batch_size=1 train.global_batch_size=1 "
    "model.n_layers=2 model.hidden=128 model.n_heads=2 model.seq_len=256 logging.progress=false",
    # the benchmarks at a small width: the point is that they run and print their tables
    "python tools/bench_single.py": f"--steps 1 --warmup 0 --layers 2 {SMALL_BENCH} --batch 2",
    # compiling is most of its time: one small GPT keeps it to the compile of each contender
    "python tools/bench_single.py --compile": "--steps 1 --warmup 1 --arch gpt --layers 1 "
    f"{SMALL_BENCH} --batch 2",
    "python tools/bench_tp.py": f"--steps 1 --warmup 0 {SMALL_BENCH} --micro-batch 2",
    "python tools/bench_pp.py": f"--steps 1 --warmup 0 {SMALL_BENCH} --micro-batch 2",
    "python tools/bench_zero.py": f"--steps 1 --warmup 0 {SMALL_BENCH} --micro-batch 2",
    "python tools/bench_kernels.py": "--cpu-smoke",
    # a tiny config's shapes (grouped K/V, rotary, experts: llama-tiny's launches are all among
    # mixtral-tiny's), every candidate, one target; of attention the branch of blocks with
    # documents (tests/kernels/test_gpu_build.py builds the whole windows' sweep at head 128)
    "python tools/build_kernels.py": "--configs configs/mixtral-tiny.yaml --jobs 1 "
    "--calls 'blocks, documents' norms bias_gelu swiglu rotary cross_entropy grouped_mm "
    "wgrad_accumulate",
    "python tools/bench_cp.py --seq 4096 --cp 2": "--seq 256 --heads 2 --kv-heads 1 "
    "--head-dim 16 --steps 1 --warmup 0",
    "python tools/bench_gpu.py": "--device cpu --configs configs/gpt2-124m.yaml --layers 1 "
    f"{SMALL_BENCH} --micro-batch 2 --steps 1 --warmup 1",
    "python tools/bench_moe.py": "--tokens 64 --hidden 32 --ffn 48 --experts 4 --repeats 1 "
    "--ranks 2 --eps 1 2 --steps 2 --step-overrides model.n_layers=1 model.hidden=64 "
    "model.ffn_hidden=128 model.seq_len=64",
    "python tools/fp8_convergence.py train.precision=bf16": "--steps 2 --out runs/fp8-convergence "
    "train.eval_interval=1 train.eval_steps=1 train.micro_batch_size=2 train.global_batch_size=2",
    "python tools/estimate_memory.py --config configs/llama-7b.yaml --world-size 32": "",
    "python tools/bench_init.py": "--layout configs/gpt2-124m.yaml:tp=2,pp=2,vpp=1 --repeat 1",
    "python tools/bench_prepare.py": "--mb 0.5 --repeat 1",
    "megalite data tokenizer --kind byte-bpe --input raw/ --glob '*.jsonl.*' --vocab-size 8000 "
    "--out data/bpe": "",
    "megalite data prepare --input raw/ --glob '*.jsonl.*' --tokenizer data/bpe.json "
    "--out data/web": "",
    "megalite data prepare --input raw/books.parquet --text-field content "
    "--tokenizer data/bpe.json --out data/books": "",
    'megalite train --config configs/gpt-tiny.yaml data.source="0.7 data/web 0.3 data/books" '
    "train.out_dir=runs/mine": TRAIN_SHORT,
    "megalite export-hf --checkpoint runs/mine --out hf/mine --dtype bf16": "",
    "megalite estimate --config configs/llama-7b.yaml --world-size 64": "",
    "megalite plan --config configs/llama-7b.yaml --gpus 64 --gpu-memory 80GB --nodes 8": "",
    "megalite plan --config configs/gpt-tiny.yaml --gpus 8 --device cpu": "",
    "megalite profile --config configs/gpt-tiny.yaml train.out_dir=runs/profile": PROFILE_SHORT,
    "torchrun --nproc-per-node 2 -m megalite profile --config configs/gpt-tiny.yaml "
    "--trace runs/profile-pp2/trace parallel.pp=2 train.out_dir=runs/profile-pp2": PROFILE_SHORT,
    "megalite plot runs/gpt-tiny runs/3d": "",
    "megalite plot runs/profile-pp2/profile.json": "",
    "torchrun --nproc-per-node 4 --max-restarts 3 -m megalite train --config configs/gpt-tiny.yaml "
    "train.micro_batch_size=2 checkpoint.interval=50 checkpoint.async_save=true "
    "train.out_dir=runs/tiny4": TRAIN_SHORT,
    "RDZV_HOST=localhost NNODES=1 NPROC=2 examples/torchrun_multinode.sh --config "
    "configs/gpt-tiny.yaml train.micro_batch_size=4 train.out_dir=runs/multinode": TRAIN_SHORT,
    "python tools/bench_checkpoint.py": "--configs configs/gpt-tiny.yaml --saves 1 --steps-after 1 "
    "--warmup 0 --seq 32",
    "python tools/bench_group_startup.py": "--fake 64:2:2 --gloo 4:2:1",
    "megalite estimate --config configs/gpt2-1.3b.yaml --world-size 8 parallel.zero=2 "
    "optim.offload=cpu optim.state_dtype=bf16": "",
    "megalite train --config configs/gpt-tiny.yaml parallel.zero=2 optim.state_dtype=bf16 "
    "train.recompute=segments train.out_dir=runs/lean": TRAIN_SHORT,
    # tests/distributed/test_restarts.py runs the 4-rank trial; here the tool itself, on 2 ranks.
    "python tools/restart_trials.py --trials 10": "--trials 1 --nproc 2 --steps 8 --interval 3",
}

# What a command prints when it worked (besides exiting 0), by the longest prefix that matches.
EXPECTED = {
    "megalite train": "trained to step",
    'megalite train --config configs/gpt-tiny.yaml data.source="0.7': "data blend: 0.7000 data/web",
    "torchrun": "trained to step",
    "megalite generate": "And God said",
    "megalite export-hf --checkpoint runs/gpt-tiny": "wrote hf/gpt-tiny",
    "megalite export-hf --checkpoint runs/mine": "wrote hf/mine",
    "megalite data tokenizer --input": "32000 pieces",
    "megalite data tokenizer --kind byte-bpe": "data/bpe.json (8000 pieces)",
    "megalite data prepare --input corpus": "wrote data/corpus",
    "megalite data prepare --input raw/ ": "wrote data/web",
    "megalite data prepare --input raw/books": "wrote data/books",
    "make train": "trained to step 2",
    "python tools/bench_single.py": "tokens/s",  # the header of each benchmark's table
    "python tools/bench_single.py --compile": "0 graphs compiled after it",
    "python tools/bench_tp.py": "tokens/s",
    "python tools/bench_pp.py": "tokens/s",
    "python tools/bench_zero.py": "tokens/s",
    "python tools/bench_kernels.py": "fwd",
    "python tools/build_kernels.py": "candidates compiled in",
    "python tools/bench_cp.py": "MiB sent per rank",
    "python tools/bench_gpu.py": "tokens/s",
    "python tools/bench_moe.py": "edp",
    "python tools/estimate_memory.py": "GiB",
    "python tools/bench_init.py": "shard",
    "python tools/bench_prepare.py": "MB/s",
    "megalite estimate": "peak:",
    "megalite plan": "--nproc-per-node=8 -m megalite train --config",
    "megalite profile": "wrote runs/profile/profile.json",
    "torchrun --nproc-per-node 2 -m megalite profile": "pipeline bubble (idle / compute)",
    "megalite plot runs/gpt-tiny": "plots/loss.png",
    "megalite plot runs/profile-pp2": "_time.png",
    "RDZV_HOST": "trained to step",
    "python tools/bench_checkpoint.py": "async",
    "python tools/bench_group_startup.py": "world splits",
    "python tools/restart_trials.py": "1 of 1 trials recovered",
}


def readme_commands() -> list[str]:
    """The README's bash-block commands in order: continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = " ".join(re.sub(r"\s+#.*$", "", line).split())
            if command:
                commands.append(command)
    return commands


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, builtin_corpus_8000):
    """A user's directory: the repository's configs and tools, and a corpus of their own."""
    from megalite.data.builtin import builtin_corpus_text

    root = tmp_path_factory.mktemp("readme")
    for name in ("configs", "tools", "examples"):
        (root / name).symlink_to(REPO / name)
    text = builtin_corpus_text()
    (root / "corpus.txt").write_text(text)
    books = text.split("\n\n")
    with open(root / "corpus.jsonl", "w") as f:
        for book in books:
            f.write(json.dumps({"text": book}) + "\n")
    # Bring your own corpus: compressed JSONL shards and a Parquet file with another column.
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "raw").mkdir()
    half = len(books) // 2
    shards = [_jsonl(books[:half:2]), _jsonl(books[1:half:2])]
    (root / "raw" / "web-0.jsonl.gz").write_bytes(gzip.compress(shards[0]))
    (root / "raw" / "web-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(shards[1]))
    pq.write_table(pa.table({"content": books[half:]}), root / "raw" / "books.parquet")
    return root


def _jsonl(texts: list[str]) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def test_every_readme_command_has_a_test():
    missing = [c for c in readme_commands() if c not in SHORT]
    assert not missing, f"README commands without an entry in SHORT (add one): {missing}"
    stale = [c for c in SHORT if c not in readme_commands()]
    assert not stale, f"SHORT names commands the README no longer shows: {stale}"


def _argv(command: str, workspace: Path) -> tuple[list[str], Path, dict[str, str]]:
    """How to run `command` here: the venv's Python for `megalite` / `python`, a free port for
    torchrun, the repository as the directory of make."""
    words = shlex.split(command) + shlex.split(SHORT[command])
    env = {"OMP_NUM_THREADS": "1"}
    while "=" in words[0]:  # VAR=value before a command sets its environment
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    if words[0].startswith("examples/"):  # a launch script: torchrun from this venv, a free port
        env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        env.update(RDZV_PORT=str(free_port()))
        return ["bash", *words], workspace, env
    if words[0] == "make":
        run_dir = workspace / "runs" / "make-train"
        return [*words, f"RUN_DIR={run_dir}", f"VENV={sys.prefix}"], REPO, env
    if words[0] == "megalite":
        return [sys.executable, "-m", "megalite", *words[1:]], workspace, env
    if words[0] == "python":
        return [sys.executable, *words[1:]], workspace, env
    assert words[0] == "torchrun", f"no way to run {words[0]} here"
    env[comm_trace.ENV] = str(workspace / "torchrun-trace")
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--master-port={free_port()}"]
    return [*launcher, *words[1:]], workspace, env


def _collected(selections: list[list[str]]) -> list[list[str]]:
    """The test ids that pytest selects with each option list (collected only, in one process;
    the workers of `-n` do not change the selection)."""
    without_workers = []
    for options in selections:
        at = options.index("-n") if "-n" in options else len(options)
        without_workers.append(options[:at] + options[at + 2 :])
    argv = [sys.executable, str(Path(__file__).with_name("collect_ids.py"))]
    found = subprocess.run(
        [*argv, json.dumps(without_workers)], cwd=REPO, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout[-2000:] + found.stderr[-2000:]
    return json.loads(found.stdout.splitlines()[-1])


def _check_every_test_runs_once(recipe: str) -> None:
    """The pytest commands of `make test` (the parallel pass and the serial one) select every
    test of the suite, none twice: a marker expression that drops tests would pass CI unseen."""
    passes = [shlex.split(line) for line in recipe.splitlines() if " pytest " in line]
    assert [argv[1:3] for argv in passes] == [["-m", "pytest"]] * 2, passes
    *by_pass, everything = _collected([argv[3:] for argv in passes] + [["tests"]])
    selected = [test_id for ids in by_pass for test_id in ids]
    assert len(selected) == len(set(selected)), passes
    assert sorted(selected) == sorted(everything)
    assert len(everything) > 1000  # the whole suite, not a collection that found nothing


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, workspace):
    if command == "make test":
        ci = (REPO / ".ci" / "run").read_text()
        assert "\nmake test\n" in ci, ".ci/run must run the README's test command"
        dry = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True)
        assert dry.returncode == 0 and "pytest" in dry.stdout, dry.stdout + dry.stderr
        _check_every_test_runs_once(dry.stdout)
        return
    argv, cwd, env = _argv(command, workspace)
    result = subprocess.run(
        argv, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{command}\n{output[-4000:]}"
    matching = [prefix for prefix in EXPECTED if command.startswith(prefix)]
    if matching:
        text = EXPECTED[max(matching, key=len)]
        assert text in output, f"{command}: no {text!r} in\n{output[-4000:]}"
    if command.startswith("torchrun"):
        comm_trace.check_traces(workspace / "torchrun-trace")
    if "--out hf/mine" in command:
        _check_own_export(workspace)


def test_slurm_example_is_valid_bash():
    """The sbatch script cannot run without Slurm; its shell syntax at least is checked."""
    script = REPO / "examples" / "slurm_megalite.sbatch"
    checked = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "torchrun" in script.read_text() and "--rdzv-backend c10d" in script.read_text()


def _check_own_export(workspace: Path) -> None:
    """The exported model is bf16, and AutoTokenizer encodes as the byte-level BPE it was
    trained with."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from megalite.data import open_tokenizer
    from megalite.data.tokenizer import PROBE

    with safe_open(str(workspace / "hf" / "mine" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    auto = AutoTokenizer.from_pretrained(workspace / "hf" / "mine")
    ours = open_tokenizer(workspace / "data" / "bpe.json")
    assert auto(PROBE, add_special_tokens=False)["input_ids"] == ours.encode(PROBE)
    assert auto.eos_token_id == ours.eos_id
