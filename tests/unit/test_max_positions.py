"""`model.max_positions`: a model keeps every position it has, whatever context it trains at.
A Hugging Face GPT-2 with 1024 positions (and a Llama with max_position_embeddings 1024) goes
through `checkpoint.init_from` into a run at seq_len 256 and comes back out of `export-hf`
with every tensor identical, and the positions beyond seq_len still compute Hugging Face's
logits and serve `generate`. Without `model.max_positions` set, `checkpoint.init_from` adopts
the model's own."""

import json

import pytest
import torch
import yaml
from megalite.models.factory import model_class
from megalite.models.flops import flops_per_token
from megalite.models.layers import BuildContext
from safetensors.torch import load_file

import megalite.training.loop as loop
from megalite.checkpoint.hf import export_hf, read_hf
from megalite.checkpoint.sharded import Checkpoint, CheckpointError, resolve_checkpoint
from megalite.cli import main
from megalite.config import load_config
from megalite.generate import generate
from megalite.parallel_state import ParallelState
from megalite.tensor_parallel import TPRandom

POSITIONS, SEQ = 1024, 256
MODEL = {
    "gpt": ["model.arch=gpt"],
    "llama": ["model.arch=llama", "model.n_kv_heads=2", "model.rope_theta=500000"],
}
SMALL = [
    "model.n_layers=2",
    "model.hidden=64",
    "model.n_heads=4",
    "model.vocab_size=500",  # the test corpus' vocabulary (tests/conftest.py)
    f"model.seq_len={SEQ}",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
    "train.eval_interval=1000",
    "logging.progress=false",
]
POSITION_KEY = {"gpt": "n_positions", "llama": "max_position_embeddings"}


