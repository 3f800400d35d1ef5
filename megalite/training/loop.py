"""The training run, as every rank runs it: `train` below reads from the top. Join the world,
find where the run stands, open the data, build (or resume) this rank's share of the run, then
train. What follows each step (the watchdog, the bad-step stop, evaluation, metrics,
checkpoints, the closing summary) is a list of small hooks (`training/hooks.py`,
`training/watchdog.py`); everything a resume restores is one
`RunState` (`checkpoint/state.py`), saved and loaded by the checkpoint module alone."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from megalite import comm
from megalite.checkpoint.initial import adoption_line, init_from_settings
from megalite.checkpoint.saver import CheckpointSaver
from megalite.checkpoint.sharded import (
    Checkpoint,
    complete_checkpoints,
    find_checkpoint,
    load_checkpoint,
    read_manifest,
)
from megalite.checkpoint.state import RngStreams, RunState, routing_tensors
from megalite.checkpoint.writer import (
    adopt_as_latest,
    check_shared_directory,
    demote_from,
    remove_unfinished,
)
from megalite.config import Config, config_to_dict, save_config
from megalite.data import (
    BlendedDataset,
    DataError,
    GlobalBatchSampler,
    HFTokenizer,
    TokenBatch,
    TokenDataset,
    Tokenizer,
    builtin_data,
    open_tokenizer,
    parse_source,
)
from megalite.data.tokenizer import find_tokenizer_file, same_tokenizer
from megalite.optimizer.lr_schedule import learning_rate
from megalite.parallel_state import (
    ParallelState,
    build_parallel_state,
    choose_device,
    init_distributed,
    keep_launch_order,
    layout_change,
    node_presence,
)
from megalite.tensor_parallel import seed_dropout
from megalite.training.hooks import (
    BadSteps,
    Checkpointing,
    Evaluation,
    Hook,
    MetricsLogging,
    StepRecord,
    Summary,
    TrainingError,
)
from megalite.training.metrics import MetricsLogger, StepCost, metrics_row, reset_peak_memory
from megalite.training.preemption import Preempted, Preemption
from megalite.training.run_lock import lock_out_dir
from megalite.training.setup import Run, build_run
from megalite.training.step import LaunchedStep, eval_loss, launch_step, read_steps
from megalite.training.trackers import new_tracker_id
from megalite.training.watchdog import Watchdog, collective_timeout


def train(cfg: Config) -> dict[str, float]:
    """Train to cfg.train.steps (resuming if a checkpoint says so) and print one summary line;
    returns the last metrics row, empty when an earlier run already got there. The run holds
    its out_dir's lock throughout: a second run there stops at once."""
    ps = setup_topology(cfg)
    with node_presence(ps):  # each node's first process says when it joins and leaves
        lock = lock_out_dir(Path(cfg.train.out_dir), ps)
        try:
            return train_locked(cfg, ps)
        finally:
            if lock is not None:
                lock.release()


def train_locked(cfg: Config, ps: ParallelState) -> dict[str, float]:
    """`train`, once the world is joined and the out_dir is this run's."""
    t = cfg.train
    out_dir = Path(t.out_dir)
    ckpt_root = out_dir / "checkpoints"
    remove_unfinished(ckpt_root, ps)  # before any rank writes (ordered by the next collective)
    resume_from = resume_point(cfg, ckpt_root)
    cfg, adopted = init_from_settings(cfg, resume_from)  # the model's positions, rotary settings
    if adopted and ps.rank == 0:
        print(adoption_line(adopted))
    if resume_from is not None and already_trained(resume_from, cfg, ps):
        return {}
    check_shared_directory(ckpt_root, ps)  # every rank writes its own checkpoint files there
    if resume_from is not None and cfg.checkpoint.resume != "auto":
        adopt_as_latest(ckpt_root, resume_from, ps)
    cost = StepCost.of(cfg, ps)
    seed_dropout(t.seed, ps)
    data = open_data(cfg)
    run, state = start_run(cfg, ps, data, resume_from)
    if ps.rank == 0:
        save_config(cfg, out_dir / "config.yaml")
        if len(data.train.datasets) > 1:
            print(data.train.describe())
    state.tracker_id = state.tracker_id or new_tracker_id()
    logger = MetricsLogger(cfg, out_dir, ps.rank == 0, state.step, state.tracker_id, ps)
    summary = Summary(state.step, cost.tokens)
    saver = CheckpointSaver(
        ckpt_root, cfg.checkpoint.keep, data.tokenizer_path, cfg.checkpoint.async_save
    )
    watchdog = Watchdog.for_run(cfg.fault, ps, state.step)

    def save() -> Path:
        """Collective. Saved during a bad-step streak (preemption, the last step), it is marked
        bad: no resume picks it by itself, and pruning keeps the newest good one."""
        run.optimizer.finish_param_gather()  # the overlapped gather: all weights, then save
        return saver.save(state, good=run.bad_steps.in_a_row == 0)

    def last_good(streak_weights: int) -> Path | None:
        saver.finish()  # collective: a save still being written may be the newest good one
        return demote_from(ckpt_root, streak_weights, ps)

    def streak() -> int:
        return run.bad_steps.in_a_row

    preemption = Preemption(ps, save, saver.finish, t.steps)
    hooks = [
        watchdog,
        BadSteps(run.bad_steps, last_good, logger.log),
        Evaluation(lambda: evaluate(run, data.val), t.eval_interval, t.steps, logger.write),
        MetricsLogging(logger, t.log_interval, t.steps),
        Checkpointing(
            save,
            cfg.checkpoint.interval,
            t.steps,
            saver.finish,
            streak,
            logger.write,
            saver.finish_if_written,
        ),
        summary,
        preemption,  # last: it sees whether this step was saved
    ]
    try:
        try:
            row = run_steps(run, state, data.train, cost, hooks)
        except Preempted as stop:  # a clean stop, its step saved: close the logs and sum up
            summary.checkpoint = stop.checkpoint
            close_run(hooks, summary, ps)
            raise
        except TrainingError:  # every rank stops alike: publish the save still being written
            saver.finish()
            raise
        finally:
            watchdog.close()  # its threads must not outlive the steps, however they end
        close_run(hooks, summary, ps)  # a signal now waits for the last save's publishing
    finally:
        preemption.close()  # its signal handlers must not outlive the run
    return row


