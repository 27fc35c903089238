"""Per-row checksums of the completions JSONL: ``ids_sha256`` over a row's token ids, ``row_sha256`` over all of it.

A completions row carries ``ids_sha256`` = sha256 of ``"<prompt ids>|<completion ids>"`` (each
list as comma-separated decimal ids, no spaces; UTF-8), and, last, ``row_sha256`` = sha256 of the
row's canonical JSON without ``row_sha256`` itself (:func:`row_sha256`: keys sorted, no spaces,
non-ASCII escaped), so every field a stage reads (``id``, ``stop_reason``, ``max_new_tokens``,
``generation`` with the sampling settings, ``text``, ...) is covered, not only the ids. Both are
written by the completions stage and checked by :func:`dflash_eval.data.completions.read_completions`:
a value changed in the file (an edit, a bad copy) is refused naming the line and the row, instead
of conditioning the cache and the replay on tokens the target never produced or on another
generation limit. Rows of files written before a checksum existed lack it: they are read, with one
warning per file naming what is unverified; a file whose rows differ in which checksums they carry
(a row's checksums removed) is refused (:func:`check_uniform`).

Each row also carries its place, ``row_index`` (0-based) and ``n_rows``, under ``row_sha256``, so a
row deleted, added, duplicated or moved is refused too (:func:`check_places`). The prompts file of
the ``prompts`` stage carries ``row_index``, ``n_rows`` and ``row_sha256`` the same way
(:func:`dflash_eval.data.prompts.write_prompts`).

Inside the workflow every prompts and completions file is written by this project's stages, which
seal every row: the shell prefix of its jobs (``rules/common.smk``) sets :data:`SEALED_ENV`, and
there a file whose rows carry no checksum at all (rewritten without them) is refused
(:func:`sealed_required`) instead of read with the warning a direct CLI call gives; so is a sealed JSON
output without its ``content_sha256`` (:func:`check_document`) and a hidden-state cache of a format
before 6 (:class:`dflash_eval.cache.reader.CacheReader`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

from dflash_eval.core.errors import InputError

FIELD = "ids_sha256"
ROW_FIELD = "row_sha256"
INDEX, COUNT = "row_index", "n_rows"
#: set to 1 by the workflow's jobs: unsealed prompts and completions files are refused
SEALED_ENV = "DFLASH_EVAL_REQUIRE_SEALED"


def sealed_required(require: bool | None = None) -> bool:
    """``require`` when given, else whether :data:`SEALED_ENV` is ``1`` (a job of the workflow)."""
    return os.environ.get(SEALED_ENV) == "1" if require is None else require


def ids_sha256(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> str:
    """The row checksum (hex): sha256 of ``"<p0>,<p1>,...|<c0>,<c1>,..."``."""
    text = ",".join(str(int(t)) for t in prompt_ids) + "|" + ",".join(str(int(t)) for t in completion_ids)
    return hashlib.sha256(text.encode()).hexdigest()


def row_sha256(row: dict) -> str:
    """The whole-row checksum (hex): sha256 of ``json.dumps(row without row_sha256, sort_keys=True,
    separators=(",", ":"))`` (ASCII: non-ASCII characters escaped), UTF-8. Computed on the row as JSON
    reads it back, so writer and reader hash the same text (tuples are lists, floats round-trip)."""
    body = {k: v for k, v in json.loads(json.dumps(row)).items() if k != ROW_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: the checksum of a whole JSON output (an evaluate output, ``target_costs.json``) over its other keys
DOC_FIELD = "content_sha256"


def content_sha256(doc: dict) -> str:
    """:func:`row_sha256` of a JSON document without its ``content_sha256`` (same canonical text)."""
    return row_sha256({k: v for k, v in doc.items() if k != DOC_FIELD})


def seal_document(doc: dict) -> dict:
    """``doc`` with ``content_sha256`` added last (what ``evaluate`` and ``target_costs`` write)."""
    return {**doc, DOC_FIELD: content_sha256(doc)}


def check_document(path, doc: dict, stage: str, fix: str) -> bool:
    """Compare a JSON output's ``content_sha256`` with its content.

    Returns:
        True when it carries one and it matches; False when it carries none (written before it: the
        caller warns) outside the workflow.

    Raises:
        InputError: ``(path, "content_sha256", ...)`` when a value changed after ``stage`` wrote it, or
            when it carries none inside the workflow (:func:`sealed_required`: there every such file is
            written, and sealed, by this version's ``stage`` stage).
    """
    want = doc.get(DOC_FIELD)
    if want is None:
        if sealed_required():
            raise InputError(path, DOC_FIELD, f"missing, but inside the workflow every {stage} output is written "
                             f"and sealed by its {stage} stage: it was rewritten after that stage, or written by an "
                             "earlier version", fix)
        return False
    if content_sha256(doc) != want:
        raise InputError(path, DOC_FIELD, f"its content does not match its checksum: a value (or a key) changed after "
                         f"the {stage} stage wrote it", fix)
    return True


def seal(row: dict) -> dict:
    """``row`` with ``row_sha256`` added last (a prompts row, :func:`dflash_eval.data.prompts.write_prompts`)."""
    return {**row, ROW_FIELD: row_sha256(row)}


def seal_row(row: dict) -> dict:
    """``row`` with ``ids_sha256`` and, last, ``row_sha256`` added (what the completions stage writes)."""
    return seal({**row, FIELD: ids_sha256(row["prompt_ids"], row["completion_ids"])})


def check_sealed(path, line: int, row: dict, what: str, fix: str) -> bool:
    """Compare a row's ``row_sha256`` with its fields (completions and prompts rows alike).

    Args:
        what: the message's cause, naming the row (e.g. ``"prompt 'a': its fields do not match ..."``).

    Returns:
        True when the row carries ``row_sha256`` and it matches, False when it carries none.

    Raises:
        InputError: ``(path, "line <line>: row_sha256", what, fix)`` when it does not match.
    """
    want = row.get(ROW_FIELD)
    if want is None:
        return False
    if row_sha256(row) != want:
        raise InputError(path, f"line {line}: {ROW_FIELD}", what, fix)
    return True


def check_row(path, line: int, row: dict) -> str | None:
    """Compare a completions row's checksums with its values; returns what they covered.

    Returns:
        ``"row"`` (``row_sha256``: every field), ``"ids"`` (only ``ids_sha256``: a file written before
        ``row_sha256``; the other fields unverified) or None (no checksum: a file from before both).

    Raises:
        InputError: ``(path, "line <n>: ids_sha256", ...)`` when the ids do not match it;
            ``(path, "line <n>: row_sha256", ...)`` when another field does not match the row checksum.
    """
    want = row.get(FIELD)
    if want is not None and ids_sha256(row["prompt_ids"], row["completion_ids"]) != want:
        raise InputError(path, f"line {line}: {FIELD}", f"row {row.get('id')!r}: its prompt_ids/completion_ids do "
                         "not match their checksum (the file changed after the completions stage wrote it)",
                         "regenerate the completions (snakemake -R completions, or delete the file and rerun), "
                         "or restore an intact copy")
    fields = ", ".join(sorted(k for k in row if k not in (FIELD, ROW_FIELD, "prompt_ids", "completion_ids")))
    if not check_sealed(path, line, row, f"row {row.get('id')!r}: its fields do not match the row checksum: one of "
                        f"{fields} (or a field added or removed) changed after the completions stage wrote it (its "
                        "ids still match ids_sha256)", "regenerate the completions (snakemake -R completions, or "
                        "delete the file and rerun), or restore an intact copy"):
        return "ids" if want is not None else None
    return "row"


def check_uniform(path, rows: Sequence[tuple[int, dict]], fields: Sequence[str], fix: str) -> None:
    """Refuse a file in which some rows carry one of ``fields`` (checksums, places) and others do not.

    A writer seals every row alike, so a row without them beside rows with them had them removed (to
    pass an edit unchecked) or was added by hand.

    Args:
        rows: ``(line number, row)`` of every row in the file's order.

    Raises:
        InputError: ``(path, "line <n>: <field>", ...)`` naming the first row that differs from the first row.
    """
    for field in fields:
        has = [field in r for _, r in rows]
        if any(has) and not all(has):
            line, r = next((ln, r) for (ln, r), h in zip(rows, has) if h != has[0])
            first = "carries" if field in r else "carries no"
            other = "do not" if has[0] is False else "do"
            raise InputError(path, f"line {line}: {field}", f"row {r.get('id')!r} {first} {field} while the rows before "
                             f"it {other}: the writer seals every row alike, so rows were edited or added by hand", fix)


def check_places(path, rows: Sequence[tuple[int, dict]], fix: str) -> bool:
    """Compare each row's ``row_index`` / ``n_rows`` with where it is: no row deleted, added, duplicated or moved.

    Args:
        rows: ``(line number, row)`` of every row in the file's order (their checksums already checked,
            so the places are what the writer wrote).

    Returns:
        True when the rows carry their places (all checked), False when none does (a file written before them).

    Raises:
        InputError: ``(path, "line <n>: row_index", ...)`` for the first row out of place (as
            :func:`check_uniform` when only some rows carry them).
    """
    check_uniform(path, rows, (INDEX, COUNT), fix)
    if not rows or COUNT not in rows[0][1]:
        return False
    n = len(rows)
    for pos, (line, r) in enumerate(rows):
        if r[INDEX] != pos or r[COUNT] != n:
            raise InputError(path, f"line {line}: {INDEX}", f"row {r.get('id')!r} was written as row {r[INDEX] + 1} of "
                             f"{r[COUNT]}, but is row {pos + 1} of {n} here: rows were deleted, added or moved after "
                             "the file was written", fix)
    return True


#: a run-level output's record of the sealed outputs it was computed from: ``{path: content_sha256}``
INPUTS_FIELD = "inputs_sha256"


def write_run_output(out, result: dict, stage: str, settings_record=None, inputs: dict | None = None,
                     **dumps) -> dict:
    """Write a run-level stage's JSON output (``target_costs.json``, the report's sections of ``kernel_parity``,
    ``engine_parity``, ``validate_online``, ``validate_engine``) atomically, naming its ``stage``, the path
    it was written to (``output``: ``results/<run>/...``, so that a copy in another run's folder is seen, whose
    settings may well be the same: the ninth trial) and the sha256 of the workflow's options record of the job
    (``settings_sha256``; None off the workflow), sealed by
    ``content_sha256``: what :func:`check_run_output` compares, so that another run's file copied in place, or an
    edited one, is refused by the stages that read it (the eighth trial's S4, S5). ``inputs``: the sealed outputs it
    was computed from, ``{path: their content_sha256 as read}`` (``validate_online`` / ``validate_engine``: the
    evaluate outputs it compared with), stored as :data:`INPUTS_FIELD` and compared by :func:`check_run_output`
    with those files as they are then (the tenth trial: an evaluate output edited, validated, then restored with
    its old mtime left a report comparing online decoding with the edited numbers). ``dumps``: ``default`` for
    values JSON lacks (e.g. ``float`` for numpy scalars).

    Returns:
        the document as written.
    """
    from dflash_eval.core.errors import atomic_path

    settings = hashlib.sha256(open(settings_record, "rb").read()).hexdigest() if settings_record else None
    plain = json.loads(json.dumps(result, default=dumps.get("default")))  # numpy scalars etc. as JSON has them
    doc = {**plain, "stage": stage, "settings_sha256": settings, "output": os.path.normpath(str(out))}
    if inputs is not None:
        doc[INPUTS_FIELD] = {os.path.normpath(str(k)): v for k, v in inputs.items()}
    doc = seal_document(doc)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def check_run_output(path, doc: dict, records=None, fix: str | None = None, stage: str | None = None) -> None:
    """Verify a run-level stage's output (:func:`write_run_output`): its seal (:func:`check_document`), and, with
    ``records`` (the run's options records of the run-level stages, ``results/<run>/options/<stage>/run.json``:
    the workflow passes them), that it names one of those stages and that stage's record; and that each output it
    was computed from (:data:`INPUTS_FIELD`) still carries the ``content_sha256`` it had then.

    Raises:
        InputError: ``(path, "content_sha256" | "stage" | "output" | "settings_sha256" | "inputs_sha256", ...)``:
            edited; not an output of the run's stages; written at another path (another run's file copied in
            place); made with other settings or by an earlier version; computed from an evaluate output that has
            changed (or gone) since.
    """
    from pathlib import Path

    stage = doc.get("stage") or stage or "its"  # the stage named in the file, else the caller's expectation
    fix = fix or f"rerun it: snakemake --forcerun {path}"
    if not check_document(path, doc, stage, fix):
        import logging

        logging.getLogger(__name__).warning("%s: no content_sha256 (written before it): read unverified", path)
    for src, sha in (doc.get(INPUTS_FIELD) or {}).items():
        try:
            now = json.loads(Path(src).read_text()).get(DOC_FIELD)
        except (OSError, ValueError, AttributeError):
            now = "unreadable"
        if now != sha:
            raise InputError(path, INPUTS_FIELD, f"{stage} compared with {src} as it was then (content_sha256 "
                             f"{str(sha)[:16]}...), but that file is {'gone or ' if now == 'unreadable' else ''}"
                             f"{'unreadable' if now == 'unreadable' else 'now ' + str(now)[:16] + '...'}: it was "
                             "edited, replaced or restored after this stage ran", fix)
    if records is None:
        return
    want = {Path(r).parent.name: (str(r), hashlib.sha256(Path(r).read_bytes()).hexdigest()) for r in records}
    if doc.get("stage") not in want:
        raise InputError(path, "stage", f"{doc.get('stage')!r} is not one of the run's stages ({', '.join(sorted(want))}): "
                         "not an output of this run's workflow, or one of an earlier version", fix)
    record, sha = want[doc["stage"]]
    if doc.get("output") != os.path.normpath(str(path)):
        raise InputError(path, "output", f"written by the {doc['stage']} stage as {doc.get('output')!r}, not at this "
                         "path: another run's file (or another folder's) copied in place, or one of an earlier version",
                         fix)
    got = doc.get("settings_sha256")
    if got != sha:
        raise InputError(path, "settings_sha256", f"{'missing' if got is None else got[:16] + '...'}, but the run's "
                         f"{doc['stage']} options record {record} has sha256 {sha[:16]}...: the file was made with other "
                         "settings (another run's copied in place) or by an earlier version", fix)
