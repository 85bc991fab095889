"""The literature measures (tieflax.analysis.literature, tieflax.study.literature) on constructed inputs whose
answer is known; the input-gradient intervention (train.tied_input_grad_scale) against a float64 reference
and, at 1.0, the step every config before it compiled; no interval and no verdict from too little data."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tieflax.analysis import literature as lit
from tieflax.analysis import stats as st
from tieflax.study import literature as study_lit


# ----------------------------------------------------------------------------------- unembedding bias
def _rotation(d: int, seed: int) -> np.ndarray:
    q, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(d, d)))
    return q


def test_a_tied_matrix_equal_to_the_head_is_like_the_head():
    rng = np.random.default_rng(0)
    w_in, w_out = rng.normal(size=(600, 16)), rng.normal(size=(600, 16))
    # The tied matrix is the head up to a rotation and a scale: CKA and neighbours cannot tell them apart.
    tied = 3.0 * w_out @ _rotation(16, 1)
    out = lit.alignment(tied, w_in, w_out, k=10, max_rows=200)
    assert out["cka_output"] == pytest.approx(1.0, abs=1e-12) and out["knn_output"] == 1.0
    assert out["cka_input"] < 0.1 and out["knn_input"] < 0.1  # an unrelated draw: about chance
    assert out["knn_chance"] == pytest.approx(10 / 599)
    assert out["cka_diff"] > 0.9 and out["knn_diff"] > 0.9
    back = lit.alignment(w_in.copy(), w_in, w_out, k=10, max_rows=200)  # equal to the input: the other sign
    assert back["cka_input"] == pytest.approx(1.0) and back["cka_diff"] < -0.9 and back["knn_diff"] < -0.9
    # Only the rows given count: the rows where the tied matrix is the head.
    mixed = w_in.copy()
    mixed[:300] = w_out[:300]
    assert lit.alignment(mixed, w_in, w_out, rows=np.arange(300), k=5)["cka_output"] == pytest.approx(1.0)


def test_nearest_neighbours_on_a_half_circle():
    """Rows at angles 0, 1, 2, ... degrees: row i's neighbours are i-1, i+1, i-2, i+2, ... (ties: lower id)."""
    angles = np.deg2rad(np.arange(40))
    w = np.stack([np.cos(angles), np.sin(angles)], 1) * np.linspace(1, 5, 40)[:, None]  # norms do not matter
    nn = lit.nearest_neighbours(w, k=4, queries=np.array([0, 10, 39]))
    np.testing.assert_array_equal(nn, [[1, 2, 3, 4], [9, 11, 8, 12], [38, 37, 36, 35]])
    assert lit.knn_overlap(w, w[:, ::-1] * [1, -1], k=4) == 1.0  # a rotation keeps every neighbourhood


# ------------------------------------------------------------------------------------------- paths
def test_path_ratio_early_and_late():
    rows = [dict(step=s, split="train", **{lit.HEAD_KEY: h, lit.LOOKUP_KEY: 1.0})
            for s, h in ((10, 8.0), (20, 8.0), (100, 2.0), (190, 1.0), (200, 1.0))]
    rows.append(dict(step=200, split="val", loss=3.0))  # other rows are ignored
    p = lit.path_ratio(rows, num_steps=200)
    assert p["early"] == pytest.approx(math.log(8)) and p["early_rows"] == 2
    assert p["late"] == pytest.approx(0.0) and p["late_rows"] == 2  # steps 190 and 200: after 180
    assert p["steps"] == [10, 20, 100, 190, 200]
    few = lit.path_ratio(rows[2:3], num_steps=200)  # no row in either window: the first and the last row
    assert few["early"] == few["late"] == pytest.approx(math.log(2))
    assert math.isnan(lit.path_ratio([dict(step=1, loss=2.0)], 10)["early"])  # an untied run logs neither


# ------------------------------------------------------------------------------------------- lenses
def test_layer_contribution_is_the_drop_between_two_layers():
    np.testing.assert_allclose(lit.layer_contribution([[5.0, 4.0], [3.0, 3.5], [1.0, 1.0]], 0, 1), [2.0, 0.5])