def close_run(hooks: list[Hook], summary: Summary, ps: ParallelState) -> None:
    """Close every hook and print the closing summary line (rank 0)."""
    for hook in hooks:
        hook.close()
    if ps.rank == 0:
        print(summary.line())


def run_steps(
    run: Run, state: RunState, train_data: BlendedDataset, cost: StepCost, hooks: list[Hook]
) -> dict[str, float]:
    """Train from `state.step` to the last step; returns the last step's metrics row. Steps are
    launched without reading anything back (`launch_step`) until one that a hook acts after
    (`Hook.reads_at`: every log interval, an evaluation, a checkpoint, the last step); there the
    metrics of every step since the last read come to the host in one copy, and each step's
    record goes to the hooks in order. Their step time is the interval's wall time shared out
    evenly, as the device ran them back to back."""
    cfg, steps = run.cfg, run.cfg.train.steps
    row: dict[str, float] = {}
    launched: list[tuple[int, float, LaunchedStep]] = []  # (step, lr, step) not yet read
    reset_peak_memory(run.ps.device)
    start = time.perf_counter()
    for step in range(state.step, steps):
        lr = learning_rate(step, cfg.optim, steps)
        batch = rank_batch(train_data, state.sampler.next_batch(), run)
        launched.append((step + 1, lr, launch_step(run, batch, lr)))
        state.step = step + 1
        if not any(hook.reads_at(state.step) for hook in hooks):
            continue
        metrics = read_steps([one for _, _, one in launched])
        elapsed = (time.perf_counter() - start) / len(launched)
        for (done, lr, _), step_metrics in zip(launched, metrics):
            row = metrics_row(done, step_metrics, lr, elapsed, cost)
            record = StepRecord(done, step_metrics, lr, elapsed, row, newest=done == state.step)
            for hook in hooks:
                hook.after_step(record)
        launched = []
        reset_peak_memory(run.ps.device)
        start = time.perf_counter()  # an evaluation or a save is not a step's time
    run.optimizer.finish_param_gather()  # the last update's weights landed (ZeRO-3: owned)
    return row


def setup_topology(cfg: Config) -> ParallelState:
    """Join the world and build the groups. The layout is checked against the launcher's world
    size before any process group exists."""
    cfg.layout_for_world(int(os.environ.get("WORLD_SIZE", 1)))
    device = choose_device(cfg.train.device)
    p = cfg.parallel
    if device.type == "cuda":
        keep_launch_order(p.tp)  # before init_distributed starts CUDA
    init_distributed(device, collective_timeout(cfg.fault))
    timeout = collective_timeout(cfg.fault)
    return build_parallel_state(
        p.tp, p.pp, device, timeout, cp=p.cp, ep=p.ep, dp_replicate=p.dp_replicate
    )


def start_run(
    cfg: Config,
    ps: ParallelState,
    data: Data,
    resume_from: Path | None,
) -> tuple[Run, RunState]:
    """This rank's run and its resumable state: new (seeded weights, or those of
    `checkpoint.init_from`) or restored from the checkpoint `resume_from`."""
    t = cfg.train
    sampler = GlobalBatchSampler(data.train.sizes, t.global_batch_size, t.seed, data.train.weights)
    init_from = cfg.checkpoint.init_from
    run = build_run(
        cfg,
        ps,
        init_from=Path(init_from) if init_from and not resume_from else None,
        random_init=resume_from is None,  # the checkpoint overwrites every weight
        eos_id=data.train.eos_id,
    )
    state = run_state(run, sampler)
    if resume_from is not None:
        load_checkpoint(resume_from, state, announce=lambda ckpt: announce_resume(ckpt, cfg, ps))
    return run, state


