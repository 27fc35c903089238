"""What the run's last stages wrote: the sha256 of each final output, compared at parse time.

``tau.csv`` and ``tau.parquet`` (``summary``), ``report.md`` and ``report.html`` (``report``) and
``trackers.json`` (``trackers``), and the report's figures, are read again by no later job when nothing upstream changes, so one edited,
or another run's copied in place (even with an older mtime), stayed with "Nothing to be done" and exit 0 (the
eleventh trial: another run's tau.parquet / tau.csv and report.md / report.html). Inside the workflow each of
these stages records the sha256 of what it wrote in ``results/<run>/digests/<stage>.json`` (sealed by
``content_sha256``); the parse (``rules/common.smk``) compares the files with it, and a file that differs is
made again: :func:`dflash_eval.job_records.write_planned_evaluations` changes ``planned_evaluations.txt``, an
input of ``summary``, ``report`` and ``trackers``, so the three rerun (cheap; the trackers log no point twice).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import sha256_file

#: the folder of ``results/<run>/`` that holds the digests
DIGEST_DIR = "digests"
#: each stage's final outputs under ``results/<run>/`` (a folder: every file in it)
FINAL_OUTPUTS = {"summary": ("tau.csv", "tau.parquet"), "report": ("report.md", "report.html", "figures"),
                 "trackers": ("trackers.json",)}


def digest(path: str | os.PathLike) -> str:
    """sha256 (hex) of a file, or of a folder: its files' relative names and sha256, in name order (hidden files
    left out: Snakemake puts a ``.snakemake_timestamp`` in a folder output after the job)."""
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path).hexdigest()
    import hashlib

    h = hashlib.sha256()
    for f in sorted(q for q in path.rglob("*") if q.is_file()
                    and not any(part.startswith(".") for part in q.relative_to(path).parts)):
        h.update(f"{f.relative_to(path).as_posix()}\0{sha256_file(f).hexdigest()}\n".encode())
    return h.hexdigest()


def record_outputs(stage: str, paths: Iterable, made_from: Iterable = ()) -> Path | None:
    """Record the :func:`digest` of ``paths`` (the stage's final outputs, files or folders, in one ``results/<run>/``
    folder) in ``<that folder>/digests/<stage>.json``, inside the workflow only
    (:func:`dflash_eval.row_checksum.sealed_required`; a direct CLI call writes nothing beside its outputs), with
    ``made_from``: the inputs they were made of (evaluate outputs, target costs, report sections), so that only
    those are called lost when gone (:func:`made_from`).

    Returns:
        the digest file written, or None.
    """
    from dflash_eval.row_checksum import seal_document, sealed_required

    files = [Path(p) for p in paths if p]
    if not files or not sealed_required():
        return None
    out = files[0].parent / DIGEST_DIR / f"{stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = seal_document({"stage": stage, "outputs": {os.path.normpath(str(f)): digest(f) for f in files},
                         "made_from": sorted({os.path.normpath(str(f)) for f in made_from if f})})
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def made_from(run_dir: str | os.PathLike, stages: Iterable[str] = ("summary", "report")) -> set[str] | None:
    """The inputs the run's final outputs were made of (:func:`record_outputs`' ``made_from``, normalised paths),
    or ``None`` when no verified digest of ``stages`` holds the field (a version before it: every planned input
    counts). A planned output that is missing but not among them is new, not lost (the sixteenth trial's P5b: a new
    checkpoint's evaluate output was called "gone")."""
    from dflash_eval.row_checksum import check_document

    found: set[str] | None = None
    for stage in stages:
        rec = Path(run_dir) / DIGEST_DIR / f"{stage}.json"
        try:
            doc = json.loads(rec.read_text())
            check_document(rec, doc, str(doc.get("stage")), "")
            names = doc["made_from"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InputError):
            continue
        found = (found or set()) | {str(n) for n in names}
    return found


def replaced_outputs(run_dir: str | os.PathLike, stages: Iterable[str] = tuple(FINAL_OUTPUTS)) -> list[str]:
    """The final outputs (:data:`FINAL_OUTPUTS`) of ``stages`` under ``run_dir`` that are there but are not what their
    stage recorded (:func:`record_outputs`): edited, truncated, replaced by a folder, or another run's copied in place;
    also one whose digest is missing or does not verify (the twelfth trial: ``digests/`` deleted, then an edited
    tau.csv with its old mtime passed; results of a version before the digests are made again once). A missing
    output is not listed (Snakemake remakes it). ``stages``: those the run plans (a stage no longer run would have
    its outputs listed at every parse).
    """
    from dflash_eval.row_checksum import check_document

    found: list[str] = []
    for stage in stages:
        rec = Path(run_dir) / DIGEST_DIR / f"{stage}.json"
        try:
            doc = json.loads(rec.read_text())
            check_document(rec, doc, str(doc.get("stage")), "")
            outputs = dict(doc["outputs"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InputError):
            outputs = {}
        for name in FINAL_OUTPUTS[stage]:
            path = os.path.normpath(os.path.join(run_dir, name))
            if os.path.lexists(path):
                try:
                    same = outputs.get(path) == digest(path)
                except OSError:
                    same = False
                if not same:
                    found.append(path)
    return found


#: suffix a sealed run-level output found edited is moved to (:func:`reject_edited_outputs`), kept for a look
REJECTED_SUFFIX = ".rejected"


def reject_edited_outputs(paths: Iterable[str], move: bool = True) -> list[str]:
    """The sealed run-level outputs among ``paths`` (``target_costs.json``, ``validate_online.json`` and the other
    report sections) whose ``content_sha256`` does not match their content: with ``move``, each is moved to
    ``<file>.rejected`` so that the same command makes it again (the fourteenth trial's A7: an edited
    ``validate_online.json`` with its mtime put back stayed as the run's, "Nothing to be done"; only a rerun of
    the report noticed). Files without a seal (an earlier version's) and unreadable ones are left to the stages
    that read them. A command that runs no job passes ``move=False``: listed only."""
    from dflash_eval.row_checksum import DOC_FIELD, content_sha256

    found = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if isinstance(doc, dict) and DOC_FIELD in doc and content_sha256(doc) != doc[DOC_FIELD]:
            if move:
                os.replace(path, str(path) + REJECTED_SUFFIX)
            found.append(str(path))
    return found


def failed_checks(paths: Iterable[str], since: float) -> list[str]:
    """One line per check that did not pass in the validation outputs among ``paths`` (``validate_online.json``,
    ``validate_engine.json``) written at or after ``since`` (seconds since the epoch): an entry with ``"ok": false``
    (greedy online vs offline steps, engine vs offline tau) or ``"within_goal": false`` (sampled online vs offline
    tau), named by checkpoint and mode. The Snakefile's ``onsuccess`` prints them (the fifteenth trial: a validation
    that failed was only an "ok: no" row in the report, exit 0)."""
    lines: list[str] = []

    def walk(node, where: tuple, path: str) -> None:
        if isinstance(node, list):
            for value in node:
                walk(value, where, path)
        elif isinstance(node, dict):
            where = where + (str(node["checkpoint"]),) if "checkpoint" in node else where
            if node.get("ok") is False or node.get("within_goal") is False:
                lines.append(f"{path}: {' '.join(where) or 'run'}: " + (
                    "sampled online tau differs from offline beyond the goal" if node.get("within_goal") is False
                    else "did not pass") + " (see the report)")
            for key, value in node.items():
                if key not in ("samples", "requests", "per_position"):
                    walk(value, where if key in ("checkpoints", "modes", "sampling") else where + (key,), path)

    for path in paths:
        try:
            if os.path.getmtime(path) < since:
                continue
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        walk(doc, (), str(path))
    return lines
