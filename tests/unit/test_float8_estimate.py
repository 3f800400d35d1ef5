"""`megalite estimate` under `train.fp8`: the layout line and JSON name the recipe, a note says
what float8 keeps and that MFU stays against the bf16 dense peak, and tensorwise's float8
copies shrink the activations of a shipped config where rowwise keeps them."""

from megalite.commands.estimate import as_dict, table
from megalite.config import load_config
from megalite.profiling.estimate import estimate_layout


def _estimate(fp8: str):
    cfg = load_config("configs/gpt2-1.3b.yaml", [f"train.fp8={fp8}", "parallel.pp=1"])
    return estimate_layout(cfg, 8, device="cuda")


def test_the_table_says_what_float8_keeps_and_which_peak_mfu_uses():
    text = table(_estimate("tensorwise"))
    assert "fp8=tensorwise" in text.splitlines()[0]
    assert "float8 copies" in text and "MFU is stated against the bf16 dense peak" in text
    assert "fp8=" not in table(_estimate("none"))
    assert as_dict(_estimate("rowwise"))["fp8"] == "rowwise"


def test_tensorwise_shrinks_the_activations_rowwise_keeps_them():
    kept = {
        fp8: _estimate(fp8).stages[0].part("activations")
        for fp8 in ("none", "tensorwise", "rowwise")
    }
    assert kept["tensorwise"] < kept["none"] == kept["rowwise"]
