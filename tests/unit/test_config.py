"""The run config: YAML + dotted overrides, defaults, and an error that names the key and the fix
for every bad input (megalite/config.py)."""

from pathlib import Path

import pytest
import yaml

from megalite.config import (
    Config,
    ConfigError,
    build_config,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
    with_values,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def error_of(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


# ----------------------------------------------------------------------------- good inputs


def test_defaults_fill_in():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.model.n_kv_heads == cfg.model.n_heads
    assert cfg.model.ffn_hidden == 4 * cfg.model.hidden


@pytest.mark.parametrize(
    "arch, hidden, expected",
    [
        ("gpt", 64, 256),
        ("gpt", 96, 384),
        ("llama", 64, 192),  # 8/3 * 64 = 170.7 -> rounded up to a multiple of 64
        ("llama", 256, 704),  # 682.7 -> 704
        ("llama", 4096, 10944),  # 10922.7 -> 10944 (Meta rounds to 256: 11008)
    ],
)
def test_ffn_hidden_default_rules(arch, hidden, expected):
    cfg = load_config(None, [f"model.arch={arch}", f"model.hidden={hidden}"])
    assert cfg.model.ffn_hidden == expected


def test_max_positions_defaults_to_seq_len_and_may_exceed_it():
    assert load_config(None, ["model.seq_len=128"]).model.max_positions == 128
    cfg = load_config(None, ["model.seq_len=128", "model.max_positions=1024"])
    assert (cfg.model.seq_len, cfg.model.max_positions) == (128, 1024)


def test_explicit_values_are_kept():
    cfg = load_config(
        None, ["model.arch=llama", "model.n_kv_heads=2", "model.ffn_hidden=100", "model.hidden=64"]
    )
    assert (cfg.model.n_kv_heads, cfg.model.ffn_hidden) == (2, 100)
    assert load_config(None, ["model.n_kv_heads=null"]).model.n_kv_heads == 4


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "train.steps=50",
            "optim.lr=2.5e-3",
            "optim.min_lr=1e-4",  # YAML 1.1 reads this as a string
            "optim.warmup_steps=0",
            "parallel.sp=false",
            "train.out_dir=a=b",  # only the first '=' splits
            "data.tokenizer=",  # empty means None
            "optim.weight_decay=0",  # an int for a float field
        ],
    )
    assert cfg.train.steps == 50 and cfg.optim.lr == 2.5e-3 and cfg.optim.min_lr == 1e-4
    assert cfg.train.out_dir == "a=b" and cfg.data.tokenizer is None
    assert isinstance(cfg.optim.weight_decay, float) and cfg.optim.weight_decay == 0.0
    assert parse_override(" train.steps =7") == (["train", "steps"], 7)


def test_yaml_then_overrides_precedence(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model:\n  hidden: 64\n  n_layers: 2\ntrain:\n  steps: 10\n  seed: 7\noptim:\n  lr: 3e-3\n"
    )
    cfg = load_config(path, ["train.steps=20", "model.hidden=128", "logging.progress=false"])
    assert cfg.train.steps == 20 and cfg.model.hidden == 128  # overrides beat the file
    assert cfg.train.seed == 7 and cfg.model.n_layers == 2 and cfg.optim.lr == 3e-3  # file
    assert cfg.train.micro_batch_size == 8 and cfg.logging.progress is False  # defaults
    assert cfg.model.ffn_hidden == 512  # derived from the overridden hidden, not the file's
    assert load_config(path, ["train.steps=30", "train.steps=40"]).train.steps == 40


def test_empty_yaml_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    assert load_config(path) == Config()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    raw = yaml.safe_load(path.read_text())
    assert cfg.model.arch == raw["model"]["arch"]
    assert cfg.model.vocab_size == raw["model"]["vocab_size"]


def test_all_tiny_configs_shipped():
    names = {p.name for p in CONFIGS.glob("*.yaml")}
    assert {"gpt-tiny.yaml", "llama-tiny.yaml"} <= names


def test_save_config_round_trip(tmp_path):
    cfg = load_config(
        CONFIGS / "llama-tiny.yaml",
        [
            *("train.steps=3", "optim.decay_steps=5", "parallel.tp=2"),
            *("data.source=data/corpus", "data.tokenizer=tok.model"),
        ],
    )
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temporary left
    again = load_config(path)
    assert again == cfg and config_to_dict(again) == config_to_dict(cfg)
    saved = yaml.safe_load(path.read_text())
    assert saved["model"]["n_kv_heads"] == 2 and saved["model"]["ffn_hidden"] == 704  # resolved


