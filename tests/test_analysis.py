"""Embedding diagnostics on constructed inputs with known answers (float64 NumPy oracles)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from tieflax import analysis
from tieflax.model import ModelConfig, TransformerLM, head_loss_kwargs


RNG = np.random.default_rng(0)


def _pad(w, rows=8):
    """Append padding rows full of huge values: any diagnostic that reads them is visibly wrong."""
    return np.concatenate([w, np.full((rows, w.shape[1]), 1e6)], 0)


# Frequency ---------------------------------------------------------------------------------------------
def test_frequency_buckets_split_by_rank_rarest_first():
    counts = np.array([50, 0, 7, 7, 1000, 3, 9, 2])
    buckets = analysis.frequency_buckets(counts, 4)
    # sorted by (count, id): 1(0), 7(2), 5(3), 2(7), 3(7), 6(9), 0(50), 4(1000)
    np.testing.assert_array_equal(buckets, [3, 0, 1, 2, 3, 1, 2, 0])
    with pytest.raises(ValueError, match="n_buckets"):
        analysis.frequency_buckets(counts, 9)
    with pytest.raises(ValueError, match="negative"):
        analysis.frequency_buckets(-counts, 2)


def test_frequency_norm_planted_correlation_and_padding_ignored():
    v, d = 400, 16
    counts = RNG.permutation(np.arange(1, v + 1) ** 2)
    directions = RNG.normal(size=(v, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = 1.0 + np.log(counts)  # norm grows with frequency: rank correlation exactly 1
    out = analysis.frequency_norm(_pad(directions * norms[:, None]), counts, n_buckets=4)
    assert out["spearman"] == pytest.approx(1.0)
    assert np.all(np.diff(out["bucket_norm"]) > 0)
    buckets = analysis.frequency_buckets(counts, 4)
    np.testing.assert_allclose(out["bucket_norm"], [norms[buckets == b].mean() for b in range(4)])
    np.testing.assert_allclose(out["bucket_log10_freq"],
                               [np.log10(counts[buckets == b] / counts.sum()).mean() for b in range(4)])
    reversed_ = analysis.frequency_norm(directions * (100 - norms)[:, None], counts)
    assert reversed_["spearman"] == pytest.approx(-1.0)
    noisy = directions * RNG.uniform(1, 2, size=(v, 1))
    assert abs(analysis.frequency_norm(noisy, counts)["spearman"]) < 0.15


# Geometry ----------------------------------------------------------------------------------------------
def test_isotropic_gaussian_rows():
    v, d = 3000, 16
    w = _pad(RNG.normal(size=(v, d)) * 0.3)
    assert abs(analysis.mean_pairwise_cosine(w, v, max_rows=None)) < 0.01
    assert analysis.isotropy_score(w, v) > 0.9
    assert analysis.effective_rank(w, v) > 0.95 * d
    # A shared offset (the anisotropy the seeds describe) lowers all three.
    shifted = w[:v] + 3.0 * np.eye(d)[0]
    assert analysis.mean_pairwise_cosine(shifted, v, max_rows=None) > 0.8  # ~ 9 / (9 + 16 * 0.09)
    assert analysis.isotropy_score(shifted, v) == pytest.approx(np.exp(-6), rel=0.1)  # Z(-e1) / Z(e1)
    assert analysis.effective_rank(shifted, v) < 0.7 * d  # one singular value ~10x the others: ~9.9


def test_mean_pairwise_cosine_exact_on_signed_copies():
    n_pos, n_neg = 30, 10
    w = np.concatenate([np.tile([2.0, 0, 0], (n_pos, 1)), np.tile([-0.5, 0, 0], (n_neg, 1))])
    n = n_pos + n_neg
    expected = (n_pos * (n_pos - 1) + n_neg * (n_neg - 1) - 2 * n_pos * n_neg) / (n * (n - 1))
    assert analysis.mean_pairwise_cosine(_pad(w), n) == pytest.approx(expected, abs=1e-12)
    cos = analysis.pairwise_cosines(w, n, max_rows=None)
    assert cos.shape == (n * (n - 1) // 2,) and cos.mean() == pytest.approx(expected, abs=1e-12)
    # Sampling: a subset of rows, deterministic for a seed.
    a = analysis.mean_pairwise_cosine(RNG.normal(size=(500, 4)), 500, max_rows=50, seed=3)
    assert np.isfinite(a)


def test_effective_rank_counts_equal_singular_values():
    q, _ = np.linalg.qr(RNG.normal(size=(200, 200)))
    for r in (1, 5, 12):
        w = q[:, :r] @ np.diag([3.0] * r) @ np.linalg.qr(RNG.normal(size=(16, 16)))[0][:r]
        assert analysis.effective_rank(_pad(w), 200) == pytest.approx(r, rel=1e-9)


def test_isotropy_score_matches_definition():
    v, d = 100, 5
    w = RNG.normal(size=(v, d)) + np.array([1.0, 0, 0, 0, 0])
    _, vecs = np.linalg.eigh(w.T @ w)
    z = [np.exp(w @ (s * c)).sum() for c in vecs.T for s in (1, -1)]
    assert analysis.isotropy_score(_pad(w), v) == pytest.approx(min(z) / max(z), rel=1e-10)


def test_in_out_similarity_known_answers():
    v, d = 300, 8
    a = RNG.normal(size=(v, d))
    q, _ = np.linalg.qr(RNG.normal(size=(d, d)))
    same = analysis.in_out_similarity(_pad(a), _pad(a), v)
    assert same["row_cosine_mean"] == pytest.approx(1.0) and same["cka"] == pytest.approx(1.0)
    rotated = analysis.in_out_similarity(a, 2.5 * a @ q, v)  # CKA sees through rotation and scale
    assert rotated["cka"] == pytest.approx(1.0)
    assert rotated["row_cosine_mean"] < 0.9
    assert analysis.in_out_similarity(a, -a, v)["row_cosine_mean"] == pytest.approx(-1.0)
    independent = analysis.in_out_similarity(a, RNG.normal(size=(v, d)), v)
    assert independent["cka"] < 0.15 and abs(independent["row_cosine_mean"]) < 0.1
    # CKA against a float64 oracle written in the sample (n x n) form of Kornblith et al.
    b = RNG.normal(size=(v, d)) + a
    k, l_ = a @ a.T, b @ b.T
    h = np.eye(v) - 1.0 / v
    hsic = lambda x, y: np.trace(x @ h @ y @ h)  # noqa: E731
    assert analysis.linear_cka(a, b, v) == pytest.approx(hsic(k, l_) / np.sqrt(hsic(k, k) * hsic(l_, l_)))


# Gradients ---------------------------------------------------------------------------------------------
def test_gradient_interference_constructed_split():
    v, d = 8, 3
    counts = np.array([1, 2, 3, 4, 5, 6, 7, 8])  # buckets (2): rows 0-3 rare, 4-7 common
    head = np.ones((v, d))
    lookup = np.zeros((v, d))
    lookup[4] = 2.0          # same direction, norm ratio 2
    lookup[5] = -1.0         # opposite direction, ratio 1
    lookup[6] = [1, -1, 0]   # orthogonal, ratio sqrt(2)/sqrt(3)
    lookup[1] = -3.0         # a rare row: opposite, ratio 3
    out = analysis.gradient_interference(_pad(lookup), _pad(head), counts, n_buckets=2)
    assert out["rows_lookup"] == 4 / 8 and out["rows_head"] == 1.0 and out["rows_both"] == 4 / 8
    assert out["cosine_mean"] == pytest.approx((1 - 1 + 0 - 1) / 4)
    assert out["conflict_fraction"] == pytest.approx(2 / 4)
    assert out["norm_ratio_median"] == pytest.approx(np.median([2, 1, np.sqrt(2 / 3), 3]))
    assert out["bucket_cosine"] == pytest.approx([-1.0, 0.0])
    assert out["bucket_rows_lookup"] == [0.25, 0.75]
    assert out["bucket_norm_ratio"] == pytest.approx([3.0, 1.0])
    sq_l, sq_h = (lookup ** 2).sum(), (head ** 2).sum()
    assert out["head_share"] == pytest.approx(sq_h / (sq_l + sq_h))
    assert out["matrix_cosine"] == pytest.approx((lookup * head).sum() / np.sqrt(sq_l * sq_h))
    with pytest.raises(ValueError, match="same shape"):
        analysis.gradient_interference(lookup[:, :2], head, counts)


V = 200
TINY = ModelConfig(family="llama", vocab_size=V, vocab_pad_multiple=128, d_model=32, n_layers=1, n_heads=2,
                   d_ff=64, max_seq_len=16, tie_embeddings=True)


@pytest.fixture(scope="module")
def tiny_tied():
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 60)  # ids >= 60 never appear as inputs
    params = jax.jit(TransformerLM(TINY).init)(jax.random.key(0), tokens)["params"]
    return jax.tree.map(lambda x: getattr(x, "value", x), params,
                        is_leaf=lambda x: hasattr(x, "value")), tokens


def test_split_gradient_sums_to_the_tied_gradient(tiny_tied):
    params, tokens = tiny_tied
    batch = dict(inputs=tokens, targets=jnp.roll(tokens, -1, axis=1).at[:, -1].set(-1))
    lookup, head = analysis.split_embedding_gradients(TINY, params, batch)
    model = TransformerLM(TINY)

    def tied_loss(p):
        loss, _ = model.apply({"params": p}, batch["inputs"], batch["targets"], method=TransformerLM.loss)
        return loss.sum() / jnp.sum(batch["targets"] >= 0)

    tied = jax.jit(jax.grad(tied_loss))(params)["embed"]["embedding"]
    np.testing.assert_allclose(np.asarray(lookup) + np.asarray(head), tied, rtol=1e-5, atol=1e-8)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=V)
    out = analysis.gradient_interference(lookup, head, counts, n_buckets=4)
    # The lookup updates exactly the rows of input tokens that feed a scored position (the last
    # position's target is ignored, and nothing attends to it); the head updates every valid row.
    assert out["rows_lookup"] == pytest.approx(len(np.unique(np.asarray(tokens)[:, :-1])) / V)
    assert out["rows_head"] == 1.0
    assert out["bucket_rows_lookup"][0] == 0.0  # the rarest bucket: never-seen tokens


# Softmax -----------------------------------------------------------------------------------------------
def test_softmax_statistics_match_float64_and_the_loss_aux(tiny_tied):
    params, tokens = tiny_tied
    config = TINY.replace(final_logit_softcap=5.0, logit_scale=1.7)
    model = TransformerLM(config)
    hidden, weight, _ = jax.jit(lambda p, t: model.apply({"params": p}, t, method=TransformerLM.features))(
        params, tokens)
    kw = head_loss_kwargs(config)
    lse, mean_prob = analysis.softmax_statistics(hidden, weight, vocab_size=V, logit_scale=kw["logit_scale"],
                                                 softcap=kw["softcap"], token_block=12)  # 32 = 12+12+8
    h = np.asarray(hidden, np.float64).reshape(-1, 32)
    z = h @ np.asarray(weight, np.float64)[:V].T * 1.7
    z = 5.0 * np.tanh(z / 5.0)
    ref_lse = np.log(np.exp(z).sum(1))
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    np.testing.assert_allclose(mean_prob, np.exp(z - ref_lse[:, None]).mean(0), rtol=1e-4, atol=1e-9)
    assert mean_prob.shape == (V,) and mean_prob.sum() == pytest.approx(1.0, abs=1e-5)
    _, aux = jax.jit(lambda p, t: model.apply({"params": p}, t, jnp.roll(t, -1, 1), method=TransformerLM.loss))(
        params, tokens)
    np.testing.assert_allclose(lse, np.asarray(aux["lse"]).ravel(), rtol=1e-5)


def test_softmax_diagnostics_by_bucket():
    counts = np.array([1, 1, 2, 2, 10, 10, 30, 40])
    data = counts / counts.sum()
    out = analysis.softmax_diagnostics(np.array([1.0, 2.0, 3.0]), data, counts, n_buckets=2)
    assert out["mean_lse"] == pytest.approx(2.0)
    np.testing.assert_allclose(out["bucket_mass_ratio"], [1.0, 1.0])  # calibrated on unigram frequency
    uniform = analysis.softmax_diagnostics(np.zeros(3), np.full(8, 1 / 8), counts, targets=np.array([0, 7, -1]),
                                           n_buckets=2)
    np.testing.assert_allclose(uniform["bucket_mass"], [0.5, 0.5])
    np.testing.assert_allclose(uniform["bucket_mass_ratio"], [0.5 / (6 / 96), 0.5 / (90 / 96)])
    assert uniform["bucket_lse"] == [0.0, 0.0]


# The training hook -------------------------------------------------------------------------------------
def test_training_diagnostics_flat_keys_tied_and_untied():
    v, d = 300, 8
    counts = RNG.integers(0, 100, size=v)
    w = _pad(RNG.normal(size=(v, d)))
    tied = analysis.training_diagnostics({"embed": {"embedding": w}}, counts, lookup_grad=w, head_grad=-w)
    assert all(isinstance(x, float) for x in tied.values())
    assert tied["diag/input/spearman"] == tied["diag/output/spearman"]
    assert tied["diag/gradient/cosine_mean"] == pytest.approx(-1.0)
    assert "diag/in_out/cka" not in tied and "diag/input/bucket_norm/3" in tied
    assert tied["diag/input/spearman"] == pytest.approx(
        stats.spearmanr(np.linalg.norm(w[:v], axis=1), counts).statistic)
    untied = analysis.training_diagnostics({"embed": {"embedding": w}, "lm_head": {"embedding": 2 * w}}, counts)
    assert untied["diag/in_out/cka"] == pytest.approx(1.0)
    assert untied["diag/output/mean_norm"] == pytest.approx(2 * untied["diag/input/mean_norm"])
    assert not any(k.startswith("diag/gradient") for k in untied)
    with pytest.raises(ValueError, match="both"):
        analysis.training_diagnostics({"embed": {"embedding": w}}, counts, lookup_grad=w)
    with pytest.raises(ValueError, match="embed/embedding"):
        analysis.training_diagnostics({"params": {}}, counts)


# Corrected measures: planted answers ----------------------------------------------------------------
from tieflax.analysis import measures, stats as st  # noqa: E402


def _zipf_counts(v=2000, seed=1):
    return np.random.default_rng(seed).permutation((1e5 / np.arange(1, v + 1)).astype(np.int64))


def test_mass_bins_hold_equal_token_mass_and_strata_recover_a_planted_profile():
    counts = _zipf_counts()
    bins = measures.mass_bins(counts, 8)
    mass = np.array([counts[bins == b].sum() for b in range(8)]) / counts.sum()
    assert np.all(np.abs(mass - 1 / 8) < 0.07) and bins[np.argmax(counts)] == 7 and bins[np.argmin(counts)] == 0
    rng = np.random.default_rng(2)
    d = 16
    u = measures._unit(rng.normal(size=(counts.size, d)))
    # Planted: norms fall with frequency over the rare half of the mass, rise over the frequent half
    # (the U shape): one rho over all rows hides it, the strata show it.
    lf = np.log(counts)
    split = np.median(lf[bins >= 4])
    norms = np.where(bins >= 4, 1 + (lf - split), 1 + 0.5 * (lf.max() - lf) / lf.max())
    out = measures.frequency_profile(_pad(u * norms[:, None]), counts, 8)
    assert out["rho_head"] == pytest.approx(1.0)
    assert all(r == pytest.approx(1.0) for r, b in zip(out["rho"], range(8)) if b >= 4 and np.isfinite(r))
    assert all(r == pytest.approx(-1.0, abs=1e-3) for r, b in zip(out["rho"], range(8)) if b < 4 and np.isfinite(r))
    assert sum(out["rows"]) == counts.size and sum(out["mass"]) == pytest.approx(1.0)
    np.testing.assert_allclose(out["norm"], [norms[bins == b].mean() for b in range(8)])
    shuffled = measures.frequency_profile(measures.shuffled_rows(u * norms[:, None], counts.size), counts, 8)
    assert abs(shuffled["rho_head"]) < 0.2  # the control loses the planted relation


def test_row_movement_by_bin():
    counts = _zipf_counts(500)
    bins = measures.mass_bins(counts, 4)
    w0 = RNG.normal(size=(500, 8))
    step = np.where(bins == 3, 2.0, 0.5)[:, None] * measures._unit(RNG.normal(size=(500, 8)))
    out = measures.row_movement(_pad(w0 + step), _pad(w0), counts, 4)
    np.testing.assert_allclose(out["bin_move"], [0.5, 0.5, 0.5, 2.0])
    assert out["move_ratio_top_bottom"] == pytest.approx(4.0)
    np.testing.assert_allclose(out["bin_rel"][3], (2.0 / np.linalg.norm(w0, axis=1))[bins == 3].mean())


def test_unit_anisotropy_planted_common_direction_and_rank():
    v, d = 2000, 32
    counts = np.ones(v, np.int64)
    e1 = np.eye(d)[0]
    noise = RNG.normal(size=(v, d))
    noise[:, 0] = 0
    theta = np.deg2rad(60)  # u = cos(theta) e1 + sin(theta) n: expected pairwise cosine cos^2 = 0.25
    u = np.cos(theta) * e1 + np.sin(theta) * measures._unit(noise)
    out = measures.unit_anisotropy(_pad(7.0 * u), counts, max_rows=None)  # a row scale changes nothing
    assert out["mean_cosine"] == pytest.approx(0.25, abs=0.01)
    assert out["effective_rank_frac"] > 0.9  # centring removes the common direction
    iso = measures.unit_anisotropy(measures._unit(RNG.normal(size=(v, d))), counts, max_rows=None)
    assert abs(iso["mean_cosine"]) < 0.01 and iso["isotropy_centered"] > 0.5
    # Rows on +-e_k for k < 4, equally often: exactly 4 equal singular values after centring.
    flat = np.concatenate([np.eye(d)[:4], -np.eye(d)[:4]] * 50)
    out = measures.unit_anisotropy(flat, np.ones(400, np.int64), max_rows=None)
    assert out["effective_rank_frac"] == pytest.approx(4 / d)
    # Frequency-weighted: the frequent tokens share a direction, the rare ones do not.
    counts = np.r_[np.full(100, 1000), np.ones(v - 100)].astype(np.int64)
    w = measures._unit(RNG.normal(size=(v, d)))
    w[:100] = e1
    out = measures.unit_anisotropy(w, counts, max_rows=None)
    p = counts / counts.sum()
    expected = (np.sum(p[:100]) ** 2 - np.sum(p[:100] ** 2)) / (1 - np.sum(p ** 2))  # ~ share^2
    assert out["mean_cosine_freq"] == pytest.approx(expected, abs=0.02) and out["mean_cosine"] < 0.01
    # All-but-the-top removes one dominant direction from the centred rows.
    spiky = RNG.normal(size=(v, d)) + np.outer(RNG.normal(size=v) * 6, np.eye(d)[1])
    out = measures.unit_anisotropy(spiky, np.ones(v, np.int64), max_rows=None, n_top=1)
    assert out["isotropy_abtt"] > out["isotropy_centered"] + 0.1 and out["top_pc_share"] > 0.3
    assert iso["top_pc_share"] == pytest.approx(1 / d, rel=0.3)


def test_mean_cosine_from_sum_matches_pairs():
    u = measures._unit(RNG.normal(size=(50, 6)) + 1.0)
    gram = u @ u.T
    expected = gram[np.triu_indices(50, 1)].mean()
    assert measures.mean_cosine_from_sum(u.sum(0), 50.0, 50) == pytest.approx(expected)


def test_accumulated_interference_planted_alignment():
    v, d = 300, 8
    counts = _zipf_counts(v)
    a, b = RNG.normal(size=(v, d)), RNG.normal(size=(v, d))
    b -= a * (a * b).sum() / (a * a).sum()  # b orthogonal to a
    a, b = a / np.linalg.norm(a), b / np.linalg.norm(b)
    for c in (-0.6, 0.0, 0.8):
        head = c * a + np.sqrt(1 - c ** 2) * b
        out = measures.accumulated_interference(_pad(a), _pad(head), np.ones((v, d)), counts)
        assert out["cosine"] == pytest.approx(c, abs=1e-12)
        assert out["cosine_adam"] == pytest.approx(c, abs=1e-6)  # P = I / (1 + eps)
        assert out["cross_share"] == pytest.approx(2 * c / (2 + 2 * c), abs=1e-12)
    # The preconditioner changes the metric: one coordinate with a tiny second moment dominates.
    gl, gh = np.zeros((v, d)), np.zeros((v, d))
    gl[0, 0], gh[0, 0], gl[1, 1], gh[1, 1] = 1.0, 1.0, 1.0, -1.0
    nu = np.ones((v, d))
    nu[0, 0] = 1e-4
    out = measures.accumulated_interference(gl, gh, nu, counts)
    assert out["cosine"] == pytest.approx(0.0, abs=1e-12)
    assert out["cosine_adam"] == pytest.approx((100 - 1) / (100 + 1), rel=1e-5)


def test_updated_fractions_are_magnitude_aware():
    v, d = 400, 4
    counts = _zipf_counts(v)
    lookup, head = np.zeros((v, d)), np.full((v, d), 1e-4)  # every row has a non-zero head gradient
    lookup[:100] = 1.0
    out = measures.updated_fractions(lookup, head, counts, taus=(0.01, 0.5))
    assert out["frac_0.01"] == pytest.approx(100 / v) and out["frac_0.5"] == pytest.approx(100 / v)
    assert out["reference"] == pytest.approx(np.linalg.norm(np.full(d, 1 + 1e-4)))


def test_bootstrap_intervals_known_answers():
    const = st.bootstrap_ci([0.3] * 5)
    assert const["lo"] == pytest.approx(0.3) and const["hi"] == pytest.approx(0.3)
    rng = np.random.default_rng(0)
    x = rng.normal(1.0, 1.0, size=400)
    ci = st.bootstrap_ci(x)
    assert ci["lo"] < 1.0 < ci["hi"] and ci["hi"] - ci["lo"] == pytest.approx(2 * 1.96 / 20, rel=0.2)
    assert st.excludes_zero(ci) and "above" in st.verdict(ci, "above", "below")
    assert st.verdict(st.bootstrap_ci([0.1]), "a", "b").startswith("no verdict from < 2 units (1 seed: no interval over seeds)")
    # Two levels: per-seed offsets that dwarf document noise widen the joint interval, not the doc one.
    tokens = np.full(200, 100.0)
    base = rng.normal(0, 0.01, size=(3, 200)) * tokens
    a = base + 0.05 * tokens + np.array([[0.0], [0.2], [-0.2]]) * tokens
    out = st.two_level_bootstrap(a, base, tokens)
    assert out["mean"] == pytest.approx(0.05, abs=1e-9)
    assert out["doc_hi"] - out["doc_lo"] < 0.01 < out["hi"] - out["lo"]
    assert out["seed_lo"] <= out["mean"] <= out["seed_hi"]


def test_decoupled_embed_dim_split_gradient_sums_to_tied(tiny_tied):
    _, tokens = tiny_tied
    config = TINY.replace(embed_dim=8)
    params = jax.jit(TransformerLM(config).init)(jax.random.key(0), tokens)["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
    assert params["embed"]["embedding"].shape == (256, 8) and params["embed"]["out_proj"].shape == (8, 32)
    batch = dict(inputs=tokens, targets=jnp.roll(tokens, -1, axis=1))
    lookup, head = analysis.split_embedding_gradients(config, params, batch)
    model = TransformerLM(config)
    tied = jax.jit(jax.grad(lambda p: model.apply({"params": p}, tokens, batch["targets"],
                                                  method=TransformerLM.loss)[0].mean()))(params)
    np.testing.assert_allclose(np.asarray(lookup) + np.asarray(head), tied["embed"]["embedding"], rtol=1e-5,
                               atol=1e-8)
