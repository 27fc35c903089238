"""Stage ``reslice`` (rule ``reslice``): per-request records -> a tau table by new bins, running nothing else.

Reads records files (:mod:`dflash_eval.report.records`: ``results/<run>/eval/<ckpt>/<set>.records.parquet``, the
validations' ``validate_online.records.parquet`` / ``validate_engine.records.parquet``, or folders holding them) and
prints, or writes as CSV, :func:`dflash_eval.report.reslice.reslice`: one row per (run, source, checkpoint, prompt
set, method, sampling setting, draft policy) by the position bins, prompt-length bins and sample subset of the
options (config section ``reslice``; defaults: the tau table's bins, every sample). As vllm-project/speculators
PR #1107 re-bins its per-request table (``scripts/evaluate/rebin.py``).
"""

from __future__ import annotations

import logging

from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.report.records import read_records
from dflash_eval.report.reslice import reslice
from dflash_eval.report.tau_table import table_csv

log = logging.getLogger(__name__)

STAGE = "reslice"


def add_arguments(p) -> None:
    p.add_argument("--records", nargs="+", required=True,
                   help="records files (<job>.records.parquet) or folders searched for them (e.g. results/<run>)")
    p.add_argument("--out", default=None, help="CSV to write (default: print the table)")


def main(args, opts) -> None:
    write_reslice(args.records, args.out, opts)


def write_reslice(records, out=None, opts=None, **overrides):
    """Re-bin the records of ``records`` (files or folders) and write the table to ``out`` (CSV, atomically) or print
    it; returns the DataFrame (:func:`dflash_eval.report.reslice.reslice`).

    Args:
        records: records files or folders (:func:`dflash_eval.report.records.read_records`).
        out: CSV path, or None (print).
        opts: the stage's options (config section ``reslice``: ``position_bins``, ``prompt_len_bins``, ``samples``);
            None: ``overrides`` over the schema's defaults.

    Raises:
        InputError: no records found; unreadable records; bad bins or samples (:func:`~dflash_eval.report.reslice.reslice`).
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    df, _ = read_records(records)
    if df.empty:
        raise InputError(", ".join(map(str, records)), None, "no per-request record found",
                         "pass <job>.records.parquet files (evaluate, validate_online, validate_engine write them) "
                         "or a results folder holding them")
    table = reslice(df, opts.position_bins, opts.prompt_len_bins, list(opts.samples) or None)
    if out:
        with atomic_path(out) as tmp:
            tmp.write_text(table_csv(table))
    else:
        print(table_csv(table), end="")
    log.info("re-sliced %d records into %d rows", len(df), len(table))
    steps = table[[c for c in table.columns if str(c).startswith("steps_pos_")]]
    unbinned = int(steps.isna().all(axis=1).sum()) if steps.shape[1] else 0
    if unbinned:
        log.warning("%d rows at temperature > 0 have no position bins (NaN): their expected counts are stored per "
                    "tau-table position bin, so a new edge must be one of those (0, 64, 128, ...)", unbinned)
    return table