# ----------------------------------------------------------------------------- layout_for_world


@pytest.mark.parametrize(
    "tp, pp, micro, global_batch, world, expected",
    [
        (1, 1, 2, 8, 1, (1, 4)),
        (2, 1, 2, 8, 2, (1, 4)),
        (2, 2, 2, 8, 8, (2, 2)),
        (1, 2, 1, 8, 8, (4, 2)),
        (1, 1, 4, 8, 2, (2, 1)),
    ],
)
def test_layout_for_world(tp, pp, micro, global_batch, world, expected):
    cfg = load_config(
        None,
        [
            f"parallel.tp={tp}",
            f"parallel.pp={pp}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={global_batch}",
        ],
    )
    assert cfg.layout_for_world(world) == expected


def test_layout_world_not_divisible_by_model_parallel():
    cfg = load_config(None, ["parallel.tp=2", "parallel.pp=2"])
    with pytest.raises(ConfigError) as info:
        cfg.layout_for_world(6)
    message = str(info.value)
    assert "world size 6" in message and "tp*pp = 2*2" in message
    assert "multiple of 4 processes" in message and "parallel.tp" in message


def test_layout_global_batch_not_a_multiple():
    cfg = load_config(None, ["train.micro_batch_size=2", "train.global_batch_size=6"])
    with pytest.raises(ConfigError) as info:
        cfg.layout_for_world(2)
    message = str(info.value)
    assert "train.global_batch_size=6" in message and "micro_batch_size*dp = 2*2" in message


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_key_suggests_close_match():
    message = error_of(["model.n_layer=2"])
    assert "unknown config key 'model.n_layer'" in message
    assert "did you mean" in message and "model.n_layers" in message


def test_unknown_key_without_close_match_lists_valid_keys():
    message = error_of(["train.zzzzzzzzzzzzzzzzzz=1"])
    assert "'train.zzzzzzzzzzzzzzzzzz'" in message and "valid keys:" in message
    assert "train.steps" in message and "model.hidden" not in message  # the section's keys


def test_unknown_key_in_yaml_file(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate'"):
        load_config(path)


@pytest.mark.parametrize(
    "broken, where",
    [
        (
            "  hidden: [256",
            "line 6, column 10: expected ',' or ']', but got ':' (while parsing a "
            "flow sequence from line 5, column 11)",
        ),
        ("\thidden: 256", "line 5, column 1: found character '\\t' that cannot start any token"),
        (
            " hidden: 256",
            "line 5, column 2: expected <block end>, but found '<block mapping "
            "start>' (while parsing a block mapping from line 2, column 1)",
        ),
    ],
    ids=["unclosed", "tab", "indent"],
)
def test_a_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, broken, where):
    """PyYAML's own message runs over 8 lines (an excerpt with a caret): one line here."""
    text = (CONFIGS / "gpt-tiny.yaml").read_text().replace("  hidden: 256", broken)
    path = tmp_path / "gpt-tiny.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path} is not valid YAML: {where}"


def test_unknown_section():
    message = error_of(["modle.hidden=64"])
    assert "'modle'" in message and "did you mean model" in message
    message = error_of(["zzz.hidden=64"])
    assert "'zzz'" in message and "valid keys: model, parallel, train" in message


def test_section_that_is_not_a_mapping(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("model: 3\n")
    with pytest.raises(ConfigError, match=r"config section 'model' must be a mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"config section 'model' must be a mapping"):
        load_config(path, ["model.hidden=64"])


# ----------------------------------------------------------------------------- wrong types


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.steps=abc", "train.steps must be int, got 'abc'"),
        ("train.steps=2.5", "train.steps must be int, got 2.5"),
        ("model.n_layers=true", "model.n_layers must be int, got True"),  # bool is not an int
        ("model.n_kv_heads=x", "model.n_kv_heads must be int, got 'x'"),  # int | None
        ("parallel.sp=1", "parallel.sp must be bool, got 1"),
        ("parallel.sp=maybe", "parallel.sp must be bool, got 'maybe'"),
        ("optim.lr=fast", "optim.lr must be float, got 'fast'"),
        ("optim.lr=true", "optim.lr must be float, got True"),
        (
            "model.arch=false",
            "model.arch must be gpt, llama, mixtral, mistral, gemma3, qwen2, qwen3 or qwen3_moe, "
            "got 'false'",
        ),  # text
        ("train.steps=", "train.steps must be int, got None"),  # None only where allowed
        ("model.n_kv_heads=None", "model.n_kv_heads must be int, got 'None' (write null for none)"),
        ("model.hidden={a: 1}", "model.hidden must be int, got {'a': 1}"),
        ("train.steps=[1", "override 'train.steps=[1': the value is not valid YAML (line 1, "),
    ],
)
def test_wrong_type(override, expected):
    assert error_of([override]).startswith(expected)


