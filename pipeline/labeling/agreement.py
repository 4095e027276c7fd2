"""Agreement between labelers: Cohen's κ, Fleiss' κ and the per-labeler and pairwise statistics of ``label --stats``.

Pure: works on decoded HumanLabels (anything with their attributes) and plain values.

>>> from types import SimpleNamespace as L
>>> labels = [
...     L(kind="memory_choice", sample_id="s1", labeler="ann", correct_memories=[3], rating=4, skip_reason=None),
...     L(kind="memory_choice", sample_id="s1", labeler="bob", correct_memories=[3], rating=3, skip_reason=None),
...     L(kind="memory_choice", sample_id="s2", labeler="bob", correct_memories=[], rating=None, skip_reason="unsure"),
... ]
>>> result = agreement(labels, offered={"s1": {3, 5}})
>>> result["samples"], result["samples_with_several_labelers"], result["labelers"]["bob"]["skip_reasons"]
(2, 1, {'unsure': 1})
>>> pair = result["pairs"][0]
>>> pair["labelers"], pair["overlap"], pair["slot_decisions"], pair["same_set"], pair["kappa_memories"]
(['ann', 'bob'], 1, 2, 1.0, 1.0)
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pipeline.promtext import finite


def cohens_kappa(a: Sequence[Any], b: Sequence[Any], weights: str | None = None) -> float:
    """Cohen's κ of two raters who labelled the same items (``a[i]`` and ``b[i]``: item i).

    ``κ = 1 − D_o / D_e``: D_o is the mean disagreement weight over the items, D_e the one
    expected if the two raters chose independently with their own marginal frequencies.
    ``weights=None``: unweighted (nominal labels; weight 1 for any disagreement), which is
    the familiar ``(p_o − p_e) / (1 − p_e)``. ``"linear"``: weighted κ for numeric ordinal
    labels, weight ``|x − y|`` (a rating 4 against 3 counts less than 5 against 0);
    ``"quadratic"``: ``(x − y)²``. The scale of the weights cancels, so categories that
    neither rater used do not matter. Computed exactly (fractions). Returns NaN when κ is
    undefined: no items, or no disagreement expected by chance (both raters gave one and
    the same label to every item).

    >>> cohens_kappa([1, 1, 0, 0, 1], [1, 0, 0, 0, 1])  # p_o = 0.8, p_e = 0.6·0.4 + 0.4·0.6 = 0.48
    0.6153846153846154
    >>> cohens_kappa([0, 1, 2], [0, 2, 2], weights="linear")  # D_o = 1/3, D_e = 1
    0.6666666666666666
    >>> cohens_kappa([1, 0], [0, 1])
    -1.0
    >>> math.isnan(cohens_kappa([3, 3], [3, 3]))
    True
    """
    if len(a) != len(b):
        raise ValueError(f"the raters labelled different numbers of items ({len(a)} and {len(b)})")
    n = len(a)
    if n == 0:
        return math.nan
    if weights is None:

        def w(x: Any, y: Any) -> Fraction:
            return Fraction(0 if x == y else 1)

    elif weights in ("linear", "quadratic"):
        power = 1 if weights == "linear" else 2

        def w(x: Any, y: Any) -> Fraction:
            return abs(Fraction(x) - Fraction(y)) ** power

    else:
        raise ValueError(f"weights must be None, 'linear' or 'quadratic', not {weights!r}")
    observed = sum((w(x, y) for x, y in zip(a, b, strict=True)), Fraction(0)) / n
    count_a, count_b = Counter(a), Counter(b)
    expected = sum((ca * cb * w(x, y) for x, ca in count_a.items() for y, cb in count_b.items()), Fraction(0)) / (n * n)
    if expected == 0:
        return math.nan
    return float(1 - observed / expected)


def fleiss_kappa(items: Sequence[Sequence[Any]]) -> float:
    """Fleiss' κ of any number of raters: ``items[i]`` holds the labels item i received.

    Items may have different numbers of raters (at least two each; items with fewer are
    left out): ``P_i = (Σ_j n_ij² − n_i) / (n_i (n_i − 1))`` is the share of agreeing rater
    pairs on item i, ``P̄`` their mean, ``p_j`` the share of all labels in category j and
    ``P_e = Σ_j p_j²``; ``κ = (P̄ − P_e) / (1 − P_e)``. With two raters per item it is
    Scott's π. Exact (fractions); NaN when undefined (no item, or one category for all).

    >>> fleiss_kappa([[1, 1, 1], [0, 0, 0]])
    1.0
    >>> round(fleiss_kappa([[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 1, 0]]), 4)  # P̄ = 2/3, P_e = 0.5
    0.3333
    >>> math.isnan(fleiss_kappa([[2, 2], [2, 2]])), math.isnan(fleiss_kappa([[1]]))
    (True, True)
    """
    rated = [list(x) for x in items if len(x) >= 2]
    if not rated:
        return math.nan
    totals: Counter[Any] = Counter()
    agree = Fraction(0)
    for labels in rated:
        counts = Counter(labels)
        totals.update(counts)
        n = len(labels)
        agree += Fraction(sum(c * c for c in counts.values()) - n, n * (n - 1))
    p_bar = agree / len(rated)
    all_labels = sum(totals.values())
    p_e = sum((Fraction(c, all_labels) ** 2 for c in totals.values()), Fraction(0))
    if p_e == 1:
        return math.nan
    return float((p_bar - p_e) / (1 - p_e))


@dataclass(frozen=True)
class Answer:
    """One labeler's latest answer to one sample (from a ``memory_choice`` label)."""

    labeler: str
    sample_id: str
    correct: frozenset[int]
    rating: int | None
    skip_reason: str | None  # not None: a skip (the labeler did not judge the memories)