def _reference_lens(model, hidden, final_logits, steps: int):
    """The tuned-lens package's training of its ``TunedLens`` on ``model`` (its train loop and optimizer:
    tuned_lens/scripts/train_loop.py, ingredients.py), or, where the package is not installed, the same
    module written out (``h + Linear(h)`` zeroed, read through the model's final norm and head).
    Returns ([(weight [d, d], bias [d]) per layer], what ran)."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    try:
        from tuned_lens.nn.lenses import TunedLens

        lens = TunedLens.from_model(model)
        translators, forward, what = lens.layer_translators, (lambda h, i: lens(h, idx=i)), "tuned-lens package"
    except ImportError:
        d = hidden[0].shape[-1]
        translators = torch.nn.ModuleList([torch.nn.Linear(d, d) for _ in hidden])
        for t in translators:
            t.weight.data.zero_()
            t.bias.data.zero_()
        forward, what = (lambda h, i: model.lm_head(model.transformer.ln_f(h + translators[i](h)))), "written out"
    momentum = 0.9
    opt = torch.optim.SGD(translators.parameters(), lr=1.0 * (1 - momentum), momentum=momentum, nesterov=True,
                          weight_decay=1e-3)
    scheduler = get_linear_schedule_with_warmup(opt, 0, steps)
    labels = final_logits.log_softmax(-1)
    for _ in range(steps):
        for i, h in enumerate(hidden):
            logits = forward(h, i)
            torch.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean().backward()
        torch.nn.utils.clip_grad_norm_(translators.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
        scheduler.step()
    return [(t.weight.detach().numpy().astype(np.float64), t.bias.detach().numpy().astype(np.float64))
            for t in translators], what


def test_the_tuned_lens_trains_as_the_tuned_lens_package_does_on_a_tiny_hugging_face_model():
    """tieflax's translators (JAX/optax) against the package's own recipe in PyTorch on a 2-layer GPT-2 with
    random weights: the same translators after 250 steps within 1e-4, and the lens well below the logit
    lens's KL (training did something)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from train_support import torch_one_thread
    from tieflax.analysis import lens

    with torch_one_thread():   # 0.4 CPU-s, not 15.7 on a loaded machine (train_support says why)
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config).eval().requires_grad_(False)
        with torch.no_grad():
            out = model(torch.randint(0, 64, (8, 32)), output_hidden_states=True)
        hidden = [h.reshape(-1, 16) for h in out.hidden_states[:-1]]   # embeddings and block 1: 2 translators
        final = out.logits.reshape(-1, 64)
        steps = 250
        expected, what = _reference_lens(model, hidden, final, steps)

    ln, head = model.transformer.ln_f, model.lm_head.weight.detach().numpy()
    w, b, eps = ln.weight.detach().numpy(), ln.bias.detach().numpy(), ln.eps

    def logits_fn(h):   # GPT-2's final LayerNorm and head, in JAX
        mu = h.mean(-1, keepdims=True)
        var = ((h - mu) ** 2).mean(-1, keepdims=True)
        return ((h - mu) / jnp.sqrt(var + eps) * w + b) @ head.T

    xs = np.stack([h.numpy() for h in hidden])
    translators, history = lens.train_translators(xs, final.numpy(), logits_fn, target_fn=lambda t: jax.nn.log_softmax(t),
                                                  steps=steps, batch_tokens=len(final))
    for i, (weight, bias) in enumerate(expected):
        np.testing.assert_allclose(np.asarray(translators["a"][i]), weight.T, atol=1e-4, err_msg=f"{what}, layer {i}")
        np.testing.assert_allclose(np.asarray(translators["b"][i]), bias, atol=1e-4, err_msg=f"{what}, layer {i}")
    target = jax.nn.log_softmax(jnp.asarray(final.numpy()))
    for i in range(2):
        tuned = float(lens.kl_from_final(target, logits_fn(lens.translate(translators, i, xs[i]))))
        plain = float(lens.kl_from_final(target, logits_fn(jnp.asarray(xs[i]))))
        assert tuned < 0.9 * plain, (i, tuned, plain)
    assert history[-1] < history[0]
    assert np.abs(np.asarray(translators["a"])).max() > 1e-3   # it moved away from the identity


