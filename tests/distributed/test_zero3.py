"""ZeRO-3 (sharded 16-bit parameters, gathered unit by unit): equivalence with the single process
at dp 4, tp 2 + SP x dp 2, pp 2 x dp 2 (1f1b, interleaved, zb-v), cp 2 x dp 2 and ep 2 x dp 2
(mixtral), with each recompute policy, optimizer offload, evaluation and a compiled step; float8
bit for bit as zero 2 computes it; checkpoints saved at zero 3 resumed at zero 1 and zero 0, and
one saved at zero 1 resumed at zero 3, with the uninterrupted run's losses; and what a rank
holds: between steps its owned shard of the parameters alone (1/dp of the buckets, as the
estimate counts it), while a block computes its own parameters and the next block's on their
way, each bucket gathered once for the forward and once again for the backward of every
micro-batch, and the most it holds gathered at once as the estimate counts it."""

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from equivalence import (
    EVAL,
    SAVE_AT_5,
    TINY,
    assert_equals_reference,
    assert_same_losses,
    assert_same_val_losses,
    read_run,
    reference,
    relative_error,
    rewind_to_step_5,
    train_each,
)

from megalite import comm
from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.parallel_state import build_parallel_state
from megalite.profiling.estimate import estimate_layout, zero_paper_bytes
from megalite.profiling.memory import SavedActivationTracker, live_bytes
from megalite.training.setup import build_run
from megalite.training.step import train_step

GPT = ("model.arch=gpt",)
LLAMA = ("model.arch=llama", "model.n_kv_heads=2")
MIXTRAL = ("model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4", "model.ffn_hidden=96")
ZERO3 = ("parallel.zero=3",)
PP2 = ("parallel.pp=2",)
VPP2 = ("parallel.pp=2", "parallel.vpp=2")
KEPT = ("parallel.reshard_after_forward=false",)
LAYOUTS = {
    "dp4-eval": ((*LLAMA, *EVAL), ()),
    "tp2-sp-dp2-offload": (GPT, ("parallel.tp=2", "parallel.sp=true", "optim.offload=cpu")),
    "pp2-dp2-selective": (GPT, (*PP2, "train.recompute=selective")),
    "pp2-vpp2-interleaved-full": (
        GPT,
        (*VPP2, "parallel.schedule=interleaved", "train.recompute=full"),
    ),
    "pp2-vpp2-zb-v": (GPT, (*VPP2, "parallel.schedule=zb-v")),
    "pp2-dp2-kept": (LLAMA, (*PP2, *KEPT)),
    "pp2-vpp2-interleaved-kept": (GPT, (*VPP2, "parallel.schedule=interleaved", *KEPT)),
    "cp2-dp2-segments": (LLAMA, ("parallel.cp=2", "train.recompute=segments")),
    "mixtral-ep2-dp2": (MIXTRAL, ("parallel.ep=2",)),
}
"""4 ranks each, at zero 3: (model, layout)."""
NORM_RTOL = {"mixtral-ep2-dp2": 1e-4}
"""Top-k routing ties move the gradient norm by ~1e-5 (`test_moe.NORM_RTOL`)."""


def _train_runs(world: int, runs: dict[str, tuple[str, ...]], root: Path) -> dict[str, Path]:
    """Each run trained on `world` ranks, one after the other in one launch: its directory."""
    dirs = {name: root / name for name in runs}
    run_ranks(world, train_each, [(runs[n], str(dirs[n])) for n in runs], timeout=600)
    return dirs


