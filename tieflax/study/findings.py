"""Findings, not claims: every heading of the compare report is what the numbers show, with a verdict word
on the claim it tests, both computed from one interval.

A :class:`Claim` is a sentence from a paper (or the study's own hypothesis), its source, the side of a
reference value (0 unless said) its measure should fall on if the claim holds, and the two sentences that
say what was found when the interval lies above or below the reference. :func:`finding` turns a claim and
an interval into the finding's sentence and the verdict word:

- *holds here*: the 95% interval lies on the side the claim predicts;
- *contradicted here*: it lies on the other side;
- *unresolved*: it includes the reference;
- *no verdict from < 2 units*: no interval exists (fewer than 2 seeds or documents at a level the interval
  resamples), and the finding says what is missing.

Nothing here writes a verdict by hand: ``tests/test_compare.py`` re-derives every verdict of a report from
the interval it prints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tieflax.analysis import stats as st

NAN = float("nan")
HOLDS, CONTRA, OPEN, LITTLE = "holds here", "contradicted here", "unresolved", "no verdict from < 2 units"
VERDICTS = (HOLDS, CONTRA, OPEN, LITTLE)


@dataclass(frozen=True)
class Claim:
    """A claim the study tests. ``predicted``: 'above' or 'below' ``ref``, where its measure lies if the
    claim holds; ``above`` / ``below``: the finding when the interval lies there; ``topic``: what the
    measure is about, for the finding when nothing is resolved."""

    claim: str
    source: str
    predicted: str
    above: str
    below: str
    topic: str
    ref: float = 0.0


def judge(ci: dict, predicted: str, ref: float = 0.0) -> str:
    """The verdict word of an interval ``ci`` ({'lo', 'hi'}) on a claim predicting ``predicted`` of ``ref``."""
    lo, hi = ci.get("lo", NAN), ci.get("hi", NAN)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return LITTLE
    if lo > ref:
        return HOLDS if predicted == "above" else CONTRA
    if hi < ref:
        return HOLDS if predicted == "below" else CONTRA
    return OPEN


def side_of(verdict: str, predicted: str) -> str | None:
    """Which side of the reference a verdict puts the interval on ('above', 'below'; None: neither)."""
    if verdict == HOLDS:
        return predicted
    if verdict == CONTRA:
        return "below" if predicted == "above" else "above"
    return None


def finding_text(claim: Claim, verdict: str, ci: dict) -> str:
    """The sentence a heading states: the side the interval lies on, or that none is resolved (and why)."""
    side = side_of(verdict, claim.predicted)
    if side is not None:
        return claim.above if side == "above" else claim.below
    if verdict == OPEN:
        return f"{claim.topic}: no resolved difference (the 95% interval includes {claim.ref:g})"
    return f"{claim.topic}: no interval ({st.missing(ci) or 'not measured'})"


def finding(claim: Claim, ci: dict, verdict: str | None = None) -> dict:
    """``{'finding', 'verdict', 'claim', 'source', 'predicted', 'ref', 'mean', 'lo', 'hi'}`` of one claim
    measured by ``ci``. ``verdict``: a verdict a row derives by a stated rule from more than this interval
    (the rare-token row: no share of a gain that is not resolved); default :func:`judge` of ``ci``."""
    verdict = verdict or judge(ci, claim.predicted, claim.ref)
    return dict(finding=finding_text(claim, verdict, ci), verdict=verdict, claim=claim.claim, source=claim.source,
                predicted=claim.predicted, ref=claim.ref, mean=ci.get("mean", NAN), lo=ci.get("lo", NAN),
                hi=ci.get("hi", NAN))


def heading(f: dict) -> str:
    """A finding as the report states it: the finding in bold, then the claim it tests, quoted, with its
    source and the verdict word."""
    return f"**{f['finding']}.** Claim tested: \"{f['claim']}\" ({f['source']}): *{f['verdict']}*."


def direction(ci: dict, above: str, below: str, topic: str) -> str:
    """A measured direction with no claim behind it (ablations, controls): ``above`` / ``below`` when the
    interval excludes 0, else that it is unresolved or has no interval."""
    ex = st.excludes_zero(ci)
    if ex is None:
        return f"{topic}: no interval ({st.missing(ci)}), {LITTLE}"
    if not ex:
        return f"{topic}: {OPEN} (the 95% interval includes 0)"
    return above if ci["lo"] > 0 else below
