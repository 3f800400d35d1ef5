"""`megalite estimate` counts what float8 keeps for backward: on 4 gloo ranks (one launch), each
rank's saved activations under `train.fp8` equal the estimate within 5 %, as
test_estimate_measured.py holds every other layout: tensorwise's float8 copies of the linears'
inputs and their scales (with tp + SP, where a column-parallel linear keeps its shard; under
zb-h1, where the split backward holds the float8 inputs until W), rowwise's compute-dtype
inputs, and Mixtral's float8 experts."""

from test_estimate_measured import MODEL, TINY, _check, _config

FP8 = "train.fp8_min_dim=0"
LAYOUTS = {
    "gpt tensorwise tp2+sp": (
        "model.arch=gpt",
        "train.fp8=tensorwise",
        "parallel.tp=2",
        "parallel.sp=true",
    ),
    "llama tensorwise pp2 zb-h1": (
        "model.arch=llama",
        "model.n_kv_heads=2",
        "train.fp8=tensorwise",
        "parallel.pp=2",
        "parallel.schedule=zb-h1",
    ),
    "gpt rowwise tp2": ("model.arch=gpt", "train.fp8=rowwise", "parallel.tp=2"),
    "mixtral tensorwise ep2": (
        "model.arch=mixtral",
        *MODEL["mixtral"],
        "train.fp8=tensorwise",
        "parallel.ep=2",
        "model.moe_top_k=4",
    ),
}


def test_float8_activations_are_estimated():
    cfgs = [_config(None, (*TINY, FP8, *layout)) for layout in LAYOUTS.values()]
    _check(cfgs, list(LAYOUTS))
