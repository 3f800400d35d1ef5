"""Hugging Face round trip: a megalite checkpoint exported with `export_hf` and loaded back
through `checkpoint.init_from` into tp=2 x pp=2 trains exactly as the single-process run that
starts from the original checkpoint (same losses to 1e-5), for GPT (tied embeddings split
across the first and last stage) and Llama (grouped-query attention). Plus the errors for a
Hugging Face model that does not match the config."""

import json

import pytest
from equivalence import TINY, run_layout

from megalite.checkpoint.hf import export_hf, read_hf
from megalite.checkpoint.sharded import CheckpointError
from megalite.config import load_config

ARCHS = {"gpt": ("model.arch=gpt",), "llama": ("model.arch=llama", "model.n_kv_heads=2")}
FIVE = ("train.steps=5",)


def _latest(out_dir):
    return out_dir / "checkpoints" / (out_dir / "checkpoints" / "latest").read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_export_then_init_from_in_another_layout(builtin_corpus, tmp_path, arch):
    model = TINY + ARCHS[arch]
    run_layout(1, model + FIVE, tmp_path / "source")
    source = _latest(tmp_path / "source")
    hf_dir = export_hf(source, tmp_path / "hf")

    from_source, _ = run_layout(
        1, model + FIVE + (f"checkpoint.init_from={source}",), tmp_path / "a"
    )
    from_hf, _ = run_layout(
        4,
        model + FIVE + (f"checkpoint.init_from={hf_dir}", "parallel.tp=2", "parallel.pp=2"),
        tmp_path / "b",
    )
    untrained, _ = run_layout(1, model + FIVE, tmp_path / "c")
    assert from_source[0][0] < untrained[0][0] - 0.2  # the weights were loaded, not re-drawn
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(from_hf, from_source), 1):
        assert abs(loss - ref_loss) <= 1e-5 * ref_loss, (step, loss, ref_loss)
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (step, norm, ref_norm)


def test_a_mismatched_hugging_face_model_names_the_overrides(builtin_corpus, tmp_path):
    model = TINY + ARCHS["llama"]
    run_layout(1, model + ("train.steps=1",), tmp_path / "source")
    hf_dir = export_hf(_latest(tmp_path / "source"), tmp_path / "hf")

    other = load_config(None, [*model, "model.hidden=128", "model.n_kv_heads=4"]).model
    with pytest.raises(CheckpointError) as error:
        read_hf(hf_dir, other)
    assert str(error.value) == (
        f"the Hugging Face model in {hf_dir} does not match the config: set model.hidden=64 "
        "model.n_kv_heads=2 model.ffn_hidden=192"  # ffn_hidden followed hidden=128 to 384
    )
    gpt = load_config(None, [*TINY, "model.arch=gpt"]).model
    with pytest.raises(CheckpointError, match="set model.arch=llama"):
        read_hf(hf_dir, gpt)

    (hf_dir / "model.safetensors").rename(hf_dir / "pytorch_model.bin")
    same = load_config(None, list(model)).model
    with pytest.raises(CheckpointError, match="does not unpickle pytorch_model.bin"):
        read_hf(hf_dir, same)

    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    with pytest.raises(CheckpointError, match="model_type 'bloom' is not one megalite builds"):
        read_hf(hf_dir, same)


def test_weights_saved_from_the_base_class_and_tied_heads_are_read(builtin_corpus, tmp_path):
    """Hub checkpoints are often saved from the base model (`h.0...` rather than
    `transformer.h.0...`), and some Llamas tie the head to the embedding."""
    import torch
    from safetensors.torch import load_file, save_file

    model = TINY + ARCHS["llama"]
    run_layout(1, model + ("train.steps=1",), tmp_path / "source")
    hf_dir = export_hf(_latest(tmp_path / "source"), tmp_path / "hf")
    m = load_config(None, list(model)).model
    exported = read_hf(hf_dir, m)

    state = load_file(hf_dir / "model.safetensors")
    bare = {k.removeprefix("model."): v for k, v in state.items() if k != "lm_head.weight"}
    save_file(bare, hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tied = read_hf(hf_dir, m)
    assert tied.keys() == exported.keys()
    assert torch.equal(tied["lm_head.weight"], exported["tok_embeddings.weight"])
    for name in exported.keys() - {"lm_head.weight"}:
        assert torch.equal(tied[name], exported[name]), name


def test_rope_theta_travels_both_ways(builtin_corpus, tmp_path):
    model = TINY + ARCHS["llama"] + ("model.rope_theta=500000",)
    run_layout(1, model + ("train.steps=1",), tmp_path / "source")
    hf_dir = export_hf(_latest(tmp_path / "source"), tmp_path / "hf")
    read_hf(hf_dir, load_config(None, list(model)).model)  # accepted as it is
    default = load_config(None, list(TINY + ARCHS["llama"])).model
    with pytest.raises(CheckpointError, match=r"set model.rope_theta=500000(\.0)?$"):
        read_hf(hf_dir, default)
