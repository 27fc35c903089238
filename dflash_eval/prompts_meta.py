"""``<set>.meta.json``: what the prompts stage made a prompts file from, verified by the completions stage.

The prompts stage writes it beside the prompts JSONL (``set.jsonl`` -> ``set.meta.json``)::

    {"source", "path", "n", "seed", "max_prompt_tokens",      # the subset rule's settings
     "available", "written", "skipped", "skip_reasons",       # what was kept and why not (the report's table)
     "prompts_sha256",     # sha256 of the prompts JSONL's bytes
     "tokenizer_sha256",   # sha256 of the tokenizer files it templated and tokenized with (tokenizer_sha256())
     "settings_sha256",    # sha256 of the workflow's options record of the job (dflash_eval.job_records), or null
     "content_sha256"}     # over all of the above (dflash_eval.row_checksum.seal_document)

Every prompts row is sealed on its own (``row_sha256`` with its place), which catches an edited,
moved or deleted row; but a whole prompts file of *other settings* (another seed, ``n`` or
tokenizer) copied over the run's is sealed just as validly. The meta binds the file to the settings
the workflow planned: the completions stage (given ``--prompts-settings``, as the workflow does)
compares the three sha256 with the prompts file it reads, its target's tokenizer and the job's
options record (:func:`check_prompts_provenance`). Copying a meta along with its prompts file does
not help: its ``settings_sha256`` is the other run's.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from .errors import InputError, atomic_path
from .io import read_json_object, sha256_file
from .plan import TOKENIZER_FILES
from .row_checksum import check_document, seal_document

log = logging.getLogger(__name__)

#: the fix of a meta or prompts file that does not match: regenerate both
META_FIX = "regenerate the prompts with the 'prompts' stage (snakemake -R prompts), or restore the run's own copies"


def meta_path(prompts_path: str | Path) -> Path:
    """The metadata file beside a prompts JSONL: ``<name>.meta.json`` (``set.jsonl`` -> ``set.meta.json``)."""
    p = Path(prompts_path)
    return p.with_name(p.stem + ".meta.json")


def tokenizer_sha256(tokenizer_dir: str | Path) -> str:
    """sha256 over the tokenizer files of a target folder (those of :data:`dflash_eval.plan.TOKENIZER_FILES`
    that exist, in that order, each as ``name NUL bytes NUL``): what the prompts were templated with."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = Path(tokenizer_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\0")
            sha256_file(f, h)
            h.update(b"\0")
    return h.hexdigest()


def write_meta(prompts_path: str | Path, meta: dict, tokenizer_dir: str | Path,
               settings_record: str | Path | None = None) -> Path:
    """Write :func:`meta_path` of a prompts file just written: ``meta`` (the second value of
    :func:`dflash_eval.prompts.build_prompt_set_with_meta`) with the three sha256 of the module docstring,
    sealed, atomically.

    Args:
        prompts_path: the prompts JSONL (already written).
        meta: the subset rule's settings and skip counts.
        tokenizer_dir: the target folder whose tokenizer made the prompts.
        settings_record: the workflow's options record of the prompts job (``settings_sha256``; None off the workflow).

    Returns:
        the meta file's path.
    """
    doc = {**meta, "prompts_sha256": sha256_file(prompts_path).hexdigest(),
           "tokenizer_sha256": tokenizer_sha256(tokenizer_dir),
           "settings_sha256": sha256_file(settings_record).hexdigest() if settings_record else None}
    out = meta_path(prompts_path)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(seal_document(doc), indent=1), encoding="utf-8")
    return out


def read_prompt_meta(path: str | Path) -> dict:
    """The metadata :func:`write_meta` stored for a prompts file (or the ``.meta.json`` path itself), verified
    against its ``content_sha256`` (one written before the seal is read with a warning).

    Raises:
        InputError: missing or malformed file, no ``skipped`` table, content changed after the prompts stage.
    """
    p = Path(path)
    p = p if p.name.endswith(".meta.json") else meta_path(p)
    meta = read_json_object(p, "prompts metadata", "re-run the prompts stage")
    if not check_document(p, meta, "prompts", META_FIX):
        log.warning("%s: no content_sha256 (written before it): read unverified", p)
    if not isinstance(meta.get("skipped"), dict):
        raise InputError(p, "skipped", "missing", "re-run the prompts stage")
    return meta


def check_prompts_provenance(prompts_path: str | Path, prompts_sha256: str, tokenizer_dir: str | Path,
                             settings_record: str | Path | None = None) -> dict | None:
    """Check that a prompts file is the one its meta describes, made with this tokenizer and (with
    ``settings_record``) with the settings the workflow planned.

    Args:
        prompts_path: the prompts JSONL being read.
        prompts_sha256: its sha256 (hex), computed by the caller while reading it anyway.
        tokenizer_dir: the target folder of the reading stage.
        settings_record: the workflow's options record of the prompts job; then the meta must exist and
            name it. Without it a missing meta is accepted (prompts written by hand or by
            :func:`dflash_eval.prompts.write_prompts` alone) and the settings are not compared.

    Returns:
        the meta, or None when there is none (and no ``settings_record``).

    Raises:
        InputError: naming the meta file and its field: no meta or an unsealed one (with ``settings_record``), a
            meta changed after the prompts stage, or a ``prompts_sha256`` / ``tokenizer_sha256`` / ``settings_sha256``
            that differs from the file, the tokenizer or the record.
    """
    mp = meta_path(prompts_path)
    if not mp.is_file():
        if settings_record:
            raise InputError(mp, None, f"the metadata of {prompts_path} is missing, so the file cannot be traced to "
                             "the run's prompt settings", META_FIX)
        return None
    meta = read_prompt_meta(mp)
    if settings_record and "content_sha256" not in meta:  # the workflow's prompts stage always seals it
        raise InputError(mp, "content_sha256", "missing, but the workflow's prompts stage always seals its metadata: "
                         "it was rewritten after that stage (or by an earlier version)", META_FIX)
    expected = {"prompts_sha256": (prompts_sha256, f"the bytes of {prompts_path}: the prompts file was replaced or "
                                   "changed after the prompts stage wrote this metadata"),
                "tokenizer_sha256": (tokenizer_sha256(tokenizer_dir), f"the tokenizer files of {tokenizer_dir}: the "
                                     "prompts were templated and tokenized with another tokenizer")}
    if settings_record:
        expected["settings_sha256"] = (sha256_file(settings_record).hexdigest(), f"the run's prompt settings "
                                       f"({settings_record}): the prompts file and its metadata come from a run with "
                                       "other settings (seed, n, source, max_prompt_tokens, tokenizer folder)")
    for key, (want, what) in expected.items():
        if key not in meta:
            if settings_record:
                raise InputError(mp, key, "missing (written before the prompts stage recorded it)", META_FIX)
            continue
        if meta[key] != want:
            raise InputError(mp, key, f"{str(meta[key])[:16]}... does not match {what}", META_FIX)
    return meta


def skip_table_markdown(metas: dict[str, dict]) -> str:
    """Markdown table of the skip counts of several prompt sets (``{prompt set: meta}``), for the report."""
    from .prompts import SKIP_REASONS

    codes = sorted({k for m in metas.values() for k in m["skipped"]})
    head = ["prompt set", "source", "available", "written"] + [SKIP_REASONS.get(c, c) for c in codes]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in sorted(metas.items()):
        cells = [name, m.get("source", ""), str(m.get("available", "")), str(m.get("written", ""))]
        lines.append("| " + " | ".join(cells + [str(m["skipped"].get(c, 0)) for c in codes]) + " |")
    return "\n".join(lines)
