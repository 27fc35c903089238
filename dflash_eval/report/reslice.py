"""Tau tables re-binned from the per-request records, without running a target or a drafter.

The records (:mod:`dflash_eval.report.records`) keep every verify step of every request, so a table by other
position bins, other prompt-length bins or a subset of the samples is a function of them alone, as
vllm-project/speculators PR #1107 re-bins its per-request table (``scripts/evaluate/rebin.py``). The command
``python -m dflash_eval reslice`` (:mod:`dflash_eval.stages.reslice`; options: config section ``reslice``) prints or
writes :func:`reslice`.

Conventions are those of :mod:`dflash_eval.replay.metrics` (the tau table's): ``tau`` is the macro mean over the
responses with a verify step of their per-response tau; ``tau_se`` its standard error over prompts;
``tau_tokens_per_step`` the pooled committed tokens / verify steps; ``tau_pos_<bin>`` the tokens per verify step of
the steps whose anchor's completion position (0 = the prefill token; the running position: the sum of the
accepted lengths before the step) lies in the bin, ``steps_pos_<bin>`` their count; ``tau_prompt_<bin>``,
``n_prompt_<bin>``, ``se_prompt_<bin>`` the macro tau, responses and standard error of the responses whose prompt
length lies in the bin. A bin ``[lo, hi)`` holds ``lo <= x < hi``; the last is open; positions below the first edge
fall in no bin. At temperature > 0 the rows are expectations: their steps are the expected counts per
:data:`~dflash_eval.replay.metrics.POSITION_BINS` bin, so new position bins are exact only when every edge is one of
those (their bins are merged); otherwise the row's ``tau_pos_*`` are NaN.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd

from dflash_eval.core.errors import InputError
from dflash_eval.replay.metrics import POSITION_BINS, PROMPT_BINS, position_bin_labels

#: the columns that name a row of a re-sliced table (one per job, method, sampling setting and draft policy)
KEY = ["run", "source", "checkpoint", "step", "prompt_set", "method", "sampling", "draft"]


def _suffix(label: str) -> str:
    return label.replace("-", "_")


def _check_edges(edges: Sequence[int], field: str) -> list[int]:
    e = [int(x) for x in edges]
    if not e or any(x < 0 for x in e) or any(b <= a for a, b in zip(e, e[1:])):
        raise InputError(None, field, f"{list(edges)} is not a non-empty ascending list of non-negative edges",
                         "give lower edges in tokens, ascending, e.g. 0 64 128 256")
    return e


def _bins(x: pd.Series, edges: list[int]) -> pd.Series:
    """Bin index of each value of ``x`` (``[lo, hi)``, the last open; -1 below the first edge)."""
    return pd.Series(np.searchsorted(np.asarray(edges), x.to_numpy(dtype=np.int64), side="right") - 1, index=x.index)


def _se(x: pd.Series) -> float:
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) >= 2 else math.nan


def _step_bins(df: pd.DataFrame, edges: list[int]) -> pd.DataFrame:
    """``[row, bin, tokens, steps]``: the committed tokens and verify steps of each record ``row`` per position bin."""
    greedy = df[df["accepted_lengths"].notna()]
    parts = []
    if len(greedy):
        steps = greedy["accepted_lengths"].map(list).explode().dropna().astype(np.int64).rename("tokens").to_frame()
        pos = steps.groupby(level=0)["tokens"].cumsum() - steps["tokens"]  # the anchor's completion position
        steps = steps.assign(bin=_bins(pos, edges).to_numpy(), steps=1.0)
        parts.append(steps.rename_axis("row").reset_index())
    sampled = df[df["accepted_lengths"].isna() & df["expected_bin_steps"].notna()]
    if len(sampled):
        merged = set(edges) <= set(POSITION_BINS)  # each POSITION_BINS bin lies in one new bin: their sums merge
        fine = _bins(pd.Series(POSITION_BINS), edges).to_numpy() if merged else np.full(len(POSITION_BINS), -2)
        n = len(POSITION_BINS)
        parts.append(pd.DataFrame({"row": np.repeat(sampled.index.to_numpy(), n), "bin": np.tile(fine, len(sampled)),
                                   "tokens": np.concatenate([np.asarray(t, float) for t in sampled["expected_bin_tokens"]]),
                                   "steps": np.concatenate([np.asarray(t, float) for t in sampled["expected_bin_steps"]])}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["row", "bin", "tokens", "steps"])


def reslice(records: pd.DataFrame, position_bins: Sequence[int] = POSITION_BINS,
            prompt_len_bins: Sequence[int] = PROMPT_BINS, samples: Sequence[str] | None = None) -> pd.DataFrame:
    """The tau table of ``records`` by the given bins (module docstring).

    Args:
        records: record rows (:func:`dflash_eval.report.records.read_records`).
        position_bins: lower edges of the completion-position bins, tokens, ascending (last bin open).
        prompt_len_bins: lower edges of the prompt-length bins, tokens, ascending (last bin open).
        samples: the ``sample_id`` values to keep; None or empty: every sample.

    Returns:
        one row per :data:`KEY` group, in the records' order: ``n_samples``, ``n_skipped`` (responses without a verify
        step), ``tau``, ``tau_se``, ``tau_tokens_per_step`` (tokens per verify step, float64), then per position bin
        ``tau_pos_<lo>_<hi>`` and ``steps_pos_<lo>_<hi>``, per prompt-length bin ``tau_prompt_<lo>_<hi>``,
        ``n_prompt_<lo>_<hi>``, ``se_prompt_<lo>_<hi>`` (``inf`` for the open end).

    Raises:
        InputError: bins that are not ascending non-negative edges; ``samples`` none of which is in the records.
    """
    pos_edges = _check_edges(position_bins, "reslice.position_bins")
    len_edges = _check_edges(prompt_len_bins, "reslice.prompt_len_bins")
    df = records.reset_index(drop=True)
    if samples:
        keep = df["sample_id"].astype(str).isin([str(s) for s in samples])
        if not keep.any():
            raise InputError(None, "reslice.samples", f"none of {list(samples)[:5]} is a sample_id of the records",
                             "give sample ids as the records' sample_id column holds them")
        df = df[keep]
    live = df["tau"].notna()
    greedy = df["accepted_lengths"].notna()
    steps = pd.Series(np.where(greedy, df["accepted_lengths"].map(lambda v: len(v) if v is not None else 0),
                               df["expected_steps"].astype(float).fillna(0.0)), index=df.index)
    tokens = pd.Series(np.where(greedy, df["accepted_lengths"].map(lambda v: sum(v) if v is not None else 0),
                                df["expected_committed"].astype(float).fillna(0.0)), index=df.index)
    df = df.assign(_live=live, _steps=steps.where(live, 0.0), _tokens=tokens.where(live, 0.0),
                   _plen=_bins(df["prompt_len"].fillna(-1).astype(np.int64), len_edges))
    df.loc[df["prompt_len"].isna(), "_plen"] = -1
    pos = _step_bins(df[live], pos_edges)
    pos_labels = position_bin_labels(pos_edges)
    len_labels = position_bin_labels(len_edges)
    rows = []
    for key, g in df.groupby(KEY, sort=False, dropna=False):
        ok = g[g["_live"]]
        steps_n = ok["_steps"].sum()
        row = dict(zip(KEY, key), n_samples=len(ok), n_skipped=len(g) - len(ok),
                   tau=float(ok["tau"].mean()) if len(ok) else math.nan, tau_se=_se(ok["tau"]),
                   tau_tokens_per_step=float(ok["_tokens"].sum() / steps_n) if steps_n else math.nan)
        p = pos[pos["row"].isin(ok.index)]
        unbinnable = (p["bin"] == -2).any()
        for i, lab in enumerate(pos_labels):
            b = p[p["bin"] == i]
            s = float(b["steps"].sum())
            row[f"tau_pos_{_suffix(lab)}"] = math.nan if unbinnable or not s else float(b["tokens"].sum()) / s
            row[f"steps_pos_{_suffix(lab)}"] = math.nan if unbinnable else s
        for i, lab in enumerate(len_labels):
            t = ok.loc[ok["_plen"] == i, "tau"]
            row[f"tau_prompt_{_suffix(lab)}"] = float(t.mean()) if len(t) else math.nan
            row[f"n_prompt_{_suffix(lab)}"] = len(t)
            row[f"se_prompt_{_suffix(lab)}"] = _se(t)
        rows.append(row)
    out = pd.DataFrame(rows)
    return out.astype({"step": "Int64"}) if len(out) else out
