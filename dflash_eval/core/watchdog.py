"""A job stops when the Snakemake that started it is gone (SIGKILL, OOM kill, a closed SSH session).

A job of a local Snakemake run is a child of Snakemake's process; when Snakemake dies by a signal
it cannot catch, the job is not told: it runs on as an orphan, still writing its output, while
the user's rerun starts a second copy next to it. The workflow's shell prefix therefore names
Snakemake's process in :data:`OWNER_ENV` (``<pid>:<start time>``, :func:`owner_token`; only in
the main Snakemake process, never inside cluster jobs: ``rules/common.smk``), and the CLI starts
:func:`start` before running a stage. Its daemon thread looks at that process every
``interval_s`` seconds; once it is gone (the pid is free, or now belongs to another process: the
start time differs) it logs why and sends the job SIGTERM, so the stage stops through its usual
:class:`~dflash_eval.core.errors.Interrupted` path: temporary files removed, the partial cache or
completions file kept for the rerun to resume, exit status 143.

A process is identified by pid and start time (``/proc/<pid>/stat`` field 22, clock ticks since
boot), as ``ps`` does, so a recycled pid is never mistaken for the owner, and the token names the
owner's pid namespace (``/proc/<pid>/ns/pid``). Where the owner cannot be seen when the job starts
(no ``/proc``, a container with its own pid namespace), nothing is watched: a job is never stopped
because the watchdog cannot see. An owner missing from the job's own pid namespace at the start is
gone (killed while the job's Python was starting; unwatched, such a job would run to its end): the job
stops at once.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import threading
from pathlib import Path

log = logging.getLogger(__name__)

#: ``<pid>:<start ticks>`` of the Snakemake process that runs this job (set by the workflow's shell prefix)
OWNER_ENV = "DFLASH_EVAL_OWNER"


def start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None when
    there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # field 2 (comm) is parenthesised and may hold spaces: split after its closing parenthesis
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[19])  # fields[0] is field 3 (state); field 22 is fields[19]


def pid_namespace(pid: int | str = "self") -> str:
    """The pid namespace of process ``pid`` (``readlink /proc/<pid>/ns/pid``, e.g. ``pid:[4026531836]``), or ``""``
    where it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def owner_token(pid: int | None = None) -> str:
    """The :data:`OWNER_ENV` value naming process ``pid`` (default: this process): ``"<pid>:<start ticks>:<pid
    namespace>"``, with an empty part where it cannot be read. Tokens of an earlier version have two parts."""
    pid = os.getpid() if pid is None else pid
    ticks = start_ticks(pid)
    return f"{pid}:{'' if ticks is None else ticks}:{pid_namespace(pid)}"


def _parts(token: str) -> tuple[int, str, str]:
    """``(pid, start ticks text, pid namespace)`` of a token (the namespace holds no ``:`` of its own: ``pid:[n]``
    is rejoined)."""
    pid_text, _, rest = token.partition(":")
    ticks_text, _, ns = rest.partition(":")
    return int(pid_text), ticks_text, ns


def alive(token: str) -> bool:
    """Whether the process named by ``token`` (:func:`owner_token`) still runs (a zombie counts as gone)."""
    pid, ticks_text, _ = _parts(token)
    if ticks_text:
        ticks = start_ticks(pid)
        if ticks is None or ticks != int(ticks_text):
            return False
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Watchdog:
    """The thread started by :func:`start` (``stop()`` ends it; used by tests)."""

    def __init__(self, token: str, interval_s: float):
        self.token = token
        self.interval_s = interval_s
        self._stop = threading.Event()
        self.fired = False
        self.thread = threading.Thread(target=self._run, name="dflash-eval-watchdog", daemon=True)

    def _run(self) -> None:
        while True:  # look at once (the owner may have died while this job's Python started), then every interval
            if not alive(self.token):
                self.fired = True
                log.error("the Snakemake process that started this job (pid %s) is gone: stopping, keeping "
                          "what is resumable (partial cache / completions) for the rerun", self.token.split(":")[0])
                os.kill(os.getpid(), signal.SIGTERM)
                return
            if self._stop.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self.thread.join()


def start(environ=None, interval_s: float = 1.0) -> Watchdog | None:
    """Watch the process named in :data:`OWNER_ENV` (when set and visible); SIGTERM this process once it is gone.

    Call after :func:`dflash_eval.core.errors.install_signal_handlers`, so SIGTERM becomes
    :class:`~dflash_eval.core.errors.Interrupted`.

    Returns:
        the :class:`Watchdog`, or None when nothing is watched (no owner named, a malformed value,
        or the owner not visible from here). An owner of this process's pid namespace that is gone already
        gets a watchdog too: it stops the job at once.
    """
    token = (os.environ if environ is None else environ).get(OWNER_ENV, "")
    pid_text = token.partition(":")[0]
    if not pid_text.isdigit():
        if token:
            log.warning("%s=%r is not <pid>:<start time>: not watching the workflow's process", OWNER_ENV, token)
        return None
    _, ticks_text, ns = _parts(token)
    if int(pid_text) == os.getpid():
        return None
    if not alive(token) and not (ticks_text and ns and ns == pid_namespace()):
        log.debug("%s=%s: the owner is not visible from this process; not watching it", OWNER_ENV, token)
        return None
    dog = Watchdog(token, interval_s)
    dog.thread.start()
    log.debug("watching the workflow's process %s", token)
    return dog


def owner_export(main_process: bool) -> str:
    """The shell-prefix words naming this (main Snakemake) process for the jobs' watchdog; ``""`` in cluster jobs
    (they re-read the Snakefile in their own Snakemake; SLURM ends its jobs itself)."""
    return f"export {OWNER_ENV}={shlex.quote(owner_token())};" if main_process else ""
