"""What the run's last stages wrote: the sha256 of each final output, compared at parse time.

``tau.csv`` and ``tau.parquet`` (``summary``), ``report.md`` and ``report.html`` (``report``) and
``trackers.json`` (``trackers``) are read again by no later job when nothing upstream changes, so one edited,
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

from .errors import InputError, atomic_path
from .io import sha256_file

#: the folder of ``results/<run>/`` that holds the digests
DIGEST_DIR = "digests"


def record_outputs(stage: str, paths: Iterable) -> Path | None:
    """Record the sha256 of ``paths`` (the stage's final outputs, in one ``results/<run>/`` folder) in
    ``<that folder>/digests/<stage>.json``, inside the workflow only
    (:func:`dflash_eval.row_checksum.sealed_required`; a direct CLI call writes nothing beside its outputs).

    Returns:
        the digest file written, or None.
    """
    from .row_checksum import seal_document, sealed_required

    files = [Path(p) for p in paths if p]
    if not files or not sealed_required():
        return None
    out = files[0].parent / DIGEST_DIR / f"{stage}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = seal_document({"stage": stage, "outputs": {os.path.normpath(str(f)): sha256_file(f).hexdigest()
                                                     for f in files}})
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return out


def replaced_outputs(run_dir: str | os.PathLike) -> list[str]:
    """The final outputs under ``run_dir`` whose bytes differ from what their stage recorded (:func:`record_outputs`):
    edited, or another run's copied in place. A missing output is not listed (Snakemake remakes it); a digest file
    that is unreadable or edited lists the outputs it names (or itself), so they are made again.
    """
    from .row_checksum import check_document

    found: list[str] = []
    for rec in sorted((Path(run_dir) / DIGEST_DIR).glob("*.json")):
        try:
            doc = json.loads(rec.read_text())
            check_document(rec, doc, str(doc.get("stage")), "")
            outputs = dict(doc["outputs"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InputError):
            found.append(str(rec))
            continue
        found += [p for p, sha in outputs.items() if os.path.isfile(p) and sha256_file(p).hexdigest() != sha]
    return found
