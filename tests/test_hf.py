"""Hugging Face interop: logits parity with transformers, tied and untied, for every supported model type.

Each case builds a tiny random model with ``transformers`` offline (from a config object), saves it,
imports it into tieflax and compares fp32 logits on random tokens; then exports the tieflax parameters
and loads them back with ``transformers``. Weights are drawn with std 0.3 (norm scales and biases
included) so that soft-caps, sliding windows and norm offsets all move the logits; the window tests
check that they do.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf extra (torch) is not installed")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tieflax.model.params import abstract_params, count_params  # noqa: E402
from tieflax.interop import hf_config, hf_weights  # noqa: E402
from tieflax.interop.hf import (UnsafeCheckpoint, load_hf_checkpoint, read_safetensors,  # noqa: E402
                                save_hf_checkpoint)
from tieflax.model import TransformerLM  # noqa: E402


transformers.logging.set_verbosity_error()

V, T = 100, 12       # vocabulary (pads to 128 in tieflax); sequence length, longer than the windows below
TOL = 1e-4
_BODY = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
CASES = {
    "llama": lambda: transformers.LlamaConfig(**_BODY),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **_BODY, attention_bias=True, mlp_bias=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=8)),
    "mistral": lambda: transformers.MistralConfig(**_BODY, sliding_window=5),
    "qwen2": lambda: transformers.Qwen2Config(**_BODY),
    "gemma": lambda: transformers.GemmaConfig(**_BODY, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**_BODY, head_dim=8, sliding_window=5, query_pre_attn_scalar=12,
                                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=16),
}
TOKENS = np.random.default_rng(0).integers(0, V, (2, T))


def _hf_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.float().numpy()


def _tieflax_logits(config, params) -> np.ndarray:
    return np.asarray(TransformerLM(config).apply({"params": params}, jnp.asarray(TOKENS)))[..., :V]


def build_case(name: str, tied: bool, root: str):
    """(HF model, its folder, reference logits [2, T, V])."""
    config = CASES[name]()
    config.tie_word_embeddings = tied
    torch.manual_seed(list(CASES).index(name) * 2 + tied)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    folder = os.path.join(root, f"{name}-{'tied' if tied else 'untied'}")
    model.save_pretrained(folder)
    return model, folder, _hf_logits(model)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def imported(root):
    cache = {}

    def get(name, tied):
        if (name, tied) not in cache:
            model, folder, ref = build_case(name, tied, root)
            config, params = load_hf_checkpoint(folder)
            cache[name, tied] = model, folder, ref, config, params, _tieflax_logits(config, params)
        return cache[name, tied]
    return get


CASE_IDS = [(name, tied) for name in CASES for tied in (True, False)]


@pytest.mark.parametrize("name,tied", CASE_IDS)
def test_import_matches_transformers(imported, name, tied):
    model, folder, ref, config, params, logits = imported(name, tied)
    assert config.tie_embeddings is tied and ("lm_head" not in params) is tied
    names = set(read_safetensors(folder))
    assert ("lm_head.weight" in names) is not tied  # a tied checkpoint carries no head
    assert np.abs(ref).max() > 1.0  # the check is not vacuous
    np.testing.assert_allclose(logits, ref, atol=TOL, rtol=0)
    # Exact counts: padding rows excluded, the tied head counted once (as transformers' parameters()).
    assert count_params(abstract_params(config), config) == sum(p.numel() for p in model.parameters())
    emb = np.asarray(params["embed"]["embedding"])
    assert emb.shape[0] == config.padded_vocab > V and not emb[V:].any()


@pytest.mark.parametrize("name,tied", CASE_IDS)
def test_export_loads_in_transformers(imported, root, name, tied):
    model, _, ref, config, params, _ = imported(name, tied)
    out = os.path.join(root, f"export-{name}-{tied}")
    save_hf_checkpoint(out, config, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert back.config.tie_word_embeddings is tied
    if tied:
        assert back.lm_head.weight.data_ptr() == back.get_input_embeddings().weight.data_ptr()
    mine, theirs = back.state_dict(), model.state_dict()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    np.testing.assert_allclose(_hf_logits(back), ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_sliding_window_is_exercised(imported, name):
    """Turning tieflax's window off changes the logits: the parity above really covers it."""
    _, _, ref, config, params, _ = imported(name, False)
    assert config.sliding_window == 5 and config.sliding_window_every == (2 if name == "gemma2" else 1)
    off = _tieflax_logits(config.replace(sliding_window=0), params)
    assert np.abs(off - ref).max() > 100 * TOL