@pytest.fixture(scope="module")
def layouts(builtin_corpus, tmp_path_factory) -> dict[str, Path]:
    """Every layout of LAYOUTS trained, in one launch."""
    runs = {name: TINY + model + ZERO3 + layout for name, (model, layout) in LAYOUTS.items()}
    return _train_runs(4, runs, tmp_path_factory.mktemp("zero3"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_zero3_matches_single_process(layouts, name):
    model = LAYOUTS[name][0]
    losses, weights = read_run(layouts[name])
    assert_equals_reference(model, losses, weights, norm_rtol=NORM_RTOL.get(name))
    if EVAL[0] in model:
        assert_same_val_losses(model, layouts[name])


def test_a_compiled_zero3_step_matches_and_never_recompiles(builtin_corpus, tmp_path):
    """The unit hooks run eagerly around each compiled block (graph breaks at its ends)."""
    (out_dir,) = _train_runs(
        4, {"compiled": TINY + GPT + ZERO3 + ("train.compile=true",)}, tmp_path
    ).values()
    losses, weights = read_run(out_dir)
    assert_equals_reference(GPT, losses, weights)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["recompiles"] for row in rows] == [0] * len(rows)


def test_float8_at_zero3_is_zero2_bit_for_bit(builtin_corpus, tmp_path):
    """Sharding the parameters changes no value float8 casts: the same layout at zero 2 and 3
    gives the same losses and weights, exactly (the gradient norm, a float64 sum over other
    bucket cuts, to rounding)."""
    fp8 = (
        *TINY,
        *GPT,
        "train.fp8=tensorwise",
        "train.fp8_min_dim=0",
        "parallel.tp=2",
        "parallel.sp=true",
    )
    dirs = _train_runs(4, {z: (*fp8, f"parallel.zero={z}") for z in ("2", "3")}, tmp_path)
    (losses2, weights2), (losses3, weights3) = read_run(dirs["2"]), read_run(dirs["3"])
    assert [loss for loss, _ in losses3] == [loss for loss, _ in losses2]
    assert_same_losses(losses3, losses2, rtol=1e-12)  # the norm: summed in other buckets
    assert all(relative_error(weights3[k], weights2[k]) == 0 for k in weights2)


def test_checkpoints_resume_across_zero_levels(builtin_corpus, tmp_path):
    """Steps 1-5 at zero 3 on dp 4, steps 6-10 from its step-5 checkpoint at zero 1, at zero 0
    and at zero 3 on tp 2 x dp 2; steps 1-5 at zero 1, 6-10 at zero 3: the single process's
    losses, each."""
    saved = {3: tmp_path / "zero3", 1: tmp_path / "zero1"}
    first = [(TINY + GPT + SAVE_AT_5 + (f"parallel.zero={z}",), str(d)) for z, d in saved.items()]
    run_ranks(4, train_each, first, timeout=300)
    for directory in saved.values():
        rewind_to_step_5(directory)
    resumes = {
        "3->1": (saved[3], ("parallel.zero=1",)),
        "3->0": (tmp_path / "zero3-at-zero0", ("parallel.zero=0",)),
        "3->3 tp2": (tmp_path / "zero3-at-tp2", (*ZERO3, "parallel.tp=2", "parallel.sp=true")),
        "1->3": (saved[1], ZERO3),
    }
    for directory, _ in list(resumes.values())[1:3]:
        shutil.copytree(saved[3], directory)
    runs = [(TINY + GPT + SAVE_AT_5 + layout, str(d)) for d, layout in resumes.values()]
    run_ranks(4, train_each, runs, timeout=300)
    ref_losses, _ = reference(TINY + GPT)
    for name, (directory, _) in resumes.items():
        losses, _ = read_run(directory)
        assert len(losses) == 5, name
        assert_same_losses(losses, ref_losses[5:])


def _step_config():
    return load_config(None, [*TINY, *LLAMA, *ZERO3, "train.global_batch_size=16"])


def _units_during_a_step(_) -> dict:
    """One step of 2 micro-batches at zero 3 on dp 4, recording which blocks' buckets are
    gathered (and which still arriving) as each block's forward and backward starts, every
    all-gather issued, and the parameter bytes resident before and after."""
    run = build_run(_step_config(), build_parallel_state(1, 1, torch.device("cpu")))
    (buffer,) = run.buffers
    blocks = list(run.chunks[0].layers.values())
    buckets = [
        {id(buffer.bucket_of[p]): buffer.bucket_of[p] for p in b.parameters()} for b in blocks
    ]
    index_of = {id(bucket): i for i, bucket in enumerate(buffer.buckets)}
    seen: list[tuple] = []

    def state(phase: str, layer: int) -> None:
        gathered = [
            i for i, bs in enumerate(buckets) if all(buffer.is_gathered(b) for b in bs.values())
        ]
        arriving = [
            i for i, bs in enumerate(buckets) if any(b.gather is not None for b in bs.values())
        ]
        seen.append((phase, layer, gathered, arriving))

    def on_output(layer: int, _module, _args, output) -> None:
        if torch.is_grad_enabled():
            output.register_hook(lambda _grad: state("backward", layer))

    for layer, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, layer=layer: state("forward", layer))
        block.register_forward_hook(functools.partial(on_output, layer))
    issued: list[int] = []
    real_gather = comm.all_gather_flat

    def gather(output, shard, group, async_op=False):
        issued.append(index_of[next(id(b) for b in buffer.buckets if b.full is output)])
        return real_gather(output, shard, group, async_op)

    comm.all_gather_flat = gather
    before = live_bytes(run)["params"]
    try:
        torch.manual_seed(run.ps.coord("dp"))
        train_step(run, torch.randint(0, 500, (4, 33)), 1e-3)
    finally:
        comm.all_gather_flat = real_gather
    return {
        "live": live_bytes(run),
        "before": before,
        "after": live_bytes(run)["params"],
        "padded": sum(b.numel for b in buffer.buckets) * buffer.params_owned.element_size(),
        "model": sum(p.numel() * p.element_size() for p in run.names),
        "gathered after": [i for i, b in enumerate(buffer.buckets) if buffer.is_gathered(b)],
        "buckets": len(buffer.buckets),
        "issued": issued,
        "seen": seen,
    }


