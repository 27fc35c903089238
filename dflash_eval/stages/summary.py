"""Stage ``summary`` (rule ``summary``): every evaluate job's per-request records -> ``tau.csv`` and ``tau.parquet``.

The rule passes the records (``results/<run>/eval/<ckpt>/<set>.records.parquet``, :mod:`dflash_eval.report.records`),
read once; evaluate JSONs given instead are made into the same records.

With ``--out-compare`` it also writes ``tau_compare.csv``: every checkpoint against the previous one of its run and
the best of its set, paired over the same prompts, with 95 % bootstrap intervals (:mod:`dflash_eval.report.compare`).

The table's columns and their definitions: :mod:`dflash_eval.report.tau_table`. With the run's
``target_costs.json`` (``--costs``; the rule passes it when ``target_costs.enabled``) the table also
carries the report's speedup estimate per row and whether it is reliable
(:func:`dflash_eval.report.tau_table.speedup_columns`); without it those columns are empty.

In the workflow the rule passes the settings the config gives (``--expected-settings``): an evaluate output
or target costs file whose provenance block records other settings is refused, naming the file, the option,
both values and the fix (results copied without ``.snakemake/``, then an option changed). The tables'
own provenance block goes to ``tau.provenance.json`` and into ``tau.parquet``'s schema metadata.

With the run's completions files (``--completions``; the rule passes every prompt set's) the table carries the loop
columns ``n_loop``, ``tau_noloop``, ``tau_noloop_se`` (:mod:`dflash_eval.report.loops`; options: config section
``loops``); without them those columns are empty.
"""

from __future__ import annotations

import json
import logging

import pandas as pd

from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import atomic_path
from dflash_eval.core.io import sha256_file
from dflash_eval.data.provenance import block, check_settings, settings_of, write_json
from dflash_eval.report.compare import comparisons
from dflash_eval.report.loops import read_loops, records_loops
from dflash_eval.report.records import load_offline
from dflash_eval.report.tau_table import summary_frame, table_csv, with_speedups, write_parquet
from dflash_eval.target.costs import read_costs

log = logging.getLogger(__name__)

STAGE = "summary"


def add_arguments(p) -> None:
    p.add_argument("--evals", nargs="+", required=True,
                   help="the evaluate jobs' records (results/<run>/eval/<ckpt>/<set>.records.parquet; the workflow "
                        "passes these) or their JSONs (<set>.json, made into the same records when read)")
    p.add_argument("--out-csv", required=True, help="tau.csv")
    p.add_argument("--out-parquet", required=True, help="tau.parquet")
    p.add_argument("--out-provenance", default=None,
                   help="tau.provenance.json: the provenance block of the two tables (also in tau.parquet's metadata)")
    p.add_argument("--out-compare", default=None,
                   help="tau_compare.csv: paired bootstrap intervals between checkpoints (dflash_eval.report.compare)")
    p.add_argument("--costs", default=None,
                   help="target_costs.json: fills the speedup_* and estimate_reliable columns (empty without it)")
    p.add_argument("--completions", nargs="*", default=[],
                   help="the run's completions files (results/<run>/completions/<set>.jsonl): fill the loop columns "
                        "n_loop, tau_noloop, tau_noloop_se (empty without them)")
    p.add_argument("--expected-settings", default=None, metavar="JSON",
                   help='the settings the config gives, {"evaluate": {<prompt set>: {option: value}}, "target_costs": '
                        '{"run": {...}}} (the workflow passes them): an evaluate output or target_costs.json whose '
                        "provenance records other settings is refused, naming the option and the fix")


def main(args, opts) -> None:
    expected = json.loads(args.expected_settings) if args.expected_settings else None
    write_summary(args.evals, args.out_csv, args.out_parquet, costs=args.costs, expected=expected,
                  out_provenance=args.out_provenance, out_compare=args.out_compare, completions=args.completions,
                  opts=opts)


def write_summary(evals: list[str], out_csv, out_parquet, costs=None, expected: dict | None = None,
                  out_provenance=None, out_compare=None, completions: list[str] | None = None,
                  opts=None) -> pd.DataFrame:
    """Write ``tau.csv``, ``tau.parquet`` and (``out_provenance``) ``tau.provenance.json`` atomically; returns the frame.

    Args:
        evals: the evaluate jobs' records files (:mod:`dflash_eval.report.records`) or their JSONs (made into the
            same records when read: :func:`dflash_eval.report.records.load_offline`); read once.
        out_csv, out_parquet: the two tables.
        costs: ``target_costs.json`` path, or None: the speedup columns (:func:`dflash_eval.report.tau_table.speedup_columns`)
            are filled from it, else left empty.
        expected: the settings the config gives (:meth:`dflash_eval.workflow.plan.Plan.expected_settings`), compared with
            the provenance block of every evaluate output and of ``costs``; None: not compared.
        out_provenance: where to write the tables' provenance block (also stored in the parquet's metadata).
        out_compare: where to write ``tau_compare.csv`` (:func:`dflash_eval.report.compare.comparisons`); None: not
            written.
        completions: the completions files of the prompt sets (named ``<set>.jsonl``), for the loop columns
            (:func:`dflash_eval.report.loops.read_loops`); None or []: the records' ``repeated_8gram_fraction`` at
            ``loops.ngram`` 8 (:func:`dflash_eval.report.loops.records_loops`), else those columns are empty.
        opts: the stage's options (:func:`dflash_eval.core.options.make`; config section ``loops``); None: the
            schema's defaults.

    Raises:
        InputError: an unreadable evaluate output (:func:`dflash_eval.report.tau_table.summary_frame`) or target costs
            file (:func:`dflash_eval.target.costs.read_costs`); one made with other settings than ``expected`` gives;
            an unreadable completions file, or one that lacks an evaluated sample
            (:meth:`dflash_eval.report.loops.Loops.flags`).
    """
    opts = opts if opts is not None else options_mod.make(STAGE)
    offline = load_offline(evals)  # every job's records, read once: the tau table and the paired bootstrap
    loops = read_loops(completions, opts.ngram, opts.threshold) if completions else \
        records_loops(offline.records, opts.ngram, opts.threshold)
    df = summary_frame(offline, expected, loops)
    cost_data = read_costs(costs) if costs else None
    if cost_data is not None and expected:
        check_settings(costs, cost_data.get("provenance"), expected, "run", "target_costs",
                       "rerun it with this config: snakemake --forcerun target_costs")
    df = with_speedups(df, cost_data)
    settings = {**{stage: by_key for stage, by_key in (expected or {}).items()}, STAGE: {"run": settings_of(STAGE, opts)}}
    inputs = {str(e): sha256_file(e).hexdigest() for e in [*evals, *([costs] if costs else []), *(completions or [])]}
    prov = block("summary", settings, inputs)
    with atomic_path(out_csv) as tmp:
        tmp.write_text(table_csv(df))
    with atomic_path(out_parquet) as tmp:
        write_parquet(df, tmp, prov)
    if out_provenance:
        write_json(out_provenance, prov)
    if out_compare:
        with atomic_path(out_compare) as tmp:
            tmp.write_text(table_csv(comparisons(offline, df)))
    shown = ["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]
    if loops is not None:
        shown += ["n_loop", "tau_noloop"]
    if costs:
        shown += ["speedup_chain", "estimate_reliable"]
    log.info("tau table:\n%s", df[shown].to_string(index=False))
    return df
