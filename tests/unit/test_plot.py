"""`megalite plot`: PNGs from a real short run's metrics, several runs on one figure, stacked
bars from a profile report, and a clear error for a run with nothing to plot."""

import json
import shutil

import matplotlib.image
import pytest

import megalite.profiling.plot as plot
from megalite.cli import main
from megalite.config import load_config
from megalite.training.loop import train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trained(builtin_corpus, tmp_path_factory):
    """A real 3-step run, evaluated on its last step."""
    prefix, tokenizer = builtin_corpus
    out_dir = tmp_path_factory.mktemp("plot") / "gpt"
    overrides = [
        *("model.n_layers=1", "model.hidden=32", "model.n_heads=2", "model.vocab_size=500"),
        *("model.seq_len=16", "train.micro_batch_size=2", "train.global_batch_size=2"),
        *("train.steps=3", "train.log_interval=1", "train.eval_interval=3", "train.eval_steps=1"),
        *("checkpoint.interval=0", "logging.progress=false"),
        *(f"data.source={prefix}", f"data.tokenizer={tokenizer}"),
        f"train.out_dir={out_dir}",
    ]
    train(load_config(None, overrides))
    return out_dir


@pytest.fixture
def figures(monkeypatch):
    """Every figure saved, by file name."""
    saved = {}
    save = plot._save

    def recording(fig, path):
        saved[path.name] = fig
        return save(fig, path)

    monkeypatch.setattr(plot, "_save", recording)
    return saved


def assert_pngs(paths):
    for path in paths:
        assert path.read_bytes()[:8] == PNG_MAGIC, path
        assert matplotlib.image.imread(path).shape[:2] == (600, 960)  # 8x5 inches at 120 dpi


def labels(fig):
    return fig.axes[0].get_legend_handles_labels()[1]


def test_a_run_is_plotted_where_it_says(trained, capsys, figures):
    assert main(["plot", str(trained)]) == 0
    out_dir = trained / "plots"
    names = ["loss.png", "tokens_per_sec.png", "mfu.png", "memory.png"]
    assert capsys.readouterr().out.splitlines() == [f"wrote {out_dir / n}" for n in names]
    assert_pngs(out_dir / n for n in names)
    assert labels(figures["loss.png"]) == ["gpt", "gpt (val)"]
    assert labels(figures["memory.png"]) == ["gpt resident (CPU)"]
    rows = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    loss_line = figures["loss.png"].axes[0].lines[0]
    assert list(loss_line.get_ydata()) == [row["loss"] for row in rows]
    assert list(loss_line.get_xdata()) == pytest.approx([32.0, 64.0, 96.0])  # 2 x 16 per step


def test_several_runs_share_each_figure(trained, tmp_path, figures):
    other = tmp_path / "llama"
    other.mkdir()
    shutil.copy(trained / "metrics.jsonl", other / "metrics.jsonl")
    written = plot.plot([trained, other], tmp_path / "compare")
    assert [p.parent for p in written] == [tmp_path / "compare"] * 4
    assert labels(figures["loss.png"]) == ["gpt", "gpt (val)", "llama", "llama (val)"]
    assert labels(figures["tokens_per_sec.png"]) == ["gpt", "llama"]


def test_profile_report_as_stacked_bars(tmp_path, figures):
    ranks = [
        {
            "rank": r,
            "tp_rank": 0,
            "pp_rank": r,
            "dp_rank": 0,
            "time_s": {"forward": 0.01, "backward": 0.02, "bubble": 0.005 * r},
            "memory_bytes": {"parameters": 2**30, "activations": (r + 1) * 2**29},
        }
        for r in range(2)
    ]
    report = tmp_path / "pp2" / "profile.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"world_size": 2, "ranks": ranks}))
    written = plot.plot([report])
    assert [p.name for p in written] == ["profile_pp2_memory.png", "profile_pp2_time.png"]
    assert {p.parent for p in written} == {tmp_path / "pp2" / "plots"}
    assert_pngs(written)
    memory = figures["profile_pp2_memory.png"].axes[0]
    assert memory.get_legend_handles_labels()[1] == ["parameters", "activations"]
    tops = [bar.get_y() + bar.get_height() for bar in memory.patches]
    assert tops == pytest.approx([1.0, 1.0, 1.5, 2.0])  # GiB: parameters, then activations


def test_nothing_to_plot_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path}/metrics.jsonl is empty: train at least one step before plotting "
        "the run\n"
    )
    with pytest.raises(plot.PlotError, match="does not exist"):
        plot.plot([tmp_path / "missing"])
    (tmp_path / "metrics.jsonl").unlink()
    with pytest.raises(plot.PlotError, match="metrics.jsonl does not exist: pass a train.out_dir"):
        plot.plot([tmp_path])


def test_tokens_seen_add_up_each_steps_batch_across_a_change_of_batch_size():
    """Steps 1-2 of 100 tokens, then (resumed with twice the batch, logged every other step)
    steps 4 and 6 of 200: step 3, which has no row, is taken at the batch of step 4."""
    rows = [
        {"step": step, "tokens_per_sec": tokens / 0.5, "step_time_s": 0.5}
        for step, tokens in [(1, 100), (2, 100), (4, 200), (6, 200)]
    ]
    assert plot.tokens_seen(rows) == {1: 100, 2: 200, 4: 600, 6: 1000}
