"""``python -m dflash_eval records --from-evals results/<run>``: the per-request records of a results folder written
before they existed, from its evaluate JSONs, so that upgrading reruns no drafter replay.

Not a rule (nothing in the workflow calls it): a one-off upgrade step. For every evaluate output
``<run>/eval/<ckpt>/<set>.json`` without its ``<set>.records.parquet`` it writes the records that ``evaluate``
would have written beside it (:func:`dflash_eval.report.records.evaluate_records`; the ``run`` column is the
folder's name, the repeated 8-gram fraction of each completion is measured on ``<run>/completions/<set>.jsonl``
when that file is there, else left null), and likewise the validations' records. Records already there are kept.

Snakemake then plans no job for them: an output without Snakemake metadata (the new file) makes it skip the job's
params / code / input triggers, so the rule's new shell command (``--out-records``) reruns nothing. For the same
reason a later option change would not rerun them either: the command printed last (:func:`touch_command`) records
them as done under this version's rules (docs/outputs.md, "Upgrading a results folder").
"""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import read_json_object
from dflash_eval.data.completions import read_completions
from dflash_eval.data.repetition import repeated_ngram_fraction
from dflash_eval.report.records import (engine_records, evaluate_records, online_records, read_eval, records_path,
                                        validation_jobs, write_records)

log = logging.getLogger(__name__)


def add_arguments(p) -> None:
    p.add_argument("--from-evals", required=True, metavar="RESULTS",
                   help="a results folder (results/<run>): writes each missing eval/<ckpt>/<set>.records.parquet "
                        "from its evaluate JSON")


def main(args, opts) -> None:
    written = records_from_evals(args.from_evals)
    if written:
        print(f"wrote the records of {len(written)} output(s); `snakemake -n` plans no job for them now. Then "
              f"let Snakemake record them (else a later option change does not rerun them), with your run's "
              f"--configfile / profile options:\n  {touch_command(written)}")
    else:
        print("every output already has its records: nothing written")


def touch_command(written: list[Path]) -> str:
    """The Snakemake command that records the jobs of ``written`` (:func:`records_from_evals`) as done under this
    version's rules without running them: ``--touch`` of exactly those jobs (``--forcerun`` of their rules, limited
    to them by ``--allowed-rules``), the targets first (those two options read every word after them). Without it
    the new records file has no Snakemake metadata, and Snakemake then skips the params / code / input triggers of
    its job (snakemake/snakemake, ``src/snakemake/dag.py``: ``reason.no_metadata``; Snakemake 9.27)."""
    rules = sorted({"evaluate" if w.parent.parent.name == "eval" else w.stem for w in written})
    targets = " ".join(shlex.quote(str(w)) for w in written)  # first: --forcerun / --allowed-rules take every word
    return f"snakemake {targets} --touch --forcerun {' '.join(rules)} --allowed-rules {' '.join(rules)}"


def records_from_evals(results) -> list[Path]:
    """Write ``<set>.records.parquet`` beside each evaluate output ``results/eval/<ckpt>/<set>.json`` lacking it, and
    ``validate_online.records.parquet`` / ``validate_engine.records.parquet`` beside those outputs when missing (their
    rows: :func:`~dflash_eval.report.records.online_records` / :func:`~dflash_eval.report.records.engine_records` of
    the JSON, the evaluate JSONs of its checkpoints and the first ``n_samples`` rows of its completions file,
    ``results/completions/<set>.jsonl``, as the stages pick them).

    Args:
        results: a run's results folder (``results/<run>``); its name is the records' ``run`` column.

    Returns:
        The JSONs whose records were written: the evaluate outputs sorted, then the validations.

    Raises:
        InputError: ``results`` holds no ``eval/`` folder; an evaluate JSON that is not one
            (:func:`dflash_eval.report.records.read_eval`), or missing for a validated checkpoint; an unreadable
            validation JSON or completions file.
    """
    results = Path(results)
    if not (results / "eval").is_dir():
        raise InputError(results, None, "no eval/ folder: not a results folder of a run",
                         "pass results/<run> (the folder holding eval/<checkpoint>/<prompt set>.json)")
    written, fractions = [], {}
    for js in sorted((results / "eval").glob("*/*.json")):
        out = records_path(js)
        if out.is_file():
            continue
        r = read_eval(js)
        s = r["prompt_set"]
        if s not in fractions:
            comp = results / "completions" / f"{s}.jsonl"
            fractions[s] = {str(c["id"]): repeated_ngram_fraction(c["completion_ids"])
                            for c in read_completions(comp)} if comp.is_file() else {}
        rep = {i: fractions[s][str(x.get("id"))] for i, x in enumerate(r["samples"]) if str(x.get("id")) in fractions[s]}
        df, job = evaluate_records(r, results.name, rep or None)
        write_records(out, df, [job])  # as evaluate writes them (one job object per file)
        log.info("%s: %d samples -> %s", js, len(r["samples"]), out)
        written.append(js)
    for name, convert in (("validate_online", online_records), ("validate_engine", engine_records)):
        js = results / f"{name}.json"
        if js.is_file() and not records_path(js).is_file():
            result = read_json_object(js, name, f"rerun it: snakemake --forcerun {name}")
            comp = results / "completions" / Path(str(result.get("completions", ""))).name
            rows = read_completions(comp)[: int(result["n_samples"])]
            ckpts = list(dict.fromkeys([str(e["checkpoint"]) for e in result.get("checkpoints", [])]
                                       + [str(e["checkpoint"]) for e in result.get("sampled", [])]))
            loaded = [read_eval(results / "eval" / c / f"{comp.stem}.json") for c in ckpts]
            df = convert(result, loaded, rows, results.name)
            write_records(records_path(js), df, validation_jobs(df, result))
            log.info("%s: %d records -> %s", js, len(df), records_path(js))
            written.append(js)
    return written
