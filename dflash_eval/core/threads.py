"""CPU threads of a stage run from the command line, chosen as the workflow chooses them.

In the workflow a torch job runs with ``threads: torch_threads`` (config, default 8), capped by
``--cores``, and Snakemake exports that number as ``OMP_NUM_THREADS`` (and the other BLAS
thread variables), which torch reads for its intra-op pool. A stage run by hand had no such
cap: torch starts one thread per core, and on a shared host those threads fight the other
jobs (measured: the same completions 4x slower than inside the workflow). So the CLI picks:

1. ``--threads N`` when given;
2. else ``OMP_NUM_THREADS`` when set (the workflow's jobs, SLURM scripts, the user's shell);
3. else the schema default of ``torch_threads``, capped by the cores this process may run on
   (``os.sched_getaffinity``: a ``taskset``, cgroup cpuset or SLURM allocation counts, not
   the host's core count).

and exports it before torch is imported (``torch.set_num_threads`` as well when it already is).
"""

from __future__ import annotations

import logging
import os
import sys

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import schema_default

log = logging.getLogger(__name__)

#: the thread variables Snakemake exports for a job's ``threads`` (snakemake ``shell.py``), set alike
THREAD_ENV = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
              "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose(requested: int | None = None, environ=None) -> tuple[int, str]:
    """``(threads, why)`` by the rules of the module docstring.

    Raises:
        InputError: ``requested`` < 1.
    """
    env = os.environ if environ is None else environ
    if requested is not None:
        if requested < 1:
            raise InputError(None, "--threads", f"must be >= 1, got {requested}", "give a positive thread count")
        return requested, "--threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1:
        return int(omp), "OMP_NUM_THREADS"
    default = int(schema_default("torch_threads"))
    cores = available_cores()
    return min(default, cores), f"torch_threads default {default}, {cores} cores available to this process"


def apply(requested: int | None = None, environ=None) -> int:
    """Choose the thread count (:func:`choose`) and make torch use it; returns it.

    Sets every :data:`THREAD_ENV` variable that is not set (``OMP_NUM_THREADS`` itself is always
    the chosen number), and calls ``torch.set_num_threads`` when torch is already imported.
    """
    env = os.environ if environ is None else environ
    n, why = choose(requested, env)
    for name in THREAD_ENV:  # an explicit --threads wins over every variable; otherwise fill the unset ones
        if requested is not None or name == "OMP_NUM_THREADS" or not env.get(name):
            env[name] = str(n)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    log.debug("threads: %d (%s)", n, why)
    return n
