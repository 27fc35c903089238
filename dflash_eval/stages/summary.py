"""Stage ``summary`` (rule ``summary``): every evaluate output of the run -> ``tau.csv`` and ``tau.parquet``.

The table's columns and their definitions: :mod:`dflash_eval.tau_table`. With the run's
``target_costs.json`` (``--costs``; the rule passes it when ``target_costs.enabled``) the table also
carries the report's speedup estimate per row and whether it is reliable
(:func:`dflash_eval.costs.speedup_columns`); without it those columns are empty.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from ..costs import read_costs, with_speedups
from ..errors import atomic_path
from ..io import sha256_file
from ..tau_table import summary_frame

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs (results/<run>/eval/<ckpt>/<set>.json)")
    p.add_argument("--out-csv", required=True, help="tau.csv")
    p.add_argument("--out-parquet", required=True, help="tau.parquet")
    p.add_argument("--costs", default=None,
                   help="target_costs.json: fills the speedup_* and estimate_reliable columns (empty without it)")
    p.add_argument("--settings", nargs="*", default=[], metavar="JSON",
                   help="the run's evaluate options records (results/<run>/options/evaluate/<set>.json, one per prompt "
                        "set): an evaluate output whose settings_sha256 names another is refused")
    p.add_argument("--completions", nargs="*", default=[], metavar="JSONL",
                   help="the run's completions files (results/<run>/completions/<set>.jsonl): an evaluate output whose "
                        "cache was extracted from others is refused")


def main(args, opts) -> None:
    write_summary(args.evals, args.out_csv, args.out_parquet, costs=args.costs,
                  expected=expected_inputs(args.settings, args.completions))


def expected_inputs(settings: list[str], completions: list[str]) -> dict[str, dict]:
    """``{prompt set: {"settings_sha256", "completions_sha256"}}`` from the run's records and completions files, keyed
    by file stem (``<set>.json``, ``<set>.jsonl``); :func:`dflash_eval.tau_table.check_eval_inputs` compares them."""
    out: dict[str, dict] = {}
    for key, files in (("settings_sha256", settings), ("completions_sha256", completions)):
        for f in files or []:
            out.setdefault(Path(f).stem, {})[key] = sha256_file(f).hexdigest()
    return out


def write_summary(evals: list[str], out_csv, out_parquet, costs=None, expected: dict | None = None) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame.

    Args:
        evals: evaluate outputs.
        out_csv, out_parquet: the two tables.
        costs: ``target_costs.json`` path, or None: the speedup columns (:func:`dflash_eval.costs.speedup_columns`)
            are filled from it, else left empty.
        expected: the run's settings and completions sha256 per prompt set (:func:`expected_inputs`), or None.

    Raises:
        InputError: an unreadable evaluate output (:func:`dflash_eval.tau_table.summary_frame`) or target costs
            file (:func:`dflash_eval.costs.read_costs`).
    """
    df = summary_frame(evals, expected)
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
