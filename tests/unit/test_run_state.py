"""A run's state and its one save / load pair, in one process: everything a resume needs comes
back (weights, optimizer state and step count, RNG streams, data position, loss scaler, step),
the resume can speak before a refused data order stops it, and `Checkpoint` reads a saved run
for the modules that only need its config, tokenizer or weights."""

from pathlib import Path

import pytest
import torch
from run_configs import ONE_LAYER

from megalite.checkpoint.sharded import Checkpoint, CheckpointError, load_checkpoint
from megalite.checkpoint.writer import save_checkpoint
from megalite.config import config_to_dict, load_config
from megalite.data import (
    DataError,
    GlobalBatchSampler,
    builtin_corpus_text,
    open_tokenizer,
    train_tokenizer,
)
from megalite.optimizer.distributed import STATE_KINDS
from megalite.optimizer.loss_scale import LossScaler
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import global_tensors
from megalite.training.loop import run_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

WINDOWS = 50


def fresh_state(global_batch_size: int = 2, windows: int = WINDOWS):
    cfg = load_config(None, [*ONE_LAYER, f"train.global_batch_size={global_batch_size}"])
    run = build_run(cfg, ParallelState.single())
    sampler = GlobalBatchSampler(windows, global_batch_size, cfg.train.seed)
    return run, run_state(run, sampler)


def optimizer_state(state) -> list[torch.Tensor]:
    return [view.clone() for *_, views in state.optimizer.owned_pieces() for view in views.values()]


def _text(tmp_path) -> Path:
    (tmp_path / "text.txt").write_text(builtin_corpus_text()[:50_000])
    return tmp_path / "text.txt"


@pytest.fixture
def saved(tmp_path):
    """A run state two steps in, with an fp16 loss scaler that has seen overflows, saved."""
    run, state = fresh_state()
    for _ in range(2):
        state.sampler.next_batch()
        train_step(run, torch.randint(0, 500, (2, 17)), 1e-3)
    state.step = 2
    state.scaler.dynamic = True
    state.scaler.load_state_dict(
        LossScaler(scale=1024.0, dynamic=True, skipped_steps=3).state_dict()
    )
    tokenizer = train_tokenizer([_text(tmp_path)], tmp_path / "tok", 400, kind="byte-bpe")
    path = save_checkpoint(tmp_path / "checkpoints", state, keep=1, tokenizer=tokenizer)
    return path, state, torch.get_rng_state(), state.rng.tp_random.state.clone()


def test_a_loaded_state_is_the_saved_one(saved):
    path, before, torch_rng, tp_rng = saved
    run, state = fresh_state()
    with torch.no_grad():
        for param in state.params.values():
            param.normal_()  # anything but the saved values
    torch.manual_seed(12345)
    state.rng.tp_random.state = torch.Generator().manual_seed(1).get_state()
    state.scaler.dynamic = True  # an fp16 run, as the saved one was

    ckpt = load_checkpoint(path, state)
    assert ckpt.step == state.step == 2
    for name, param in before.params.items():
        assert torch.equal(state.params[name], param), name
    assert state.optimizer.step_count == 2
    for loaded, original in zip(optimizer_state(state), optimizer_state(before), strict=True):
        assert torch.equal(loaded, original)
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert torch.equal(state.rng.tp_random.state, tp_rng)
    assert state.sampler.state_dict() == before.sampler.state_dict()
    assert state.scaler.state_dict() == before.scaler.state_dict()
    assert state.sampler.next_batch() == before.sampler.next_batch()  # the same data from here


def test_streams_saved_on_a_gpu_leave_a_cpu_runs_own_dropout_stream():
    """A GPU's generator state (16 bytes) is no CPU generator's: a CUDA run's checkpoint resumed
    on a laptop restores the CPU generator and keeps its own tp stream, which dropout then
    draws from (restoring the GPU's crashed the first dropout)."""
    _, state = fresh_state()
    own_stream = state.rng.tp_random.state.clone()
    cpu = torch.Generator().manual_seed(7).get_state()
    gpu_like = torch.zeros(16, dtype=torch.uint8)
    saved = {"torch_cpu": cpu, "tp_stream": gpu_like, "torch_cuda": gpu_like}
    state.rng.load_state_dict(saved)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert torch.equal(state.rng.tp_random.state, own_stream)
    with state.rng.tp_random.fork():
        torch.nn.functional.dropout(torch.ones(8), 0.5)


def test_a_resume_speaks_before_a_refused_data_order_stops_it(saved):
    path, before, _, _ = saved
    _, state = fresh_state(windows=WINDOWS + 1)  # another corpus
    heard = []

    def announce(ckpt):
        weights_in = torch.equal(state.params["wte.weight"], before.params["wte.weight"])
        heard.append((ckpt.step, ckpt.config["train"]["global_batch_size"], weights_in))

    with pytest.raises(DataError, match="cannot resume the data order"):
        load_checkpoint(path, state, announce)
    assert heard == [(2, 2, True)]
    assert state.step == 0


def test_checkpoint_read_api(saved):
    path, before, _, _ = saved
    ckpt = Checkpoint(path)
    assert ckpt.step == 2
    assert ckpt.config == config_to_dict(load_config(None, [*ONE_LAYER]))
    ckpt.config["train"]["steps"] = -1  # a copy, free to change
    assert ckpt.config["train"]["steps"] != -1
    original = open_tokenizer(path.parents[1] / "tok.json")
    assert ckpt.tokenizer.encode("In the beginning") == original.encode("In the beginning")
    assert (path / "tokenizer.json").read_bytes() == (path.parents[1] / "tok.json").read_bytes()
    names = ckpt.weight_names()
    assert "wte.weight" in names and not any(n.endswith(STATE_KINDS) for n in names)
    assert set(names) <= set(global_tensors(before.params))  # fused parameters by part
    assert torch.equal(ckpt.tensor("wte.weight"), before.params["wte.weight"][:500])

    _, state = fresh_state()
    ckpt.load_parameters(state.params, state.ps)
    for name, param in before.params.items():
        assert torch.equal(state.params[name], param), name


def test_a_checkpoint_without_a_tokenizer_says_so(tmp_path):
    _, state = fresh_state()
    path = save_checkpoint(tmp_path, state, keep=1)
    with pytest.raises(CheckpointError, match=r"step_000000 carries no tokenizer"):
        _ = Checkpoint(path).tokenizer
