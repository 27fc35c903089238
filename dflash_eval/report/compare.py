"""Checkpoints compared within the noise of the prompt sample: paired bootstrap intervals of tau differences.

With 16 to a few hundred prompts per set, two checkpoints' taus often differ by less than the spread the choice of
prompts alone gives. Each row kind of the tau table (prompt set, sampling setting, draft policy) is compared here
checkpoint by checkpoint, **paired**: both checkpoints replay the same cached completions, so the difference is
taken prompt by prompt (the same sample ids) and the prompt-to-prompt spread that both share cancels.

Statistic. A row's ``tau`` is the macro mean over responses of the per-response tau
(:mod:`dflash_eval.replay.metrics`: ``sample_tau``; at temperature > 0 the per-response expectation ``E[tau_r]``,
:func:`~dflash_eval.replay.metrics.aggregate_expected`) -- a mean of per-response values, not a ratio of pooled sums.
The difference of two checkpoints' taus over the prompts both have is therefore the mean of the per-prompt
differences ``d_i = tau_a,i - tau_b,i``; that is the statistic bootstrapped.

Method: the paired (one-sample) nonparametric bootstrap, each prompt's pair of values resampled as one unit, with the
percentile interval: Efron & Tibshirani, *An Introduction to the Bootstrap*, Chapman & Hall 1993 (pairs resampled
as units: the law-school data, ch. 3 and 6; the percentile interval: ch. 13). :data:`RESAMPLES` resamples of the
prompt indices from ``numpy.random.default_rng(SEED)``, drawn afresh for every comparison, so an interval depends
only on its two checkpoints' values (not on which other checkpoints the run has) and is the same on every call.

Verdict. The best checkpoint of a row kind (highest tau; ties: the earlier step, as
:func:`dflash_eval.report.tables.best_rows`) is **ahead beyond noise** when the 95 % interval of every other
checkpoint's difference with it lies below 0; otherwise it is **tied with** the checkpoints whose interval does not
(an interval that cannot be formed, fewer than 2 shared prompts, counts as a tie).

Few prompts. Below :data:`MIN_PROMPTS` paired prompts the percentile interval is not to be trusted: a bootstrap
from n values resamples their empirical distribution, which on a handful of prompts is too narrow (the variance of
the resampled mean is (n - 1) / n times the usual estimate, and the percentile interval undercovers in small
samples: Efron & Tibshirani 1993, ch. 13 and 14; DiCiccio & Efron, "Bootstrap confidence intervals", Statistical
Science 11(3), 1996, section 1). Such a row keeps its numbers and verdict, and its ``caution`` column says so (the
report's verdict cell too).

Outputs: :func:`compare_frame` (the rows of ``tau_compare.csv``, written by the summary stage beside ``tau.csv``)
and :func:`section` (the report's "Checkpoints within noise" tables). Columns: docs/outputs.md.
"""
from __future__ import annotations

import html as html_lib
import math
import re

import numpy as np
import pandas as pd

from dflash_eval.report.records import load_offline
from dflash_eval.report.tau_table import checkpoint_order

#: bootstrap resamples per comparison
RESAMPLES = 2000
#: the seed of every comparison's resampling (``numpy.random.default_rng``)
SEED = 20240607
#: the interval's coverage
LEVEL = 0.95
#: fewer paired prompts than this: the row's interval is flagged as unreliable (module docstring, "Few prompts")
MIN_PROMPTS = 10
#: the columns that name a row kind (one comparison table each)
KIND = ["prompt_set", "sampling", "draft"]
#: ``tau_compare.csv``'s columns
COLUMNS = KIND + ["checkpoint", "step", "n_samples", "tau", "tau_se",
                  "previous", "n_paired_prev", "diff_prev", "lo_prev", "hi_prev",
                  "best", "n_paired_best", "diff_best", "lo_best", "hi_best", "verdict", "caution"]

AHEAD, BEHIND, TIED_BEST, ONLY = "ahead beyond noise", "behind the best beyond noise", "tied with the best", \
    "the only checkpoint"

NOTE = (f"Paired bootstrap over prompts ({RESAMPLES} resamples, seed {SEED}; Efron & Tibshirani 1993): each "
        "checkpoint's tau against the previous checkpoint of its run and against the set's best, over the same "
        "prompts, as the difference and its 95% interval [lo, hi]. The best checkpoint is *ahead beyond noise* "
        "when every other checkpoint's interval against it lies below 0; otherwise it is *tied with* those it "
        "cannot be told apart from on this many prompts (docs/design.md, Comparing checkpoints: paired intervals). "
        f"Below {MIN_PROMPTS} prompts the interval is too narrow to trust (DiCiccio & Efron 1996): the verdict "
        "then says *few prompts*.")


