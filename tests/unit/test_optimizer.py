"""The optimizer side of a step: megalite's single-process train_step against torch.optim.AdamW
+ clip_grad_norm_ on an identically initialised model, gradient accumulation, the lr schedule,
the fp16 loss scaler and the clip coefficient."""

import math

import pytest
import torch
from megalite.models.factory import build_chunks

import megalite.training.step as step_module
from megalite.config import OptimConfig, load_config
from megalite.optimizer.clip import clip_coefficient
from megalite.optimizer.loss_scale import LossScaler
from megalite.optimizer.lr_schedule import learning_rate
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom, global_tensors, param_parts
from megalite.training.setup import build_run
from megalite.training.step import train_step

VOCAB, SEQ, SEED = 500, 32, 1234


def tiny_config(arch: str = "gpt", micro: int = 4, global_batch: int = 4, **optim):
    overrides = [
        f"model.arch={arch}",
        "model.n_layers=2",
        "model.hidden=64",
        "model.n_heads=4",
        f"model.n_kv_heads={2 if arch == 'llama' else 4}",
        f"model.vocab_size={VOCAB}",
        f"model.seq_len={SEQ}",
        f"train.micro_batch_size={micro}",
        f"train.global_batch_size={global_batch}",
        f"train.seed={SEED}",
        "train.precision=fp32",
        "train.device=cpu",
        "train.steps=5",
        "optim.lr=3e-3",
        "optim.min_lr=3e-4",
        "optim.warmup_steps=2",
        "optim.weight_decay=0.1",
        "optim.grad_clip=1.0",
    ]
    overrides += [f"optim.{k}={v}" for k, v in optim.items()]
    return load_config(None, overrides)


def make_run(cfg):
    ps = ParallelState.single()
    return build_run(cfg, ps)


def token_batches(steps: int, batch: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator) for _ in range(steps)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def reference_model(cfg):
    """A second, independent copy of the model, initialised the way build_run initialises its
    own, trained with plain PyTorch."""
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps))
    decay = [p for p in model.parameters() if p.meta.weight_decay]
    no_decay = [p for p in model.parameters() if not p.meta.weight_decay]
    assert decay and no_decay
    o = cfg.optim
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": o.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
    )
    return model, optimizer


# Clip thresholds chosen so that some steps are clipped and some are not (their grad norms are
# gpt ~1.7 falling to ~1.2, llama ~1.1-1.2).
@pytest.mark.parametrize("arch, grad_clip", [("gpt", 1.4), ("llama", 1.14)])
def test_train_step_matches_torch_adamw(arch, grad_clip):
    cfg = tiny_config(arch, grad_clip=grad_clip)
    steps = cfg.train.steps
    run = make_run(cfg)
    model, optimizer = reference_model(cfg)
    ours = run.named_parameters()
    theirs = dict(model.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():  # identical start
        assert torch.equal(param, theirs[name]), name

    clipped_steps = 0
    for step, tokens in enumerate(token_batches(steps, cfg.train.global_batch_size)):
        lr = learning_rate(step, cfg.optim, steps)
        metrics = train_step(run, tokens, lr)

        optimizer.zero_grad(set_to_none=True)
        targets = tokens[:, 1:]
        loss = model(tokens[:, :-1], targets) / targets.numel()  # the model returns the sum
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), cfg.optim.grad_clip)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()

        assert not metrics.skipped
        assert rel(metrics.loss, loss.item()) < 1e-6, (step, metrics.loss, loss.item())
        assert rel(metrics.grad_norm, norm.item()) < 1e-6, (step, metrics.grad_norm, norm.item())
        clipped_steps += norm.item() > cfg.optim.grad_clip
    assert 0 < clipped_steps < steps  # both branches of clipping were exercised

    # GPT's key bias has an exactly-zero true gradient (adding q.b to every score of a query is
    # undone by the softmax), so both optimizers step on rounding noise there, which Adam
    # normalises to lr-sized moves. It is checked to be noise, and compared loosely.
    # Compared by global tensor: the key bias is a part of the fused q/k/v bias.
    ours, theirs = global_tensors(ours), global_tensors(theirs)
    grads = {
        part: param.grad.view(-1)[lo:hi]
        for name, param in model.named_parameters()
        for part, _, lo, hi in param_parts(name, param)
    }
    noise = [n for n in theirs if n.endswith("attn.wk.bias")]
    for name in noise:
        assert grads[name].abs().max().item() < 1e-6 * norm.item(), name
        assert (ours[name] - theirs[name]).abs().max().item() < 5 * cfg.optim.lr, name
    diffs = {n: (ours[n] - theirs[n]).abs().max().item() for n in ours if n not in noise}
    worst = max(diffs, key=diffs.get)
    relative = {n: ((ours[n] - theirs[n]).norm() / theirs[n].norm()).item() for n in diffs}
    # The updates differ by about an ulp (decoupled decay applied as p - lr*wd*p rather than
    # p * (1 - lr*wd)); Adam magnifies that in elements whose gradient is near zero. Measured
    # after 5 steps: relative error <= 7e-7 per tensor, a single element up to 2.5e-6.
    assert max(relative.values()) < 2e-6, relative
    assert diffs[worst] < 1e-5, (worst, diffs[worst])
    moved = max((ours[n] - p0).abs().max().item() for n, p0 in _initial(cfg).items())
    assert moved > 1e-3  # the comparison is not vacuous: parameters did change


