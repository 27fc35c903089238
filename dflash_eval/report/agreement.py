"""The report's target-agreement table and cache attributes, read from the hidden-state caches."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd


def agreement_frame(caches: list[str]) -> tuple[pd.DataFrame, dict]:
    """Target agreement per prompt set and each cache's attributes.

    Args:
        caches: HDF5 cache paths.

    Returns:
        ``(frame, {prompt set: cache attributes})``; the frame has one row per cache: ``prompt_set``, ``samples``,
        ``completion_tokens``, ``agreement`` (the share of completion tokens equal to the target's teacher-forced
        argmax, pooled over completion tokens from the per-sample ``argmax_agreement``), ``lowest_sample``,
        ``samples_below_1``.
    """
    from dflash_eval.cache.reader import CacheReader  # deferred: torch, only when the report reads caches (agreement)

    rows, attrs = [], {}
    for c in caches:
        with CacheReader(c) as rd:
            ps = str(rd.attrs.get("prompt_set") or Path(c).stem)
            attrs[ps] = dict(rd.attrs)
            agree, tokens = [], []
            for i in range(len(rd)):
                a = rd.sample_attrs(i)
                agree.append(float(a["argmax_agreement"]))
                tokens.append(a["length"] - int(a["prompt_len"]))
        total = sum(tokens)
        rows.append({
            "prompt_set": ps,
            "samples": len(agree),
            "completion_tokens": total,
            "agreement": sum(a * t for a, t in zip(agree, tokens)) / total if total else math.nan,
            "lowest_sample": min(agree) if agree else math.nan,
            "samples_below_1": sum(a < 1.0 for a in agree),
        })
    return pd.DataFrame(rows, columns=["prompt_set", "samples", "completion_tokens", "agreement", "lowest_sample",
                                       "samples_below_1"]), attrs
