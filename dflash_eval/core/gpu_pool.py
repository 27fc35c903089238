"""One GPU (or N) per job on a multi-GPU host: a pool of lock files the GPU jobs draw their devices from.

Snakemake's ``gpu`` resource only counts: with ``--resources gpu=8`` it starts up to eight jobs
that ask ``gpu=1`` at once, but it never tells a job *which* GPU is its own, so every job would
start on GPU 0. The pool assigns them. The workflow exports the pool folder (config ``gpu_pool``,
default ``.snakemake/gpu-pool`` in the working directory) as :data:`POOL_ENV`; each GPU stage
(:data:`GPU_STAGES`), before it touches CUDA, takes a free device with an exclusive
``fcntl.flock`` on ``<pool>/gpu-<id>.lock`` (one file per device, which also records the holder's
pid) and runs with ``CUDA_VISIBLE_DEVICES`` set to its devices (:func:`claim`). The kernel drops a
``flock`` when the holder's file descriptor closes, so a job that ends, fails or is SIGKILLed frees
its GPU at once: no stale lock to clean up. A job that finds no free device waits (logging once a
minute); with the resource count equal to the number of GPUs that only happens when something
outside this workflow holds a lock.

Devices: ``CUDA_VISIBLE_DEVICES`` of the workflow when set (ids or UUIDs: the pool hands out a
subset of them), else the indices ``nvidia-smi`` lists; :data:`DEVICES_ENV` overrides both. A
host without GPUs has an empty pool and nothing is claimed. SLURM jobs (``SLURM_JOB_ID`` set)
never use the pool: SLURM assigns their GPUs. Lock files are local-file-system locks: share a
pool folder between workflows on one host (e.g. ``gpu_pool: /tmp/dflash-gpu-pool``) so they
coordinate too; never put it on NFS.

Not covered: processes a stage starts with ``subprocess`` (a vLLM server of ``generation.serve:
vllm``) do not inherit the lock; if the stage is SIGKILLed while such a server still runs, the
GPU counts as free while the orphaned server still uses it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)

#: folder of the lock files; set by the workflow's shell prefix (config ``gpu_pool``)
POOL_ENV = "DFLASH_EVAL_GPU_POOL"
#: comma-separated devices of the pool, overriding ``CUDA_VISIBLE_DEVICES`` / ``nvidia-smi``
DEVICES_ENV = "DFLASH_EVAL_GPU_POOL_DEVICES"
#: the stages (Snakemake rules) that run on a GPU
GPU_STAGES = frozenset({"completions", "hidden_states", "evaluate", "kernel_parity", "engine_parity", "fp8_parity",
                        "validate_online", "target_costs"})

_HELD: list["Lease"] = []  # leases of this process: their descriptors stay open until it exits


@dataclass
class Lease:
    """Devices held by this process. ``devices``: the ids as the pool lists them."""

    devices: list[str]
    fds: list[int] = field(repr=False, default_factory=list)

    def release(self) -> None:
        """Close the lock files (the kernel drops the locks); the process exiting does the same."""
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def pool_devices(env=None) -> list[str]:
    """The devices of the pool: :data:`DEVICES_ENV`, else ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi``'s indices."""
    env = os.environ if env is None else env
    for key in (DEVICES_ENV, "CUDA_VISIBLE_DEVICES"):
        if key in env:
            ids = [d.strip() for d in env[key].split(",") if d.strip()]
            return [] if ids in ([], ["-1"]) else ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("nvidia-smi failed (%s): no GPU pool", err)
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _lock_path(pool_dir: Path, device: str) -> Path:
    return pool_dir / f"gpu-{re.sub(r'[^A-Za-z0-9._-]', '_', device)}.lock"


def try_acquire(n: int, pool_dir: "str | Path", devices: list[str]) -> "Lease | None":
    """Take ``n`` free devices of ``devices`` (in their order) at once, or none; never waits."""
    pool_dir = Path(pool_dir)
    pool_dir.mkdir(parents=True, exist_ok=True)
    lease = Lease([])
    for d in devices:
        fd = os.open(_lock_path(pool_dir, d), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
                 .encode())
        lease.devices.append(d)
        lease.fds.append(fd)
        if len(lease.devices) == n:
            return lease
    lease.release()
    return None


