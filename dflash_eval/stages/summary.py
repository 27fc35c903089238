"""Stage ``summary`` (rule ``summary``): every evaluate output of the run -> ``tau.csv`` and ``tau.parquet``.

The table's columns and their definitions: :mod:`dflash_eval.tau_table`. With the run's
``target_costs.json`` (``--costs``; the rule passes it when ``target_costs.enabled``) the table also
carries the report's speedup estimate per row and whether it is reliable
(:func:`dflash_eval.costs.speedup_columns`); without it those columns are empty.
"""

from __future__ import annotations

import logging

import pandas as pd

from ..costs import read_costs, with_speedups
from ..errors import atomic_path
from ..tau_table import summary_frame

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs (results/<run>/eval/<ckpt>/<set>.json)")
    p.add_argument("--out-csv", required=True, help="tau.csv")
    p.add_argument("--out-parquet", required=True, help="tau.parquet")
    p.add_argument("--costs", default=None,
                   help="target_costs.json: fills the speedup_* and estimate_reliable columns (empty without it)")


def main(args, opts) -> None:
    write_summary(args.evals, args.out_csv, args.out_parquet, costs=args.costs)


def write_summary(evals: list[str], out_csv, out_parquet, costs=None) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame.

    Args:
        evals: evaluate outputs.
        out_csv, out_parquet: the two tables.
        costs: ``target_costs.json`` path, or None: the speedup columns (:func:`dflash_eval.costs.speedup_columns`)
            are filled from it, else left empty.

    Raises:
        InputError: an unreadable evaluate output (:func:`dflash_eval.tau_table.summary_frame`) or target costs
            file (:func:`dflash_eval.costs.read_costs`).
    """
    df = summary_frame(evals)
    df = with_speedups(df, read_costs(costs) if costs else None)
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.4f")
    with atomic_path(out_parquet) as tmp:
        df.to_parquet(tmp, index=False)
    shown = ["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]
    if costs:
        shown += ["speedup_chain", "estimate_reliable"]
    log.info("tau table:\n%s", df[shown].to_string(index=False))
    return df
