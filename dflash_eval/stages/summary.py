"""Stage ``summary`` (rule ``summary``): every evaluate output of the run -> ``tau.csv`` and ``tau.parquet``.

The table's columns and their definitions: :mod:`dflash_eval.tau_table`.
"""

from __future__ import annotations

import logging

import pandas as pd

from ..errors import atomic_path
from ..tau_table import summary_frame

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs (results/<run>/eval/<ckpt>/<set>.json)")
    p.add_argument("--out-csv", required=True, help="tau.csv")
    p.add_argument("--out-parquet", required=True, help="tau.parquet")


def main(args, opts) -> None:
    write_summary(args.evals, args.out_csv, args.out_parquet)


def write_summary(evals: list[str], out_csv, out_parquet) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame."""
    df = summary_frame(evals)
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.4f")
    with atomic_path(out_parquet) as tmp:
        df.to_parquet(tmp, index=False)
    log.info("tau table:\n%s", df[["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]].to_string(index=False))
    return df