def test_text_is_taken_as_typed():
    """YAML 1.1 reads 007 as 7, 0755 as 493 and 12:30 as 750: a text field takes the override's
    text itself (null and an empty value are none), and a file's number is refused."""
    values = {"train.out_dir": "007", "logging.run_name": "12:30", "logging.wandb_group": "0x1F"}
    cfg = load_config(None, [f"{key}={value}" for key, value in values.items()])
    assert (cfg.train.out_dir, cfg.logging.run_name, cfg.logging.wandb_group) == tuple(
        values.values()
    )
    for none in ("checkpoint.init_from=null", "checkpoint.init_from=", "data.tokenizer=~"):
        key = none.split("=")[0]
        section, name = key.split(".")
        cfg = load_config(None, [f"{key}=somewhere", none])  # the later override wins
        assert getattr(getattr(cfg, section), name) is None, none
    assert load_config(None, ["logging.run_name='*exp'"]).logging.run_name == "*exp"
    error = "train.out_dir must be text, but YAML read 493 as a number: quote it"
    with pytest.raises(ConfigError, match=error):
        build_config({"train": {"out_dir": 0o755}})


def test_a_key_of_another_section_is_named():
    assert error_of(["train.lr=1e-3"]) == "unknown config key 'train.lr'; did you mean optim.lr?"
    assert error_of(["parallel.micro_batch_size=2"]).endswith(
        "did you mean train.micro_batch_size?"
    )


@pytest.mark.parametrize(
    "override", ["model.norm_eps=-1", "model.rope_theta=0", "model.init_std=-0.02"]
)
def test_model_numbers_that_would_train_nan_or_crash_are_refused(override):
    name = override.split("=")[0]
    assert error_of([override]).startswith(f"{name} must be")


def test_wrong_type_in_yaml_file(tmp_path):
    path = tmp_path / "types.yaml"
    path.write_text("train:\n  steps: '10'\n")
    with pytest.raises(ConfigError, match=r"train.steps must be int, got '10'"):
        load_config(path)


# ----------------------------------------------------------------------------- ranges


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "model.arch=bert",
            "model.arch must be gpt, llama, mixtral, mistral, gemma3, qwen2, qwen3 or qwen3_moe, "
            "got 'bert'",
        ),
        ("model.n_layers=0", "model.n_layers must be >= 1"),
        ("model.hidden=-64", "model.hidden must be >= 1"),
        ("model.n_heads=0", "model.n_heads must be >= 1"),
        ("model.vocab_size=0", "model.vocab_size must be >= 1"),
        ("model.seq_len=0", "model.seq_len must be >= 1"),
        (
            "model.max_positions=128",
            "model.seq_len (256) exceeds model.max_positions (128): raise model.max_positions "
            "to at least 256 or lower model.seq_len",
        ),
        ("model.vocab_round_to=0", "model.vocab_round_to must be >= 1"),
        ("model.hidden=66", "model.hidden (66) must be divisible by model.n_heads (4)"),
        ("model.n_kv_heads=0", "model.n_kv_heads (0) must divide model.n_heads (4)"),
        ("model.dropout=1.0", "model.dropout must be in [0, 1), got 1.0"),
        ("model.dropout=-0.1", "model.dropout must be in [0, 1), got -0.1"),
        ("parallel.tp=0", "parallel.tp must be >= 1"),
        ("parallel.pp=0", "parallel.pp must be >= 1"),
        ("parallel.vpp=0", "parallel.vpp must be >= 1"),
        ("parallel.zero=4", "parallel.zero must be 0, 1, 2 or 3, got 4"),
        (
            "parallel.schedule=zb",
            "parallel.schedule must be gpipe, 1f1b, interleaved, zb-h1 or zb-v, got 'zb'",
        ),
        ("parallel.bucket_mb=0", "parallel.bucket_mb must be > 0"),
        ("train.steps=0", "train.steps must be >= 1"),
        ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1"),
        ("train.global_batch_size=0", "train.global_batch_size must be >= 1"),
        ("train.eval_steps=0", "train.eval_steps must be >= 1"),
        ("train.precision=fp8", "train.precision must be fp32, bf16, fp16 or auto, got 'fp8'"),
        (
            "train.recompute=some",
            "train.recompute must be none, selective, full or segments, got 'some'",
        ),
        ("train.device=tpu", "train.device must be auto, cpu or cuda"),
        ("train.recompute_layers=-1", "train.recompute_layers must be >= 0"),
        ("optim.lr=0", "optim.lr"),
        ("optim.min_lr=-1e-5", "optim.min_lr"),
        ("optim.min_lr=0.5", "need 0 <= optim.min_lr <= optim.lr"),
        ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
        ("optim.beta1=1.0", "optim.beta1/beta2 must be in [0, 1)"),
        ("optim.beta2=-0.1", "optim.beta1/beta2 must be in [0, 1)"),
        ("optim.weight_decay=-0.1", "weight_decay"),
        ("optim.grad_clip=-1", "grad_clip"),
        ("data.val_fraction=0", "data.val_fraction must be in (0, 0.5)"),
        ("data.val_fraction=0.5", "data.val_fraction must be in (0, 0.5)"),
        ("data.tokenizer=tok.model", "data.source is builtin, which brings its own tokenizer"),
        ("checkpoint.interval=-1", "checkpoint.interval must be >= 0"),
        ("checkpoint.keep=0", "checkpoint.keep must be >= 1"),
    ],
)
def test_out_of_range(override, expected):
    assert expected in error_of([override])