def acquire(n: int, pool_dir: "str | Path", devices: list[str], timeout_s: float | None = None,
            poll_s: float = 1.0) -> Lease:
    """Take ``n`` devices of the pool, waiting until they are free.

    Args:
        n: devices wanted (>= 1).
        pool_dir: folder of the lock files (created).
        devices: the pool's device ids.
        timeout_s: give up after this many seconds (None: wait as long as it takes).
        poll_s: seconds between attempts.

    Returns:
        the :class:`Lease` (held until :meth:`Lease.release` or the process ends).

    Raises:
        InputError: ``n`` is more than the pool has.
        TimeoutError: ``timeout_s`` passed without ``n`` free devices.
    """
    if n > len(devices):
        raise InputError(None, "target.devices", f"the job needs {n} GPUs, the pool has {len(devices)} "
                         f"({', '.join(devices) or 'none'})",
                         "lower target.devices, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    t0 = last_log = time.monotonic()
    while True:
        lease = try_acquire(n, pool_dir, devices)
        if lease is not None:
            return lease
        now = time.monotonic()
        if timeout_s is not None and now - t0 >= timeout_s:
            raise TimeoutError(f"no {n} free GPU(s) in {pool_dir} after {timeout_s:.0f} s")
        if now - last_log >= 60:
            log.info("waiting for %d free GPU(s) of %s in %s (%.0f s so far)", n, devices, pool_dir, now - t0)
            last_log = now
        time.sleep(poll_s)


def gpus_needed(stage: str, opts) -> int:
    """GPUs a stage's job takes: 0 off the GPU (device ``cpu``, a remote completions server), else
    ``max(target.devices, 1)`` for the stages that load the target, 1 for the others; ``engine_parity`` of a
    ``cache.source: hf`` run that starts its own vLLM server: at least ``cache.vllm.tensor_parallel_size``
    (:attr:`dflash_eval.workflow.plan.Plan.engine_parity_gpus`)."""
    if stage not in GPU_STAGES or opts is None:
        return 0
    if str(getattr(opts, "device", "auto")).startswith("cpu"):
        return 0
    if stage == "completions" and getattr(opts, "source", "transformers") != "transformers" \
            and getattr(opts, "serve", None) != "vllm":
        return 0
    n = max(int(getattr(opts, "devices", 0) or 0), 1)
    vllm = getattr(opts, "vllm", None)
    if stage == "engine_parity" and getattr(opts, "source", "hf") == "hf" and vllm is not None and not vllm.url:
        n = max(n, int(vllm.tensor_parallel_size))
    return n


def claim(stage: str, opts, env=None) -> "Lease | None":
    """Take this job's GPUs from the pool and set ``CUDA_VISIBLE_DEVICES`` to them (before CUDA starts).

    Nothing happens (None) without :data:`POOL_ENV`, in a SLURM job, for a job that needs no GPU
    (:func:`gpus_needed`) or when the pool has no devices. Call before anything initialises CUDA.

    Raises:
        InputError: the job needs more GPUs than the pool has.
    """
    env = os.environ if env is None else env
    pool_dir = env.get(POOL_ENV, "")
    if not pool_dir or env.get("SLURM_JOB_ID"):
        return None
    n = gpus_needed(stage, opts)
    devices = pool_devices(env) if n else []
    if not devices:
        return None
    t0 = time.monotonic()
    lease = acquire(n, pool_dir, devices)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(lease.devices)
    _HELD.append(lease)
    log.info("GPU pool %s: %s holds GPU(s) %s (waited %.1f s); CUDA_VISIBLE_DEVICES=%s", pool_dir, stage,
             ",".join(lease.devices), time.monotonic() - t0, env["CUDA_VISIBLE_DEVICES"])
    return lease
