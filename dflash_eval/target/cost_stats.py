"""Timing statistics of the target-cost measurements: the minimum, the spread, a monotone verify cost.

On a shared or busy machine the noise of a timed run is one-sided: other work only ever adds time.
The statistic is therefore the **minimum** of the repeats (Chen & Revels 2016, "Robust benchmarking
in noisy environments", arXiv:1608.04295: the minimum is the estimator least affected by such
noise), the repeats are interleaved across shapes (one round times every shape once, so a slow
phase of the machine hits all shapes alike rather than one), and the **spread** of a measurement is
``median / min - 1`` (0 = every run as fast as the fastest).

A target forward over more tokens never costs less, so the verify costs are fitted non-decreasing
in ``n`` (isotonic regression, pool-adjacent-violators; the raw minima are kept beside the fit).

The estimate is **reliable** when every spread is at most :data:`SPREAD_BOUND` and the isotonic fit
moved no verify cost by more than that bound (:func:`assess`).
"""

from __future__ import annotations

import statistics
from typing import Sequence

#: a measurement whose median exceeds its minimum by more than this (relative) is too noisy to use
SPREAD_BOUND = 0.25


def robust_s(samples: Sequence[float]) -> float:
    """The statistic of a measurement: the minimum of its timed runs (seconds)."""
    return float(min(samples))


def spread(samples: Sequence[float]) -> float:
    """``median / min - 1`` of the timed runs (a dimensionless ratio; 0 for identical runs)."""
    lo = min(samples)
    return float(statistics.median(samples) / lo - 1) if lo > 0 else float("inf")


def isotonic(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators).

    ``values`` must already be ordered by the variable the fit is monotone in (here ``n`` tokens).
    """
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * w2 + m1 * w1) / (w2 + w1), w2 + w1]
    out: list[float] = []
    for m, w in blocks:
        out += [m] * int(w)
    return out


def assess(costs: dict, bound: float = SPREAD_BOUND) -> dict:
    """Whether a ``target_costs.json`` dict is reliable enough for a speedup estimate.

    Uses the raw samples (``decode_samples_s``, each verify's ``samples_s``, each drafter's
    ``draft_samples_s``), so files measured before the minimum statistic are assessed too; a
    measurement without samples has no spread to judge (its ``median_s`` enters the monotone check).

    Returns:
        ``{"reliable": bool, "bound": bound, "worst_spread": float, "worst": what, "non_monotone": [n, ...],
        "reasons": [text, ...]}``.
    """
    spreads = {}
    if costs.get("decode_samples_s"):
        spreads["decode step"] = spread(costs["decode_samples_s"])
    for v in costs["verify"]:
        if v.get("samples_s"):
            spreads[f"verify n={v['n']} ({v['mask']})"] = spread(v["samples_s"])
    for name, d in costs.get("drafters", {}).items():
        if d.get("draft_samples_s"):
            spreads[f"drafter {name}"] = spread(d["draft_samples_s"])
    worst = max(spreads, key=spreads.get) if spreads else None
    reasons = [f"{what}: runs spread {s:.0%} (median over min)" for what, s in spreads.items() if s > bound]
    ordered = sorted(costs["verify"], key=lambda v: v["n"])
    raw = [robust_s(v["samples_s"]) if v.get("samples_s") else float(v["median_s"]) for v in ordered]
    fit = isotonic(raw)
    moved = [v["n"] for v, r, f in zip(ordered, raw, fit) if abs(r - f) > bound * f]
    if moved:
        reasons.append(f"verify cost falls as n grows (n = {moved} moved by more than {bound:.0%} by the "
                       "non-decreasing fit)")
    return {"reliable": not reasons, "bound": bound, "worst_spread": spreads.get(worst, 0.0), "worst": worst,
            "non_monotone": moved, "reasons": reasons}
