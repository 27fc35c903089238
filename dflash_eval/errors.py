"""Errors with a file, a field and a fix, and crash-safe writes.

Every user-facing failure in dflash-eval raises :class:`InputError`, whose
message names the offending file, the field (key, column, line) and what to do
about it. Outputs are written to a temporary file in the destination folder
and renamed into place (:func:`atomic_path`), so a crash never leaves a file
that looks complete.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


class InputError(ValueError):
    """Bad user input. ``str(err)`` reads ``<file>: <field>: <problem>. Fix: <fix>``."""

    def __init__(self, file: str | os.PathLike | None, field: str | None, problem: str, fix: str | None = None):
        self.file = str(file) if file is not None else None
        self.field = field
        self.problem = problem
        self.fix = fix
        parts = [p for p in (self.file, field) if p]
        msg = ": ".join(parts + [problem]) if parts else problem
        if fix:
            msg += f". Fix: {fix}"
        super().__init__(msg)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; rename it to ``dest`` on success.

    The temporary file lives in the destination folder (same file system, so
    :func:`os.replace` is atomic) and is fsynced before the rename. On any
    exception the temporary file is removed and ``dest`` is left untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix or ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; outputs should follow the umask
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Like :func:`atomic_path` for a folder: build it under a temp name, then rename.

    An existing ``dest`` is replaced only after the new folder is complete.
    """
    import shutil

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        yield tmp
        mode = 0o666 & ~_umask()
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        for f in tmp.rglob("*"):
            os.chmod(f, (0o777 & ~_umask()) if f.is_dir() else mode)
        if dest.exists():
            old = dest.with_name(f".{dest.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(dest, old)
            os.replace(tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

