"""Looping samples in the tau table and the report: ``n_loop``, ``tau_noloop``, ``tau_noloop_se``.

A sample *loops* when its completion's repeated n-gram fraction (:mod:`dflash_eval.data.repetition`, at
``loops.ngram``) exceeds ``loops.threshold``. ``tau`` counts every sample, as serving does (a looping response is
drafted and verified like any other); the loop columns say how much of it comes from those samples:

* ``n_loop``: samples of the row that loop (of every sample of the evaluate output, those without a verify step
  included); empty when the completions of the row's prompt set were not given;
* ``tau_noloop``: the row's ``tau`` over the samples that do not loop, aggregated exactly as ``tau`` is
  (:func:`dflash_eval.replay.metrics.aggregate` at temperature 0, :func:`dflash_eval.replay.metrics.aggregate_expected`
  for the expected rows at T > 0, on the kept samples only); NaN when every sample loops;
* ``tau_noloop_se``: its standard error over prompts, as ``tau_se`` (:func:`dflash_eval.replay.metrics.standard_error`).

The per-sample measure comes from the completions files, which the ``summary`` stage reads (``--completions``),
matched to the evaluate output's samples by id; so a new threshold or n reruns ``summary`` (and the report, which
takes these columns from ``tau.csv``: :func:`with_loop_columns`), never ``evaluate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from dflash_eval.core.errors import InputError
from dflash_eval.data.repetition import STORED_NGRAM, read_repetition

#: the tau table's loop columns (module docstring), after its other per-row statistics
LOOP_COLUMNS = ["n_loop", "tau_noloop", "tau_noloop_se"]


@dataclass(frozen=True)
class Loops:
    """The repetition measure of every completion of the run, and the threshold above which a sample loops."""

    threshold: float  #: ``loops.threshold``: a sample loops when its measure is above it
    ngram: int  #: ``loops.ngram``: the n of the measure
    by_set: dict  #: prompt set -> {sample id: repeated n-gram fraction}

    def flags(self, r: dict, path) -> list[bool] | None:
        """Per sample of the evaluate output ``r`` (in its order): whether it loops; None when the completions of
        its prompt set were not given or its samples carry no ids (an evaluate output of an earlier version).

        Raises:
            InputError: a sample id of ``r`` is not in the completions of its prompt set (files of another run).
        """
        rep = self.by_set.get(str(r["prompt_set"]))
        if rep is None or not all("id" in s for s in r["samples"]):
            return None
        missing = [str(s["id"]) for s in r["samples"] if str(s["id"]) not in rep]
        if missing:
            raise InputError(path, "samples[].id", f"{len(missing)} samples (first {missing[:3]}) are not in the "
                             f"completions of prompt set {r['prompt_set']!r} given to summary",
                             "pass the completions the evaluated cache was built from (results/<run>/completions/"
                             "<prompt set>.jsonl), or rerun the evaluate job (snakemake -R evaluate)")
        return [rep[str(s["id"])] > self.threshold for s in r["samples"]]


def set_name(path) -> str:
    """The prompt set of a completions file: ``results/<run>/completions/<set>.jsonl`` -> ``<set>``."""
    name = Path(path).name
    return name[: -len(".jsonl")] if name.endswith(".jsonl") else Path(path).stem


def read_loops(completions: Sequence, ngram: int, threshold: float) -> Loops:
    """:class:`Loops` of the completions files (each named by its prompt set: :func:`set_name`).

    Raises:
        InputError: a missing or malformed completions file (:func:`dflash_eval.data.completions.read_completions`).
    """
    return Loops(float(threshold), int(ngram), {set_name(p): read_repetition(p, ngram) for p in completions})


def records_loops(records: pd.DataFrame, ngram: int, threshold: float) -> Loops | None:
    """:class:`Loops` of the per-request records (:mod:`dflash_eval.report.records`: ``repeated_8gram_fraction``,
    measured by evaluate on the cached completion), for the prompt sets whose every sample has it; None when
    ``ngram`` is not :data:`~dflash_eval.data.repetition.STORED_NGRAM` (the records hold the 8-gram measure only:
    pass the completions then) or no set has it."""
    if int(ngram) != STORED_NGRAM or records.empty:
        return None
    rows = records[(records["method"] == "chain") & (records["sampling"] == "T0") & records["sample_id"].notna()]
    by_set = {str(ps): dict(zip(g["sample_id"].astype(str), g["repeated_8gram_fraction"].astype(float)))
              for ps, g in rows.groupby("prompt_set") if g["repeated_8gram_fraction"].notna().all()}
    return Loops(float(threshold), int(ngram), by_set) if by_set else None


def loop_columns(agg: Callable, per_sample: Sequence, block_size: int, lens: Sequence[int] | None,
                 looping: Sequence[bool] | None) -> dict:
    """The :data:`LOOP_COLUMNS` of one tau-table row.

    Args:
        agg: the row's aggregate: :func:`dflash_eval.replay.metrics.aggregate` or
            :func:`~dflash_eval.replay.metrics.aggregate_expected`.
        per_sample: what ``agg`` takes, one entry per sample of the evaluate output (acceptance lengths, or the
            expectations, None for a sample without a verify step).
        block_size: B.
        lens: prompt lengths per sample, or None.
        looping: per sample whether it loops (:meth:`Loops.flags`), or None: unknown (columns empty).

    Returns:
        ``{"n_loop": int | None, "tau_noloop": float, "tau_noloop_se": float}`` (NaN where unknown or empty).
    """
    if looping is None:
        return {"n_loop": None, "tau_noloop": math.nan, "tau_noloop_se": math.nan}
    keep = [i for i, loops in enumerate(looping) if not loops]
    stats = agg([per_sample[i] for i in keep], block_size, [lens[i] for i in keep] if lens is not None else None)
    return {"n_loop": int(sum(looping)), "tau_noloop": stats.tau, "tau_noloop_se": stats.tau_se}


def with_loop_columns(every: pd.DataFrame, summary, key: Sequence[str]) -> pd.DataFrame:
    """``every`` (the report's frame, :func:`dflash_eval.report.tau_table.summary_frame` without completions) with the
    :data:`LOOP_COLUMNS` of the run's ``tau.csv`` / ``tau.parquet`` (``summary``), matched on the table's key columns
    ``key`` (:data:`dflash_eval.report.tau_table.TABLE_KEY`); ``every`` unchanged when ``summary`` is None or has
    none of them (a table of an earlier version)."""
    if summary is None:
        return every
    key = list(key)
    table = pd.read_parquet(summary) if Path(summary).suffix == ".parquet" else pd.read_csv(
        summary, dtype={k: str for k in key})
    if not set(LOOP_COLUMNS) <= set(table.columns) or not set(key) <= set(table.columns):
        return every
    loops = table[key + LOOP_COLUMNS].astype({k: str for k in key})
    out = every.drop(columns=[c for c in LOOP_COLUMNS if c in every]).astype({k: str for k in key})
    out = out.merge(loops, on=key, how="left", validate="one_to_one")
    out["n_loop"] = out["n_loop"].astype("Int64")
    order = [c for c in every.columns if c in out] + [c for c in out.columns if c not in every]
    return out[order]  # tau.csv's column order (the report's full table shows it cell for cell)


#: header of the headline table's no-loop column of a prompt set (beside its ``tau``)
NOLOOP_HEADER = "tau no loops"


def has_loops(frame: pd.DataFrame) -> bool:
    """Whether ``frame`` carries a known ``n_loop`` (the headline table then shows ``tau_noloop`` beside ``tau``)."""
    return "n_loop" in frame and frame["n_loop"].notna().any()


def loop_notes(frame: pd.DataFrame, settings: dict | None = None) -> list[str]:
    """One sentence per prompt set of ``frame`` (one row per checkpoint and set) with known loop columns: how many of
    its samples loop and, at its best checkpoint (highest tau), tau with and without them. ``settings``: the
    ``summary`` settings of ``tau.provenance.json`` (``{"ngram": n, "threshold": t}``), named when given.
    """
    if not has_loops(frame):
        return []
    rule = ""
    if settings and "threshold" in settings:
        rule = (f" (more than {float(settings['threshold']):g} of its token {settings.get('ngram', 8)}-grams "
                "already occurred earlier in it)")
    notes = [f"A sample loops when its completion repeats itself{rule}; tau counts every sample, as serving does, "
             "and *tau no loops* leaves the looping ones out (docs/design.md, Looping completions)."]
    for ps, sub in frame.dropna(subset=["tau", "n_loop"]).groupby("prompt_set", sort=True):
        r = sub.sort_values(["tau", "step"], ascending=[False, True], na_position="last").iloc[0]
        n = int(r["n_samples"]) + int(r["n_skipped"]) if "n_skipped" in r else int(r["n_samples"])
        line = f"{ps}: {int(r['n_loop'])} of {n} samples loop"
        if r["n_loop"] > 0 and pd.isna(r["tau_noloop"]):
            line += f" (every one: no tau without them); at `{r['checkpoint']}` tau {r['tau']:.3f}"
        elif r["n_loop"] > 0:
            line += f"; at `{r['checkpoint']}` tau {r['tau']:.3f} with them, {r['tau_noloop']:.3f} without"
        notes.append(line + ".")
    return notes


def side_by_side(piv: pd.DataFrame) -> pd.DataFrame:
    """The markdown headline pivot with values ``tau`` and ``tau_noloop`` (columns ``(value, prompt set)`` after
    ``checkpoint`` and ``step``) as flat columns ``checkpoint, step, <set>, <set> no loops, ...``, each set's two
    side by side (a set without any ``tau_noloop`` keeps its tau alone)."""
    out = pd.DataFrame({"checkpoint": piv[("checkpoint", "")], "step": piv[("step", "")]})
    for ps in [c[1] for c in piv.columns if c[0] == "tau"]:
        out[ps] = piv[("tau", ps)]
        if ("tau_noloop", ps) in piv.columns:
            out[f"{ps} no loops"] = piv[("tau_noloop", ps)]
    return out
