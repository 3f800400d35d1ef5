"""`megalite plan`: proposals validate, fit, come sorted and run as printed; the throughput
model's pipeline extrapolation, link choice and shared-core CPU bound behave as documented."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import shlex

import pytest
from megalite.models.partition import stage_costs

from megalite.cli import main
from megalite.commands.plan import machine_from_args, parse_memory
from megalite.config import ConfigError, config_to_dict, load_config
from megalite.profiling import throughput
from megalite.profiling.plan import PlanError, estimated_peak_bytes, layouts, plan, validated
from megalite.profiling.throughput import pipeline_makespan, predict

# (config, device, devices, nodes, memory per device); peaks are given, so nothing is measured
CASES = [
    ("configs/llama-7b.yaml", "cuda", 64, 8, "80GB"),
    ("configs/gpt2-124m.yaml", "cuda", 8, 1, "24GB"),
    ("configs/llama-tiny.yaml", "cuda", 4, 1, "16GiB"),
    ("configs/gpt-tiny.yaml", "cpu", 8, 1, "2GB"),
]


def machine(device: str, gpus: int, nodes: int = 1, memory: str | None = None, **options):
    args = argparse.Namespace(
        gpus=gpus,
        nodes=nodes,
        device=device,
        gpu_memory=memory,
        mfu_fraction=None,
        intra_node_gbps=None,
        inter_node_gbps=None,
        peak_tflops=0.05 if device == "cpu" else 989.0,
    )
    for key, value in options.items():
        setattr(args, key, value)
    return machine_from_args(args, load_config(None))


@functools.cache
def proposals(path: str, device: str, gpus: int, nodes: int, memory: str):
    hardware = machine(device, gpus, nodes, memory)
    return hardware, plan(path, [], load_config(path), hardware, top=4)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_proposals_validate_fit_sort_and_run_as_printed(case):
    path, device, gpus, nodes, _ = case
    hardware, found = proposals(*case)
    assert found
    times = [p.prediction.step_s for p in found]
    assert times == sorted(times)
    for proposal in found:
        words = shlex.split(proposal.command)
        assert words[0] == "torchrun" and words[words.index("-m") + 1 :][:2] == [
            "megalite",
            "train",
        ]
        launched = int(next(w for w in words if w.startswith("--nproc-per-node=")).split("=")[1])
        assert launched * nodes == gpus
        config_at = words.index("--config")
        assert words[config_at + 1] == path
        parsed = load_config(path, words[config_at + 2 :])  # what `megalite train` would run
        assert config_to_dict(parsed) == config_to_dict(proposal.config)
        assert parsed.layout_for_world(gpus) == (proposal.dp, proposal.microbatches)
        assert proposal.peak_bytes == estimated_peak_bytes(parsed, hardware)
        assert proposal.peak_bytes <= hardware.memory_bytes
        assert proposal.reasons


def test_validation_is_the_command_lines():
    """Every enumerated layout is accepted by the planner exactly when `load_config` with its
    overrides and `layout_for_world` accept it (the planner never proposes a rejected one)."""
    path, world = "configs/gpt-tiny.yaml", 8
    base = load_config(path)
    accepted = 0
    for layout in dict.fromkeys(layouts(base, world)):
        found = validated(base, layout, world, "cpu")
        chosen = found[0] if found else layout
        try:
            load_config(path, chosen.settings(base, "cpu")).layout_for_world(world)
            ok = True
        except ConfigError:
            ok = False
        assert ok == (found is not None), layout
        accepted += ok
    assert 10 < accepted  # and some are rejected: tp 8 does not divide 4 heads
    assert validated(base, dataclasses.replace(layout, tp=8, pp=1), world, "cpu") is None


def test_recompute_only_when_it_is_what_fits():
    path = "configs/gpt2-124m.yaml"
    base = load_config(path)
    hardware = machine("cuda", 1, memory="4GB")  # GPT-2 124M, seq 1024, on one small GPU
    found = plan(path, [], base, hardware, top=3)
    assert any(p.layout.recompute != "none" for p in found)
    for proposal in found:
        if proposal.layout.recompute == "none":
            continue
        assert f"needs {proposal.layout.recompute} recompute to fit" in proposal.reasons
        lighter = dataclasses.replace(proposal.layout, recompute="none")
        plain = load_config(path, lighter.settings(base, "cuda"))
        assert estimated_peak_bytes(plain, hardware) > hardware.memory_bytes


def test_bad_input_is_one_clear_error(capsys):
    assert parse_memory("80GB") == 80e9 and parse_memory("80 GiB") == 80 * 2**30
    assert parse_memory("512mb") == 512e6
    for bad in ("eighty", "80XB", "-1GB", "0GB"):
        with pytest.raises(PlanError, match="not a memory size"):
            parse_memory(bad)
    code = main(["plan", "--config", "configs/gpt-tiny.yaml", "--gpus", "8", "--gpu-memory", "x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --gpu-memory 'x'") and err.count("\n") == 1
    base = load_config("configs/gpt-tiny.yaml")
    with pytest.raises(PlanError, match="no layout of this config validates on 7 ranks"):
        plan("configs/gpt-tiny.yaml", [], base, machine("cuda", 7, memory="80GB"))
    llama = load_config("configs/llama-tiny.yaml")
    with pytest.raises(PlanError, match="no layout fits in .* on 2 devices: the smallest"):
        plan("configs/llama-tiny.yaml", [], llama, machine("cuda", 2, memory="100MB"))
    with pytest.raises(PlanError, match="--nodes 3 must divide --gpus 8"):
        machine("cuda", 8, nodes=3, memory="80GB")


def test_long_pipelines_extrapolate_the_simulation(monkeypatch):
    cfg = load_config(
        "configs/gpt-tiny.yaml",
        ["model.n_layers=16", "parallel.pp=4", "parallel.vpp=2", "parallel.schedule=interleaved"],
    )
    costs = stage_costs(cfg)
    forward, backward = [c.forward for c in costs], [c.backward for c in costs]
    short = pipeline_makespan(cfg, 32, forward, backward)
    monkeypatch.setattr(throughput, "_simulated_microbatches", lambda cfg, m: m)
    full = pipeline_makespan(cfg, 32, forward, backward)
    assert short[0] == pytest.approx(full[0], rel=0.01)
    assert short[1] == pytest.approx(full[1], abs=0.01)


def test_the_command_shows_its_progress_then_the_table(capsys):
    """`megalite plan` takes seconds for long sequences on many devices: each pass shows a bar
    on stderr (every layout predicted; the fastest checked for memory until --top fit), and
    stdout holds only the table and the commands."""
    code = main(["plan", "--config", "configs/gpt-tiny.yaml", "--gpus", "8", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith("8 CPU ranks on 1 node(s)")
    assert out.count("torchrun ") == 5
    predicted = re.findall(r"predicting layouts: 100%\S* (\d+)/(\d+)", err)
    assert predicted and predicted[-1][0] == predicted[-1][1]
    checked = re.findall(r"checking memory, fastest first: (\d+)layout", err)
    assert checked and int(checked[-1]) >= 5


def test_links_and_shared_cores():
    layout = ["parallel.tp=4", "parallel.sp=true", "train.micro_batch_size=1"]
    cfg = load_config("configs/gpt2-124m.yaml", [*layout, "train.global_batch_size=64"])
    one_node = predict(cfg, machine("cuda", 64, nodes=8, memory="80GB"))
    split = predict(cfg, machine("cuda", 64, nodes=32, memory="80GB"))  # tp 4 spans 2 nodes
    assert split.tp_comm_s > 5 * one_node.tp_comm_s and split.step_s > one_node.step_s
    # nodes of 6 GPUs: tp 4 fits a node's size, yet ranks 4-7 straddle nodes 0 and 1
    six = machine("cuda", 12, nodes=2, memory="80GB")
    same_share = [*layout, "train.global_batch_size=12"]  # 4 micro-batches per rank, as above
    straddling = predict(load_config("configs/gpt2-124m.yaml", same_share), six)
    assert straddling.tp_comm_s > 5 * one_node.tp_comm_s
    assert not six.within_node(4) and six.within_node(3) and six.within_node(6)

    # 8 CPU ranks on fewer cores: a pipeline's idle ranks lend their cores, so on a machine of
    # its own pp costs no bubble there (on a busy one, the share not lent), while on GPUs it does
    tiny = ["train.micro_batch_size=1", "parallel.zero=1"]
    dp = load_config("configs/gpt-tiny.yaml", tiny)
    pp = load_config("configs/gpt-tiny.yaml", [*tiny, "parallel.pp=4"])
    cpu = dataclasses.replace(machine("cpu", 8, memory="1GB"), cores=2, bubble_lent=1.0)
    assert predict(pp, cpu).cpu_bound and predict(pp, cpu).bubble > 0.3
    assert predict(pp, cpu).step_s <= predict(dp, cpu).step_s  # less dp traffic, no bubble
    busy = dataclasses.replace(cpu, bubble_lent=0.5)
    lost = predict(pp, busy).step_s / predict(pp, cpu).step_s - 1
    assert lost == pytest.approx(0.5 * predict(pp, cpu).bubble, rel=0.05)
    gpu = machine("cuda", 8, memory="80GB")
    assert predict(pp, gpu).step_s > 1.3 * predict(dp, gpu).step_s


def test_zero_bubble_schedules_rank_against_1f1b_and_interleaved():
    """Each schedule's bubble comes from the simulator with the stages' F, B and W FLOPs:
    llama-7b on 64 GPUs as tp 8 x pp 8 with 16 micro-batches, stages balanced, ZB-H1 idles
    less than 1F1B and ZB-V least; the planner enumerates all four."""
    gpu = machine("cuda", 64, 8, "80GB")
    overrides = ["parallel.tp=8", "parallel.pp=8", "train.micro_batch_size=1"]
    overrides += ["train.global_batch_size=16"]
    predicted = {}
    for schedule, vpp in [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zb-v", 2)]:
        layout = [*overrides, f"parallel.schedule={schedule}", f"parallel.vpp={vpp}"]
        predicted[schedule] = predict(load_config("configs/llama-7b.yaml", layout), gpu)
    order = sorted(predicted, key=lambda k: predicted[k].step_s, reverse=True)
    assert order == ["1f1b", "zb-h1", "interleaved", "zb-v"]
    assert predicted["zb-h1"].bubble < 0.75 * predicted["1f1b"].bubble
    assert predicted["zb-v"].bubble < predicted["interleaved"].bubble
    found = {layout.schedule for layout in layouts(load_config("configs/llama-7b.yaml"), 64)}
    assert found == {"1f1b", "zb-h1", "interleaved", "zb-v"}


def test_bubble_is_idle_over_compute_as_the_metrics_report_it():
    """The reasons state the pipeline bubble as training's `bubble_fraction` and `megalite
    profile` do, idle time relative to compute: (pp - 1) / m, 1.00 for pp 2 with one
    micro-batch (whatever the stages cost, each rank idles while the other computes), not the
    idle share of the step (0.50)."""
    hardware = machine("cuda", 2, memory="80GB")
    cfg = load_config("configs/gpt-tiny.yaml", ["parallel.pp=2", "train.micro_batch_size=8"])
    (proposal,) = [
        p
        for p in plan("configs/gpt-tiny.yaml", [], cfg, hardware, top=100)
        if p.layout.pp == 2 and p.microbatches == 1 and p.layout.schedule == "1f1b"
    ][:1]
    assert "bubble 1.00 of compute" in proposal.reasons


def test_zero3_is_planned_and_fits_where_zero2_does_not():
    """llama-7b as dp 8 alone (full recompute) on 40 GB devices: ZeRO-2's 16-bit parameters
    whole on every rank do not fit, ZeRO-3's shard does; the planner enumerates zero 3, and its
    model charges the two gathers of every micro-batch (more collectives than zero 2's)."""
    hardware = machine("cuda", 8, 1, "40GB")
    dp_only = [
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.vpp=1",
        "parallel.schedule=1f1b",
        "parallel.sp=false",
        "train.micro_batch_size=1",
        "train.recompute=full",
        "train.global_batch_size=64",
    ]
    by_zero = {
        z: load_config("configs/llama-7b.yaml", [*dp_only, f"parallel.zero={z}"]) for z in (2, 3)
    }
    assert estimated_peak_bytes(by_zero[2], hardware) > hardware.memory_bytes
    assert estimated_peak_bytes(by_zero[3], hardware) < hardware.memory_bytes
    two, three = (predict(by_zero[z], hardware) for z in (2, 3))
    assert three.latency_s > two.latency_s and three.step_s > two.step_s
    base = load_config("configs/llama-7b.yaml")
    assert any(layout.zero == 3 for layout in layouts(base, 8))