def sample_values(records) -> pd.DataFrame:
    """Per-response tau of every tau-table row, from the run's offline records.

    Args:
        records: record rows (:mod:`dflash_eval.report.records`; :attr:`~dflash_eval.report.records.Offline.records`),
            or records files / evaluate JSONs (:func:`~dflash_eval.report.records.load_offline`); the ``offline`` rows
            of method ``chain`` are used: at ``T0`` the greedy walk, above it the expectation.

    Returns:
        long DataFrame, one row per (job, sampling setting, draft policy, sample): ``checkpoint``, ``prompt_set``,
        ``sampling``, ``draft``, ``sample`` (the sample's ``sample_id``, str; ``#<sample_index>`` when a job has no
        ids or repeats one) and ``tau`` (float64 tokens per verify step, the value the row's ``tau`` averages; NaN for
        a response without a verify step, left out of the row's tau as well). Kinds the tau table does not show (a
        ``T0`` walk of a job configured at temperature > 0 only) are harmless: :func:`compare_frame` looks up the
        table's kinds only.
    """
    cols = ["checkpoint"] + KIND + ["sample", "tau"]
    records = records if isinstance(records, pd.DataFrame) else load_offline(records).records
    rows = records[(records["source"] == "offline") & (records["method"] == "chain")]
    if rows.empty:
        return pd.DataFrame(columns=cols)
    rows = rows.assign(sample=rows["sample_id"].astype(object))
    job = ["run", "checkpoint", "prompt_set", "sampling", "draft"]
    ids = rows.groupby(job, dropna=False)["sample"]
    bad = ids.transform(lambda x: x.isna().any() or x.duplicated().any())
    rows.loc[bad, "sample"] = "#" + rows.loc[bad, "sample_index"].astype(str)
    out = rows.assign(sample=rows["sample"].astype(str), tau=rows["tau"].astype(np.float64))
    return out[cols].astype({c: object for c in ["checkpoint"] + KIND}).reset_index(drop=True)


