"""Errors with a file, a field and a fix, crash-safe writes, and clean shutdown on signals.

Every user-facing failure in dflash-eval raises :class:`InputError`, whose
message names the offending file, the field (key, column, line) and what to do
about it. Outputs are written to a temporary file in the destination folder
and renamed into place (:func:`atomic_path`, :func:`atomic_dir`), so a crash never
leaves a file that looks complete.

Interrupted jobs: :func:`install_signal_handlers` (called once by the CLI) turns SIGTERM
(what SLURM sends at a time limit, ``scancel``, Snakemake on Ctrl-C) and SIGINT into an
:class:`Interrupted` exception in the main thread, so every ``with atomic_path(...)``
removes its temporary file and the hidden_states stage commits its partial cache for
the next run to resume (:mod:`dflash_eval.cache.format`). A temporary file survives only a
SIGKILL or a lost node; it is locked (``flock``) while its writer lives, and the next
write of the same output removes every unlocked one (:func:`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

try:
    import fcntl
except ImportError:  # not POSIX: no locks
    fcntl = None

log = logging.getLogger(__name__)


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


def _lock(path: Path) -> int | None:
    """Open ``path`` and hold an exclusive ``flock`` on it; the fd (None where locks are unsupported)."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _temp_pattern(dest: Path) -> re.Pattern:
    """Names :func:`atomic_path` / :func:`atomic_dir` give temporaries of ``dest`` (mkstemp: 8 random chars)."""
    return re.compile(rf"^\.{re.escape(dest.name)}\.[A-Za-z0-9_]{{8}}(\.[A-Za-z0-9_.]+)?$")


def remove_stale_temps(dest: str | os.PathLike) -> list[Path]:
    """Remove temporaries of ``dest`` left by killed writers (those whose ``flock`` nobody holds).

    A live writer holds an exclusive lock on its temporary (:func:`atomic_path`); a SIGKILL-ed
    one's lock is gone with its process. On file systems without ``flock`` nothing is removed.

    Returns:
        the paths removed.
    """
    dest = Path(dest)
    pattern = _temp_pattern(dest)
    removed = []
    try:
        candidates = [p for p in dest.parent.iterdir() if pattern.match(p.name)]
    except FileNotFoundError:
        return removed
    for p in candidates:
        try:
            fd = _lock(p)
        except OSError:  # vanished meanwhile
            continue
        if fd is None:
            continue  # in use (or locks unsupported): leave it
        try:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
        finally:
            _unlock(fd)
    if removed:
        log.info("removed %d stale temporary file(s) of %s left by killed runs: %s", len(removed), dest,
                 ", ".join(p.name for p in removed))
    return removed