def _initial(cfg) -> dict[str, torch.Tensor]:
    ps = ParallelState.single()
    (model,) = build_chunks(cfg, ps, TPRandom(cfg.train.seed, ps))
    return {
        n: p.detach().clone() for n, p in global_tensors(dict(model.named_parameters())).items()
    }


def test_weight_decay_spares_norms_and_biases():
    ps = ParallelState.single()
    cfg = tiny_config()
    (model,) = build_chunks(cfg, ps, TPRandom(SEED, ps))
    for name, param in model.named_parameters():
        if param.dim() == 1:
            assert not param.meta.weight_decay, name
    assert model.get_parameter("layers.0.attn.wqkv.weight").meta.weight_decay


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_gradient_accumulation_matches_one_micro_batch(arch):
    (tokens,) = token_batches(1, 4)
    one = make_run(tiny_config(arch, micro=4, global_batch=4))
    two = make_run(tiny_config(arch, micro=2, global_batch=4))
    a = train_step(one, tokens, 1e-3)
    b = train_step(two, tokens, 1e-3)
    assert rel(b.loss, a.loss) < 1e-6
    assert rel(b.grad_norm, a.grad_norm) < 1e-5
    # Compare the accumulated fp32 gradients, not the updated weights: Adam's first step is
    # ~lr * sign(g), which turns rounding noise in near-zero gradients into lr-sized changes.
    for ga, gb in zip(one.buffers, two.buffers):
        scale = ga.grads_flat.abs().max().item()
        assert (ga.grads_flat - gb.grads_flat).abs().max().item() < 1e-5 * scale


@pytest.mark.parametrize("growth_interval", [1000, 1])
def test_loss_scaling_does_not_change_the_step(growth_interval):
    """A power-of-two loss scale is exact in fp32: the scaled step equals the unscaled one,
    also on the step after which the scale grows (the gradients carry the scale the loss was
    multiplied by, not the next one)."""
    cfg = tiny_config()
    (tokens,) = token_batches(1, 4)
    plain, scaled = make_run(cfg), make_run(cfg)
    scaled.scaler = LossScaler(scale=2.0**12, dynamic=True, growth_interval=growth_interval)
    a = train_step(plain, tokens, 1e-3)
    b = train_step(scaled, tokens, 1e-3)
    assert not b.skipped and scaled.scaler.scale == 2.0 ** (12 + (growth_interval == 1))
    assert rel(b.loss, a.loss) < 1e-7 and rel(b.grad_norm, a.grad_norm) < 1e-6
    pa, pb = plain.named_parameters(), scaled.named_parameters()
    assert max((pa[n] - pb[n]).abs().max().item() for n in pa) < 1e-7


