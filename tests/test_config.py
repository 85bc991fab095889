"""Config loading, overrides and validation errors that name the field."""

import os

import pytest

from tieflax.config import apply_override, default_config, load_config, model_config
from tieflax.model import ConfigError, ModelConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs/experiments/tiny.py")


def test_overrides_are_typed():
    config = load_config(TINY, ["--config.model.tie_embeddings=False", "model.d_model=64",
                                "--config.train.learning_rate=1"])
    assert config.model.tie_embeddings is False and config.model.d_model == 64
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)


@pytest.mark.parametrize("override,message", [
    ("model.no_such_field=1", "no field 'no_such_field'"),
    ("nosection.x=1", "no section 'nosection'"),
    ("model.d_model", "must look like"),
    ("model.d_model=wide", "model.d_model"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_override(default_config(), override)


@pytest.mark.parametrize("override,line", [
    # a typo: the closest field, in one line (the list of every field was cut off before the likely match)
    ("--config.model.tie_embedding=False", "no field 'tie_embedding' in config.model: did you mean "
                                           "config.model.tie_embeddings?"),
    ("--config.trian.num_steps=3", "no section 'trian' in the config: did you mean config.train?"),
    ("--config.seed.value=3", "config.seed is a field, not a section: set it as --config.seed=VALUE"),
    # a value of the wrong kind: what the field takes (ml_collections said "no is of original type ... cannot
    # be casted")
    ("--config.model.tie_embeddings=no", "config.model.tie_embeddings takes True or False (any case), not 'no'"),
    ("--config.train.num_steps=many", "config.train.num_steps takes a whole number, e.g. 100, not 'many'"),
    ("--config.train.learning_rate=fast", "config.train.learning_rate takes a number, e.g. 3e-4, not 'fast'"),
])
def test_a_bad_override_is_one_line_saying_what_to_write(override, line):
    with pytest.raises(ConfigError) as refused:
        apply_override(default_config(), override)
    assert str(refused.value) == f"override {override!r}: {line}"


def test_an_override_with_a_space_before_its_value_gets_the_commands_usage(capsys):
    from tieflax.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["train", "--workdir", "w", "--config.model.tie_embeddings", "False"])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith("usage: tieflax train "), err
    assert err.strip().splitlines()[-1] == (
        "tieflax train: error: --config.model.tie_embeddings False: a config override takes its value after '=', "
        "not a space: --config.model.tie_embeddings=False")


@pytest.mark.parametrize("fields,field", [
    (dict(n_heads=3, d_model=64), "n_heads"),
    (dict(n_heads=8, n_kv_heads=3), "n_kv_heads"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(vocab_size=-5), "vocab_size"),
    (dict(family="rnn"), "family"),
    (dict(norm="batchnorm"), "norm"),
    (dict(mlp="relu"), "mlp"),
    (dict(position="alibi"), "position"),
    (dict(dtype="float8"), "dtype"),
    (dict(logit_scale=0.0), "logit_scale"),
    (dict(final_logit_softcap=-1.0), "final_logit_softcap"),
    (dict(scan_layers=1), "scan_layers"),         # a switch takes True or False, not 1
    (dict(d_model=64.5), "d_model"),              # a size is a whole number
])
def test_validation_names_the_field(fields, field):
    with pytest.raises(ConfigError, match=rf"config\.model\.{field}"):
        ModelConfig(**fields)


def test_unknown_model_key_is_an_error():
    config = default_config()
    config.model.unlock()
    config.model.n_layer = 3  # a typo of n_layers
    with pytest.raises(ConfigError, match="n_layer"):
        model_config(config)


def test_missing_file_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config("configs/nope.py")


def test_validation_happens_at_load_time():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        load_config(TINY, ["model.n_kv_heads=3"])


@pytest.mark.parametrize("raw, policy", [("none", "none"), ("None", "none"), ("full", "full"), ("True", "full"),
                                         ("False", "none"), ("save_qkv_proj", "save_qkv_proj")])
def test_remat_overrides_name_a_policy(raw, policy):
    """`--config.model.remat=none` is the policy 'none', not Python's None (which validation refuses)."""
    config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "experiments", "tiny.py"))
    apply_override(config, f"model.remat={raw}")
    assert model_config(config).remat == policy