def random_hf_model(arch: str, path):
    """A small Hugging Face model built offline, every tensor random (biases and norm weights
    too, so that a swapped or dropped name cannot hide behind zeros and ones), saved to path."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    if arch == "gpt":
        config = GPT2Config(
            vocab_size=500,
            n_positions=POSITIONS,
            n_embd=64,
            n_layer=2,
            n_head=4,
            activation_function="gelu_new",
            bos_token_id=None,
            eos_token_id=None,
        )
    else:
        config = LlamaConfig(
            vocab_size=500,
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=POSITIONS,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_init_from_then_export_keeps_every_position(builtin_corpus, tmp_path, monkeypatch, arch):
    original = random_hf_model(arch, tmp_path / "hf")
    # One real step (forward, backward, optimizer) at learning rate 0 changes no weight, so the
    # exported model must equal the original bit for bit.
    monkeypatch.setattr(loop, "learning_rate", lambda step, optim, total: 0.0)
    overrides = [
        *SMALL,
        *MODEL[arch],
        f"model.max_positions={POSITIONS}",
        "train.steps=1",
        f"checkpoint.init_from={tmp_path / 'hf'}",
        f"train.out_dir={tmp_path / 'run'}",
    ]
    loop.train(load_config(None, overrides))
    back = export_hf(tmp_path / "run", tmp_path / "back")

    config = json.loads((back / "config.json").read_text())
    assert config[POSITION_KEY[arch]] == POSITIONS
    before, after = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(back / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name

    # Positions beyond the training seq_len compute what Hugging Face computes, and generate
    # reads up to all of them back.
    ours = Checkpoint(resolve_checkpoint(tmp_path / "run")).model()
    ids = torch.randint(0, 500, (1, POSITIONS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = original(ids).logits, ours(ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    contexts, forward = [], ours.forward
    monkeypatch.setattr(ours, "forward", lambda x: contexts.append(x.shape[1]) or forward(x))
    generate(ours, ids[:, : POSITIONS - 4], 6, temperature=0)
    assert contexts == [1020, 1021, 1022, 1023, 1024, 1024]

    # Starting from the megalite checkpoint without max_positions adopts its positions; setting
    # others names the ones it has.
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000001"
    fewer = [*SMALL, *MODEL[arch], "train.steps=1", f"checkpoint.init_from={checkpoint}"]
    loop.train(load_config(None, [*fewer, f"train.out_dir={tmp_path / 'again'}"]))
    again = Checkpoint(resolve_checkpoint(tmp_path / "again")).config["model"]
    assert again["max_positions"] == POSITIONS
    other = [*fewer, "model.max_positions=512", f"train.out_dir={tmp_path / 'other'}"]
    with pytest.raises(CheckpointError) as error:
        loop.train(load_config(None, other))
    assert str(error.value) == (
        f"the megalite checkpoint {checkpoint} does not match the config: set "
        f"model.max_positions={POSITIONS}"
    )


def test_positions_that_do_not_match_name_the_override(tmp_path):
    random_hf_model("gpt", tmp_path)
    at_256 = load_config(None, [*SMALL, "model.arch=gpt"]).model  # max_positions = seq_len
    with pytest.raises(CheckpointError) as error:
        read_hf(tmp_path, at_256)
    assert str(error.value) == (
        f"the Hugging Face model in {tmp_path} does not match the config: set "
        f"model.max_positions={POSITIONS}"
    )
    longer = load_config(None, [*SMALL, "model.arch=gpt", "model.seq_len=2048"]).model
    with pytest.raises(CheckpointError, match=r"set model.max_positions=1024 model.seq_len=1024$"):
        read_hf(tmp_path, longer)


def test_the_position_table_has_max_positions_rows_and_flops_use_seq_len():
    def build(*extra):
        m = load_config(None, [*SMALL, *extra]).model
        ps = ParallelState.single("cpu")
        return m, model_class(m.arch)(BuildContext(m, ps, TPRandom(0, ps)), range(m.n_layers))

    m, gpt = build("model.arch=gpt", f"model.max_positions={POSITIONS}")
    assert gpt.wpe.shape == (POSITIONS, 64)
    _, llama = build(*MODEL["llama"], f"model.max_positions={POSITIONS}")
    assert llama.layers["0"].attn.cos.shape == (POSITIONS, 16)
    same, _ = build("model.arch=gpt")
    assert flops_per_token(m) == flops_per_token(same)  # work per token follows seq_len


def test_init_from_adopts_the_models_positions(builtin_corpus, tmp_path, capsys):
    """GPT-2's 1024 positions at seq_len 64, no max_positions set: the run takes the model's,
    says so in one line, records them in its config.yaml (a resume rebuilds the same model)
    and exports them. A conflicting max_positions set by the user stops the run before it
    writes anything, exit code 2, naming the override."""
    random_hf_model("gpt", tmp_path / "hf")
    model = [
        *SMALL,
        "model.arch=gpt",
        "model.seq_len=64",
        f"checkpoint.init_from={tmp_path / 'hf'}",
    ]
    run = tmp_path / "run"
    assert main(["train", *model, "train.steps=1", f"train.out_dir={run}"]) == 0
    line = (
        f"init_from: adopting the model's max_positions={POSITIONS} "
        "(set model.max_positions to override)"
    )
    assert line in capsys.readouterr().out.splitlines()
    saved = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert (saved["seq_len"], saved["max_positions"]) == (64, POSITIONS)
    rebuilt = load_config(run / "config.yaml")  # what was adopted is now set
    assert rebuilt.model.max_positions == POSITIONS and "model.max_positions" in rebuilt.explicit

    # The resume adopts the same (from the checkpoint it resumes), so the models match.
    assert main(["train", *model, "train.steps=2", f"train.out_dir={run}"]) == 0
    assert line in capsys.readouterr().out.splitlines()
    assert Checkpoint(resolve_checkpoint(run)).step == 2
    exported = export_hf(run, tmp_path / "back")
    assert json.loads((exported / "config.json").read_text())["n_positions"] == POSITIONS

    capsys.readouterr()  # transformers' progress bars
    other = tmp_path / "other"
    assert main(["train", *model, "model.max_positions=512", f"train.out_dir={other}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: the Hugging Face model in {tmp_path / 'hf'} does not match the config: set "
        f"model.max_positions={POSITIONS}"
    ]
    assert not other.exists()
