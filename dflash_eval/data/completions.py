"""The completions file of a prompt set (token ids, never re-tokenized text): format, resumable writer, reader.

Output JSONL, one row per prompt, in the prompts file's order::

    {"id": str,
     "prompt_ids": [int, ...],       # copied from the prompts file
     "completion_ids": [int, ...],   # generated ids up to and including the first stop id; no padding
     "text": str,                    # tokenizer.decode(completion_ids), special tokens kept
     "stop_reason": "eos" | "length",
     "max_new_tokens": int,
     "generation": {...},            # provenance, the same in every row (below)
     "row_index": int, "n_rows": int,  # the row's place in the file: 0-based, and the number of rows
     "ids_sha256": str,              # sha256 of the row's ids (dflash_eval/row_checksum.py), verified when read
     "row_sha256": str}              # sha256 of the whole row but itself (the same module), verified when read

``completion_ids`` are what the target produced (greedy argmax), not a
re-tokenization of ``text``: the hidden-state cache and the replay condition on
exactly these ids. ``generation`` records ``source`` (``transformers`` | ``openai``
| ``sglang``), ``stop_ids`` (the end-of-generation ids used, see
:func:`dflash_eval.serving.generation.stop_token_ids`) and the source's identity: library versions, dtype and
device for ``transformers``; ``engine``, ``model`` (the served model id) and
``server_version`` for servers, plus the launch settings when the workflow
started the server (``generation.serve: vllm``). Timings go to the log only, so a
rerun with the same inputs writes the same bytes. Rows re-tokenized from a
server's text (``generation.allow_retokenize``) carry ``"retokenized": true`` and
``"retokenize_mismatch"`` (the re-tokenized length differs from the number of
tokens the server generated).

Written by the ``completions`` stage (:mod:`dflash_eval.stages.completions`) from a source of
:mod:`dflash_eval.serving.generation`; read by the stages that run the target over the completions.

Resume (append-only): completions are appended as they finish to a sidecar file
``.<out name>.partial`` next to the output (first line: a key of everything that
shapes the output; then one row per line, flushed and fsynced). The sidecar is not
a declared Snakemake output, so Snakemake's clean-up of failed jobs leaves it
alone. A rerun of a killed job (SIGKILL, SIGTERM, node loss, server crash) keeps
the rows already there, generates only the missing prompts, writes the output in
the prompts' order (temp file + rename) and deletes the sidecar: every prompt
exactly once, and the same bytes as an uninterrupted run (the transformers source
regenerates whole batches, so batch composition and thus numerics are the same).
A sidecar whose key differs from this run's (other prompts, target, stop ids,
limits, server, dtype...) is refused with the differences named.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Sequence

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import iter_jsonl
from dflash_eval.row_checksum import COUNT, FIELD, INDEX, ROW_FIELD, check_places, check_row, check_uniform, sealed_required

log = logging.getLogger(__name__)

STOP_EOS, STOP_LENGTH = "eos", "length"
PARTIAL_FORMAT = "dflash-eval/completions-partial"
PARTIAL_VERSION = 1


class PartialCompletions:
    """Append-only sidecar ``<out dir>/.<out name>.partial`` (format: module docstring).

    Args:
        out: the final completions path.
        key: JSON-able dict; a sidecar written under another key is refused.
    """

    def __init__(self, out: str | Path, key: dict):
        self.out = Path(out)
        self.path = self.out.with_name(f".{self.out.name}.partial")
        self.key = json.loads(json.dumps(key))  # normalized (tuples -> lists)
        self._fh = None
        self._lock = threading.Lock()

    def load(self) -> dict[str, str]:
        """Open the sidecar for appending; return the rows already there (``{id: JSON line}``).

        A torn last line (the process died mid-write) is cut off; a sidecar without a
        complete header is started afresh.

        Raises:
            InputError: the sidecar was written under another key (differences named), or a
                complete line in it is not a row.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        done: dict[str, str] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted write", self.path,
                            len(data) - end)
                with open(self.path, "r+b") as fh:
                    fh.truncate(end)
                data = data[:end]
            lines = data.decode("utf-8").splitlines()
            header = None
            if lines:
                with contextlib.suppress(json.JSONDecodeError):
                    header = json.loads(lines[0])
            if not isinstance(header, dict) or header.get("format") != PARTIAL_FORMAT:
                log.warning("%s has no valid header; starting it afresh", self.path)
                self.path.unlink()
            else:
                if header.get("key") != self.key:
                    raise InputError(self.path, "key", "partial completions from an interrupted run with other settings: "
                                     + _key_diff(header.get("key") or {}, self.key),
                                     f"delete {self.path} to start over, or rerun with the settings it was made with")
                failed = []
                for n, line in enumerate(lines[1:], 2):
                    try:
                        row = json.loads(line)
                        rid = str(row["id"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise InputError(self.path, f"line {n}", "not a completions row",
                                         f"delete {self.path} to start over") from None
                    try:  # the stage seals every row it appends: one that fails (or lacks) its checksums is redone
                        sealed = check_row(self.path, n, row) == "row"
                    except (InputError, KeyError, TypeError, ValueError):
                        sealed = False
                    if not sealed:
                        failed.append(rid)
                        continue
                    done.setdefault(rid, line)
                if failed:
                    log.warning("%s: %d row(s) fail their checksums (edited or damaged since they were written: %s): "
                                "generated again", self.path, len(failed), ", ".join(map(repr, failed[:5])))
        if not self.path.exists():
            with atomic_path(self.path) as tmp:
                tmp.write_text(json.dumps({"format": PARTIAL_FORMAT, "version": PARTIAL_VERSION, "key": self.key})
                               + "\n", encoding="utf-8")
        self._fh = open(self.path, "a", encoding="utf-8")
        return done

    def append(self, lines: Sequence[str]) -> None:
        """Append rows (JSON lines without newline) in one write, then flush and fsync."""
        if not lines:
            return
        with self._lock:
            self._fh.write("".join(line + "\n" for line in lines))
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def finish(self, ordered_lines: Sequence[str]) -> None:
        """Write the output (the given lines, in order) atomically, then delete the sidecar."""
        self.close()
        with atomic_path(self.out) as tmp:
            with open(tmp, "w", encoding="utf-8") as fh:
                for line in ordered_lines:
                    fh.write(line + "\n")
        self.path.unlink(missing_ok=True)


def _key_diff(old: dict, new: dict, prefix: str = "") -> str:
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            if a != b:
                diffs.append(_key_diff(a, b, f"{prefix}{k}."))
        elif a != b:
            diffs.append(f"{prefix}{k} was {json.dumps(a)}, this run {json.dumps(b)}")
    return "; ".join(diffs)



def subset_text(rows: Sequence[dict]) -> str:
    """JSONL of ``rows`` (a slice of :func:`read_completions`, so verified) as a completions file of their
    own: each row resealed with its new place (``row_index``, ``n_rows``; :func:`dflash_eval.row_checksum.seal_row`),
    so :func:`read_completions` accepts the subset (the stages that check a few samples write one)."""
    from dflash_eval.row_checksum import seal_row

    drop = (FIELD, ROW_FIELD)
    return "".join(json.dumps(seal_row({**{k: v for k, v in r.items() if k not in drop}, INDEX: i, COUNT: len(rows)}),
                              ensure_ascii=False) + "\n" for i, r in enumerate(rows))


#: the fix of a completions file changed after the completions stage wrote it
FIX = ("regenerate the completions (snakemake -R completions, or delete the file and rerun), or restore an "
       "intact copy")


def read_completions(path: str | Path, require_sealed: bool | None = None) -> list[dict]:
    """Parse the completions JSONL (InputError with the line number on malformed lines).

    Each row's ``ids_sha256`` and ``row_sha256`` are verified, then each row's place (``row_index`` /
    ``n_rows``: :func:`~dflash_eval.row_checksum.check_places`) and that ids are unique; rows without
    them (files written before they existed) are read, with one warning per file and what is unverified,
    unless ``require_sealed`` (default: inside the workflow, :func:`dflash_eval.row_checksum.sealed_required`:
    its completions files are always the completions stage's, which seals every row).

    Raises:
        InputError: missing file, malformed line, missing field, empty prompt, ids or another field not
            matching the row's checksums, some rows with checksums or places and others without, a row
            deleted, added or moved, a duplicate id, no rows, rows without checksums with ``require_sealed``.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "completions file not found", "run the completions rule first")
    rows, lines = [], []
    unverified = ids_only = 0
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for n, r in iter_jsonl(fh, path, fix="regenerate the completions"):
            for k in ("id", "prompt_ids", "completion_ids", "max_new_tokens"):
                if k not in r:
                    raise InputError(path, f"line {n}: {k}", "missing", "regenerate the completions")
            if not r["prompt_ids"]:
                raise InputError(path, f"line {n}: prompt_ids", "empty prompt", "drop the sample")
            covered = check_row(path, n, r)
            unverified += covered is None
            ids_only += covered == "ids"
            if str(r["id"]) in seen:
                raise InputError(path, f"line {n}: id", f"duplicate id {r['id']!r} (first on line {seen[str(r['id'])]}): "
                                 "the completions stage writes each prompt once", FIX)
            seen[str(r["id"])] = n
            rows.append(r)
            lines.append(n)
    numbered = list(zip(lines, rows))
    check_uniform(path, numbered, (FIELD, ROW_FIELD), FIX)
    if not check_places(path, numbered, FIX) and rows and ROW_FIELD in rows[0]:
        log.warning("%s: its rows carry no %s/%s (written before them): a deleted or moved row would not be noticed",
                    path, INDEX, COUNT)
    if (unverified or ids_only) and sealed_required(require_sealed):
        raise InputError(path, f"line {lines[0]}: {FIELD if unverified else ROW_FIELD}", "its rows carry no row checksum, "
                         "but inside the workflow every completions file is written (and sealed) by its completions "
                         "stage: it was rewritten after that stage, or by a version from before the checksums", FIX)
    if unverified:
        log.warning("%s: %d of %d rows carry no ids_sha256 (written before row checksums): read unverified",
                    path, unverified, len(rows))
    if ids_only:
        log.warning("%s: %d of %d rows carry no row_sha256 (written before it): their ids are verified, their other "
                    "fields (stop_reason, max_new_tokens, generation, text) read unverified", path, ids_only, len(rows))
    if not rows:
        raise InputError(path, None, "no samples", "check the prompt set and completions stage")
    return rows