def paired_interval(a, b, resamples: int = RESAMPLES, seed: int = SEED,
                    level: float = LEVEL) -> tuple[float, float, float, int]:
    """The difference ``tau(a) - tau(b)`` over the prompts both have, with its paired percentile-bootstrap interval.

    Args:
        a, b: ``[n]`` float per-prompt taus of two checkpoints, aligned (entry ``i`` is the same prompt); NaN (no
            verify step in either) drops that prompt from both.
        resamples: bootstrap resamples R.
        seed: ``numpy.random.default_rng`` seed; the same arguments give the same interval on every call.
        level: the interval's coverage.

    Returns:
        ``(diff, lo, hi, n)``: the difference of the two macro taus over the ``n`` shared prompts (= the mean of the
        per-prompt differences), and the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles (numpy's linear
        interpolation) of that difference over R resamples of the ``n`` prompt indices drawn with replacement
        (Efron & Tibshirani 1993, ch. 13). Units: tokens per verify step. NaN interval for ``n < 2``; NaN everything
        for ``n = 0``.
    """
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    d = d[~np.isnan(d)]
    n = len(d)
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    diff = float(d.mean())
    if n < 2:
        return diff, math.nan, math.nan, n
    rng = np.random.default_rng(seed)
    chunk = max(1, (1 << 22) // n)  # resamples per draw: at most ~4M indices in memory at once
    boot = np.concatenate([d[rng.integers(0, n, size=(min(chunk, resamples - s), n))].mean(axis=1)
                           for s in range(0, resamples, chunk)])
    lo, hi = np.quantile(boot, [(1 - level) / 2, (1 + level) / 2])
    return diff, float(lo), float(hi), n


def _best(rows: pd.DataFrame) -> str | None:
    """The checkpoint of ``rows`` (one row kind) with the highest tau; ties: the earlier step."""
    r = rows.dropna(subset=["tau"]).sort_values(["tau", "step"], ascending=[False, True], na_position="last")
    return None if r.empty else str(r["checkpoint"].iloc[0])


def compare_frame(frame: pd.DataFrame, values: pd.DataFrame, resamples: int = RESAMPLES, seed: int = SEED,
                  level: float = LEVEL) -> pd.DataFrame:
    """Every checkpoint of every row kind against the previous checkpoint of its run and against the kind's best.

    Args:
        frame: the tau table (:func:`dflash_eval.report.tau_table.summary_frame`): ``checkpoint``, ``step``,
            ``prompt_set``, ``sampling``, ``draft``, ``n_samples``, ``tau``, ``tau_se``, and ``variant`` (the run; a
            table without it is one run).
        values: :func:`sample_values` of the same evaluate outputs.
        resamples, seed, level: :func:`paired_interval`.

    Returns:
        DataFrame with :data:`COLUMNS`, per row kind (in table order) its checkpoints in training order
        (:func:`~dflash_eval.report.tau_table.checkpoint_order`): ``previous`` (the run's previous checkpoint, empty
        on a run's first), ``diff_prev`` = tau - previous's tau over the ``n_paired_prev`` shared prompts, with the
        interval ``[lo_prev, hi_prev]``; ``best`` and ``diff_best`` / ``lo_best`` / ``hi_best`` /
        ``n_paired_best`` likewise against the kind's best (empty on the best's own row); ``verdict``: on the best's
        row :data:`AHEAD`, ``tied with X, Y`` or :data:`ONLY`; on the others :data:`BEHIND` (``hi_best < 0``),
        ``ahead of the best on the shared prompts`` (``lo_best > 0``: possible only when they evaluated other
        prompts) or :data:`TIED_BEST`.
    """
    order = checkpoint_order(frame)
    first = frame.drop_duplicates("checkpoint").set_index("checkpoint")
    run = (first["variant"] if "variant" in first else pd.Series("", index=first.index)).fillna("").to_dict()
    wide = values.set_index(["checkpoint"] + KIND + ["sample"])["tau"].unstack("checkpoint") \
        if len(values) else pd.DataFrame()
    rows = []
    for kind, sub in frame.groupby(KIND, sort=False):
        sub = sub.set_index("checkpoint").reindex([c for c in order if c in set(sub["checkpoint"])]).reset_index()
        x = wide.loc[kind] if len(wide) and kind in wide.index.droplevel("sample") else pd.DataFrame()
        best = _best(sub)

        def interval(c, other):
            if other is None or c not in x or other not in x:
                return math.nan, math.nan, math.nan, 0
            return paired_interval(x[c].to_numpy(), x[other].to_numpy(), resamples, seed, level)

        seen: dict[str, str] = {}
        for r in sub.itertuples(index=False):
            c = str(r.checkpoint)
            prev = seen.get(run.get(c, ""))
            seen[run.get(c, "")] = c
            dp, lp, hp, np_ = interval(c, prev)
            db, lb, hb, nb = interval(c, best) if c != best else (math.nan, math.nan, math.nan, 0)
            rows.append({**dict(zip(KIND, kind)), "checkpoint": c, "step": r.step, "n_samples": r.n_samples,
                         "tau": r.tau, "tau_se": r.tau_se, "previous": prev,
                         "n_paired_prev": np_ if prev else pd.NA, "diff_prev": dp, "lo_prev": lp, "hi_prev": hp,
                         "best": best, "n_paired_best": nb if c != best else pd.NA, "diff_best": db, "lo_best": lb,
                         "hi_best": hb})
    out = pd.DataFrame(rows, columns=COLUMNS)
    out["verdict"] = _verdicts(out)
    out["caution"] = _cautions(out)
    return out.astype({"step": "Int64", "n_paired_prev": "Int64", "n_paired_best": "Int64"})


def _verdicts(cmp: pd.DataFrame) -> list[str]:
    """The ``verdict`` column of :func:`compare_frame` (see there)."""
    out = []
    for r in cmp.itertuples(index=False):
        if r.checkpoint == r.best:
            others = cmp[(cmp[KIND] == [getattr(r, k) for k in KIND]).all(axis=1) & (cmp["checkpoint"] != r.best)]
            tied = [str(o.checkpoint) for o in others.itertuples(index=False) if not o.hi_best < 0]
            out.append(ONLY if others.empty else ("tied with " + ", ".join(tied)) if tied else AHEAD)
        elif r.best is None:
            out.append("")
        else:
            out.append(BEHIND if r.hi_best < 0 else "ahead of the best on the shared prompts" if r.lo_best > 0
                       else TIED_BEST)
    return out


def caution(n) -> str:
    """The ``caution`` of a comparison over ``n`` paired prompts (an int, or NA/None: no comparison): ``""`` from
    :data:`MIN_PROMPTS` on or without a comparison, else ``"few prompts (n = 4 < 10): interval not reliable"``
    (module docstring, "Few prompts")."""
    return "" if n is None or pd.isna(n) or int(n) >= MIN_PROMPTS else \
        f"few prompts (n = {int(n)} < {MIN_PROMPTS}): interval not reliable"


def _cautions(cmp: pd.DataFrame) -> list[str]:
    """The ``caution`` column of :func:`compare_frame`: :func:`caution` of the row's comparison with the best (on the
    best's row: the fewest prompts of its comparisons with the others; none: with the previous checkpoint)."""
    out = []
    for r in cmp.itertuples(index=False):
        if r.checkpoint == r.best:
            others = cmp[(cmp[KIND] == [getattr(r, k) for k in KIND]).all(axis=1) & (cmp["checkpoint"] != r.best)]
            n = others["n_paired_best"].dropna()
            out.append(caution(int(n.min()) if len(n) else None))
        else:
            out.append(caution(r.n_paired_best if r.best is not None else r.n_paired_prev))
    return out


def comparisons(evals, frame: pd.DataFrame, resamples: int = RESAMPLES, seed: int = SEED) -> pd.DataFrame:
    """:func:`compare_frame` of the tau table ``frame`` built from ``evals`` (records files or evaluate JSONs, or
    those already read: :func:`dflash_eval.report.records.load_offline`), on their per-request taus.

    Raises:
        InputError: an unreadable input (:func:`~dflash_eval.report.records.load_offline`).
    """
    return compare_frame(frame, sample_values(load_offline(evals).records), resamples, seed)


def _cell(diff, lo, hi) -> str:
    """``+0.123 [+0.045, +0.201]``; empty where there is no difference; the interval left out below 2 prompts."""
    if pd.isna(diff):
        return ""
    return f"{diff:+.3f}" + ("" if pd.isna(lo) else f" [{lo:+.3f}, {hi:+.3f}]")


def display_tables(cmp: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The report's tables: ``{title: table}``, one per row kind of ``cmp`` (:func:`compare_frame`); the title is the
    prompt set, followed by `` @ <sampling>`` and `` [<draft>]`` where another kind of the table differs in them.
    Columns: ``checkpoint``, ``tau`` (float), ``vs previous``, ``vs best`` (text: diff [lo, hi]), ``verdict``."""
    out = {}
    multi = cmp[["sampling", "draft"]].drop_duplicates()
    for (ps, samp, draft), sub in cmp.groupby(KIND, sort=False):
        title = str(ps) + (f" @ {samp}" if multi["sampling"].nunique() > 1 else "") \
            + (f" [{draft}]" if multi["draft"].nunique() > 1 else "")
        out[title] = pd.DataFrame({
            "checkpoint": sub["checkpoint"].to_numpy(), "tau": sub["tau"].to_numpy(dtype=float),
            "vs previous": [_cell(*v) for v in zip(sub["diff_prev"], sub["lo_prev"], sub["hi_prev"])],
            "vs best": [_cell(*v) for v in zip(sub["diff_best"], sub["lo_best"], sub["hi_best"])],
            "verdict": [f"{v} ({c})" if c else v for v, c in zip(sub["verdict"], sub["caution"])]})
    return out


def best_verdict(cmp: pd.DataFrame | None, frame: pd.DataFrame, prompt_set: str, checkpoint: str) -> str:
    """The verdict of ``checkpoint`` as the best of ``prompt_set`` at the set's first row kind in ``frame`` (the
    report's per-set rows, :func:`~dflash_eval.report.tau_table.primary_rows`), e.g. ``"tied with step200"``, followed
    by its ``caution`` in parentheses where it has one; ``""``
    when ``cmp`` (:func:`compare_frame`) has no such row or names another best."""
    if cmp is None or cmp.empty:
        return ""
    first = frame[frame["prompt_set"] == prompt_set].iloc[0]
    hit = cmp[(cmp["prompt_set"] == prompt_set) & (cmp["sampling"] == first["sampling"])
              & (cmp["draft"] == first["draft"]) & (cmp["checkpoint"] == checkpoint) & (cmp["best"] == checkpoint)]
    if hit.empty:
        return ""
    v, c = str(hit["verdict"].iloc[0]), str(hit["caution"].iloc[0]) if "caution" in hit else ""
    return f"{v} ({c})" if c else v


def section(cmp: pd.DataFrame | None, md_table, styled) -> tuple[str, str] | None:
    """The report's "Checkpoints within noise" section as ``(markdown, HTML)``, or None without comparisons.

    Args:
        cmp: :func:`compare_frame` output (None: no section).
        md_table: ``(DataFrame, digits) -> str`` markdown table writer (the report's).
        styled: ``(DataFrame, digits, table_id) -> Styler`` (the report's).
    """
    if cmp is None or cmp.empty:
        return None
    tables = display_tables(cmp)
    md = [NOTE, ""]
    html = ["<p>" + re.sub(r"\*([^*]+)\*", r"<i>\1</i>", html_lib.escape(NOTE, quote=False)) + "</p>"]
    for i, (title, t) in enumerate(tables.items()):
        md += [f"### {title}", "", md_table(t, 3), ""]
        html += [f"<h3>{html_lib.escape(title)}</h3>",
                 f'<div class="scroll">{styled(t, 3, f"noise-{i}").to_html()}</div>']
    return "\n".join(md), "\n".join(html)
