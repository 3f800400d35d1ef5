"""The training run: topology, data, model, resume, then steps with logging, evaluation and
checkpoints. Every rank runs this same function."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megalite import comm
from megalite.checkpoint.sharded import (
    check_shared_directory,
    checkpoint_step,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megalite.config import Config, config_to_dict, save_config
from megalite.data import (
    BlendedDataset,
    GlobalBatchSampler,
    TokenDataset,
    builtin_data,
    parse_source,
)
from megalite.errors import MegaliteError
from megalite.optimizer.lr_schedule import learning_rate
from megalite.parallel_state import (
    ParallelState,
    build_parallel_state,
    choose_device,
    init_distributed,
)
from megalite.profiling.flops import flops_per_token, peak_flops
from megalite.training.metrics import MetricsLogger, summary_line
from megalite.training.setup import Run, build_run
from megalite.training.step import eval_loss, train_step


class TrainingError(MegaliteError):
    """Training cannot go on (for example the loss became NaN)."""


@dataclass
class Data:
    train: BlendedDataset
    val: BlendedDataset
    tokenizer_path: Path


def open_data(cfg: Config, cache_dir: Path | None = None) -> Data:
    """The builtin corpus (tokenized to the model's vocabulary on first use, by the first process
    of each node while the others wait), or prepared data: one prefix or a weighted blend of
    several (`data.source="0.7 a 0.3 b"`). Collective."""
    d, seq = cfg.data, cfg.model.seq_len
    if d.source == "builtin":
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one process per node builds the cache
            builtin_data(cfg.model.vocab_size, cache_dir)
        comm.barrier()
        prefix, tokenizer = builtin_data(cfg.model.vocab_size, cache_dir)
        blend = [(1.0, prefix)]
    else:
        blend, tokenizer = parse_source(d.source), d.tokenizer
    weights = [weight for weight, _ in blend]
    kwargs = dict(val_fraction=d.val_fraction, vocab_size=cfg.model.vocab_size)
    splits = {
        split: BlendedDataset([TokenDataset(p, seq, split, **kwargs) for _, p in blend], weights)
        for split in ("train", "val")
    }
    return Data(splits["train"], splits["val"], Path(tokenizer or splits["train"].tokenizer_path))


def describe_blend(train: BlendedDataset) -> str | None:
    """'data blend: 0.7000 a (N windows), ...' with the proportions actually drawn."""
    if len(train.datasets) == 1:
        return None
    parts = [
        f"{weight:.4f} {dataset.prefix} ({len(dataset):,} windows)"
        for weight, dataset in zip(train.interleave.weights, train.datasets)
    ]
    return "data blend: " + ", ".join(parts)


def rank_slice(batch: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """This data-parallel rank's contiguous share of a global batch, on the rank's device."""
    share = batch.shape[0] // ps.dp_size
    return batch[ps.dp_rank * share : (ps.dp_rank + 1) * share].to(ps.device)


def evaluate(run: Run, val: BlendedDataset) -> float:
    """Mean token loss over the first eval_steps global batches of the held-out split."""
    t = run.cfg.train
    losses = []
    for k in range(t.eval_steps):
        batch = val.evaluation_batch(k, t.global_batch_size)
        losses.append(eval_loss(run, rank_slice(batch, run.ps)))
    return sum(losses) / len(losses)


def setup_topology(cfg: Config) -> tuple[ParallelState, int]:
    """Join the world and build the groups; returns the state and micro-batches per step.
    The layout is checked against the launcher's world size before any process group exists."""
    _, num_microbatches = cfg.layout_for_world(int(os.environ.get("WORLD_SIZE", 1)))
    device = choose_device(cfg.train.device)
    init_distributed(device)
    return build_parallel_state(cfg.parallel.tp, cfg.parallel.pp, device), num_microbatches


# Settings that shape the learning-rate schedule or the batch: a resume that changes them does
# not continue the run it resumes, so it says what changed.
RESUME_SENSITIVE = (
    "train.steps",
    "train.global_batch_size",
    "train.micro_batch_size",
    "optim.lr",
    "optim.min_lr",
    "optim.warmup_steps",
    "optim.decay_steps",
)


def config_changes(saved: dict, cfg: Config) -> list[str]:
    """`key old -> new` for each RESUME_SENSITIVE setting of `cfg` that differs from `saved`
    (the checkpoint's config as a dict; keys it lacks are not compared)."""
    now = config_to_dict(cfg)
    changes = []
    for key in RESUME_SENSITIVE:
        section, name = key.split(".")
        new = now[section][name]
        old = saved.get(section, {}).get(name, new)
        if old != new:
            changes.append(f"{key} {json.dumps(old)} -> {json.dumps(new)}")
    return changes


def resume_point(cfg: Config, ckpt_root: Path) -> Path | None:
    """The checkpoint this run continues from, if any; refuses a fresh run that would overwrite
    the checkpoints of another."""
    resume_from = find_checkpoint(ckpt_root, cfg.checkpoint.resume)
    if resume_from is None and any(ckpt_root.glob("step_*")):
        resume = (
            "checkpoint.resume=auto"
            if cfg.checkpoint.resume == "none"
            else "checkpoint.resume=<one of them> (there is no `latest`)"
        )
        raise TrainingError(
            f"{ckpt_root} already holds checkpoints that a fresh run would overwrite: continue "
            f"the run with {resume}, or use another train.out_dir"
        )
    return resume_from