def test_gqa_is_llama_only():
    message = error_of(["model.n_kv_heads=2"])
    assert (
        "model.n_kv_heads" in message
        and "only in llama, mixtral, mistral, gemma3, qwen2, qwen3 or qwen3_moe" in message
    )


@pytest.mark.parametrize("key", ["train.eval_interval", "train.log_interval"])
def test_interval_range_error_names_the_key(key):
    """The message must say which interval is wrong (it used to say only 'intervals')."""
    message = error_of([f"{key}=0"])
    assert key.split(".")[1] in message and ">= 1" in message


@pytest.mark.parametrize(
    "override",
    ["model.ffn_hidden=0", "model.ffn_hidden=-64", "optim.decay_steps=-5", "optim.eps=-1.0"],
)
def test_unchecked_ranges_are_refused(override):
    """Nonsense sizes must fail in the config, not deep inside model building or as a silently
    odd learning-rate curve."""
    key = override.split("=")[0]
    assert key.split(".")[1] in error_of([override])


# ----------------------------------------------------------------------------- cross-field


def test_tp_must_divide_n_heads():
    message = error_of(["parallel.tp=3"])
    assert "parallel.tp=3 must divide model.n_heads=4" in message and "choose a tp" in message


def test_tp_must_divide_ffn_hidden():
    message = error_of(["parallel.tp=4", "model.hidden=64", "model.ffn_hidden=102"])
    assert "parallel.tp=4 must divide model.ffn_hidden=102" in message


def test_tp_must_divide_hidden_is_implied():
    """hidden % n_heads == 0 and n_heads % tp == 0 already give hidden % tp == 0, so the
    hidden check can never be the first to fire; the n_heads one names the fix instead."""
    message = error_of(["parallel.tp=3", "model.n_heads=4", "model.hidden=66"])
    assert "model.hidden (66) must be divisible by model.n_heads (4)" in message


def test_tp_and_n_kv_heads_must_nest():
    message = error_of(
        [
            "model.arch=llama",
            "model.n_heads=12",
            "model.n_kv_heads=4",
            "model.hidden=192",
            "model.ffn_hidden=516",
            "parallel.tp=6",
        ]
    )
    assert "parallel.tp=6 and model.n_kv_heads=4: one must divide the other" in message
    # Fewer kv heads than tp ranks is fine when one divides the other.
    load_config(
        None,
        ["model.arch=llama", "model.n_heads=8", "model.n_kv_heads=2", "parallel.tp=4"],
    )


def test_n_kv_heads_must_divide_n_heads():
    message = error_of(["model.arch=llama", "model.n_kv_heads=3"])
    assert "model.n_kv_heads (3) must divide model.n_heads (4)" in message


def test_sp_needs_tp():
    assert "parallel.sp=true needs parallel.tp > 1" in error_of(["parallel.sp=true"])


def test_sp_needs_seq_len_divisible_by_tp():
    message = error_of(["parallel.tp=2", "parallel.sp=true", "model.seq_len=33"])
    assert "model.seq_len (33) divisible by parallel.tp (2)" in message
    load_config(None, ["parallel.tp=2", "parallel.sp=true", "model.seq_len=34"])


