"""Per-row checksums of the completions JSONL: ``ids_sha256`` over a row's token ids.

A completions row carries ``ids_sha256`` = sha256 of ``"<prompt ids>|<completion ids>"`` (each
list as comma-separated decimal ids, no spaces; UTF-8), written by the completions stage and
checked by :func:`dflash_eval.completions_file.read_completions`: an id changed in the file (an
edit, a bad copy) is refused naming the line and the row, instead of conditioning the cache and
the replay on tokens the target never produced. Rows of files written before the checksum
existed have none: they are read, with one warning per file.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

from .errors import InputError

FIELD = "ids_sha256"


def ids_sha256(prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> str:
    """The row checksum (hex): sha256 of ``"<p0>,<p1>,...|<c0>,<c1>,..."``."""
    text = ",".join(str(int(t)) for t in prompt_ids) + "|" + ",".join(str(int(t)) for t in completion_ids)
    return hashlib.sha256(text.encode()).hexdigest()


def check_row(path, line: int, row: dict) -> bool:
    """Compare a completions row's ``ids_sha256`` with its ids; returns whether the row had one.

    Raises:
        InputError: ``(path, "line <n>: ids_sha256", ...)`` when the ids do not match it.
    """
    want = row.get(FIELD)
    if want is None:
        return False
    got = ids_sha256(row["prompt_ids"], row["completion_ids"])
    if got != want:
        raise InputError(path, f"line {line}: {FIELD}", f"row {row.get('id')!r}: its prompt_ids/completion_ids do "
                         "not match their checksum (the file changed after the completions stage wrote it)",
                         "regenerate the completions (snakemake -R completions, or delete the file and rerun), "
                         "or restore an intact copy")
    return True
