"""``<name>.meta.json`` beside a prompts or completions file: what its stage made it from, verified by the next stage.

The prompts stage writes ``prompts/<set>.meta.json``, the completions stage ``completions/<set>.meta.json``::

    {...,                  # prompts: the subset rule's settings and skip counts (the report's table)
     "prompts_sha256" | "completions_sha256",   # sha256 of the file's bytes
     "tokenizer_sha256",   # prompts only: the tokenizer files it templated and tokenized with (tokenizer_sha256())
     "target_sha256",      # completions only: the weights that generated them (null for a server's)
     "settings_sha256",    # sha256 of the workflow's options record of the job (dflash_eval.job_records), or null
     "content_sha256"}     # over all of the above (dflash_eval.row_checksum.seal_document)

Every row of those files is sealed on its own (``row_sha256`` with its place), which catches an edited,
moved or deleted row; but a whole file of *other settings* (another seed, ``n``, tokenizer or
``max_new_tokens``) copied over the run's is sealed just as validly. The meta binds the file to the
settings the workflow planned: the next stage (``completions`` for prompts, ``hidden_states`` for
completions; the workflow passes ``--prompts-settings`` / ``--completions-settings``) compares the
sha256 with the file it reads, its tokenizer and the job's options record (:func:`check_provenance`).
Copying a meta along with its file does not help: its ``settings_sha256`` is the other run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import read_json_object, sha256_file
from dflash_eval.job_records import record_sha256
from dflash_eval.workflow.plan import TOKENIZER_FILES
from dflash_eval.row_checksum import check_document, seal_document

log = logging.getLogger(__name__)

#: the settings of each stage that its options record holds (named in the settings_sha256 error)
SETTINGS_NAMED = {"prompts": "seed, n, source, max_prompt_tokens, tokenizer folder",
                  "completions": "max_new_tokens, sampling, source, target folder"}


def meta_path(prompts_path: str | Path) -> Path:
    """The metadata file beside a prompts JSONL: ``<name>.meta.json`` (``set.jsonl`` -> ``set.meta.json``)."""
    p = Path(prompts_path)
    return p.with_name(p.stem + ".meta.json")


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """sha256 over the tokenizer files of a target folder (those of :data:`dflash_eval.workflow.plan.TOKENIZER_FILES`
    that exist, in that order, each as ``name NUL bytes NUL``): what the prompts were templated with."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(tokenizer_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            sha256_file(f, h)
            h.update(b"\0")
    return h.hexdigest()


def fix_of(stage: str) -> str:
    """The fix of a file or meta of ``stage`` that does not match: make both again."""
    return f"regenerate it with the '{stage}' stage (snakemake -R {stage}), or restore the run's own copies"


def write_meta(path: str | Path, meta: dict, *, file_key: str, tokenizer_dir: str | Path | None = None,
               settings_record: str | Path | None = None) -> Path:
    """Write :func:`meta_path` of a file just written: ``meta`` with the sha256 of the module docstring (the
    file's under ``file_key``; the tokenizer's with ``tokenizer_dir``; the record's), sealed, atomically.

    Args:
        path: the prompts or completions JSONL (already written).
        meta: what else to record (prompts: the subset rule's settings and skip counts).
        file_key: ``prompts_sha256`` or ``completions_sha256``.
        tokenizer_dir: the target folder whose tokenizer made the rows (prompts).
        settings_record: the workflow's options record of the job (``settings_sha256``; None off the workflow).

    Returns:
        the meta file's path.
    """
    doc = {**meta, file_key: sha256_file(path).hexdigest(),
           "settings_sha256": record_sha256(settings_record) if settings_record else None}
    if tokenizer_dir is not None:
        doc["tokenizer_sha256"] = tokenizer_sha256(tokenizer_dir)
    out = meta_path(path)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(seal_document(doc), indent=1), encoding="utf-8")
    return out


def read_meta(path: str | Path, stage: str) -> dict:
    """A meta :func:`write_meta` stored (or the ``.meta.json`` path itself), verified against its
    ``content_sha256`` (one written before the seal is read with a warning).

    Raises:
        InputError: missing or malformed file, content changed after ``stage`` wrote it.
    """
    p = Path(path) if str(path).endswith(".meta.json") else meta_path(path)
    meta = read_json_object(p, f"{stage} metadata", fix_of(stage))
    if not check_document(p, meta, stage, fix_of(stage)):
        log.warning("%s: no content_sha256 (written before it): read unverified", p)
    return meta