def run_state(run: Run, sampler: GlobalBatchSampler) -> RunState:
    """The resumable state of `run` at its start: what a checkpoint saves and a resume fills."""
    return RunState(
        ps=run.ps,
        params=run.named_parameters(),
        optimizer=run.optimizer,
        rng=RngStreams(run.tp_random),
        sampler=sampler,
        scaler=run.scaler,
        bad_steps=run.bad_steps,
        config=config_to_dict(run.cfg),
        routing=routing_tensors(run.chunks),
    )


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
        failure = None
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # one process per node builds the cache
            try:
                builtin_data(cfg.model.vocab_size, cache_dir)
            except DataError as error:
                failure = error
        if comm.any_rank(failure is not None):  # the others wait here, as at a barrier
            echo = DataError("the builtin corpus could not be made (a node's first rank says why)")
            echo.same_on_every_rank = True
            raise failure or echo
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
    path = Path(tokenizer or splits["train"].tokenizer_path)
    if not tokenizer and not path.exists():
        raise DataError(
            f"{blend[0][1]} names its tokenizer {path} (relative to the data), which is not "
            "there: copy the tokenizer beside the data, or set data.tokenizer to its path"
        )
    data_tokenizer = open_tokenizer(path)
    splits["train"].check_tokenizer(data_tokenizer)  # val reads the same corpora
    theirs = _init_from_tokenizer(cfg, data_tokenizer)
    return Data(splits["train"], splits["val"], path if d.tokenizer or not theirs else theirs)


def _init_from_tokenizer(cfg: Config, data_tokenizer: Tokenizer | HFTokenizer) -> Path | None:
    """A run that starts from another model's weights reads its data with that model's
    tokenizer (it is what the embeddings were trained for): the one the model brings, if any,
    which must encode as the data's does."""
    init_from = cfg.checkpoint.init_from
    theirs = find_tokenizer_file(Path(init_from)) if init_from else None
    if theirs is None:
        return None
    if not same_tokenizer(open_tokenizer(theirs), data_tokenizer):
        raise DataError(
            f"checkpoint.init_from={init_from} brings its own tokenizer, but the data was "
            f"prepared with {data_tokenizer.path}, which encodes differently: prepare the data "
            f"with `megalite data prepare --tokenizer {init_from} ...`"
        )
    return theirs


def rank_batch(data: BlendedDataset, pairs: list[tuple[int, int]], run: Run) -> TokenBatch:
    """This rank's share of the global batch `pairs` (the sampler's, the same on every rank),
    read from disk onto its device: its data-parallel rank's contiguous slice, and of that the
    inputs on the first pipeline stage, the targets on the last, nothing on a middle stage.
    Every tp rank of a stage reads the same share."""
    ps = run.ps
    share = len(pairs) // ps.size("dp")
    mine = pairs[ps.coord("dp") * share : (ps.coord("dp") + 1) * share]
    first, last = any(run.executor.is_first), any(run.executor.is_last)
    first = first or run.sequence_cut.needs_inputs  # every stage finds the documents
    return data.read(mine, inputs=first, targets=last).to(ps.device)


def evaluate(run: Run, val: BlendedDataset) -> float:
    """Mean token loss over the first eval_steps global batches of the held-out split."""
    t = run.cfg.train
    losses = []
    for k in range(t.eval_steps):
        pairs = val.evaluation_pairs(k, t.global_batch_size)
        losses.append(eval_loss(run, rank_batch(val, pairs, run)))
    return sum(losses) / len(losses)


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
    if resume_from is None and complete_checkpoints(ckpt_root):  # checkpoint.resume=none
        raise TrainingError(
            f"{ckpt_root} already holds checkpoints that a fresh run would overwrite: continue "
            "the run with checkpoint.resume=auto, or use another train.out_dir"
        )
    return resume_from


def already_trained(resume_from: Path, cfg: Config, ps: ParallelState) -> bool:
    """Whether the checkpoint a run would continue from already reached train.steps (rank 0
    says so). Read from its manifest alone, without hashing files: loading does that."""
    saved_step = Checkpoint(resume_from, verify_files=False).step
    if saved_step < cfg.train.steps:
        return False
    if ps.rank == 0:
        print(
            f"already trained to step {saved_step} (out_dir {Path(cfg.train.out_dir)}); "
            "raise train.steps to continue"
        )
    return True


def announce_resume(ckpt: Checkpoint, cfg: Config, ps: ParallelState) -> None:
    """Rank 0 says where the run continues from, and what changed since that shapes it."""
    if ps.rank != 0:
        return
    print(f"resumed from {ckpt.path} at step {ckpt.step}")
    saved_layout = read_manifest(ckpt.path, verify_files=False)["layout"]
    t, saved = cfg.train, ckpt.config.get("train", {})
    batch = (t.global_batch_size, t.micro_batch_size)
    saved_batch = (
        saved.get("global_batch_size", t.global_batch_size),
        saved.get("micro_batch_size", t.micro_batch_size),
    )
    layout = layout_change(saved_layout, ps, saved_batch, batch)
    if layout:
        print(f"resuming in another layout: {layout}")
    changes = config_changes(ckpt.config, cfg)
    if changes:
        print(f"changed since the checkpoint: {', '.join(changes)}")