def test_overflow_skips_the_update():
    cfg = tiny_config()
    (tokens,) = token_batches(1, 4)
    run = make_run(cfg)
    run.scaler = LossScaler(scale=2.0**200, dynamic=True)  # the scaled loss overflows fp32
    before = {n: p.detach().clone() for n, p in run.named_parameters().items()}
    metrics = train_step(run, tokens, 1e-3)
    assert metrics.skipped and run.scaler.skipped_steps == 1
    assert run.scaler.scale == 2.0**199
    assert math.isfinite(metrics.loss)  # the reported loss is unscaled
    assert run.optimizer.step_count == 0
    for name, param in run.named_parameters().items():
        assert torch.equal(param, before[name]), name


def test_a_loss_that_is_not_finite_is_a_bad_step_even_where_the_scaler_skips(monkeypatch):
    """An fp16 overflow (finite loss) is the scaler's to skip, and no bad step; weights that
    give a NaN loss overflow too, and are a bad step all the same, or the streak would never
    count and its checkpoints would be saved as good."""
    (tokens,) = token_batches(1, 4)
    run = make_run(tiny_config())
    run.scaler = LossScaler(scale=2.0**12, dynamic=True)
    finalize = step_module.finalize_grads

    def overflowing(buffers, ps):
        finalize(buffers, ps)
        buffers[0].owned_grads[0] = math.inf

    monkeypatch.setattr(step_module, "finalize_grads", overflowing)
    overflow = train_step(run, tokens, 1e-3)
    assert overflow.skipped and overflow.bad is None and run.bad_steps.in_a_row == 0
    monkeypatch.setattr(step_module, "global_loss", lambda local, run: local.fill_(math.nan))
    diverged = train_step(run, tokens, 1e-3)
    assert diverged.skipped and diverged.bad == "loss is nan" and run.bad_steps.in_a_row == 1
    assert run.optimizer.step_count == 0


# ----------------------------------------------------------------------------- lr schedule


def test_warmup_is_linear_and_peaks_at_its_end():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    lrs = [learning_rate(s, cfg, 100) for s in range(10)]
    assert lrs == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)], rel=1e-12)
    steps = [b - a for a, b in zip(lrs, lrs[1:])]
    assert max(steps) - min(steps) < 1e-12  # equal increments
    assert learning_rate(9, cfg, 100) == pytest.approx(1e-3)  # last warmup step: the peak
    assert learning_rate(10, cfg, 100) == pytest.approx(1e-3)  # decay starts from the peak
    assert all(learning_rate(s, cfg, 100) <= 1e-3 + 1e-15 for s in range(100))


def test_cosine_decay_reaches_min_lr_at_the_end():
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10)
    total = 100
    decay = [learning_rate(s, cfg, total) for s in range(10, total + 1)]
    assert all(b <= a for a, b in zip(decay, decay[1:]))  # monotone
    assert learning_rate(total, cfg, total) == pytest.approx(1e-4, rel=1e-12)
    assert learning_rate(55, cfg, total) == pytest.approx(0.5 * (1e-3 + 1e-4))  # half way
    # The last optimizer step (index total-1) is one step short of the end of the cosine.
    assert 1e-4 < learning_rate(total - 1, cfg, total) < 1e-4 + 1e-6
    assert learning_rate(10 * total, cfg, total) == pytest.approx(1e-4)  # stays at min_lr


def test_explicit_decay_steps_and_no_warmup():
    cfg = OptimConfig(lr=2e-3, min_lr=0.0, warmup_steps=0, decay_steps=20)
    assert learning_rate(0, cfg, 1000) == pytest.approx(2e-3)
    assert learning_rate(10, cfg, 1000) == pytest.approx(1e-3)
    assert learning_rate(20, cfg, 1000) == pytest.approx(0.0, abs=1e-15)
    assert learning_rate(500, cfg, 1000) == pytest.approx(0.0, abs=1e-15)


