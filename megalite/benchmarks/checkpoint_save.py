"""What a checkpoint save costs a training run, in step time: megalite's synchronous save,
its asynchronous one (`checkpoint.async_save`), and `torch.distributed.checkpoint.async_save`.

For each model, a run trains a few warm-up steps, then each contender in turn (interleaved,
the order alternating) saves the run's full state (weights, Adam state, RNG) and the run trains
`--steps-after` more steps before the save is finished (published, or DCP's future resolved).
The cost of a save is the time the training loop lost to it: the save call itself (for an
asynchronous save, the copy to host memory), the steps run while the background writer shares
the machine (their time above a plain step's), and the wait for the write at the finish.

    python tools/bench_checkpoint.py                          # gpt-tiny and GPT-2 124M
    python tools/bench_checkpoint.py --configs configs/gpt-tiny.yaml --saves 5
    python -m megalite.benchmarks.checkpoint_save             # from an installed megalite

fp32 on CPU, one gloo rank per `--ranks` (dp, ZeRO-1): each rank writes its own shard. Files are
fsynced by all three (DCP's FileSystemWriter syncs by default).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megalite.benchmarks import harness
from megalite.benchmarks.table import print_table
from megalite.checkpoint.saver import CheckpointSaver
from megalite.checkpoint.state import RunState
from megalite.checkpoint.writer import owned_tensors
from megalite.config import load_config
from megalite.data.sampler import GlobalBatchSampler
from megalite.launch import run_or_join
from megalite.parallel_state import build_parallel_state
from megalite.training.loop import run_state

MB = 2**20


class Saver(Protocol):
    """What the benchmark needs of a contender: start a save, finish it."""

    def save(self, state: RunState) -> object: ...

    def finish(self) -> object: ...


class DcpSaver:
    """`torch.distributed.checkpoint.async_save` of the same tensors megalite writes (each
    rank's shard under its own keys), in the same save / finish shape as CheckpointSaver."""

    def __init__(self, root: Path) -> None:
        self.root, self.count, self.pending = root, 0, None

    def save(self, state: RunState) -> None:
        files, _ = owned_tensors(state)
        files["rng"] = state.rng.state_dict()
        rank = state.ps.rank
        flat = {f"r{rank}/{f}/{k}": t for f, tensors in files.items() for k, t in tensors.items()}
        self.count += 1
        self.pending = dcp.async_save(flat, checkpoint_id=str(self.root / f"save_{self.count}"))

    def finish(self) -> None:
        if self.pending is None:
            return
        upload = getattr(self.pending, "upload_completion", self.pending)  # newer torch: a pair
        upload.result()
        self.pending = None
        if dist.get_rank() == 0:
            shutil.rmtree(self.root / f"save_{self.count - 1}", ignore_errors=True)


def _stopwatch(action: Callable[[], object]) -> float:
    """Seconds `action` took on the slowest rank."""
    dist.barrier()
    start = time.perf_counter()
    action()
    elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


class NoSave:
    """The control: the same steps with no save, so that the table shows the noise floor."""

    def save(self, state: RunState) -> None:
        pass

    def finish(self) -> None:
        pass


def _one_save(saver: Saver, state: RunState, step: Callable[[], None], steps: int) -> dict:
    """Seconds of the save call, of each of the `steps` steps after it, and of the finish."""
    blocked = _stopwatch(lambda: saver.save(state))
    during = [_stopwatch(step) for _ in range(steps)]
    return {"blocked": blocked, "during": during, "wait": _stopwatch(saver.finish)}


def _costs(save: dict, baseline_s: float) -> dict[str, float]:
    slowdown = sum(save["during"]) - len(save["during"]) * baseline_s
    return {
        "blocked": save["blocked"],
        "slowdown": slowdown,
        "wait": save["wait"],
        "cost": save["blocked"] + slowdown + save["wait"],
        "write": save["blocked"] + sum(save["during"]) + save["wait"],
    }


def measure_config(args: argparse.Namespace, path: str, root: Path) -> dict:
    """One model: the plain step time, then every contender's saves, interleaved."""
    world = dist.get_world_size()
    overrides = [
        f"model.seq_len={args.seq}",
        "model.dropout=0.0",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.micro_batch * world}",
        "train.precision=fp32",
        "train.device=cpu",
        "parallel.zero=1",
    ]
    cfg = load_config(path, overrides)
    ps = build_parallel_state(1, 1, torch.device("cpu"))
    run = harness.megalite_run(cfg, ps)
    state = run_state(run, GlobalBatchSampler(1000, cfg.train.global_batch_size, cfg.train.seed))
    shape = argparse.Namespace(vocab=cfg.model.vocab_size, seq=args.seq, seed=cfg.train.seed)
    batches = harness.make_batches(shape, 4, cfg.train.global_batch_size)
    train = harness.megalite_step(run, args.lr)
    count = iter(range(10**9))

    def step() -> None:
        train(batches[next(count) % len(batches)])
        state.step += 1

    for _ in range(args.warmup):
        step()
    savers: dict[str, Saver] = {
        "no save (noise)": NoSave(),
        "megalite sync": CheckpointSaver(root / "sync", keep=1),
        "megalite async": CheckpointSaver(root / "async", keep=1, async_save=True),
        "torch DCP async_save": DcpSaver(root / "dcp"),
    }
    order = list(savers)
    saves: dict[str, list[dict]] = {name: [] for name in savers}
    for i in range(args.saves):
        for name in order if i % 2 == 0 else order[::-1]:
            saves[name].append(_one_save(savers[name], state, step, args.steps_after))
    baseline = statistics.median(t for save in saves[order[0]] for t in save["during"])
    written = sum(f.stat().st_size for f in (root / "sync").rglob("*.safetensors"))
    params = sum(p.numel() for p in run.named_parameters().values())
    rows = []
    for name, results in saves.items():
        costs = [_costs(save, baseline) for save in results]
        row = {key: statistics.median(c[key] for c in costs) for key in costs[0]}
        rows.append({"model": Path(path).stem, "name": name, **row})
    return {"params": params * world, "mb": written / MB, "baseline": baseline, "rows": rows}