def test_gemma2_softcaps_are_exercised(imported):
    _, _, ref, config, params, _ = imported("gemma2", True)
    for field in ("attn_softcap", "final_logit_softcap"):
        off = _tieflax_logits(config.replace(**{field: 0.0}), params)
        assert np.abs(off - ref).max() > 100 * TOL, field


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_import_into_scanned_layers_and_export_back(imported, name):
    """scan_layers=True: the layers arrive stacked (Gemma 2 as one local/global pair per scan step), the
    logits still match transformers, and export writes the very tensors of the per-layer model."""
    _, folder, ref, config, params, _ = imported(name, True)
    scanned, stacked = load_hf_checkpoint(folder, scan_layers=True)
    assert set(stacked["layers"]) == ({"block_0", "block_1"} if name == "gemma2" else {"block_0"})
    assert not any(k.startswith("block_") for k in stacked)
    np.testing.assert_allclose(_tieflax_logits(scanned, stacked), ref, atol=TOL, rtol=0)
    mine, theirs = hf_weights.state_from_params(stacked, scanned), hf_weights.state_from_params(params, config)
    assert mine.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)


def test_sharded_checkpoints_both_ways(imported, root):
    model, folder, ref, config, params, _ = imported("llama", False)
    sharded = os.path.join(root, "hf-sharded")
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    _, params2 = load_hf_checkpoint(sharded)
    for a, b in zip(*(jax.tree.leaves(p) for p in (params, params2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = os.path.join(root, "export-sharded")
    files = save_hf_checkpoint(out, config, params, max_shard_bytes=20_000)
    assert sum(f.endswith(".safetensors") for f in files) > 1
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    np.testing.assert_allclose(_hf_logits(back), ref, atol=TOL, rtol=0)


def test_bfloat16_export(imported, root):
    _, _, ref, config, params, _ = imported("qwen2", False)
    out = os.path.join(root, "export-bf16")
    save_hf_checkpoint(out, config, params, dtype="bfloat16")
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.bfloat16
    assert np.abs(_hf_logits(back) - ref).max() < 0.1 * np.abs(ref).max()  # bf16 rounding, not garbage
    config16, params16 = load_hf_checkpoint(out)
    assert params16["embed"]["embedding"].dtype == jnp.float32


# ------------------------------------------------------------------------------------------------------
# Refusals and defaults (no model needed)
def _llama_dict(**changes):
    base = dict(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4)
    return {**base, **changes}


def test_pickle_weights_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_llama_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(UnsafeCheckpoint, match="pytorch_model.bin.*arbitrary code.*safe_serialization"):
        load_hf_checkpoint(str(tmp_path))


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="falcon"), "model_type 'falcon' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), "rope_type='yarn'"),
    (dict(model_type="gemma2", layer_types=["full_attention", "sliding_attention"], sliding_window=4),
     "layer_types"),
    (dict(model_type="gemma", use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_unsupported_configs_are_named(changes, match):
    with pytest.raises(hf_config.UnsupportedHFConfig, match=match):
        hf_config.config_from_hf(_llama_dict(**changes))


def test_checkpoint_fields_cannot_be_overridden_on_import():
    assert hf_config.config_from_hf(_llama_dict(), vocab_pad_multiple=256).padded_vocab == 256
    with pytest.raises(hf_config.UnsupportedHFConfig, match=r"\['tie_embeddings'\].*surgery"):
        hf_config.config_from_hf(_llama_dict(), tie_embeddings=True)


def test_gpt2_unsupported_option_is_named():
    gpt2 = dict(model_type="gpt2", vocab_size=V, n_embd=32, n_layer=1, n_head=4)
    with pytest.raises(hf_config.UnsupportedHFConfig, match="scale_attn_by_inverse_layer_idx"):
        hf_config.config_from_hf({**gpt2, "scale_attn_by_inverse_layer_idx": True})


@pytest.mark.parametrize("model_type,tied", [("gpt2", True), ("gemma", True), ("gemma2", True),
                                             ("llama", False), ("mistral", False), ("qwen2", False)])
def test_tie_default_when_key_absent(model_type, tied):
    hf = (dict(model_type="gpt2", vocab_size=V, n_embd=32, n_layer=1, n_head=4) if model_type == "gpt2"
          else _llama_dict(model_type=model_type, head_dim=8))
    assert "tie_word_embeddings" not in hf
    assert hf_config.config_from_hf(hf).tie_embeddings is tied


def test_family_defaults_match_transformers():
    """A key absent from config.json means the transformers class default: ours must be the same."""
    classes = dict(llama=transformers.LlamaConfig, mistral=transformers.MistralConfig, qwen2=transformers.Qwen2Config,
                   gemma=transformers.GemmaConfig, gemma2=transformers.Gemma2Config, gpt2=transformers.GPT2Config)
    for model_type, defaults in hf_config.FAMILY_DEFAULTS.items():
        hf = classes[model_type]()
        for key, value in defaults.items():
            if model_type == "qwen2" and key == "sliding_window":
                continue  # transformers clears it to None unless use_sliding_window (default False)
            theirs = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta") if key == "rope_theta" else None
            theirs = getattr(hf, key) if theirs is None else theirs
            assert theirs == value, (model_type, key)


def test_transformers_4_rope_layout_is_read():
    c = hf_config.config_from_hf(_llama_dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)))
    assert (c.rope_theta, c.rope_scaling_factor, c.rope_original_max_len) == (500000.0, 32.0, 8192)


def test_untied_checkpoint_without_head_is_refused(imported, root):
    _, folder, *_ = imported("llama", True)  # tied: no lm_head.weight in the file
    config = hf_config.config_from_hf({**json.load(open(os.path.join(folder, "config.json"))),
                                       "tie_word_embeddings": False})
    with pytest.raises(hf_weights.CheckpointMismatch, match="missing lm_head.weight.*tie_word_embeddings=true"):
        hf_weights.params_from_state(read_safetensors(folder), config)


def test_export_refuses_switches_without_hf_counterpart(imported):
    _, _, _, config, params, _ = imported("llama", False)
    for changes, field in ((dict(logit_scale=0.5), "logit_scale"), (dict(scale_input_embedding=True),
                                                                      "scale_input_embedding")):
        with pytest.raises(hf_config.UnsupportedHFConfig, match=field):
            hf_config.config_to_hf(config.replace(**changes))
    with pytest.raises(hf_weights.CheckpointMismatch, match="head_bias"):
        hf_weights.weight_entries(config.replace(head_bias=True))


def test_gpt2_names_without_prefix_and_buffers(imported):
    """The published 'gpt2' checkpoint was saved from GPT2Model: no 'transformer.' prefix, attn.bias buffers."""
    _, folder, _, config, params, _ = imported("gpt2", True)
    state = {k.removeprefix("transformer."): v for k, v in read_safetensors(folder).items()}
    state["h.0.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
    again = hf_weights.params_from_state(state, config)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state["h.0.attn.c_attn.extra"] = state["ln_f.weight"]
    with pytest.raises(hf_weights.CheckpointMismatch, match="unexpected transformer.h.0.attn.c_attn.extra"):
        hf_weights.params_from_state(state, config)


def test_tied_checkpoint_with_a_different_head_warns_and_ignores_it(imported):
    _, folder, _, config, params, _ = imported("llama", True)
    state = dict(read_safetensors(folder))
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0
    with pytest.warns(UserWarning, match="ignores lm_head.weight"):
        again = hf_weights.params_from_state(state, config)
    assert "lm_head" not in again
    np.testing.assert_array_equal(again["embed"]["embedding"], params["embed"]["embedding"])


def test_every_published_config_exports_and_reads_back():
    """configs/models/*.py: config_to_hf is accepted by transformers and reads back to the same model."""
    import glob

    from tieflax.config import load_config, model_config

    paths = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs", "models", "*.py")))
    assert len(paths) >= 6
    for path in paths:
        config = model_config(load_config(path))
        hf = hf_config.config_to_hf(config)
        theirs = transformers.AutoConfig.for_model(**hf)
        assert theirs.tie_word_embeddings is config.tie_embeddings, path
        back = hf_config.config_from_hf(json.loads(theirs.to_json_string()))
        assert hf_config.checkpoint_fields(back) == hf_config.checkpoint_fields(config), path
