"""The compare report states findings, not claims: every verdict word is computed from the interval it sits
beside (tieflax.study.findings), every difference is untied - tied, tables align text left and numbers
right, the runs are named relative to the study, the HTML travels alone, a repeated run is refused, and
untying's rare-token gains are followed through training (tieflax.study.literature.through_compare).
All on small synthetic summaries: no training."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tieflax.study import findings as fd
from tieflax.study import literature as study_lit
from tieflax.study import report

CLAIM = fd.Claim("Tying helps", "arXiv 0000.00000", "below", "Tied is worse", "Tied is better", "Loss")


@pytest.mark.parametrize("lo,hi,verdict,said", [
    (-0.3, -0.1, fd.HOLDS, "Tied is better"), (0.1, 0.3, fd.CONTRA, "Tied is worse"),
    (-0.1, 0.2, fd.OPEN, "Loss: no resolved difference"), (math.nan, math.nan, fd.LITTLE, "Loss: no interval")])
def test_the_finding_and_its_verdict_come_from_the_interval(lo, hi, verdict, said):
    ci = dict(mean=(lo + hi) / 2 if math.isfinite(lo) else 0.1, lo=lo, hi=hi, missing="1 seed: no interval over seeds")
    f = fd.finding(CLAIM, ci)
    assert f["verdict"] == verdict and f["finding"].startswith(said)
    text = fd.heading(f)
    assert f'"Tying helps" (arXiv 0000.00000): *{verdict}*' in text
    assert sum(text.count(v) for v in fd.VERDICTS) == 1   # one verdict word per heading


def _check_findings(found):
    """Every finding's verdict is the one its interval gives, and its sentence is that side's (a heading that
    states what its own numbers contradict fails here)."""
    for f in found:
        claim = next(c for c in (*report.CLAIMS.values(), *study_lit.CLAIMS.values()) if c.claim == f["claim"])
        expected = fd.judge(f, claim.predicted, claim.ref)
        if f.get("key") == "rare" and expected in (fd.HOLDS, fd.CONTRA):
            assert f["verdict"] in (expected, fd.OPEN, fd.LITTLE)   # the stated rule: no share of an unresolved gain
        else:
            assert f["verdict"] == expected, f
        assert f["finding"] == fd.finding_text(claim, f["verdict"], f), f


def _run(variant, seed, loss, bins, through, tokens):
    return dict(variant=variant, seed=seed, run_dir=f"/somewhere/study/{variant}/seed_{seed}", train=dict(num_steps=150),
                analysis=dict(val=dict(doc_loss=list(loss), doc_tokens=list(tokens.sum(1)), loss=0.0,
                                       doc_bin_loss=bins.tolist(), doc_bin_tokens=tokens.tolist()),
                              through=[dict(step=s, doc_bin_loss=b.tolist(), loss=0.0) for s, b in through]))


def _groups(gain_at, seeds=(0, 1, 2), docs=6, n_bins=4, steps=(50, 100, 150)):
    """tied and untied runs whose per-bin losses differ by ``gain_at(step, bin)`` per token (untied - tied)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 20, size=(docs, n_bins)).astype(float)
    groups = {"tied": [], "untied": []}
    for s in seeds:
        for variant in ("tied", "untied"):
            through = []
            for step in steps:
                bins = rng.normal(3, 0.01, size=(docs, n_bins)) * tokens
                if variant == "untied":
                    bins = bins + np.array([gain_at(step, j) for j in range(n_bins)]) * tokens
                through.append((step, bins))
            groups[variant].append(_run(variant, s, through[-1][1].sum(1), through[-1][1], through, tokens))
    return groups


def test_gains_through_training_grow_and_the_verdict_respects_the_units():
    # Untying's gain on the rare half grows from -0.1 to -0.5 nats/token; the frequent half stays at -0.05.
    grow = lambda step, j: (-0.1 - 0.4 * (step - 50) / 100) if j < 2 else -0.05  # noqa: E731
    summary = {"compare": {"bootstrap": 300}}
    comp = study_lit.through_compare(summary, _groups(grow), "untied", "tied")
    assert comp["steps"] == [50, 100, 150] and len(comp["bins"]) == 3 and len(comp["bins"][0]) == 4
    assert comp["rare"][0]["mean"] == pytest.approx(-0.1, abs=0.01) and comp["rare"][-1]["mean"] == pytest.approx(-0.5, abs=0.01)
    assert comp["growth"]["mean"] == pytest.approx(-0.4, abs=0.01) and comp["growth"]["hi"] < 0
    assert fd.judge(comp["growth"], study_lit.CLAIMS["growth"].predicted) == fd.HOLDS
    assert comp["share_change"]["lo"] > 0   # the rare half carries more of a growing difference
    flat = study_lit.through_compare(summary, _groups(lambda step, j: -0.1 if j < 2 else -0.05), "untied", "tied")
    assert fd.judge(flat["growth"], "below") == fd.OPEN
    one_seed = study_lit.through_compare(summary, _groups(grow, seeds=(0,)), "untied", "tied")
    assert fd.judge(one_seed["growth"], "below") == fd.LITTLE and "1 seed" in one_seed["growth"]["missing"]
    one_step = study_lit.through_compare(summary, _groups(grow, steps=(150,)), "untied", "tied")
    assert "1 analysed checkpoint" in one_step["growth"]["missing"]


