"""Paired intervals for task accuracy: variant B minus variant A on the same items, over items x seeds.

Input: lm-eval per-sample records (``samples_<task>_*.jsonl`` lines, or ``results["samples"][task]``),
one list per trained seed of each variant. Items are joined by lm-eval's ``doc_id``, and each item's
``prompt_hash`` must agree across every record (the same prompt, few-shot context included): a run scored
with another task version or few-shot seed would otherwise be compared item by wrong item.

The bootstrap resamples items (the benchmark is a sample of possible items) and seeds (training is a
sample of possible runs) with replacement, both at once; the paired difference keeps the item draw common
to both variants, which is what removes the item-difficulty variance from the comparison.

    summary = paired_difference([tied_seed0, tied_seed1], [untied_seed0, untied_seed1], metric="acc")
    summary["difference"] -> {"mean", "low", "high"}; summary["excludes_zero"] -> bool
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tieflax.eval.decode import EvalError

Records = Sequence[dict]


def item_table(runs: Sequence[Records], metric: str, *, prompts: dict | None = None) -> tuple[list, np.ndarray]:
    """-> (doc ids, values [seeds, items] float64) of ``metric``; ``prompts`` (doc id -> prompt hash) is
    filled from the first record seen and checked against every later one."""
    prompts = {} if prompts is None else prompts
    tables = []
    for seed, records in enumerate(runs):
        table = {}
        for r in records:
            if metric not in r:
                held = sorted(k for k in r if k not in ("doc", "arguments"))[:12]
                raise EvalError(f"the samples have no metric {metric!r} (they hold {held}); choose one of the "
                                "task's metrics")
            doc, prompt = int(r["doc_id"]), r.get("prompt_hash")
            if prompts.setdefault(doc, prompt) != prompt:
                raise EvalError(f"item {doc} has another prompt in run {seed} (prompt_hash differs): the runs were "
                                "scored with different task versions or few-shot settings; score them alike")
            table[doc] = float(r[metric])
        tables.append(table)
    docs = sorted(tables[0]) if tables else []
    for seed, table in enumerate(tables):
        if sorted(table) != docs:
            raise EvalError(f"run {seed} scored other items than run 0 ({len(table)} vs {len(docs)}); use the same "
                            "--limit for every run")
    return docs, np.array([[t[d] for d in docs] for t in tables], np.float64)


def paired_difference(a: Sequence[Records], b: Sequence[Records], *, metric: str = "acc", samples: int = 10_000,
                      level: float = 0.95, seed: int = 0) -> dict:
    """Mean ``metric`` of A and of B with bootstrap intervals, and of B - A on shared items.

    a, b: per-seed sample lists of each variant (at least one each, the same items). Returns
    ``{"n_items", "seeds": (sA, sB), "a", "b", "difference": {"mean", "low", "high"}, "excludes_zero"}``.
    """
    if not a or not b:
        raise EvalError("paired_difference needs at least one run of each variant")
    prompts: dict = {}
    docs_a, va = item_table(a, metric, prompts=prompts)
    docs_b, vb = item_table(b, metric, prompts=prompts)
    if docs_a != docs_b:
        raise EvalError(f"the variants were scored on different items ({len(docs_a)} vs {len(docs_b)}); use the "
                        "same tasks and --limit for both")
    n = len(docs_a)
    rng = np.random.default_rng(seed)
    items = rng.integers(0, n, (samples, n))                      # one item draw, shared by both variants
    seeds_a = rng.integers(0, va.shape[0], (samples, 1))
    seeds_b = rng.integers(0, vb.shape[0], (samples, 1))
    # Each bootstrap replicate: one seed per variant, the same resampled items.
    boot_a = va[seeds_a, items].mean(axis=1)
    boot_b = vb[seeds_b, items].mean(axis=1)
    tail = (1 - level) / 2

    def summary(point, boot):
        low, high = np.quantile(boot, [tail, 1 - tail])
        return {"mean": float(point), "low": float(low), "high": float(high)}

    diff = summary(vb.mean() - va.mean(), boot_b - boot_a)
    return {"n_items": n, "seeds": (va.shape[0], vb.shape[0]), "level": level, "a": summary(va.mean(), boot_a),
            "b": summary(vb.mean(), boot_b), "difference": diff,
            "excludes_zero": bool(diff["low"] > 0 or diff["high"] < 0)}