def test_the_tuned_lens_optimizer_is_the_packages_sgd():
    """One step by hand: clip to norm 1, add the decay, Nesterov momentum, learning rate 1.0 x (1 - 0.9)."""
    from tieflax.analysis import lens

    opt = lens.optimizer(steps=10)
    p = {"w": jnp.array([1.0, -2.0])}
    g = {"w": jnp.array([3.0, 4.0])}                   # norm 5: clipped to norm 1
    updates, _ = opt.update(g, opt.init(p), p)
    clipped = np.array([0.6, 0.8]) + 1e-3 * np.array([1.0, -2.0])
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * (clipped + 0.9 * clipped), rtol=1e-6)


def test_lens_of_identity_blocks_equals_the_model_at_every_layer():
    """Blocks whose kernels are all zero add nothing to the residual stream: every layer reads out as the
    model does (logit lens = the model's loss), and the tuned lens's translator is the identity."""
    from tieflax.model import ModelConfig, TransformerLM
    from tieflax.study.evidence import lens_measures, validation

    mc = ModelConfig(family="llama", vocab_size=200, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                     tie_embeddings=False)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 200), np.int32)
    params = jax.jit(TransformerLM(mc).init)(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
    params = {k: (jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.zeros_like(v) if "kernel" in jax.tree_util.keystr(path) else v, p)
        if k.startswith("block_") else p) for k, p in params.items()}
    batches = [dict(inputs=tokens[:4], targets=np.roll(tokens[:4], -1, 1)),
               dict(inputs=tokens[4:], targets=np.roll(tokens[4:], -1, 1))]
    doc_ids = [np.repeat(np.arange(2), 2)[:, None] * np.ones((1, 16), np.int64),
               np.repeat(np.arange(2, 4), 2)[:, None] * np.ones((1, 16), np.int64)]
    val = validation(mc, params, batches, doc_ids, 4, {})
    out = lens_measures(mc, params, batches, doc_ids, 4, val["doc_loss"], {}, fit_tokens=64)
    assert out["fit_docs"] == 2 and out["score_docs"] == 2 and out["fit_tokens"] == 64
    assert out["doc_tokens"] == [0, 0, 32, 32]
    for kind in ("logit", "tuned"):
        for layer in range(3):
            np.testing.assert_allclose(out[kind][layer][2:], val["doc_loss"][2:], rtol=2e-5)
            assert out[kind][layer][:2] == [0.0, 0.0]  # the fitting half is never scored
    one = lens_measures(mc, params, batches[:1], [np.zeros((4, 16), np.int64)], 1, [1.0], {})
    assert "1 held-out document" in one["missing"]