def _summary(groups, n_bins=4):
    runs = [r for rs in groups.values() for r in rs]
    return {"compare": {"bootstrap": 200, "seeds": sorted({r["seed"] for r in runs}), "n_bins": n_bins, "knn": 10},
            "runs": runs, "data": {"n_docs": 6}}


def test_literature_rows_are_findings_with_computed_verdicts():
    grow = lambda step, j: (-0.1 - 0.4 * (step - 50) / 100) if j < 2 else -0.05  # noqa: E731
    groups = _groups(grow)
    rows = study_lit.literature_rows(_summary(groups), groups)
    keys = [r["key"] for r in rows]
    assert keys[-2:] == ["rare", "growth"]
    _check_findings(rows)
    growth = rows[-1]
    assert growth["verdict"] == fd.HOLDS and growth["finding"] == study_lit.CLAIMS["growth"].below
    assert "untied - tied" in growth["measure"]
    table = study_lit.literature_table(rows, report._table)
    assert "| finding | claim tested (source) |" in table and "holds here" in table


def test_tables_align_text_left_and_numbers_right():
    text = report._table(["name", "value [95% CI]", "note"],
                         [["tied", "+0.10 [+0.01, +0.20]", "text"], ["untied", "-0.20 [-0.3, -0.1]", ""]])
    assert text.splitlines()[1] == "|---|---:|---|"


def test_runs_are_named_relative_to_the_study_and_a_repeated_run_is_refused():
    from tieflax.errors import ConfigError

    r = dict(variant="tied", seed=0, run_dir="/tmp/abs/study/tied/seed_0")
    assert report.run_path(r) == "tied/seed_0"
    assert report.run_path(dict(r, run_dir="gs://bucket/study/tied/seed_0")) == "tied/seed_0"
    runs = [dict(variant="tied", seed=0), dict(variant="untied", seed=0), dict(variant="tied", seed=0)]
    with pytest.raises(ConfigError, match=r"`tied` seed 0 twice: a repeated run is one unit, not two"):
        report.check_units({"runs": runs})
    assert report.seed_units({"runs": runs[:2]}) == [0]


def test_the_html_embeds_its_images(tmp_path):
    pytest.importorskip("markdown_it")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG fake")
    path = report.write_html("![plot](plot.png)\n", str(tmp_path / "report.html"), str(tmp_path))
    html = open(path).read()
    assert 'src="data:image/png;base64,iVBORyBmYWtl"' in html and 'src="plot.png"' not in html


def test_provenance_is_kept_when_nothing_trains():
    from tieflax.study.provenance import carried_seconds, provenance

    before = dict(command="tieflax compare --config c.py --workdir w", commit="abc123", date="2026-12-01",
                  compute_seconds=400.0, runs_trained=9)
    previous = {"provenance": before, "runs": [dict(variant="tied", seed=0, seconds=dict(train=40.0, analysis=5.0))]}
    runs = [dict(seconds=dict(train=0.5, analysis=0.1))]
    assert provenance(previous, runs, "tieflax compare again", trained=0) == before
    assert carried_seconds(previous, "tied", 0) == dict(train=40.0, analysis=5.0)
    fresh = provenance(previous, runs, "tieflax compare again", trained=1)
    assert fresh["command"] == "tieflax compare again" and fresh["compute_seconds"] == pytest.approx(0.6)
    runs = [dict(variant="tied", seed=s, run_dir=f"/abs/w/tied/seed_{s}") for s in range(9)]
    line = report.provenance_line({"provenance": dict(before, command="tieflax compare --workdir /abs/w"), "runs": runs,
                                   "report_written": dict(date="2026-12-09 10:00", seconds=3.0)})
    assert "6.7 minutes of training (as each run first measured it) and analysis" in line and "abc123" in line
    assert "(3.0 s)" in line
    assert "`tieflax compare --workdir <this folder>`" in line   # no absolute path in the report
    assert re.search(r"This report was written on 2026-12-09", line)
