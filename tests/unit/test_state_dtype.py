"""Lean optimizer state (optim.state_dtype=bf16): stochastic rounding is unbiased and keeps a
slowly decaying second moment moving where rounding to nearest freezes it; the first step equals
fp32's and a short run stays close to it; a bf16-state run resumes exactly, and a checkpoint
resumes into the other state dtype, converted."""

import pytest
import torch
from run_configs import TWO_LAYERS

from megalite.checkpoint.sharded import Checkpoint, load_checkpoint
from megalite.checkpoint.writer import save_checkpoint
from megalite.config import OptimConfig, load_config
from megalite.data import GlobalBatchSampler
from megalite.optimizer.adamw import AdamW, stochastic_round_
from megalite.parallel_state import ParallelState
from megalite.training.loop import run_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

STEPS = 12
LOSS_RTOL = 1e-4
"""How far a bf16-state run's per-step loss may move from fp32's over STEPS steps of this model
(measured: 6.6e-6 relative at most). Over 300 steps of configs/gpt-tiny.yaml the curves move
apart by up to 0.7 % at a step and end 0.04 % apart in validation loss."""


def _run(state_dtype: str):
    cfg = load_config(None, [*TWO_LAYERS, f"optim.state_dtype={state_dtype}", "optim.lr=3e-3"])
    return build_run(cfg, ParallelState.single())


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (4, 33), generator=generator) for _ in range(steps)]


def _moments(run) -> list[torch.Tensor]:
    return [t for s in run.optimizer.states for t in (s.exp_avg, s.exp_avg_sq)]


def test_stochastic_rounding_is_unbiased_and_lands_on_the_neighbours():
    value = 1.0 + 2**-10  # 1/8 of the way from 1 to the next bf16 number, 1 + 2^-7
    x = torch.full((200_000,), value)
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0)
    )
    rounded = stochastic_round_(x.clone(), noise)
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # exact in bf16
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(value, abs=3 * 2**-7 * 0.33 / 200_000**0.5)


def test_second_moment_keeps_decaying_where_rounding_to_nearest_freezes():
    """beta2 = 0.999 with zero gradients: v shrinks by 0.1 % a step, under half of bf16's
    spacing; rounded to nearest it never moves, rounded stochastically it decays on average."""
    cfg = OptimConfig(beta2=0.999, state_dtype="bf16", weight_decay=0.0)
    n, steps = 4096, 200
    adamw = AdamW(cfg, torch.device("cpu"), n, rank=0)
    master, grads = torch.zeros(n), torch.zeros(n)
    exp_avg, exp_avg_sq = adamw.zeros(n, pin=False), adamw.zeros(n, pin=False).fill_(1.0)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        adamw.begin_step(step, 1.0)
        adamw.update(master, grads, exp_avg, exp_avg_sq, [], lr=1e-3)
        nearest = (nearest.float() * cfg.beta2).to(torch.bfloat16)
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))
    assert exp_avg_sq.float().mean().item() == pytest.approx(cfg.beta2**steps, rel=0.01)


def test_first_step_equals_fp32_and_the_run_stays_close():
    full, lean = _run("fp32"), _run("bf16")
    assert all(t.dtype == torch.bfloat16 for t in _moments(lean))
    assert all(s.master.dtype == torch.float32 for s in lean.optimizer.states)
    worst = 0.0
    for step, tokens in enumerate(_batches(STEPS)):
        a, b = train_step(full, tokens, 3e-3), train_step(lean, tokens, 3e-3)
        if step == 0:  # the update used the unrounded moments; only their storage is rounded
            for name, param in full.named_parameters().items():
                assert torch.equal(lean.named_parameters()[name], param), name
            for m_full, m_lean in zip(_moments(full)[::2], _moments(lean)[::2]):
                assert torch.equal(m_lean, m_full.to(torch.bfloat16))
        if step <= 1:
            assert b.loss == a.loss
        worst = max(worst, abs(b.loss - a.loss) / a.loss)
    print(f"bf16 state: largest per-step loss difference over {STEPS} steps {worst:.1e}")
    assert 0 < worst <= LOSS_RTOL


def _saved(tmp_path, state_dtype: str, steps: int = 2):
    run = _run(state_dtype)
    state = run_state(run, GlobalBatchSampler(50, 4, run.cfg.train.seed))
    for tokens in _batches(steps):
        train_step(run, tokens, 3e-3)
    state.step = steps
    return run, save_checkpoint(tmp_path / state_dtype, state, keep=1)


def _resumed(path, state_dtype: str):
    run = _run(state_dtype)
    load_checkpoint(path, run_state(run, GlobalBatchSampler(50, 4, run.cfg.train.seed)))
    return run


def test_a_bf16_state_run_resumes_exactly(tmp_path):
    run, path = _saved(tmp_path, "bf16")
    assert Checkpoint(path).tensor("wte.weight.exp_avg").dtype == torch.bfloat16  # as it is kept
    resumed = _resumed(path, "bf16")
    for tokens in _batches(4)[2:]:
        assert train_step(resumed, tokens, 3e-3).loss == train_step(run, tokens, 3e-3).loss
    for mine, theirs in zip(_moments(resumed), _moments(run), strict=True):
        assert torch.equal(mine, theirs)
    for name, param in run.named_parameters().items():
        assert torch.equal(resumed.named_parameters()[name], param), name


@pytest.mark.parametrize("saved_as,resumed_as", [("fp32", "bf16"), ("bf16", "fp32")])
def test_a_checkpoint_resumes_into_the_other_state_dtype(tmp_path, saved_as, resumed_as):
    run, path = _saved(tmp_path, saved_as)
    resumed = _resumed(path, resumed_as)
    dtype = resumed.optimizer.states[0].exp_avg.dtype
    assert dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[resumed_as]
    for mine, saved in zip(_moments(resumed), _moments(run), strict=True):
        assert torch.equal(mine, saved.to(dtype))  # bf16 -> fp32 exact, fp32 -> bf16 rounded
    for mine, saved in zip(resumed.optimizer.states, run.optimizer.states, strict=True):
        assert torch.equal(mine.master, saved.master)