def latest_answers(labels: Sequence[Any]) -> dict[tuple[str, str], Answer]:
    """``{(sample_id, labeler): Answer}`` from HumanLabels in topic order; the last answer wins.

    A sample's labels all share one partition (they are keyed by query id), so topic order
    is publish order: a labeler who answered a sample twice (a crash after the broker's ack
    and before the commit) counts once, with the later answer.
    """
    out: dict[tuple[str, str], Answer] = {}
    for label in labels:
        if label.kind != "memory_choice" or not label.sample_id:
            continue
        out[(label.sample_id, label.labeler)] = Answer(
            label.labeler,
            label.sample_id,
            frozenset(label.correct_memories or ()),
            label.rating,
            label.skip_reason,
        )
    return out


def agreement(labels: Sequence[Any], offered: dict[str, set[int]] | None = None) -> dict[str, Any]:
    """Per-labeler counts and pairwise agreement over samples answered by several labelers.

    Only ``memory_choice`` labels count, the latest per (sample, labeler). For a pair of
    labelers, the *overlap* is the samples both answered without skipping (a skip means
    "could not judge", not "no memory is correct", so it is no decision to agree with).

    - **κ memories** (unweighted): one binary decision per (overlapping sample, slot),
      "is this slot a correct memory?", for every slot the labelers were offered: the
      sample's candidates and top slots, as queued on ``active-learning`` (``offered``),
      plus any slot either of them chose. Samples whose candidates are no longer known (the
      sample has left the topic) are left out of this κ and counted as ``unknown``: without
      the offered slots there are no "no" decisions, and κ would be meaningless.
    - **same set**: the share of overlapping samples where the two chose identical sets.
    - **κ rating** (linear-weighted, see :func:`cohens_kappa`): over the overlapping
      samples that both rated 0–5 (how much the query needed memory).

    Over all labelers at once: **Fleiss' κ memories** (:func:`fleiss_kappa`) on the same
    per-slot decisions, for every sample that at least two labelers judged and whose
    offered slots are known; and the **disagreements**: samples judged by several
    labelers who chose different sets (what a review settles).
    """
    offered = offered or {}
    answers = latest_answers(labels)
    per: dict[str, dict[str, Any]] = {}
    by_sample: dict[str, dict[str, Answer]] = {}
    for (sid, who), ans in answers.items():
        stats = per.setdefault(who, {"answered": 0, "skipped": 0, "rated": 0, "skip_reasons": Counter()})
        if ans.skip_reason is not None:
            stats["skipped"] += 1
            stats["skip_reasons"][ans.skip_reason or "skipped"] += 1
        else:
            stats["answered"] += 1
        if ans.rating is not None:
            stats["rated"] += 1
        by_sample.setdefault(sid, {})[who] = ans
    pairs = []
    for x, y in itertools.combinations(sorted(per), 2):
        overlap = [
            (s[x], s[y])
            for sid, s in sorted(by_sample.items())
            if x in s and y in s and s[x].skip_reason is None and s[y].skip_reason is None
        ]
        dec_x: list[int] = []
        dec_y: list[int] = []
        unknown = 0
        for ax, ay in overlap:
            slots = offered.get(ax.sample_id)
            if slots is None:
                unknown += 1
                continue
            for slot in sorted(set(slots) | ax.correct | ay.correct):
                dec_x.append(int(slot in ax.correct))
                dec_y.append(int(slot in ay.correct))
        rated = [(ax.rating, ay.rating) for ax, ay in overlap if ax.rating is not None and ay.rating is not None]
        if not overlap:
            continue
        pairs.append(
            {
                "labelers": [x, y],
                "overlap": len(overlap),
                "slot_decisions": len(dec_x),
                "unknown_samples": unknown,
                "kappa_memories": finite(cohens_kappa(dec_x, dec_y), 6),
                "same_set": sum(ax.correct == ay.correct for ax, ay in overlap) / len(overlap),
                "rated_by_both": len(rated),
                "kappa_rating": finite(cohens_kappa([r[0] for r in rated], [r[1] for r in rated], weights="linear"), 6),
            }
        )
    fleiss_items: list[list[int]] = []
    disagreements: list[dict[str, Any]] = []
    for sid, by_who in sorted(by_sample.items()):
        judged = {who: a for who, a in by_who.items() if a.skip_reason is None}
        if len(judged) < 2:
            continue
        if len({a.correct for a in judged.values()}) > 1:
            disagreements.append(
                {"sample_id": sid, "answers": {w: sorted(a.correct) for w, a in sorted(judged.items())}}
            )
        slots = offered.get(sid)
        if slots is None:
            continue
        for slot in sorted(set(slots).union(*(a.correct for a in judged.values()))):
            fleiss_items.append([int(slot in a.correct) for a in judged.values()])
    labelers = {
        who: {**s, "skip_reasons": dict(sorted(s["skip_reasons"].items(), key=lambda kv: (-kv[1], kv[0])))}
        for who, s in sorted(per.items())
    }
    return {
        "samples": len(by_sample),
        "samples_with_several_labelers": sum(len(v) > 1 for v in by_sample.values()),
        "labelers": labelers,
        "pairs": pairs,
        "fleiss_kappa_memories": finite(fleiss_kappa(fleiss_items), 6),
        "fleiss_slot_decisions": len(fleiss_items),
        "disagreements": disagreements,
    }