def worker(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    scratch = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    root = scratch / f"megalite-bench-checkpoint-{args.token}"
    try:
        return [measure_config(args, path, root / str(i)) for i, path in enumerate(args.configs)]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def options() -> argparse.ArgumentParser:
    """This benchmark's command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        nargs="+",
        default=["configs/gpt-tiny.yaml", "configs/gpt2-124m.yaml"],
        help="model configs (their model section is used)",
    )
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks (data parallel, ZeRO-1)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sample (model.seq_len)")
    p.add_argument("--micro-batch", type=int, default=2, help="samples per rank per step")
    p.add_argument("--saves", type=int, default=3, help="saves per contender (median reported)")
    p.add_argument("--steps-after", type=int, default=3, help="steps between save and finish")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dir", help="where checkpoints are written (default: the temp dir)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up")
    return p


def run(args: argparse.Namespace) -> list[dict] | None:
    """Measure on `--ranks` gloo ranks; rank 0's result (None on other torchrun ranks)."""
    args.token = f"{time.time_ns():x}"
    return run_or_join(args.ranks, worker, args, timeout=args.timeout)


def report(args: argparse.Namespace, result: list[dict]) -> None:
    """Print one row per model and contender."""
    columns = ["model", "contender", "step ms", "ckpt MB", "blocked ms", "slowdown ms"]
    columns += ["wait ms", "cost ms", "cost/step", "write ms"]
    table = []
    for model in result:
        for row in model["rows"]:
            params = f"{row['model']} ({model['params'] / 1e6:.0f}M)"
            cells = [row["blocked"], row["slowdown"], row["wait"], row["cost"]]
            table.append(
                [params, row["name"], f"{model['baseline'] * 1e3:.0f}", f"{model['mb']:.0f}"]
                + [f"{value * 1e3:.0f}" for value in cells]
                + [f"{row['cost'] / model['baseline']:.2f}", f"{row['write'] * 1e3:.0f}"]
            )
    notes = [
        f"fp32 CPU, {args.ranks} gloo rank(s), seq {args.seq}, micro-batch {args.micro_batch}; "
        f"medians over {args.saves} saves per contender, each followed by {args.steps_after} "
        "training steps before its finish.",
        "step ms: a plain step (median of the no-save control's). blocked: the save call "
        "(sync: the whole save; async: the copy to host memory). slowdown: the steps after "
        "it, above plain steps (the background writer shares the CPU). wait: the finish (the "
        "rest of the write, publishing).",
        "cost = blocked + slowdown + wait: step time lost to one save (cost/step: in plain "
        "steps). write: from the save call to a finished checkpoint. ckpt MB: megalite's "
        "files. The no-save row's cost is the noise of the machine.",
    ]
    print_table(columns, table, notes)


def main(argv: list[str] | None = None) -> None:
    harness.command_line(options(), run, report, argv)


if __name__ == "__main__":
    main()
