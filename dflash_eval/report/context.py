"""The report's "tau against context" section: tau per prompt-length bin with its standard error, per prompt set.

Read from the tau table's ``tau_prompt_<lo>_<hi>``, ``n_prompt_<lo>_<hi>`` and ``se_prompt_<lo>_<hi>`` columns
(:mod:`dflash_eval.replay.metrics`: bins of the prompt length at request start, power-of-two edges, as
vllm-project/speculators PR #1107 ``scripts/evaluate/rebin.py`` bins its results) and the drafter's
``trained_max_len`` (the sequence length it was trained on, where its config records it). Shown for every prompt
set with responses in 2 or more bins: a figure of tau against the bin's context (log-2 axis, one line per
checkpoint, error bars of +-1.96 SE, bins past the trained length hollow in a shaded region) and a table of tau, n
and SE per bin. :func:`regime_notes` gives the headline table's note on a set whose responses lie both within and
beyond a checkpoint's trained length: its tau mixes two regimes. The figure:
:func:`dflash_eval.report.figures.tau_vs_context` (this module stays matplotlib-free, like ``report --help``).
"""

from __future__ import annotations

import math
import re

import pandas as pd

from dflash_eval.report.tau_table import checkpoint_order

TAU, N, SE = "tau_prompt_", "n_prompt_", "se_prompt_"
#: the normal quantile of the figure's error bars (a 95 % interval of the mean under the i.i.d.-prompts assumption)
Z95 = 1.96
ANCHOR = "context"  #: the section's HTML id
#: the prompt set name of the rows pooling every greedy set of a checkpoint (:func:`with_pooled`)
POOLED = "all greedy sets"


def bin_edges(suffix: str) -> tuple[int, float]:
    """``(lo, hi)`` of a column suffix ``"1024_2048"`` (``hi`` = inf for ``"32768_inf"``)."""
    lo, hi = suffix.split("_")
    return int(lo), math.inf if hi == "inf" else int(hi)


def bin_context(lo: int, hi: float) -> float:
    """The x of a bin on the log-2 context axis (tokens): the geometric midpoint of its edges, ``sqrt(lo * hi)``, with
    ``lo = hi / 2`` for the first bin (``0``) and ``hi = 2 lo`` for the open last bin."""
    lo = hi / 2 if lo == 0 else lo
    hi = 2 * lo if math.isinf(hi) else hi
    return math.sqrt(lo * hi)