def test_a_rank_holds_its_shard_and_the_blocks_it_computes():
    """Between steps a rank's 16-bit parameters are its owned shard: 1/dp of the (padded)
    buckets, as the estimate counts them (gradients and optimizer state too). While block k
    computes, its buckets are gathered and block k+1's arriving (prefetched), earlier blocks
    released; its backward gathers it again and prefetches block k-1. Every bucket is gathered
    exactly twice per micro-batch (forward, backward)."""
    per_rank = run_ranks(4, _units_during_a_step, None, timeout=240)
    stage = estimate_layout(_step_config(), 4, device="cpu").stages[0]
    for seen in per_rank:
        assert seen["before"] == seen["after"] == seen["padded"] // 4
        for part, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer",) * 2):
            assert seen["live"][part] == stage.part(name), part  # as `megalite estimate` says
        assert seen["after"] < seen["model"] / 2
        assert seen["gathered after"] == []
        forward_order = list(reversed(range(seen["buckets"])))  # buckets lie in backward order
        assert seen["issued"] == (forward_order + forward_order[::-1]) * 2  # 2 micro-batches
        layers = 4
        for phase, layer, gathered, arriving in seen["seen"]:
            if phase == "forward":
                assert gathered == [layer] + ([layer + 1] if layer + 1 < layers else [])
                assert arriving == ([layer + 1] if layer + 1 < layers else []), (phase, layer)
            else:
                # the later blocks went as their last gradients arrived
                assert gathered == ([layer - 1] if layer > 0 else []) + [layer], (phase, layer)
                assert arriving == ([layer - 1] if layer > 0 else []), (phase, layer)
        phases = [(phase, layer) for phase, layer, *_ in seen["seen"]]
        one_micro_batch = [("forward", i) for i in range(4)] + [
            ("backward", i) for i in (3, 2, 1, 0)
        ]
        assert phases == one_micro_batch * 2


GATHER_LAYOUTS = [
    GPT,
    (*GPT, "parallel.tp=2", "parallel.sp=true"),
    (*LLAMA, "parallel.pp=2"),
    (*LLAMA, "parallel.pp=2", *KEPT),
    (*GPT, *VPP2, "parallel.schedule=interleaved", *KEPT),
]


def _gather_config(layout: tuple[str, ...]):
    return load_config(None, [*TINY, *layout, *ZERO3, "train.global_batch_size=16"])


