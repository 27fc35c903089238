"""Threads and child processes a test left running: the session-end check of ``conftest.py`` and its own test.

A module of its own (not ``conftest``): ``import conftest`` from a test finds whichever of the repository's
conftest modules pytest registered under that name last (tests/data has one too).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

#: thread classes a library starts once per process and keeps (not a test's): tqdm's bar monitor
PROCESS_THREADS = ("TMonitor",)


def children() -> list[tuple[int, str]]:
    """``(pid, command line)`` of this process's live child processes (Linux ``/proc``; elsewhere ``[]``)."""
    me, out = os.getpid(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == me and fields[0] != "Z":
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                out.append((int(entry.name), cmd[:200]))
        except (OSError, ValueError):
            continue
    return out


def leftovers(baseline_threads: set[int], grace_s: float) -> tuple[list[str], list[tuple[int, str]]]:
    """Threads (beyond ``baseline_threads`` idents) and child processes still alive after ``grace_s`` seconds."""
    deadline = time.monotonic() + grace_s
    while True:
        threads = [t for t in threading.enumerate() if t.ident not in baseline_threads and t.is_alive()
                   and t is not threading.current_thread() and type(t).__name__ not in PROCESS_THREADS]
        kids = children()
        if (not threads and not kids) or time.monotonic() >= deadline:
            return [f"{t.name} (target {getattr(getattr(t, '_target', None), '__qualname__', '?')}, "
                    f"daemon={t.daemon})" for t in threads], kids
        time.sleep(0.2)