# ----------------------------------------------------------------------------- loss scaler


def skips(scaler: LossScaler, overflow: bool) -> bool:
    """Whether the scaler skips a step that did (not) overflow."""
    return bool(scaler.update(torch.tensor(float(overflow))).item())


def test_loss_scaler_for_precision():
    assert LossScaler.for_precision("fp16").scale == 2.0**16
    assert LossScaler.for_precision("fp16").dynamic
    for precision in ("fp32", "bf16"):
        scaler = LossScaler.for_precision(precision)
        assert scaler.scale == 1.0 and not scaler.dynamic
        assert skips(scaler, True) is False and scaler.scale == 1.0  # never skips


def test_a_resume_in_another_precision_keeps_its_own_scaler():
    saved = LossScaler(scale=2.0**9, dynamic=True, clean_steps=7, skipped_steps=3)
    fp16 = LossScaler.for_precision("fp16")
    fp16.load_state_dict(saved.state_dict())
    assert fp16 == saved  # fp16 after fp16 continues
    for precision in ("bf16", "fp32"):
        resumed = LossScaler.for_precision(precision)
        resumed.load_state_dict(saved.state_dict())
        assert resumed == LossScaler.for_precision(precision)
        fp16 = LossScaler.for_precision("fp16")
        fp16.load_state_dict(resumed.state_dict())
        assert fp16 == LossScaler.for_precision("fp16")  # scales and skips overflows


def test_loss_scaler_overflow_halves_and_skips():
    scaler = LossScaler(scale=1024.0, dynamic=True, growth_interval=3)
    assert skips(scaler, False) is False and scaler.clean_steps == 1
    assert skips(scaler, True) is True
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1 and scaler.clean_steps == 0
    assert skips(scaler, True) is True and scaler.scale == 256.0 and scaler.skipped_steps == 2


def test_loss_scaler_grows_after_clean_steps():
    scaler = LossScaler(scale=8.0, dynamic=True, growth_interval=3)
    assert [skips(scaler, False) for _ in range(2)] == [False, False]
    assert scaler.scale == 8.0
    skips(scaler, False)
    assert scaler.scale == 16.0
    skips(scaler, False)
    skips(scaler, True)  # an overflow restarts the count
    skips(scaler, False)
    skips(scaler, False)
    assert scaler.scale == 8.0
    skips(scaler, False)
    assert scaler.scale == 16.0


def test_loss_scaler_floor_and_state_round_trip():
    scaler = LossScaler(scale=1.0, dynamic=True)
    assert skips(scaler, True) and scaler.scale == 1.0  # never below 1
    other = LossScaler.for_precision("fp16")
    other.load_state_dict(LossScaler(scale=64.0, dynamic=True, clean_steps=5).state_dict())
    assert other == LossScaler(scale=64.0, dynamic=True, clean_steps=5)


# ----------------------------------------------------------------------------- clipping


def test_clip_coefficient():
    assert clip_coefficient(torch.tensor(0.5), 1.0) == 1.0
    assert clip_coefficient(torch.tensor(1.0 - 1e-6), 1.0) == 1.0
    assert clip_coefficient(torch.tensor(100.0), 0.0) == 1.0  # disabled
    coefficient = clip_coefficient(torch.tensor(4.0, dtype=torch.float64), 1.0).item()
    assert coefficient == pytest.approx(0.25, rel=1e-6) and coefficient < 0.25
    assert 4.0 * coefficient <= 1.0
    # The same factor torch.nn.utils.clip_grad_norm_ applies.
    grad = torch.full((16,), 1.0)  # norm 4
    param = torch.nn.Parameter(torch.zeros(16))
    param.grad = grad.clone()
    torch.nn.utils.clip_grad_norm_([param], 1.0)
    assert torch.allclose(param.grad, grad * coefficient, rtol=1e-7, atol=0)
