"""Lean optimizer state (optim.state_dtype=bf16): the rounding noise (a hash of step, tensor and
element index in the global tensor) is uniform, matches its reference, does not depend on
chunking or on the tp piece holding the element, and is the same on CUDA; stochastic rounding
is unbiased and keeps a slowly decaying second moment moving where rounding to nearest freezes
it; the first step equals fp32's and a short run stays close to it; a bf16-state run resumes
exactly, and a checkpoint resumes into the other state dtype, converted."""

import pytest
import torch
from run_configs import TWO_LAYERS

import megalite.optimizer.adamw as adamw_module
from megalite.checkpoint.sharded import Checkpoint, load_checkpoint
from megalite.checkpoint.writer import save_checkpoint
from megalite.config import OptimConfig, load_config
from megalite.data import GlobalBatchSampler
from megalite.optimizer.adamw import (
    AdamW,
    NoiseSegment,
    _int32,
    noise_seed,
    noise_seeds,
    rounding_noise,
    stochastic_round_,
)
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.layers import ParamMeta, normal_init
from megalite.training.loop import run_state
from megalite.training.setup import build_run
from megalite.training.step import train_step

STEPS = 12
LOSS_RTOL = 1e-4
"""How far a bf16-state run's per-step loss may move from fp32's over STEPS steps of this model
(measured: 6.6e-6 relative at most). Over 300 steps of configs/gpt-tiny.yaml the curves move
apart by up to 0.7 % at a step and end 0.04 % apart in validation loss."""


def begin(adamw: AdamW, step: int, keys: set[int] = frozenset({7, 11, 12, 13})) -> None:
    """Start update number `step` (the count is the device's), drawing the noise of `keys`."""
    adamw.noise_for(set(keys))
    adamw.step_tensor.fill_(step - 1)
    adamw.begin_step(1.0)


def _run(state_dtype: str):
    cfg = load_config(None, [*TWO_LAYERS, f"optim.state_dtype={state_dtype}", "optim.lr=3e-3"])
    return build_run(cfg, ParallelState.single())


def _batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 500, (4, 33), generator=generator) for _ in range(steps)]


def _moments(run) -> list[torch.Tensor]:
    return [t for s in run.optimizer.states for t in (s.exp_avg, s.exp_avg_sq)]


def _noise(start: int, count: int, seed: int, device: str = "cpu") -> torch.Tensor:
    out, work = (torch.empty(count, dtype=torch.int32, device=device) for _ in range(2))
    return rounding_noise(start, seed, out, work)


def _reference_noise(index: int, seed: int) -> int:
    """The top 16 bits of murmur3's fmix32 of (index * 0x9E3779B9 + seed) mod 2^32."""
    h = (index * 0x9E3779B9 + seed) & 0xFFFFFFFF
    h ^= h >> 16
    h = h * 0x85EBCA6B & 0xFFFFFFFF
    h ^= h >> 13
    h = h * 0xC2B2AE35 & 0xFFFFFFFF
    return h >> 16


@pytest.mark.parametrize("start", [0, 3 << 31])  # past int32, where indices wrap
def test_rounding_noise_matches_its_reference_and_is_uniform(start):
    n, bins = 1 << 22, 64
    seed = noise_seed(7, 3)
    noise = _noise(start, n, seed)
    picks = range(0, n, 4099)
    assert noise[::4099].tolist() == [_reference_noise(start + i, seed) for i in picks]
    assert 0 <= noise.min().item() and noise.max().item() < 1 << 16
    sd = ((1 << 32) / 12 / n) ** 0.5  # of the mean of n uniform draws from [0, 2^16)
    assert abs(noise.double().mean().item() - ((1 << 16) - 1) / 2) < 5 * sd
    counts = torch.bincount(noise.long() >> 10, minlength=bins).double()
    chi2 = ((counts - n / bins) ** 2 / (n / bins)).sum().item()
    assert chi2 < 125  # 63 degrees of freedom: p < 1e-6 above this
    bits = torch.stack([(noise >> b) & 1 for b in range(16)]).double().mean(1)
    assert (bits - 0.5).abs().max().item() < 5 * 0.5 / n**0.5


