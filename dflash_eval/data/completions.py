"""The completions file of a prompt set (token ids, never re-tokenized text): format, resumable writer, reader.

JSONL, one row per prompt in the prompts file's order: ``id``, ``prompt_ids``, ``completion_ids`` (the
target's ids up to and including the first stop id: the cache and the replay condition on exactly
these), ``text``, ``stop_reason``, ``max_new_tokens``, ``generation`` (provenance), ``repeated_8gram_fraction`` (how much
the completion repeats itself: :mod:`dflash_eval.data.repetition`; absent in files written before it, whose readers
compute it from the ids). Written by
:mod:`dflash_eval.stages.completions`, resumable through a ``.<out name>.partial`` sidecar.

Row format and resume: docs/outputs.md, "The completions file".
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
                for n, line in enumerate(lines[1:], 2):
                    try:
                        row = json.loads(line)
                        rid = str(row["id"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise InputError(self.path, f"line {n}", "not a completions row",
                                         f"delete {self.path} to start over") from None
                    done.setdefault(rid, line)
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
    """JSONL of ``rows`` (a slice of :func:`read_completions`) as a completions file of their own (the stages
    that check a few samples write one)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


#: the fix of a bad completions file
FIX = "regenerate the completions (snakemake -R completions, or delete the file and rerun)"


def read_completions(path: str | Path) -> list[dict]:
    """Parse the completions JSONL (InputError with the line number on malformed lines).

    Raises:
        InputError: missing file, malformed line, missing field, empty prompt, a duplicate id, no rows.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "completions file not found", "run the completions rule first")
    rows = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for n, r in iter_jsonl(fh, path, fix="regenerate the completions"):
            for k in ("id", "prompt_ids", "completion_ids", "max_new_tokens"):
                if k not in r:
                    raise InputError(path, f"line {n}: {k}", "missing", "regenerate the completions")
            if not r["prompt_ids"]:
                raise InputError(path, f"line {n}: prompt_ids", "empty prompt", "drop the sample")
            if str(r["id"]) in seen:
                raise InputError(path, f"line {n}: id", f"duplicate id {r['id']!r} (first on line {seen[str(r['id'])]}): "
                                 "the completions stage writes each prompt once", FIX)
            seen[str(r["id"])] = n
            rows.append(r)
    if not rows:
        raise InputError(path, None, "no samples", "check the prompt set and completions stage")
    return rows