def context_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The tau table's prompt-length bins in long form, one row per (checkpoint, prompt set, bin with responses).

    Args:
        frame: tau-table rows (one per checkpoint and prompt set: the report's primary rows).

    Returns:
        columns ``prompt_set``, ``checkpoint``, ``bin`` (``"1024-2048"``), ``lo``, ``hi`` (tokens, hi inf for the
        last), ``context`` (:func:`bin_context`), ``n`` (responses), ``tau``, ``se`` (NaN below 2 responses or for a
        table without ``se_prompt_*`` columns), ``trained_max_len`` (NA: unknown), ``beyond`` (the bin's lower edge
        is at or past the trained length, so every prompt in it is: the per-prompt rule of tau.csv's
        ``n_beyond_trained``) and ``partly`` (the trained length falls inside the bin); both False where it is
        unknown; in table order of the bins.
    """
    rows = []
    suffixes = [c[len(TAU):] for c in frame.columns if c.startswith(TAU)]
    for r in frame.to_dict("records"):
        trained = r.get("trained_max_len")
        trained = int(trained) if trained is not None and pd.notna(trained) else None
        for sfx in suffixes:
            n = r.get(N + sfx)
            if n is None or pd.isna(n) or int(n) == 0:
                continue
            lo, hi = bin_edges(sfx)
            x = bin_context(lo, hi)
            se = r.get(SE + sfx)
            rows.append({"prompt_set": r["prompt_set"], "checkpoint": r["checkpoint"], "bin": f"{lo}-{hi}",
                         "lo": lo, "hi": hi, "context": x, "n": int(n), "tau": float(r[TAU + sfx]),
                         "se": float(se) if se is not None and pd.notna(se) else math.nan,
                         "trained_max_len": trained, "beyond": trained is not None and lo >= trained,
                         "partly": trained is not None and lo < trained < hi})
    cols = ["prompt_set", "checkpoint", "bin", "lo", "hi", "context", "n", "tau", "se", "trained_max_len", "beyond",
            "partly"]
    out = pd.DataFrame(rows, columns=cols)
    out["trained_max_len"] = out["trained_max_len"].astype("Int64")
    return out


def with_pooled(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` plus, per checkpoint evaluated greedily (``sampling`` ``T0``) on 2 or more prompt sets, one row of
    prompt set :data:`POOLED` whose bins pool those sets' responses: a short set's bins beside a long set's on one
    axis, for the same checkpoint.

    Per bin, with the sets' ``n_i``, ``tau_i``, ``se_i``: ``n = sum n_i``; ``tau = sum n_i tau_i / n`` (the macro tau
    over the union of their responses); ``se = sqrt(var / n)`` with the union's sample variance
    ``var = (sum (n_i - 1) s_i^2 + sum n_i (tau_i - tau)^2) / (n - 1)``, ``s_i = se_i sqrt(n_i)`` (exact, from the
    per-set means and variances; NaN where a set of 2+ responses has no SE, or for ``n < 2``). Other columns are
    left empty but ``checkpoint``, ``step``, ``trained_max_len``.
    """
    if "sampling" not in frame or not any(c.startswith(TAU) for c in frame.columns):
        return frame
    greedy = frame[frame["sampling"] == "T0"]
    suffixes = [c[len(TAU):] for c in frame.columns if c.startswith(TAU)]
    rows = []
    for ck, sub in greedy.groupby("checkpoint", sort=False):
        if sub["prompt_set"].nunique() < 2:
            continue
        row = {"checkpoint": ck, "prompt_set": POOLED, "sampling": "T0",
               "step": sub["step"].iloc[0] if "step" in sub else None,
               "trained_max_len": sub["trained_max_len"].iloc[0] if "trained_max_len" in sub else None}
        for sfx in suffixes:
            n_i = sub[N + sfx].fillna(0).astype(int) if N + sfx in sub else pd.Series(0, index=sub.index)
            live = n_i > 0
            n = int(n_i[live].sum())
            row[N + sfx] = n
            if not n:
                row[TAU + sfx], row[SE + sfx] = math.nan, math.nan
                continue
            tau_i, m = sub[TAU + sfx][live].astype(float), n_i[live]
            tau = float((m * tau_i).sum() / n)
            se_i = sub[SE + sfx][live].astype(float) if SE + sfx in sub else pd.Series(math.nan, index=tau_i.index)
            within = ((m - 1) * (se_i.fillna(0.0) ** 2) * m).where(m > 1, 0.0)
            unknown = ((m > 1) & se_i.isna()).any()
            var = (within.sum() + float((m * (tau_i - tau) ** 2).sum())) / (n - 1) if n > 1 else math.nan
            row[TAU + sfx] = tau
            row[SE + sfx] = math.nan if unknown or n < 2 else math.sqrt(var / n)
        rows.append(row)
    if not rows:
        return frame
    return pd.concat([frame, pd.DataFrame(rows)], ignore_index=True)


def context_sets(frame: pd.DataFrame) -> list[str]:
    """The prompt sets with responses in 2 or more prompt-length bins (those the section shows), sorted, with
    :data:`POOLED` first when ``frame`` has its rows (:func:`with_pooled`)."""
    long = context_frame(frame)
    counts = long.groupby("prompt_set")["bin"].nunique()
    sets = sorted(counts[counts >= 2].index)
    return [POOLED] * (POOLED in sets) + [s for s in sets if s != POOLED]


def context_table(frame: pd.DataFrame, prompt_set: str) -> pd.DataFrame:
    """One prompt set's table: ``checkpoint``, ``prompt tokens`` (the bin), ``n``, ``tau``, ``SE``, ``trained length``
    (empty: unknown) and ``beyond trained`` (``"yes"`` for a bin whose lower edge is at or past it, ``"partly"`` for
    the bin it falls in), checkpoints in training order."""
    long = context_frame(frame)
    long = long[long["prompt_set"] == prompt_set]
    order = {c: i for i, c in enumerate(checkpoint_order(frame))}
    long = long.assign(rank=long["checkpoint"].map(order)).sort_values(["rank", "lo"], kind="stable")
    return pd.DataFrame({"checkpoint": long["checkpoint"], "prompt tokens": long["bin"], "n": long["n"],
                         "tau": long["tau"], "SE": long["se"], "trained length": long["trained_max_len"],
                         "beyond trained": ["yes" if b else "partly" if p else ""
                                            for b, p in zip(long["beyond"], long["partly"])]}).reset_index(drop=True)


def regime_notes(frame: pd.DataFrame) -> list[str]:
    """The headline table's notes (markdown): one per (checkpoint, prompt set) whose responses lie both within and
    beyond the checkpoint's trained length (prompt tokens at request start ``>= trained_max_len``:
    ``n_beyond_trained``), e.g. ``"humaneval, `step870`: mixes 10 prompts within and 6 beyond the trained length
    640: see tau against context"``. [] for a table without the columns."""
    if "n_beyond_trained" not in frame or "trained_max_len" not in frame:
        return []
    out = []
    for r in frame.sort_values(["prompt_set"], kind="stable").to_dict("records"):
        beyond, trained = r["n_beyond_trained"], r["trained_max_len"]
        if pd.isna(beyond) or pd.isna(trained) or not 0 < int(beyond) < int(r["n_samples"]):
            continue
        out.append(f"{r['prompt_set']}, `{r['checkpoint']}`: mixes {int(r['n_samples']) - int(beyond)} prompts within "
                   f"and {int(beyond)} beyond the trained length {int(trained)}: see tau against context")
    return out


def regime_notes_html(frame: pd.DataFrame, inline) -> list[str]:
    """:func:`regime_notes` as HTML (``inline``: the report's markdown-sentence-to-HTML function), each linking to the
    section (``#context``)."""
    return [inline(n).replace("see tau against context", f'see <a href="#{ANCHOR}">tau against context</a>')
            for n in regime_notes(frame)]


CAPTION = ("tau against context, {ps}: tau of the responses per prompt-length bin (prompt tokens at request start, "
           "power-of-two bins, plotted at the bin's geometric midpoint, checkpoints shifted slightly apart), one line "
           "per checkpoint, error bars +-1.96 "
           "SE over prompts; hollow markers in the shaded region: bins past the checkpoint's trained sequence "
           "length.")
NOTE = ("tau per prompt-length bin (prompt tokens at request start, power-of-two bins; tau.csv's "
        "`tau_prompt_<lo>_<hi>`, `n_prompt_<lo>_<hi>`, `se_prompt_<lo>_<hi>`) for the prompt sets with responses in 2 "
        "or more bins. SE: the standard error over prompts (sample sd of the per-response taus / sqrt(n); empty below "
        "2 responses), assuming the prompts are i.i.d.; *beyond trained*: every prompt of the bin is at or past the "
        "sequence length the drafter was trained on (`trained_max_len`, from its config; *partly*: that length falls "
        "inside the bin). *all greedy sets*: per "
        "checkpoint evaluated at T = 0 on 2 or more sets, their responses pooled per bin (a short set's bins beside a "
        "long set's; SE from the union's variance).")


def figure_name(prompt_set: str) -> str:
    """The figure's file name: ``context_<set>.png`` (unsafe characters as ``_``)."""
    return "context_" + re.sub(r"[^A-Za-z0-9_.-]", "_", prompt_set) + ".png"


def markdown(frame: pd.DataFrame, md_table) -> list[str]:
    """The section's markdown lines ([] when no prompt set has 2 bins); ``md_table``: the report's table writer."""
    frame = with_pooled(frame)
    sets = context_sets(frame)
    if not sets:
        return []
    parts = ["## tau against context", "", NOTE, ""]
    for ps in sets:
        parts += [f"### {ps}", "", md_table(context_table(frame, ps), 3), ""]
    return parts


def html(frame: pd.DataFrame, figs: dict, styled, inline) -> dict | None:
    """The template's ``context`` block: ``{"note" (HTML), "sets": [(prompt set, table HTML, (caption, img src))]}``;
    None when no prompt set has 2 bins. ``figs``: the page's ``{name: (caption, src)}``; ``styled``: the report's
    Styler factory (``(df, digits, table id)``); ``inline``: its markdown-sentence-to-HTML function."""
    frame = with_pooled(frame)
    sets = context_sets(frame)
    if not sets:
        return None
    return {"note": inline(NOTE), "sets": [(ps, styled(context_table(frame, ps), 3, f"context-{figure_name(ps)[8:-4]}")
                                    .to_html(), figs.get(figure_name(ps))) for ps in sets]}