def test_lens_of_a_scanned_model_is_the_lens_of_the_unrolled_one():
    """The residual stream comes from the model (``TransformerLM.residual_stream``), scanned layers included."""
    from tieflax.model import ModelConfig, TransformerLM
    from tieflax.model.layer_stacking import stack_layers
    from tieflax.study.evidence import lens_measures

    mc = ModelConfig(family="llama", vocab_size=200, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 200), np.int32)
    params = jax.jit(TransformerLM(mc).init)(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
    batches = [dict(inputs=tokens[:4], targets=np.roll(tokens[:4], -1, 1)),
               dict(inputs=tokens[4:], targets=np.roll(tokens[4:], -1, 1))]
    doc_ids = [np.repeat(np.arange(2), 2)[:, None] * np.ones((1, 16), np.int64),
               np.repeat(np.arange(2, 4), 2)[:, None] * np.ones((1, 16), np.int64)]
    final = [1.0] * 4
    out = lens_measures(mc, params, batches, doc_ids, 4, final, {}, fit_tokens=64)
    scanned = mc.replace(scan_layers=True)
    stacked = stack_layers(params, scanned)
    out_scanned = lens_measures(scanned, stacked, batches, doc_ids, 4, final, {}, fit_tokens=64)
    assert "missing" not in out_scanned and out_scanned["layers"] == 2
    assert out_scanned["doc_tokens"] == out["doc_tokens"] == [0, 0, 32, 32]
    for kind in ("logit", "tuned"):
        np.testing.assert_allclose(out_scanned[kind], out[kind], rtol=1e-5)
        assert out[kind][0][2] != out[kind][1][2]  # the layers differ: a real stream, not identity blocks


def test_the_tuned_lens_layer_0_value_survives_an_ulp_change_of_every_parameter():
    """The least-squares fit it replaces moved a narrow embedding's layer-0 value in its third decimal when
    an ulp changed; the KL-trained lens, from the identity, keeps the printed digits (3 decimals) when every
    parameter moves by one ulp."""
    from tieflax.model import ModelConfig, TransformerLM
    from tieflax.study.evidence import lens_measures, validation
    from tieflax.study.literature import LENS_DIGITS

    mc = ModelConfig(family="llama", vocab_size=200, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16,
                     tie_embeddings=False, embed_dim=8)   # a narrow embedding, as untied_matched's
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, 16), 0, 200), np.int32)
    params = jax.jit(TransformerLM(mc).init)(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(lambda x: np.asarray(getattr(x, "value", x)), params, is_leaf=lambda x: hasattr(x, "value"))
    nudged = jax.tree.map(lambda x: np.nextafter(x, np.inf, dtype=x.dtype), params)
    batches = [dict(inputs=tokens[:4], targets=np.roll(tokens[:4], -1, 1)),
               dict(inputs=tokens[4:], targets=np.roll(tokens[4:], -1, 1))]
    doc_ids = [np.repeat(np.arange(2), 2)[:, None] * np.ones((1, 16), np.int64),
               np.repeat(np.arange(2, 4), 2)[:, None] * np.ones((1, 16), np.int64)]
    layer0 = []
    for p in (params, nudged):
        val = validation(mc, p, batches, doc_ids, 4, {})
        out = lens_measures(mc, p, batches, doc_ids, 4, val["doc_loss"], {}, fit_tokens=64, recipe=dict(batch_tokens=16))
        assert out["method"] == "kl" and out["recipe"]["steps"] == 250 and len(out["kl"]) == 2
        layer0.append(np.sum(out["tuned"][0]) / np.sum(out["doc_tokens"]))
    assert f"{layer0[0]:.{LENS_DIGITS}f}" == f"{layer0[1]:.{LENS_DIGITS}f}", layer0
    assert layer0[0] != layer0[1]   # the nudge reached the lens


# --------------------------------------------------------------------------------------- rare tokens
def test_bin_sums_and_a_difference_only_in_rare_tokens():
    losses = np.array([[1.0, 2.0, 3.0, 4.0]])
    targets = np.array([[0, 1, 2, -1]])
    docs = np.array([[0, 0, 1, 1]])
    loss, tokens = lit.bin_sums(losses, targets, docs, np.array([0, 1, 1]), n_docs=2, n_bins=2)
    np.testing.assert_array_equal(loss, [[1.0, 2.0], [0.0, 3.0]])
    np.testing.assert_array_equal(tokens, [[1, 1], [0, 1]])
    # Two variants that differ only on bin 0 (the rarest of 4): the rarest half carries all of it.
    rng = np.random.default_rng(0)
    tok = rng.integers(5, 20, size=(6, 4)).astype(float)
    base = rng.normal(3, 0.1, size=(6, 4)) * tok

    def run(seed, variant, shift):
        loss = base + rng.normal(0, 1e-3, size=base.shape) * tok
        loss[:, 0] -= shift * tok[:, 0]
        return dict(seed=seed, variant=variant, analysis=dict(val=dict(doc_bin_loss=loss.tolist(),
                                                                        doc_bin_tokens=tok.tolist())))

    groups = {"tied": [run(s, "tied", 0.0) for s in range(3)], "untied": [run(s, "untied", 0.5) for s in range(3)]}
    comp = study_lit.rare_compare({"compare": {"bootstrap": 300}}, groups, "untied", "tied")
    share = comp["share"]
    token_share = tok[:, :2].sum() / tok.sum()
    assert comp["share"]["token_share"] == pytest.approx(token_share)
    assert share["mean"] == pytest.approx(1 - token_share, abs=0.01) and share["lo"] > 0
    assert comp["bins"][0]["hi"] < 0 and comp["bins"][2]["lo"] < 0 < comp["bins"][2]["hi"]
    assert study_lit.judge(share, "above") == study_lit.HOLDS


# ----------------------------------------------------------------------------------- too little data
def test_no_interval_and_no_verdict_below_two_units_per_level():
    tokens = np.full(5, 10.0)
    one_seed = st.two_level_bootstrap(np.ones((1, 5)), np.zeros((1, 5)), tokens)
    assert math.isnan(one_seed["lo"]) and one_seed["missing"] == "1 seed: no interval over seeds"
    assert math.isfinite(one_seed["doc_lo"])  # the documents alone still resample
    one_doc = st.two_level_bootstrap(np.ones((3, 1)), np.zeros((3, 1)), tokens[:1])
    assert math.isnan(one_doc["lo"]) and one_doc["missing"] == "1 document: no interval over documents"
    v = st.verdict(one_seed, "worse", "better")
    assert v.startswith("no verdict from < 2 units (1 seed: no interval over seeds)") and "worse" not in v
    assert "nan" not in st.fmt_ci(dict(one_seed, n=1)).lower() and st.fmt_interval(math.nan, 1.0) == "no interval"
    assert study_lit.judge(one_seed, "above") == study_lit.LITTLE
    ratio = st.two_level_ratio(np.full((3, 4), 3.0), np.full((3, 4), 10.0), n_boot=100)
    assert ratio["mean"] == pytest.approx(0.3) and ratio["lo"] == pytest.approx(0.3) == ratio["hi"]
    minus = st.two_level_ratio(np.full((3, 4), 3.0), np.full((3, 4), 10.0), minus=(np.ones(4), np.full(4, 4.0)))
    assert minus["mean"] == pytest.approx(0.05)
    assert st.two_level_ratio(np.ones((1, 4)), np.ones((1, 4)))["missing"] == "1 seed: no interval over seeds"


# --------------------------------------------------------------------------------- the intervention
def _step_setup(monkeypatch=None, scale=None, capture=False):
    """A tied 1-layer model's compiled train step on the 8 CPU devices; ``scale`` None: the field absent
    (every config written before it); ``capture``: the optimizer state becomes the step's gradient."""
    import flax.linen as nn
    import optax

    from train_support import micro_config
    from tieflax import sharding as shd
    from tieflax import train
    from tieflax.train import step as train_step

    config = micro_config("/nonexistent")
    config.train.warmup_steps = 0
    config.train.loss_impl = "dense"  # compiles in a fraction of the fused loss's time; the same gradient
    if scale is None:
        del config.train["tied_input_grad_scale"]
    else:
        config.train.tied_input_grad_scale = scale
    if capture:
        tx = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                          lambda g, state, params=None: (jax.tree.map(jnp.zeros_like, g), g))
        monkeypatch.setattr(train_step, "make_optimizer", lambda c: (tx, optax.constant_schedule(0.0)))
    mesh = train.setup_mesh(config)
    with nn.logical_axis_rules(shd.LOGICAL_AXIS_RULES):
        s = train.build(config, mesh)
        return config, s, train.make_train_step(config, s), mesh