def test_rounding_noise_depends_on_step_tensor_and_index_only():
    seed = noise_seed(5, 1)
    whole = _noise(1000, 3000, seed)
    pieces = [_noise(1000 + lo, hi - lo, seed) for lo, hi in ((0, 7), (7, 1200), (1200, 3000))]
    assert torch.equal(torch.cat(pieces), whole)  # one chunk or many
    assert torch.equal(_noise(1000, 3000, noise_seed(5, 1)), whole)  # no hidden state
    seeds = {noise_seed(step, key) for step in range(1, 200) for key in range(64)}
    assert len(seeds) == 199 * 64
    others = [_noise(1000, 3000, noise_seed(6, 1)), _noise(1000, 3000, noise_seed(5, 2))]
    for other in others:  # another step, another tensor: unrelated draws
        agree = (other == whole).double().mean().item()
        assert agree < 0.01
        corr = torch.corrcoef(torch.stack([other, whole]).double())[0, 1].item()
        assert abs(corr) < 0.1


def test_the_device_draws_the_seeds_the_spec_gives():
    """`noise_seeds` (the step count a tensor, as a skipped step leaves it on the device) is
    `noise_seed`, bit for bit, for keys over the whole 32-bit range and counts up to fp32's
    exact integers."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 1 << 32, (500,), generator=generator).tolist() + [0, 1, (1 << 32) - 1]
    for step in (0, 1, 9, 12345, (1 << 24) - 1):
        drawn = noise_seeds(torch.tensor(float(step)), torch.tensor(keys)).tolist()
        assert drawn == [_int32(noise_seed(step, key)) for key in keys], step


def test_a_bf16_update_is_the_same_in_one_chunk_or_many(monkeypatch):
    n = 600_000  # three CPU chunks
    generator = torch.Generator().manual_seed(0)
    master, grads = (torch.randn(2 * n, generator=generator) for _ in range(2))
    cfg = OptimConfig(state_dtype="bf16")
    results = []
    for chunk in (None, 1 << 20):
        if chunk:
            monkeypatch.setitem(adamw_module.UPCAST_CHUNK, "cpu", chunk)
        adamw = AdamW(cfg, torch.device("cpu"), n)
        state = [master.clone(), adamw.zeros(2 * n), adamw.zeros(2 * n)]
        for step in (1, 2):
            begin(adamw, step)
            for lo in (0, n):  # two pieces of one tensor: the second's noise continues
                w, m, v = (t[lo : lo + n] for t in state)
                noise = [NoiseSegment(0, n, 7, lo)]
                adamw.update(w, grads[lo : lo + n], m, v, [(0, n // 2)], lr=1e-3, noise=noise)
        results.append((adamw.chunk, state))
    (few, a), (one, b) = results
    assert few < n <= one
    for mine, theirs in zip(a, b, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_noise_and_a_bf16_update_are_the_same_on_cuda():
    seed = noise_seed(3, 0)
    for start in (0, 5 << 30):
        cpu, gpu = _noise(start, 1 << 20, seed), _noise(start, 1 << 20, seed, "cuda")
        assert torch.equal(gpu.cpu(), cpu)
    n = 1 << 20  # a bf16-state update on the GPU rounds as the CPU's does
    generator = torch.Generator().manual_seed(0)
    master, grads = (torch.randn(n, generator=generator) for _ in range(2))
    results = []
    for device in ("cpu", "cuda"):
        adamw = AdamW(OptimConfig(state_dtype="bf16"), torch.device(device), n)
        state = [master.to(device, copy=True), adamw.zeros(n), adamw.zeros(n)]
        for step in (1, 2, 3):
            begin(adamw, step)
            noise = [NoiseSegment(0, n, 7, 0)]
            adamw.update(*state[:1], grads.to(device), *state[1:], [(0, n // 2)], 1e-3, noise)
        results.append([t.cpu().float() for t in state])
    (cpu_master, *cpu_moments), (gpu_master, *gpu_moments) = results
    # The kernels differ in last bits: a moment rarely rounds the other way (by one ulp), and
    # its next step moves the master weight by ~1 % of lr more or less.
    assert (gpu_master - cpu_master).abs().max().item() < 3e-5
    for mine, theirs in zip(gpu_moments, cpu_moments, strict=True):
        assert (mine == theirs).double().mean().item() > 0.999
        assert torch.allclose(mine, theirs, rtol=2**-7, atol=0)


def test_stochastic_rounding_is_unbiased_and_lands_on_the_neighbours():
    value = 1.0 + 2**-10  # 1/8 of the way from 1 to the next bf16 number, 1 + 2^-7
    x = torch.full((200_000,), value)
    noise = _noise(0, x.numel(), noise_seed(1, 0))
    rounded = stochastic_round_(x.clone(), noise)
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # exact in bf16
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert rounded.mean().item() == pytest.approx(value, abs=3 * 2**-7 * 0.33 / 200_000**0.5)


def test_second_moment_keeps_decaying_where_rounding_to_nearest_freezes():
    """beta2 = 0.999 with zero gradients: v shrinks by 0.1 % a step, under half of bf16's
    spacing; rounded to nearest it never moves, rounded stochastically it decays on average."""
    cfg = OptimConfig(beta2=0.999, state_dtype="bf16", weight_decay=0.0)
    n, steps = 4096, 200
    adamw = AdamW(cfg, torch.device("cpu"), n)
    master, grads = torch.zeros(n), torch.zeros(n)
    exp_avg, exp_avg_sq = adamw.zeros(n), adamw.zeros(n).fill_(1.0)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    for step in range(1, steps + 1):
        begin(adamw, step)
        adamw.update(master, grads, exp_avg, exp_avg_sq, [], 1e-3, [NoiseSegment(0, n, 7, 0)])
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


def test_a_piece_draws_each_tensors_noise_in_one_hash():
    """A piece of three tensors' elements and padding, in chunks that cut the segments: each
    segment's noise is `rounding_noise` of its tensor from its index on (the padding's is any),
    whatever the chunk."""
    segments = [NoiseSegment(0, 700, 11, 300), NoiseSegment(700, 701, 12, 0)]
    segments += [NoiseSegment(705, 2000, 13, 40)]  # elements 701-704: padding
    adamw = AdamW(OptimConfig(state_dtype="bf16"), torch.device("cpu"), 2000)
    begin(adamw, 9)
    for chunk in (2000, 333):
        pieces = []
        for lo in range(0, 2000, chunk):
            hi = min(lo + chunk, 2000)
            out, work = (torch.empty(hi - lo, dtype=torch.int32) for _ in range(2))
            pieces.append(adamw._noise(segments, lo, hi, out, work))
        noise = torch.cat(pieces)
        for segment in segments:
            expected = _noise(
                segment.index, segment.hi - segment.lo, noise_seed(9, segment.tensor_key)
            )
            assert torch.equal(noise[segment.lo : segment.hi], expected), (chunk, segment)


@pytest.mark.parametrize("split", [0, 1, None])
def test_a_tp_piece_draws_the_noise_of_its_elements_in_the_global_tensor(split):
    """Rank r of tp 3 holding its piece of a (6, 9) tensor (split rows, split columns or
    replicated), from element 4 on (as a ZeRO shard begins mid-piece), in chunks that cut its
    runs of columns: each element's noise is the whole tensor's at that element."""
    meta = ParamMeta((6, 9), normal_init(1.0), tp_split_dim=split)
    adamw = AdamW(OptimConfig(state_dtype="bf16"), torch.device("cpu"), 54)
    begin(adamw, 5)

    def noise(segment: NoiseSegment, numel: int, chunk: int) -> torch.Tensor:
        pieces = []
        for lo in range(0, numel, chunk):
            hi = min(lo + chunk, numel)
            out, work = (torch.empty(hi - lo, dtype=torch.int32) for _ in range(2))
            pieces.append(adamw._noise([segment], lo, hi, out, work))
        return torch.cat(pieces)

    whole = noise(NoiseSegment(0, 54, 7, 0), 54, 54).view(6, 9)
    for rank in range(3):
        expected = whole if split is None else whole.chunk(3, dim=split)[rank]
        expected = expected.flatten()[4:]
        piece = NoiseSegment(0, len(expected), 7, 4, meta.piece_in_global(rank, 3))
        for chunk in (len(expected), 5):
            assert torch.equal(noise(piece, len(expected), chunk), expected), (rank, chunk)