def partial_path(dest: str | os.PathLike) -> Path:
    """The resumable sidecar of ``dest``: ``<dest>.partial`` (see :mod:`dflash_eval.cache.format`)."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".partial")


def remove_done_links(outputs: Iterable[str | os.PathLike]) -> list[Path]:
    """Remove each output's sidecar when it is only a second name (hard link) of the finished output.

    A sidecar that is a separate file (unfinished work of a killed run) is kept. Torch-free:
    the workflow calls it when a run ends, with success or error (Snakemake then knows which jobs finished;
    only a killed Snakemake leaves the links, for the rerun that resumes its jobs).

    Returns:
        the sidecars removed.
    """
    removed = []
    for side in done_links(outputs):
        with contextlib.suppress(OSError):
            side.unlink()
            removed.append(side)
    return removed


def reused_sidecar_note(out: str | os.PathLike, n_samples: int | None) -> str:
    """The warning of a job that takes every sample (``n_samples``) from ``out``'s sidecar and computes none: a
    cache finished by an earlier job whose Snakemake did not record it (killed), adopted as verified; with
    ``n_samples`` None, the workflow's warning at parse time that such a sidecar is there. A rerun forced to
    recompute (``-R hidden_states`` after a code change) must delete the sidecar first."""
    side = partial_path(out)
    if n_samples is None:
        return (f"{side} holds samples of {out} computed by a job that did not end with its Snakemake (killed): the "
                f"next hidden_states job of {out} takes them, verified, instead of recomputing them (a resume). If "
                f"you are forcing a re-extraction (e.g. after a code change), delete {side} first")
    return (f"{out}: all {n_samples} samples were taken, verified, from {side}, the cache an earlier "
            "job finished (kept because its Snakemake did not record it); nothing was recomputed. If you forced this "
            f"rerun to recompute the states (e.g. after a code change), delete {side} and rerun")


def sidecars(outputs: Iterable[str | os.PathLike]) -> list[Path]:
    """The sidecars of ``outputs`` that exist: a finished cache kept as a hard link, one whose output was deleted
    since, or unfinished work; the next job of that output resumes from each (the workflow names them)."""
    return [partial_path(out) for out in outputs if partial_path(out).exists()]


def done_links(outputs: Iterable[str | os.PathLike]) -> list[Path]:
    """The sidecars of ``outputs`` that are only a second name (hard link) of the finished output."""
    found = []
    for out in outputs:
        with contextlib.suppress(OSError):
            if os.path.samefile(partial_path(out), out):
                found.append(partial_path(out))
    return found


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``dest``; rename it to ``dest`` on success.

    The temporary file lives in the destination folder (same file system, so
    :func:`os.replace` is atomic) and is fsynced before the rename. On any
    exception (SIGTERM/SIGINT included, see :func:`install_signal_handlers`) the temporary
    file is removed and ``dest`` is left untouched. While the writer lives it holds an
    exclusive ``flock`` on the temporary; temporaries of ``dest`` that nobody holds (killed
    runs) are removed first (:func:`remove_stale_temps`). Open HDF5 files inside with
    ``locking=False`` (HDF5 would take a conflicting ``flock``).
    """
    dest = Path(dest)
    if dest.is_dir() and not dest.is_symlink():  # os.replace would fail with a bare IsADirectoryError
        raise InputError(dest, None, "a folder stands where this stage writes a file",
                         f"remove it (rm -r {dest}) and run the same command again")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=suffix or ".tmp", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    lock = _lock(tmp_path)
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
    finally:
        _unlock(lock)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """Like :func:`atomic_path` for a folder: build it under a temp name, then rename.

    An existing ``dest`` is replaced only after the new folder is complete. The folder is
    locked and stale ones are removed as in :func:`atomic_path`.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    lock = _lock(tmp)
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
    finally:
        _unlock(lock)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM / SIGINT once :func:`install_signal_handlers` ran.

    A :class:`KeyboardInterrupt`, so ``except Exception`` does not swallow it while every
    ``finally`` / context manager still runs. ``signum``: the signal; the CLI exits with
    ``128 + signum`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a signal death.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


_HANDLING = {"installed": False, "received": None}


def install_signal_handlers(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)) -> None:
    """Turn ``signals`` into :class:`Interrupted` in the main thread (idempotent; main thread only).

    SIGTERM: SLURM time limits and ``scancel``, Snakemake cancelling a job; SIGHUP: a closed terminal.

    The first signal raises; later ones are logged and ignored, so the clean-up (removing
    temporaries, committing the partial cache) is not cut short by a second Ctrl-C or SLURM's
    repeated SIGTERM. SIGKILL cannot be caught: what it leaves is removed or resumed by the
    next run (:func:`remove_stale_temps`, :mod:`dflash_eval.cache.format`).
    """
    if _HANDLING["installed"]:
        return

    def handler(signum, _frame):
        if _HANDLING["received"] is not None:
            log.warning("%s received again while shutting down: ignored (SIGKILL stops at once)",
                        signal.Signals(signum).name)
            return
        _HANDLING["received"] = signum
        raise Interrupted(signum)

    for s in signals:
        signal.signal(s, handler)
    _HANDLING["installed"] = True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: Snakemake's lock folder (in the working directory)
SNAKEMAKE_LOCKS = Path(".snakemake", "locks")


def snakemake_lock_note(workdir: str | os.PathLike = ".") -> str | None:
    """What to tell the user at parse time when the working directory holds Snakemake's lock, else None.

    A Snakemake killed with SIGKILL (or by the host) leaves its lock behind, and the next run stops with
    Snakemake's "Directory cannot be locked"; the lock is not removed here (another Snakemake may be running).
    """
    if not any(Path(workdir, SNAKEMAKE_LOCKS).glob("*.lock")):
        return None
    return ("the working directory holds a Snakemake lock (.snakemake/locks/). If no other Snakemake runs here (a "
            "killed Snakemake leaves its lock behind), run `snakemake --unlock` once, then your command again: with "
            "--rerun-incomplete (set in every profile and make demo) it reruns the jobs the killed run left "
            "unfinished, and those resume from their .partial files")


def failed_checks(paths: Iterable[str], since: float) -> list[str]:
    """One line per check that did not pass in the validation outputs among ``paths`` (``validate_online.json``,
    ``validate_engine.json``) written at or after ``since`` (seconds since the epoch): an entry with ``"ok": false``
    (greedy online vs offline steps, engine vs offline tau) or ``"within_goal": false`` (sampled online vs offline
    tau), named by checkpoint and mode. The Snakefile's ``onsuccess`` / ``onerror`` print them, so a validation that failed
    is not only an "ok: no" row in the report."""
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
