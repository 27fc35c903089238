"""Stage ``summary`` (rule ``summary``): every evaluate output of the run -> ``tau.csv`` and ``tau.parquet``.

The table's columns and their definitions: :mod:`dflash_eval.report.tau_table`. With the run's
``target_costs.json`` (``--costs``; the rule passes it when ``target_costs.enabled``) the table also
carries the report's speedup estimate per row and whether it is reliable
(:func:`dflash_eval.target.costs.speedup_columns`); without it those columns are empty.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from dflash_eval.target.costs import read_costs, with_speedups
from dflash_eval.drafter.files import read_strip_info
from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import sha256_file
from dflash_eval.output_digests import record_outputs
from dflash_eval.report.tau_table import summary_frame, table_csv, write_parquet

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs (results/<run>/eval/<ckpt>/<set>.json)")
    p.add_argument("--out-csv", required=True, help="tau.csv")
    p.add_argument("--out-parquet", required=True, help="tau.parquet")
    p.add_argument("--costs", default=None,
                   help="target_costs.json: fills the speedup_* and estimate_reliable columns (empty without it)")
    p.add_argument("--run-settings", nargs="*", default=None, metavar="JSON",
                   help="the run's target_costs options record (results/<run>/options/target_costs/run.json): "
                        "target_costs.json must name it (settings_sha256), else it is refused (another run's file)")
    p.add_argument("--settings", nargs="*", default=[], metavar="JSON",
                   help="the run's evaluate options records (results/<run>/options/evaluate/<set>.json, one per prompt "
                        "set): an evaluate output whose settings_sha256 names another is refused")
    p.add_argument("--completions", nargs="*", default=[], metavar="JSONL",
                   help="the run's completions files (results/<run>/completions/<set>.jsonl): an evaluate output whose "
                        "cache was extracted from others is refused")
    p.add_argument("--caches", nargs="*", default=[], metavar="H5",
                   help="the run's hidden-state caches (results/<run>/cache/<set>.h5): an evaluate output that names "
                        "another cache header checksum (another extraction) is refused")
    p.add_argument("--drafters", nargs="*", default=[], metavar="DIR",
                   help="the run's stripped drafter folders (results/<run>/drafters/<ckpt>): an evaluate output that "
                        "names another strip_info.json checksum (another drafter) is refused, and so is one of a "
                        "checkpoint or prompt set the run does not have")


def main(args, opts) -> None:
    write_summary(args.evals, args.out_csv, args.out_parquet, costs=args.costs,
                  expected=expected_inputs(args.settings, args.completions, args.caches, args.drafters),
                  run_records=args.run_settings)


def expected_inputs(settings: list[str], completions: list[str], caches: list[str] = (),
                    drafters: list[str] = ()) -> dict[str, dict]:
    """What the run's files are, for :func:`dflash_eval.report.tau_table.check_eval_inputs`: ``{"sets": {prompt set:
    {"settings_sha256", "completions_sha256", "header_sha256"}}, "checkpoints": {name: {"strip_info_sha256"}}}``,
    keyed by file stem (``<set>.json``, ``<set>.jsonl``, ``<set>.h5``) and folder name (``<ckpt>``); a kind with no
    file given is left out (not compared). ``header_sha256`` is the cache's file attribute (format 6; None
    before), ``strip_info_sha256`` the folder's verified ``strip_info.json`` ``info_sha256`` (None without one).

    Raises:
        InputError: a cache that is not a readable HDF5 file; a ``strip_info.json`` that does not verify
            (:func:`dflash_eval.drafter.files.read_strip_info`).
    """
    sets: dict[str, dict] = {}
    for key, files in (("settings_sha256", settings), ("completions_sha256", completions)):
        for f in files or []:
            sets.setdefault(Path(f).stem, {})[key] = sha256_file(f).hexdigest()
    for f in caches or []:
        sets.setdefault(Path(f).stem, {})["header_sha256"] = _cache_header_sha256(f)
    out: dict[str, dict] = {"sets": sets} if sets else {}
    if drafters:
        out["checkpoints"] = {Path(d).name: {"strip_info_sha256": read_strip_info(Path(d)).get("info_sha256")}
                              for d in drafters}
    return out


def check_paired_evals(evals: list[str], loaded: list[dict], drafters: list[str], completions,
                       eval_settings=None) -> None:
    """For a stage that reads evaluate outputs beside the drafters they were made with (``validate_online``,
    ``validate_engine``), inside the workflow (:func:`dflash_eval.row_checksum.sealed_required`): each output
    (``loaded``, as read) lies where the workflow puts it, was made from ``completions``, the paired drafter's
    ``strip_info.json`` and (when given) the run's evaluate options record ``eval_settings``
    (:func:`dflash_eval.report.tau_table.check_eval_inputs`, as summary checks them), and names the paired drafter's
    checkpoint. The eleventh trial: ckA's evaluate output copied over ckB's, validated by a targeted command,
    compared ckB decoded online with ckA's offline numbers (a false mismatch, exit 0).

    Raises:
        InputError: ``(eval, <field>, ...)`` as :func:`dflash_eval.report.tau_table.check_eval_inputs`, or ``checkpoint``
            for an output paired with another checkpoint's drafter.
    """
    from dflash_eval.row_checksum import sealed_required
    from dflash_eval.report.tau_table import check_eval_inputs

    if not sealed_required():
        return
    expected = expected_inputs([eval_settings] if eval_settings else [], [completions], drafters=drafters)
    for path, ev, drafter in zip(evals, loaded, drafters):
        check_eval_inputs(path, ev, expected)
        if str(ev["checkpoint"]) != Path(drafter).name:
            raise InputError(path, "checkpoint", f"{ev['checkpoint']!r}, but it is paired with drafter {drafter}: "
                             "pass each drafter with its own evaluate output, in the same order",
                             "re-run its evaluate job (snakemake --forcerun <this file>)")


def _cache_header_sha256(path) -> str | None:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            value = f.attrs.get("header_sha256")
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as err:  # dflash_eval.cache.reader.H5_DAMAGE
        raise InputError(path, None, f"not a readable HDF5 cache ({err})",
                         "re-run its hidden_states job (snakemake -R hidden_states)") from None
    if isinstance(value, bytes):
        value = value.decode()
    return None if value is None else str(value)


def write_summary(evals: list[str], out_csv, out_parquet, costs=None, expected: dict | None = None,
                  run_records: list[str] | None = None) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame.

    Args:
        evals: evaluate outputs.
        out_csv, out_parquet: the two tables.
        costs: ``target_costs.json`` path, or None: the speedup columns (:func:`dflash_eval.target.costs.speedup_columns`)
            are filled from it, else left empty.
        expected: what the run's options records, completions, caches and drafters are (:func:`expected_inputs`),
            or None.
        run_records: the run's target_costs options record (``[]`` / None: not compared).

    Raises:
        InputError: an unreadable evaluate output (:func:`dflash_eval.report.tau_table.summary_frame`) or target costs
            file (:func:`dflash_eval.target.costs.read_costs`).
    """
    df = summary_frame(evals, expected)
    df = with_speedups(df, read_costs(costs, run_records) if costs else None)
    with atomic_path(out_csv) as tmp:
        tmp.write_text(table_csv(df))
    with atomic_path(out_parquet) as tmp:
        write_parquet(df, tmp)  # sealed: the trackers verify what they log
    record_outputs("summary", [out_csv, out_parquet], made_from=[*evals, costs])  # compared at parse time (an edited or foreign copy is remade)
    shown = ["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]
    if costs:
        shown += ["speedup_chain", "estimate_reliable"]
    log.info("tau table:\n%s", df[shown].to_string(index=False))
    return df