def _batch(mesh, seed=0):
    from tieflax import sharding as shd

    ids = np.asarray(jax.random.randint(jax.random.key(seed), (16, 33), 0, 512), np.int32)
    host = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "segment_ids": np.ones((16, 32), np.int32),
            "positions": np.broadcast_to(np.arange(32, dtype=np.int32), (16, 32))}
    return host, {k: jax.device_put(v, shd.batch_sharding(mesh)) for k, v in host.items()}


def test_input_grad_scale_one_is_the_step_of_every_config_before_it():
    """At 1.0 the step compiles to the program of a config without the field and trains bit for bit like
    it; another scale changes the program (so the comparison has teeth)."""
    programs, params = {}, {}
    for scale in (None, 1.0, 2.0):
        _, s, step, mesh = _step_setup(scale=scale)
        _, batch = _batch(mesh)
        programs[scale] = step.lower(s.abstract_state, batch).as_text()
        if scale != 2.0:
            state = s.init_state(jax.random.key(0))
            for seed in range(2):
                state, metrics = step(state, _batch(mesh, seed)[1])
            params[scale] = (jax.device_get(state["params"]), float(metrics["loss"]))
    assert programs[1.0] == programs[None] != programs[2.0]
    assert params[1.0][1] == params[None][1]
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), params[1.0][0], params[None][0])


