"""Float8 training (`train.fp8`) in every layout equals the single process's, for both recipes,
with fp32 master weights: tp 2 + SP; pp 2 under zb-h1 (the split backward's deferred weight
GEMMs) with full recompute; cp 2; ep 2 (Mixtral's expert GEMMs); dp 2 with ZeRO-2 (dW staged);
tp 2 + SP x dp 2 with ZeRO-1; tp 2 + SP x pp 2 under zb-v. Each launch trains several runs
one after the other, and the single-process references share one. Float8 visibly changes the
result against fp32, by little. A run saved in float8 resumes without it, and back, as any
run resumes.

Why each step is also held from the layout's own state. A cast to float8 is a step function:
where a value lands within fp32 rounding of the midpoint between two float8 neighbours, a
layout that summed it in another order rounds it the other way, 1/16 (e4m3) or 1/8 (e5m2) of
the value apart. From the same weights that moves a step's loss by far less than 1e-5 (step 1
shows it), but Adam turns the ~1e-7 by which the layouts' fp32 updates differ into weights that
straddle other midpoints, and from step 3 or 4 on a trajectory can drift from the single
process's by ~1e-5 (rowwise with cp 2 or ZeRO-2, MoE routing under tensorwise). So every step
is held to 1e-5 where the single process starts from what the layout had: step 1 from the same
initial weights, and each later step from the layout's checkpoint of the step before (weights,
Adam moments, data position), resumed by the single process for one step; its loss then equals
the layout's within 1e-5 (seen: 2.4e-7 at most), its gradient norm within OWN_STATE_NORM_RTOL.
The trajectories' losses as wholes stay within DRIFT_RTOL. A wrong scale is far outside
either: the linears' scales are held to the single process's in test_fp8_linears.py. Also
here: float8 linears under `train.compile`, and no host sync."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
from equivalence import TINY, train_each
from test_step_syncs import LAYOUTS as SYNC_LAYOUTS
from test_step_syncs import _syncs

from megalite.checkpoint.sharded import step_dir
from megalite.launch import run_ranks

STEPS = 4
FP8 = (f"train.steps={STEPS}", "train.fp8_min_dim=0")
EVERY_STEP = ("checkpoint.interval=1", f"checkpoint.keep={STEPS}")
MIXTRAL = ("model.arch=mixtral", "model.n_kv_heads=2", "model.moe_experts=4", "model.ffn_hidden=96")
RECIPES = ("tensorwise", "rowwise")
DRIFT_RTOL = 1e-4
"""A whole trajectory's loss against the single process's (see the module docstring; seen:
up to 1.6e-5)."""
OWN_STATE_NORM_RTOL = 1e-4
"""The gradient norm from the layout's own state: a flip in the backward's float8 gradients
(1/8 apart in e5m2) moves it where it leaves the loss (seen: 1.2e-5, cp 2 tensorwise; the
rest below 1e-8)."""
TP_SP = ("parallel.tp=2", "parallel.sp=true")
LAYOUTS = {  # name: (ranks, model, layout)
    "tp2-sp": (2, (), TP_SP),
    "pp2-zb-h1-full": (2, (), ("parallel.pp=2", "parallel.schedule=zb-h1", "train.recompute=full")),
    "cp2": (2, (), ("parallel.cp=2",)),
    "mixtral-ep2": (2, MIXTRAL, ("parallel.ep=2",)),
    "dp2-zero2": (2, (), ("parallel.zero=2", "parallel.bucket_mb=0.05")),
    "tp2-sp-dp2-zero1": (4, (), (*TP_SP, "parallel.zero=1")),
    "tp2-sp-pp2-zb-v": (
        4,
        (),
        (*TP_SP, "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-v"),
    ),
}


def _steps(out_dir: Path) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["loss"], row["grad_norm"]) for row in rows]


def _train_runs(world: int, runs: dict[str, tuple[str, ...]]) -> dict[str, list]:
    """(loss, grad norm) per step of each run, trained one after the other in one launch."""
    with tempfile.TemporaryDirectory(prefix="megalite-fp8-") as root:
        dirs = {name: Path(root) / name for name in runs}
        run_ranks(world, train_each, [(runs[n], str(dirs[n])) for n in runs], timeout=600)
        return {name: _steps(dirs[name]) for name in runs}


def _layout_and_resumed(
    world: int, runs: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
) -> dict[str, tuple[list, list]]:
    """Each run (layout overrides, its single process's) trained on `world` ranks with a
    checkpoint after every step, then, in one more launch, the single process resumed from each
    checkpoint but the last for one step: (the layout's steps, the resumed steps 2..STEPS)."""
    with tempfile.TemporaryDirectory(prefix="megalite-fp8-") as root:
        dirs = {name: Path(root) / name for name in runs}
        trained = [((*runs[n][0], *EVERY_STEP), str(dirs[n])) for n in runs]
        run_ranks(world, train_each, trained, timeout=600)
        resumed = {
            (name, step): (
                *runs[name][1],
                f"train.steps={step + 1}",
                f"checkpoint.resume={step_dir(dirs[name] / 'checkpoints', step)}",
            )
            for name in runs
            for step in range(1, STEPS)
        }
        resumed_dirs = {key: Path(root) / f"{key[0]}-from-{key[1]}" for key in resumed}
        run_ranks(1, train_each, [(resumed[k], str(resumed_dirs[k])) for k in resumed])
        return {
            name: (
                _steps(dirs[name]),
                [_steps(resumed_dirs[name, step])[0] for step in range(1, STEPS)],
            )
            for name in runs
        }


def _run(model: tuple[str, ...], recipe: str, layout: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (*TINY, *model, *FP8, f"train.fp8={recipe}", *layout)


@functools.cache
def references() -> dict[tuple[tuple[str, ...], str], list]:
    """The single process of each model, in fp32 and under each recipe: one launch."""
    runs = {(m, r): _run(m, r) for m in ((), MIXTRAL) for r in (*RECIPES, "none")}
    by_name = _train_runs(1, {str(i): overrides for i, overrides in enumerate(runs.values())})
    return {key: by_name[str(i)] for i, key in enumerate(runs)}


@functools.cache
def layouts(world: int) -> dict[tuple[str, str], tuple[list, list]]:
    """Every layout of `world` ranks under each recipe, and the single process resumed from
    each of its steps: two launches."""
    runs = {
        (name, recipe): (_run(model, recipe, layout), _run(model, recipe))
        for name, (ranks, model, layout) in LAYOUTS.items()
        if ranks == world
        for recipe in RECIPES
    }
    by_name = _layout_and_resumed(world, {f"{n}-{r}": both for (n, r), both in runs.items()})
    return {(n, r): by_name[f"{n}-{r}"] for n, r in runs}


def _assert_close(step: tuple, ref: tuple, rtol: float, norm_rtol: float | None, where: str):
    """A step's (loss, grad norm) against another's: the loss within `rtol`, the norm within
    `norm_rtol` (None: not compared)."""
    (loss, norm), (ref_loss, ref_norm) = step, ref
    assert abs(loss - ref_loss) <= rtol * ref_loss, f"{where}: loss {loss} vs {ref_loss}"
    if norm_rtol is not None:
        assert abs(norm - ref_norm) <= norm_rtol * ref_norm, f"{where}: norm {norm} vs {ref_norm}"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_trains_in_float8_as_one_process_does(name, recipe):
    world, model, _ = LAYOUTS[name]
    steps, resumed = layouts(world)[name, recipe]
    reference = references()[model, recipe]
    assert len(steps) == len(reference) == STEPS and len(resumed) == STEPS - 1
    _assert_close(steps[0], reference[0], 1e-5, 1e-5, f"{name} {recipe} step 1")
    for step, (own, single) in enumerate(zip(steps[1:], resumed), 2):
        where = f"{name} {recipe} step {step} from its own state"
        _assert_close(own, single, 1e-5, OWN_STATE_NORM_RTOL, where)
    for step, (own, ref) in enumerate(zip(steps, reference), 1):
        _assert_close(own, ref, DRIFT_RTOL, None, f"{name} {recipe} step {step}")


@pytest.mark.parametrize("model", [(), MIXTRAL], ids=["gpt", "mixtral"])
def test_float8_changes_the_losses_slightly(model):
    """The float8 path is the one trained: its losses differ from fp32's, by little."""
    fp32 = [loss for loss, _ in references()[model, "none"]]
    for recipe in RECIPES:
        fp8 = [loss for loss, _ in references()[model, recipe]]
        gaps = [abs(a - b) / b for a, b in zip(fp8, fp32)]
        assert max(gaps) > 1e-6, (recipe, gaps)
        assert max(gaps) < 1e-3, (recipe, gaps)


def test_float8_checkpoints_resume_with_or_without_float8(tmp_path):
    """A float8 run's checkpoint holds its fp32 master weights and Adam state as any run's:
    resumed in float8 it repeats the uninterrupted run's losses exactly; resumed in fp32 (and
    an fp32 run's in float8) it continues from the same state, so its first step's loss is
    the uninterrupted run's within float8's own change of the loss."""
    base = (*TINY, "train.steps=4", "train.fp8_min_dim=0", "checkpoint.interval=2")

    def run(fp8: str, out_dir: Path, steps: int) -> list[float]:
        overrides = (*base, f"train.steps={steps}", f"train.fp8={fp8}", f"train.out_dir={out_dir}")
        run_ranks(1, train_each, [(overrides, str(out_dir))])
        return [loss for loss, _ in _steps(out_dir)]

    uninterrupted = run("tensorwise", tmp_path / "full", 4)
    for second in ("tensorwise", "none"):
        out = tmp_path / f"tensorwise-then-{second}"
        first = run("tensorwise", out, 2)
        assert first == uninterrupted[:2]
        resumed = run(second, out, 4)[len(first) :]
        if second == "tensorwise":
            assert resumed == uninterrupted[2:]
        else:
            assert resumed[0] == pytest.approx(uninterrupted[2], rel=1e-3)
    out = tmp_path / "none-then-rowwise"
    fp32 = run("none", out, 2)
    resumed = run("rowwise", out, 4)[len(fp32) :]
    reference = run("none", tmp_path / "fp32", 4)
    assert fp32 == reference[:2]
    assert resumed[0] == pytest.approx(reference[2], rel=1e-3)


def test_float8_linears_run_eager_between_compiled_pieces(tmp_path):
    """`train.compile` at tp 1 traces plain linears into each block's graph; float8 ones run
    eagerly between the compiled pieces instead: the same losses as eager, no recompile."""
    runs = {
        compiled: (
            *TINY,
            "train.steps=2",
            *FP8[1:],
            "train.fp8=tensorwise",
            f"train.compile={compiled}",
        )
        for compiled in ("false", "true")
    }
    dirs = {compiled: tmp_path / compiled for compiled in runs}
    run_ranks(1, train_each, [(runs[c], str(dirs[c])) for c in runs], timeout=600)
    rows = [json.loads(line) for line in (dirs["true"] / "metrics.jsonl").read_text().splitlines()]
    assert [row["recompiles"] for row in rows] == [0, 0]
    eager, compiled = (_steps(dirs[c]) for c in runs)
    for (loss, _), (ref, _) in zip(compiled, eager):
        assert loss == pytest.approx(ref, rel=1e-5)


def _syncs_per_recipe(overrides: tuple[str, ...]) -> list[tuple[dict[str, int], int]]:
    return [_syncs((*overrides, "train.fp8_min_dim=0", f"train.fp8={r}")) for r in RECIPES]


@pytest.mark.parametrize("layout", ["tp2-sp", "cp2", "mixtral-capped", "mixtral-ep2"])
def test_float8_adds_no_host_sync(layout):
    """`test_step_syncs`'s count of a steady step's host syncs, under each recipe: none (across
    ep, the exchange's split sizes only, as without float8)."""
    world, _, overrides = SYNC_LAYOUTS[layout]
    for per_recipe in run_ranks(world, _syncs_per_recipe, overrides):
        for sites, moe_calls in per_recipe:
            if "parallel.ep=2" in overrides:
                assert sum(sites.values()) <= moe_calls and moe_calls > 0, sites
                assert all("dispatch.py" in site for site in sites), sites
            else:
                assert sites == {}, sites