def _gathered_peak(layout: tuple[str, ...]) -> tuple[int, int]:
    """(pp rank, most bytes of full parameters gathered at once) over one step of `layout`:
    residency grows only at a gather, so its peak is right after one."""
    cfg = _gather_config(layout)
    ps = build_parallel_state(cfg.parallel.tp, cfg.parallel.pp, torch.device("cpu"))
    run = build_run(cfg, ps)
    peak = 0
    real_gather = comm.all_gather_flat

    def gather(output, shard, group, async_op=False):
        nonlocal peak
        handle = real_gather(output, shard, group, async_op)
        gathered = [t for buffer in run.buffers for t in buffer.param_tensors()[1:]]
        peak = max(peak, sum(t.untyped_storage().nbytes() for t in gathered))
        return handle

    comm.all_gather_flat = gather
    try:
        torch.manual_seed(ps.coord("dp"))
        train_step(run, torch.randint(0, 500, (16 // ps.size("dp"), 33)), 1e-3)
    finally:
        comm.all_gather_flat = real_gather
    return ps.coord("pp"), peak


def _gathered_peaks(_) -> list[tuple[int, int]]:
    return [_gathered_peak(layout) for layout in GATHER_LAYOUTS]


def test_the_estimate_counts_what_is_gathered_at_once():
    """`megalite estimate`'s "parameter gathers" is the most a rank holds gathered in a step:
    the unit computing and the one arriving, the chunk's own (GPT's wpe) and, at pp 1, GPT's tied
    embedding from its forward to the head's and from the head's backward on; kept for the
    step, every chunk's parameters on the rank."""
    per_rank = run_ranks(4, _gathered_peaks, None, timeout=240)
    for i, layout in enumerate(GATHER_LAYOUTS):
        stages = estimate_layout(_gather_config(layout), 4, device="cpu").stages
        for rank, results in enumerate(per_rank):
            pp_rank, peak = results[i]
            assert peak == stages[pp_rank].part("parameter gathers"), (layout, rank)


def test_zero_paper_figure_for_its_7_5b_example():
    """Rajbhandari et al. (2020): 7.5B parameters on 64 GPUs under P_os+g+p, 16 bytes per
    parameter over 64: 1.9 GB (1.875)."""
    assert zero_paper_bytes(7.5e9, 64, 3) == pytest.approx(1.875e9, rel=1e-12)


def _step_bytes(_) -> dict[tuple[int | str, int], dict[str, int]]:
    """Bytes of each kind of collective (of the full tensors) in a steady step at dp 4, by
    (zero stage, micro-batches per rank); zero 3 keeping its gathers for the step: "3 kept"."""
    found = {}
    for micro_batches in (1, 2):
        for zero in (1, 3, "3 kept"):
            batch = ("train.micro_batch_size=2", f"train.global_batch_size={8 * micro_batches}")
            stage = ("parallel.zero=3", *KEPT) if zero == "3 kept" else (f"parallel.zero={zero}",)
            cfg = load_config(None, [*TINY, *GPT, *batch, *stage])
            run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu")))
            tokens = torch.randint(0, 500, (2 * micro_batches, cfg.model.seq_len + 1))
            train_step(run, tokens, 1e-3)  # the first step's gathers are set-up's
            with comm.record_collectives() as log:
                train_step(run, tokens, 1e-3)
                run.optimizer.finish_param_gather()
            kinds: dict[str, int] = {}
            for record in log:
                kinds[record.op] = kinds.get(record.op, 0) + record.bytes
            found[zero, micro_batches] = kinds
    return found


def test_zero3_communicates_one_and_a_half_times_zero1():
    """The ZeRO paper's count: ZeRO-1 reduce-scatters the gradients and all-gathers the
    parameters once a step (2 Psi); ZeRO-3 gathers the parameters for the forward and again for
    the backward (3 Psi), 1.5x. That holds for one micro-batch per rank; with m, ZeRO-3 gathers
    and reduce-scatters per micro-batch, 3m Psi, and ZeRO-1 still 2 Psi."""
    found = run_ranks(4, _step_bytes, None)[0]
    one, three = found[1, 1], found[3, 1]
    psi = one["reduce_scatter"]
    assert one["all_gather"] == psi and three["all_gather"] == 2 * psi
    assert three["reduce_scatter"] == psi
    dp_bytes = {
        zero: found[zero, 1]["all_gather"] + found[zero, 1]["reduce_scatter"] for zero in (1, 3)
    }
    assert dp_bytes[3] / dp_bytes[1] == pytest.approx(1.5, rel=1e-9)
    assert found[1, 2]["all_gather"] + found[1, 2]["reduce_scatter"] == 2 * psi
    assert found[3, 2]["all_gather"] + found[3, 2]["reduce_scatter"] == 6 * psi


def test_zero3_kept_for_the_step_gathers_once():
    """parallel.reshard_after_forward=false: each bucket is gathered once a step, however many
    micro-batches (Psi), and still reduce-scattered per micro-batch (ZeRO-2's policy)."""
    found = run_ranks(4, _step_bytes, None)[0]
    psi = found[1, 1]["reduce_scatter"]
    for micro_batches in (1, 2):
        kept = found["3 kept", micro_batches]
        assert kept["all_gather"] == psi
        assert kept["reduce_scatter"] == micro_batches * psi


GPT2_124M_WIDTHS = (
    "model.n_layers=2",  # GPT-2 124M's width, heads and 50257-token vocabulary; 2 of its layers
    "model.seq_len=64",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "train.precision=bf16",
    *ZERO3,
)


def _model_states(_) -> dict[str, int]:
    cfg = load_config("configs/gpt2-124m.yaml", list(GPT2_124M_WIDTHS))
    run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu")))
    train_step(run, torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len + 1)), 1e-4)
    return live_bytes(run)


def test_model_states_at_gpt2_widths_are_the_estimate_and_the_zero_paper():
    """Measured on each of dp 4 ranks after a step, bf16: the parameters, gradients and
    optimizer state are `megalite estimate`'s to the byte, and their sum is the ZeRO paper's
    P_os+g+p (2 + 2 + 12) Psi / N_d plus what megalite does differently: its gradients are
    fp32 (4 B, not 2), so 2 Psi / N_d more."""
    cfg = load_config("configs/gpt2-124m.yaml", list(GPT2_124M_WIDTHS))
    stage = estimate_layout(cfg, 4, device="cpu").stages[0]
    psi = stage.parameters  # padded to the buckets' multiples of dp
    for live in run_ranks(4, _model_states, None, timeout=600):
        for part, name in (("params", "parameters"), ("grads", "gradients"), ("optimizer",) * 2):
            assert live[part] == stage.part(name), part
        states = live["params"] + live["grads"] + live["optimizer"]
        assert states == zero_paper_bytes(psi, 4, 3) + 2 * psi / 4


def _saved_peaks(_) -> dict[int, int]:
    """Peak bytes saved for backward over one step, the model's tensors excluded, by zero."""
    peaks = {}
    for zero in (1, 3):
        cfg = load_config(None, [*TINY, *LLAMA, f"parallel.zero={zero}"])
        run = build_run(cfg, build_parallel_state(1, 1, torch.device("cpu")))
        held = [t for chunk in run.chunks for t in (*chunk.parameters(), *chunk.buffers())]
        torch.manual_seed(0)
        with SavedActivationTracker(exclude=held) as saved:
            train_step(run, torch.randint(0, 500, (2, cfg.model.seq_len + 1)), 1e-3)
        peaks[zero] = saved.peak
    return peaks


def test_saved_activations_leave_out_the_gathered_weights():
    """The profiler's count of what autograd keeps excludes the parameters by their storage,
    which at zero 3 is allocated again at a new address for every use: the same bytes as at
    zero 1, no weight among them."""
    for peaks in run_ranks(4, _saved_peaks, None):
        assert peaks[3] == peaks[1] > 0