def read_prompt_meta(path: str | Path) -> dict:
    """The prompts stage's meta (:func:`read_meta`), with its ``skipped`` table (the report's).

    Raises:
        InputError: see :func:`read_meta`; no ``skipped`` table.
    """
    p = Path(path) if str(path).endswith(".meta.json") else meta_path(path)
    meta = read_meta(p, "prompts")
    if not isinstance(meta.get("skipped"), dict):
        raise InputError(p, "skipped", "missing", fix_of("prompts"))
    return meta


def check_provenance(path: str | Path, file_sha256: str, *, stage: str, file_key: str,
                     tokenizer_dir: str | Path | None = None, settings_record: str | Path | None = None,
                     target_sha256: str | None = None) -> dict | None:
    """Check that a prompts or completions file is the one its meta describes, made with this tokenizer
    (``tokenizer_dir``) and, with ``settings_record``, with the settings the workflow planned.

    Args:
        path: the file being read.
        file_sha256: its sha256 (hex), computed by the caller while reading it anyway.
        stage: the stage that wrote it (``prompts``, ``completions``): named in the errors and their fix.
        file_key: the meta's key of the file's sha256 (``prompts_sha256``, ``completions_sha256``).
        tokenizer_dir: the target folder of the reading stage (prompts: compared with ``tokenizer_sha256``).
        settings_record: the workflow's options record of the writing job; then the meta must exist, be
            sealed and name it. Without it a missing meta is accepted (files written by hand or by the
            stage's functions alone) and the settings are not compared.
        target_sha256: the reading stage's target weights sha256 (completions: compared with the meta's
            ``target_sha256``, the weights that generated them, when both are known: a server's are not).

    Returns:
        the meta, or None when there is none (and no ``settings_record``).

    Raises:
        InputError: naming the meta file and its field: no meta or an unsealed one (with ``settings_record``),
            a meta changed after the stage, or a file / tokenizer / settings sha256 that differs.
    """
    mp, fix = meta_path(path), fix_of(stage)
    if not mp.is_file():
        if settings_record:
            raise InputError(mp, None, f"the metadata of {path} is missing, so the file cannot be traced to "
                             f"the run's {stage} settings", fix)
        return None
    meta = read_meta(mp, stage)
    if settings_record and "content_sha256" not in meta:  # the workflow's stages always seal it
        raise InputError(mp, "content_sha256", f"missing, but the workflow's {stage} stage always seals its metadata: "
                         "it was rewritten after that stage (or by an earlier version)", fix)
    expected = {file_key: (file_sha256, f"the bytes of {path}: the {stage} file was replaced or "
                           "changed after the stage wrote this metadata")}
    if tokenizer_dir is not None:
        expected["tokenizer_sha256"] = (tokenizer_sha256(tokenizer_dir), f"the tokenizer files of {tokenizer_dir}: "
                                        "the prompts were templated and tokenized with another tokenizer")
    if target_sha256 is not None and meta.get("target_sha256") is not None:
        expected["target_sha256"] = (target_sha256, "the weights of the target this stage reads: the completions "
                                     "were generated by another model (target.path changed under the same target.name)")
    if settings_record:
        expected["settings_sha256"] = (record_sha256(settings_record), f"the run's {stage} settings "
                                       f"({settings_record}): the file and its metadata come from a run with "
                                       f"other settings ({SETTINGS_NAMED.get(stage, 'options')})")
    for key, (want, what) in expected.items():
        if key not in meta:
            if settings_record:
                raise InputError(mp, key, f"missing (written before the {stage} stage recorded it)", fix)
            continue
        if meta[key] != want:
            raise InputError(mp, key, f"{str(meta[key])[:16]}... does not match {what}", fix)
    return meta


def skip_table_markdown(metas: dict[str, dict]) -> str:
    """Markdown table of the skip counts of several prompt sets (``{prompt set: meta}``), for the report."""
    from dflash_eval.data.prompts import SKIP_REASONS

    codes = sorted({k for m in metas.values() for k in m["skipped"]})
    head = ["prompt set", "source", "available", "written"] + [SKIP_REASONS.get(c, c) for c in codes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in sorted(metas.items()):
        cells = [name, m.get("source", ""), str(m.get("available", "")), str(m.get("written", ""))]
        lines.append("| " + " | ".join(cells + [str(m["skipped"].get(c, 0)) for c in codes]) + " |")
    return "\n".join(lines)