def test_scaled_gradient_matches_a_float64_reference_of_the_two_paths(monkeypatch):
    """The step's gradient into the tied matrix is ``s * g_lookup + g_head``: the head path recomputed in
    float64 from the final hidden states (softmax(h W^T) - onehot(y))^T h / N, the lookup path from the
    untied view's gradient, summed in float64."""
    from tieflax.config import model_config
    from tieflax.model import TransformerLM
    from tieflax.model.tie import untied_view

    scale = 3.0
    config, s, step, mesh = _step_setup(monkeypatch, scale=scale, capture=True)
    host, batch = _batch(mesh)
    state = s.init_state(jax.random.key(0))
    params = jax.device_get(state["params"])
    new_state, _ = step(state, batch)
    got = np.asarray(jax.device_get(new_state["opt_state"]["embed"]["embedding"]), np.float64)

    mc = model_config(config)
    untied = TransformerLM(mc.replace(tie_embeddings=False))
    dense = lambda p: untied.apply({"params": p}, host["inputs"], host["targets"], host["positions"],  # noqa: E731
                                   host["segment_ids"], method=TransformerLM.dense_loss)[0]
    split = jax.jit(jax.grad(lambda p: dense(p).sum() / host["targets"].size))(untied_view(params))
    lookup, head32 = split["embed"]["embedding"], split["lm_head"]["embedding"]
    h = np.asarray(TransformerLM(mc).apply({"params": params}, host["inputs"], host["positions"],
                                          host["segment_ids"], method=TransformerLM.hidden_states),
                   np.float64).reshape(-1, mc.d_model)
    w = np.asarray(params["embed"]["embedding"], np.float64)
    logits = h @ w.T
    logits[:, mc.vocab_size:] = -np.inf
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y = host["targets"].reshape(-1)
    p[np.arange(len(y)), y] -= 1.0
    head64 = p.T @ h / len(y)
    np.testing.assert_allclose(np.asarray(head32, np.float64), head64, atol=1e-6 * np.abs(head64).max())
    ref = scale * np.asarray(lookup, np.float64) + head64
    assert np.abs(np.asarray(lookup)).max() > 0.1 * np.abs(head64).max()  # both paths matter here
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    # The scale is on the lookup path only: the head path alone would be off by (s - 1) g_lookup.
    assert np.abs(got - (np.asarray(lookup, np.float64) + head64)).max() > 0.5 * np.abs(lookup).max()


def test_the_scale_is_validated_and_refused_untied():
    from tieflax.config import load_config
    from tieflax.model import ConfigError

    path = "configs/experiments/tiny.py"
    with pytest.raises(ConfigError, match=r"config.train.tied_input_grad_scale = 0.0 is out of range \(0.0, inf\]"):
        load_config(path, ["train.tied_input_grad_scale=0.0"])
    with pytest.raises(ConfigError, match="has no effect with model.tie_embeddings=False"):
        load_config(path, ["train.tied_input_grad_scale=2.0", "model.tie_embeddings=False"])
    assert load_config(path, ["train.tied_input_grad_scale=2.0"]).train.tied_input_grad_scale == 2.0