def restore(run: Run, path: Path, sampler: GlobalBatchSampler) -> int:
    """Continue from the checkpoint at `path`, saying what changed since; returns its step."""
    state = load_checkpoint(path, run)
    if run.ps.rank == 0:
        print(f"resumed from {path} at step {state['step']}")
        changes = config_changes(state.get("config", {}), run.cfg)
        if changes:
            print(f"changed since the checkpoint: {', '.join(changes)}")
    sampler.load_state_dict(state["sampler"])
    run.scaler.load_state_dict(state["scaler"])
    return state["step"]


def train(cfg: Config) -> dict[str, float]:
    """Train to cfg.train.steps (resuming if a checkpoint says so) and print one summary line;
    returns the last metrics row, empty when an earlier run already got there."""
    ps, num_microbatches = setup_topology(cfg)
    t = cfg.train
    out_dir, start_step = Path(t.out_dir), 0
    ckpt_root = out_dir / "checkpoints"
    resume_from = resume_point(cfg, ckpt_root)
    if resume_from is not None and (saved_step := checkpoint_step(resume_from)) >= t.steps:
        if ps.rank == 0:
            print(
                f"already trained to step {saved_step} (out_dir {out_dir}); "
                "raise train.steps to continue"
            )
        return {}
    check_shared_directory(ckpt_root, ps)  # every rank writes its own checkpoint files there
    torch.manual_seed(t.seed)  # dropout on tp-replicated activations: same on all ranks
    data = open_data(cfg)
    sampler = GlobalBatchSampler(data.train.sizes, t.global_batch_size, t.seed, data.train.weights)
    init_from = cfg.checkpoint.init_from
    run = build_run(
        cfg,
        ps,
        num_microbatches,
        Path(init_from) if init_from and not resume_from else None,
        random_init=resume_from is None,  # the checkpoint overwrites every weight
    )
    if resume_from is not None:
        start_step = restore(run, resume_from, sampler)
    if ps.rank == 0:
        save_config(cfg, out_dir / "config.yaml")
        if blend := describe_blend(data.train):
            print(blend)
    logger = MetricsLogger(cfg, out_dir, ps.rank == 0, start_step)
    tokens_per_step = t.global_batch_size * cfg.model.seq_len
    flops_per_step = flops_per_token(cfg.model) * tokens_per_step
    peak = peak_flops(ps.device) * ps.world_size  # NaN for an unknown GPU: MFU is logged null
    row: dict[str, float] = {}
    val_loss, train_time, saved = None, 0.0, None

    def checkpoint(step: int) -> Path:
        state = {
            "step": step,
            "sampler": sampler.state_dict(),
            "scaler": run.scaler.state_dict(),
            "config": config_to_dict(cfg),
        }
        return save_checkpoint(
            ckpt_root, step, run, state, cfg.checkpoint.keep, data.tokenizer_path
        )

    for step in range(start_step, t.steps):
        lr = learning_rate(step, cfg.optim, t.steps)
        batch = rank_slice(data.train.get_batch(sampler.next_batch()), ps)
        start = time.perf_counter()
        metrics = train_step(run, batch, lr)
        elapsed = time.perf_counter() - start
        train_time += elapsed
        if not math.isfinite(metrics.loss):
            raise TrainingError(
                f"loss became {metrics.loss} at step {step + 1}: lower optim.lr, raise "
                "optim.warmup_steps, or use train.precision=bf16/fp32 instead of fp16"
            )
        done = step + 1
        row = {
            "step": done,
            "loss": metrics.loss,
            "lr": lr,
            "grad_norm": metrics.grad_norm,
            "tokens_per_sec": tokens_per_step / elapsed,
            "step_time_s": elapsed,
            "tflops": flops_per_step / elapsed / 1e12,
            "mfu": flops_per_step / elapsed / peak,
            "bubble_fraction": metrics.bubble_fraction,
            "skipped_steps": run.scaler.skipped_steps,
            "loss_scale": run.scaler.scale,
        }
        if t.eval_interval <= t.steps and (done % t.eval_interval == 0 or done == t.steps):
            val_loss = row["val_loss"] = evaluate(run, data.val)
            row["val_ppl"] = math.exp(min(val_loss, 50.0))
            logger.write(f"step {done}: val_loss {val_loss:.4f} ppl {row['val_ppl']:.1f}")
        if done % t.log_interval == 0 or done == t.steps or "val_loss" in row:
            logger.log(row)
        logger.progress(
            done,
            {
                "loss": f"{metrics.loss:.4f}",
                "lr": f"{lr:.2e}",
                "tok/s": f"{row['tokens_per_sec']:.0f}",
            },
        )
        interval = cfg.checkpoint.interval
        if (interval and done % interval == 0) or done == t.steps:
            saved = checkpoint(done)
    logger.close()
    if ps.rank == 0:
        steps_run = t.steps - start_step
        throughput = steps_run * tokens_per_step / train_time
        print(summary_line(t.steps, steps_run, row["loss"], val_loss, throughput, saved))
    return row