def test_context_parallel_rules():
    """2*cp chunks per sequence; under SP the rank's chunks split over tp; no attention
    dropout (the probabilities are never materialised); a known cp_comm; cp in the world."""
    message = error_of(["parallel.cp=3", "model.seq_len=256"])
    assert "2*cp=6 chunks" in message and "model.seq_len (256)" in message
    message = error_of(["parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "model.seq_len=36"])
    assert "model.seq_len / parallel.cp = 18) divisible by parallel.tp (4)" in message
    assert "set model.dropout=0" in error_of(["parallel.cp=2", "model.dropout=0.1"])
    assert "set model.dropout=0" in error_of(["data.document_mask=true", "model.dropout=0.1"])
    assert "p2p or allgather" in error_of(["parallel.cp_comm=ring"])
    cfg = load_config(None, ["parallel.cp=2", "parallel.tp=2", "train.global_batch_size=16"])
    assert cfg.layout_for_world(8)[0] == 2  # dp = 8 / (tp * cp)
    with pytest.raises(ConfigError, match=r"tp\*cp\*pp = 2\*2\*1"):
        cfg.layout_for_world(6)


def test_n_layers_at_least_pipeline_chunks():
    message = error_of(
        ["model.n_layers=3", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"]
    )
    assert "model.n_layers=3 is fewer than pp*vpp=4 pipeline chunks" in message
    load_config(
        None,
        ["model.n_layers=4", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=interleaved"],
    )


def test_vpp_needs_interleaved_schedule():
    message = error_of(["parallel.vpp=2", "parallel.pp=2"])
    assert "parallel.vpp=2 needs parallel.schedule=interleaved" in message


# ----------------------------------------------------------------------------- files, syntax


def test_missing_yaml_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path} not found (see configs/ for examples)"


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("model:\n  hidden: [64\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"config file {path} is not valid YAML:")
    assert "line" in message  # the YAML parser's position comes along


def test_binary_file_is_not_valid_yaml(tmp_path):
    """A config that is not text at all (say, a checkpoint passed by mistake) is a ConfigError,
    not a UnicodeDecodeError traceback."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(128, 256)))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["- model\n- train\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path} must be a mapping of sections"


@pytest.mark.parametrize("text", ["train.steps", "train.steps:5", ""])
def test_override_without_equals(text):
    assert error_of([text]) == f"override {text!r} must look like section.key=value"


@pytest.mark.parametrize("text", ["steps=5", "train.steps.x=5", "=5"])
def test_override_key_not_section_dot_key(text):
    key = text.split("=")[0]
    assert error_of([text]) == f"override key {key!r} must be section.key, e.g. train.steps"


def test_build_config_from_dict():
    cfg = build_config({"model": {"hidden": 64, "n_heads": 4}, "train": {"steps": 3}})
    assert cfg.model.hidden == 64 and cfg.train.steps == 3 and cfg.optim == Config().optim


def test_with_values_checks_like_load_config():
    """The planner's derived configs: a value is coerced and checked as an override would be,
    the changed sections and the whole config validated again, the rest shared."""
    base = load_config(CONFIGS / "llama-tiny.yaml", ["train.steps=3"])
    overrides = {"parallel.tp": 2, "parallel.sp": True, "optim.lr": "3e-3"}
    derived = with_values(base, overrides)
    texts = [f"{key}={value}" for key, value in overrides.items()]
    assert derived == load_config(CONFIGS / "llama-tiny.yaml", ["train.steps=3", *texts])
    assert derived.optim.lr == 3e-3 and derived.model is base.model
    assert derived.explicit == base.explicit | set(overrides)
    assert "parallel.tp" not in base.explicit and base.parallel.tp == 1
    with pytest.raises(ConfigError, match="parallel.tp=3 must divide model.n_heads"):
        with_values(base, {"parallel.tp": 3})
    with pytest.raises(ConfigError, match="train.steps must be int"):
        with_values(base, {"train.steps": "many"})
    with pytest.raises(ConfigError, match="did you mean parallel.tp"):
        with_values(base, {"parallel.tpp": 2})
    # fields the config derived follow the new values, as load_config derives them
    wider = {"model.hidden": 512, "model.seq_len": 512}
    texts = [f"{key}={value}" for key, value in wider.items()]
    assert with_values(base, wider) == load_config(
        CONFIGS / "llama-tiny.yaml", ["train.steps=3", *texts]
    )
