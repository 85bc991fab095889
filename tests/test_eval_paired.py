"""Paired bootstrap intervals over items x seeds (tieflax.eval.paired)."""

import numpy as np
import pytest

from tieflax.eval.decode import EvalError
from tieflax.eval.paired import paired_difference


def runs(correct: np.ndarray) -> list[list[dict]]:
    """correct [seeds, items] 0/1 -> lm-eval-like sample records per seed."""
    return [[{"doc_id": i, "prompt_hash": f"p{i}", "acc": float(v)} for i, v in enumerate(row)] for row in correct]


def test_identical_variants_give_zero_and_an_interval_that_holds_it():
    rng = np.random.default_rng(0)
    a = (rng.random((2, 400)) < 0.6).astype(float)
    out = paired_difference(runs(a), runs(a), samples=2000)
    assert out["difference"]["mean"] == 0 and out["difference"]["low"] <= 0 <= out["difference"]["high"]
    assert not out["excludes_zero"] and out["n_items"] == 400
    assert out["a"]["low"] < out["a"]["mean"] < out["a"]["high"]


def test_a_real_gain_is_found_and_pairing_narrows_the_interval():
    rng = np.random.default_rng(1)
    difficulty = rng.random(2000)                   # shared item difficulty: what pairing cancels
    a = (rng.random((2, 2000)) * 0.2 + difficulty < 0.6).astype(float)
    b = (rng.random((2, 2000)) * 0.2 + difficulty < 0.66).astype(float)
    out = paired_difference(runs(a), runs(b), samples=2000)
    assert out["excludes_zero"] and 0.03 < out["difference"]["mean"] < 0.09
    width_diff = out["difference"]["high"] - out["difference"]["low"]
    width_a = out["a"]["high"] - out["a"]["low"]
    assert width_diff < width_a   # the paired difference is tighter than one variant's accuracy


def test_mismatched_prompts_or_items_are_refused():
    a = runs(np.ones((1, 5)))
    b = runs(np.ones((1, 5)))
    b[0][3]["prompt_hash"] = "other"
    with pytest.raises(EvalError, match="item 3 has another prompt"):
        paired_difference(a, b)
    with pytest.raises(EvalError, match="different items"):
        paired_difference(a, runs(np.ones((1, 4))))
    with pytest.raises(EvalError, match="no metric 'exact_match'"):
        paired_difference(a, a, metric="exact_match")
