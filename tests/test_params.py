"""Parameter accounting reproduces the published totals exactly, from the real parameter trees."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import pytest

from tieflax import cli
from tieflax.model import TransformerLM
from tieflax.model.params import count_params, param_report
from tieflax.config import load_config, model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLISHED = {
    "gemma_2b": (2_506_172_416, True),
    "gemma2_9b": (9_241_705_984, True),
    "smollm_135m": (134_515_008, True),
    "llama3_8b": (8_030_261_248, False),
    "llama3_70b": (70_553_706_496, False),
    "llama3_2_1b": (1_235_814_400, True),
    "mistral_7b": (7_241_732_096, False),
    "qwen2_5_7b": (7_615_616_512, False),
    "qwen2_5_0_5b": (494_032_768, True),
    "gpt2": (124_439_808, True),
}


def test_every_published_model_has_a_config():
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(REPO, "configs/models/*.py"))}
    assert names == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_counts_equal_published_totals(name):
    config = model_config(load_config(os.path.join(REPO, f"configs/models/{name}.py")))
    total, tied = PUBLISHED[name]
    report = param_report(config, name)
    assert report.tied == tied == config.tie_embeddings
    assert report.total == total
    # Tying removes exactly one V x d matrix (published V: padding rows are not parameters).
    assert report.total_untied - report.total_tied == config.vocab_size * config.d_model
    assert config.padded_vocab % 128 == 0 and config.padded_vocab >= config.vocab_size


@pytest.mark.parametrize("name,change", [(name, {}) for name in sorted(PUBLISHED)]
                         + [("gpt2", dict(embed_dim=96)), ("llama3_2_1b", dict(head_bias=True, embed_dim=64))])
def test_the_tied_total_is_the_tied_models_own_tree(name, change):
    """param_report counts the untied tree alone and takes the head's matrix off for the tied total: the
    tied model's own tree must count the same, for every published family (and a decoupled width, whose
    out_proj moves between embed and lm_head, and a logit bias)."""
    config = model_config(load_config(os.path.join(REPO, f"configs/models/{name}.py"))).replace(**change)
    report = param_report(config)
    for tie, total in ((True, report.total_tied), (False, report.total_untied)):
        # The model as configured (its attention too: abstract_params traces the einsum one).
        model = TransformerLM(config.replace(tie_embeddings=tie, head_init_std=0.0, head_init="normal"))
        tree = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), jnp.int32))["params"]
        assert total == count_params(tree, config), tie


def test_published_configs_default_to_scanned_layers_with_remat():
    """What a pod run should use, with no flag: scanned layers and a remat policy. (The counts above are
    of these scanned models; tests/test_scan.py checks that unrolled ones count the same.)"""
    for name in PUBLISHED:
        config = model_config(load_config(os.path.join(REPO, f"configs/models/{name}.py")))
        assert config.scan_layers and config.remat == "full", name


def test_padding_is_not_counted():
    config = model_config(load_config(os.path.join(REPO, "configs/models/gpt2.py")))
    assert config.padded_vocab == 50304  # 50257 padded; 47 rows x 768 exist but are not parameters
    assert param_report(config.replace(vocab_pad_multiple=1)).total == param_report(config).total


def test_cli_json(capsys):
    assert cli.main(["params", "--config", os.path.join(REPO, "configs/experiments/tiny.py"), "--json",
                     "--config.model.tie_embeddings=False"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tied"] is False
    assert out["total_untied"] - out["total_tied"] == 8192 * 128 == out["embedding_matrix"]
    assert out["total"] == out["total_untied"]
