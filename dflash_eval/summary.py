"""The tau table (``tau.csv`` / ``tau.parquet``), rebuilt from the per-sample results of ``evaluate``.

``tau.csv`` / ``tau.parquet`` (the output contract other tools read): one row per
(checkpoint, prompt set) with columns

======================  =====================================================================
checkpoint              drafter name (the ``{ckpt}`` wildcard)
step                    training step (checkpoint metadata or name), empty when unknown
prompt_set              prompt set name
n_samples               responses with at least one verify step
tau                     mean over responses of (mean over verify steps of a+1), bonus included,
                        prefill token excluded (z-lab ``dflash/benchmark.py``)
tau_tokens_per_step     committed tokens / verify steps, pooled over responses
mean_accepted           tau - 1: accepted drafts per verify step (macro)
block_size              B used in the replay
n_skipped               responses with no verify step (prefill token ended them)
verify_steps            total verify steps (= target forwards after prefill)
committed_tokens        total tokens committed by verify steps
random_init             True for randomly initialised (untrained) demo drafters
device, dtype           where and in which precision the replay ran
tau_ddtree_<B>          tau (same convention) of greedy DDTree decoding with a node budget of B
                        drafted nodes per verify step, one column per configured budget
                        (``evaluate.ddtree_budgets``; :mod:`dflash_eval.ddtree`); empty for
                        rows evaluated without that budget
======================  =====================================================================
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from .errors import atomic_path
from .metrics import aggregate

log = logging.getLogger(__name__)

COLUMNS = ["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step", "mean_accepted",
           "block_size", "n_skipped", "verify_steps", "committed_tokens", "random_init", "device", "dtype"]


def summary_frame(evals: list[str]) -> pd.DataFrame:
    """Rows of the tau table from evaluate outputs (see module docstring).

    Every aggregate is recomputed with :func:`dflash_eval.metrics.aggregate` from the
    per-sample ``acceptance_lengths`` of each evaluate JSON, so the table cannot disagree
    with the per-sample data it summarises.
    """
    rows, budgets = [], set()
    for path in evals:
        r = json.loads(Path(path).read_text())
        stats = aggregate([s["acceptance_lengths"] for s in r["samples"]], r["block_size"])
        rows.append({
            "checkpoint": r["checkpoint"],
            "step": r.get("step"),
            "prompt_set": r["prompt_set"],
            "n_samples": stats.n_samples,
            "tau": stats.tau,
            "tau_tokens_per_step": stats.tau_tokens_per_step,
            "mean_accepted": stats.tau - 1.0,
            "block_size": r["block_size"],
            "n_skipped": stats.n_skipped,
            "verify_steps": stats.verify_steps,
            "committed_tokens": stats.committed_tokens,
            "random_init": r.get("random_init", False),
            "device": r.get("device"),
            "dtype": r.get("dtype"),
        })
        for b in r.get("ddtree_budgets", []):
            budgets.add(int(b))
            rows[-1][f"tau_ddtree_{b}"] = aggregate([s["acceptance_lengths_ddtree"][str(b)] for s in r["samples"]],
                                                    r["block_size"]).tau
    df = pd.DataFrame(rows, columns=COLUMNS + [f"tau_ddtree_{b}" for b in sorted(budgets)])
    df["step"] = df["step"].astype("Int64")
    return df.sort_values(["prompt_set", "step", "checkpoint"], na_position="last").reset_index(drop=True)


def write_summary(evals: list[str], out_csv, out_parquet) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame."""
    df = summary_frame(evals)
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.4f")
    with atomic_path(out_parquet) as tmp:
        df.to_parquet(tmp, index=False)
    log.info("tau table:\n%s", df[["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]].to_string(index=False))
    return df
