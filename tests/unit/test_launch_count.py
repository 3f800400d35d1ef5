"""The counter of what a GPU would wait for (`profiling.launch_count`) on small programs: each
scalar read is a host sync where it was asked for, views and allocations launch nothing, the
reads that dispatch nothing (`tolist`, `torch.tensor` onto the device) count where Python calls
them, a compiled function counts its kernels and graphs and a graph break its reason; and
`megalite profile` reports the counts of a step by phase."""

from pathlib import Path

import torch

from megalite.config import load_config
from megalite.launch import run_ranks
from megalite.profiling.launch_count import counting, graph_breaks, host_step_counts
from megalite.profiling.profile import profile
from megalite.profiling.profile_report import format_table

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "gpt-tiny.yaml")


def _counted(fn, *args, device="cpu", host=()):
    with counting(device, host=host) as tally:
        fn(*args)
    return tally.counts


def _line_of(text: str) -> int:
    """The line of this file that holds `text`."""
    return next(i for i, line in enumerate(open(__file__), 1) if text in line)


def test_each_scalar_read_is_a_sync_where_it_was_asked_for():
    x = torch.randn(8, 8)

    def two_reads():
        total = x.sum().item()
        positive = bool(x.max() > 0)
        return total, positive

    counts = _counted(two_reads)
    assert counts.total.host_syncs == 2
    assert counts.total.launches == 3  # sum, max, gt: the reads themselves launch nothing
    sites = {site.rsplit(":", 1)[1] for site in counts.sync_sites}
    assert sites == {str(_line_of("x.sum().item()")), str(_line_of("bool(x.max()"))}
    assert all(site.startswith("item at ") for site in counts.sync_sites)


def test_views_and_allocations_launch_nothing():
    x = torch.randn(4, 6)

    def views():
        x.view(24).unsqueeze(0).expand(3, 24)
        x.t().transpose(0, 1).reshape(2, 12).detach()
        x[1:3].split(1)
        x.as_strided((2, 2), (1, 1)).unbind()
        torch.empty(5), torch.empty_like(x)

    assert _counted(views).total.launches == 0
    # a copy does launch: a non-contiguous view made contiguous, a fill
    assert _counted(lambda: (x.t().contiguous(), torch.zeros(3))).total.launches == 2


def test_reads_that_dispatch_nothing_count_where_python_calls_them():
    x = torch.randn(6)
    step = torch.tensor(3.0)

    def reads():
        x.tolist()  # one sync, however many elements
        torch.tensor([1.0, 2.0], device="cpu")  # a blocking copy onto the device
        torch.tensor([1.0, 2.0])  # stays on the host: no copy
        x[x > 0]  # a mask's true count sizes the output
        torch.repeat_interleave(torch.arange(3), torch.tensor([1, 2, 3]), output_size=6)
        step.item()  # named a host tensor: no wait for the device

    counts = _counted(reads, host=[step])
    kinds = sorted(site.split(" at ")[0] for site in counts.sync_sites)
    assert kinds == ["copy to device", "output size", "tolist"]
    assert counts.total.host_syncs == 3


def test_host_step_counts_are_those_of_unfused_optimizers():
    model = torch.nn.Linear(3, 2)
    for fused, expected in ((False, 2), (True, 0)):
        optimizer = torch.optim.AdamW(model.parameters(), fused=fused)
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        assert len(host_step_counts(optimizer)) == expected


def test_a_compiled_function_counts_its_kernels_and_its_graph_break():
    import torch._dynamo

    from megalite.profiling.launch_count import kernel_markers

    def pointwise_then_break(x):
        y = (x.sin() * 2).cos()
        torch._dynamo.graph_break()
        return y  # nothing after the break: no second graph to compile

    x = torch.randn(64)
    eager = _counted(pointwise_then_break, x)
    assert eager.total.launches == 3 and eager.total.compiled_kernels == 0  # sin, mul, cos
    breaks = sum(graph_breaks().values())
    with kernel_markers():
        compiled = torch.compile(pointwise_then_break, dynamic=False)
        compiled(x)  # compiles the graph before the break
    counts = _counted(compiled, x)
    assert counts.total.graph_calls == 1
    assert counts.total.compiled_kernels == 1  # the pointwise chain fused into one kernel
    assert counts.total.launches == 1 and counts.total.host_syncs == 0
    assert counts.recompiles == 0
    assert sum(counts.graph_breaks.values()) == breaks + 1
    assert any("graph_break()" in reason for reason in counts.graph_breaks)


def _profile(out_dir: str) -> dict:
    overrides = ["model.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=4"]
    cfg = load_config(CONFIG, [*overrides, f"train.out_dir={out_dir}"])
    return profile(cfg, warmup_steps=1, steps=1)


def test_profile_reports_the_counted_step_by_phase(builtin_corpus_8000, tmp_path):
    [report] = run_ranks(1, _profile, str(tmp_path))
    counts = report["ranks"][0]["counts"]
    launches, syncs = counts["launches"], counts["host_syncs"]
    assert all(launches[phase] > 0 for phase in ("forward", "backward", "optimizer"))
    assert launches["total"] == sum(v for k, v in launches.items() if k != "total")
    assert counts["compiled_kernels"]["total"] == counts["graph_calls"]["total"] == 0  # eager
    assert counts["recompiles"] == 0
    assert syncs["total"] == sum(report["counted_step"]["sync_sites"].values())
    assert report["total"]["launches_per_step"] == launches["total"]
    assert report["total"]["host_syncs_per_step"] == syncs["total"]
    table = format_table(report)
    assert "counted step" in table and "host syncs on rank 0:" in table


def test_counting_for_a_gpu_a_host_tensor_is_no_wait():
    """Counted for a GPU, a CPU tensor is the host's: reading it makes no device wait."""
    counts = _counted(lambda: torch.ones(2).sum().item(), device="cuda")
    assert counts.total.host_syncs == 0 and counts.total.launches == 2
