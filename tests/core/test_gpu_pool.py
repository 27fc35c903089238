"""The GPU pool: concurrent jobs (processes) never share a device; a SIGKILLed holder frees its device."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash_eval.core import gpu_pool
from dflash_eval.core.errors import InputError

REPO = Path(__file__).resolve().parents[2]

#: one job: claim through the real entry point of the stages, hold the GPU(s) a while, report what it held
JOB = """
import json, os, sys, time
from types import SimpleNamespace
from dflash_eval.core import gpu_pool
lease = gpu_pool.claim(sys.argv[1], SimpleNamespace(device="auto", devices=int(sys.argv[2])))
t0 = time.time()
print("held", flush=True)
time.sleep(float(sys.argv[3]))
print(json.dumps({"devices": lease.devices, "cvd": os.environ["CUDA_VISIBLE_DEVICES"], "t0": t0, "t1": time.time()}))
"""


def _job(pool, devices: str, stage="hidden_states", n=1, hold=0.4, **extra):
    env = {**os.environ, gpu_pool.POOL_ENV: str(pool), gpu_pool.DEVICES_ENV: devices,
           "PYTHONPATH": str(REPO), **extra}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.Popen([sys.executable, "-c", JOB, stage, str(n), str(hold)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_concurrent_jobs_never_share_a_device(tmp_path):
    jobs = [_job(tmp_path / "pool", "0,1,2", hold=1.0) for _ in range(7)] + [_job(tmp_path / "pool", "0,1,2", n=2)]
    results = []
    for p in jobs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.splitlines()[-1]))
    assert sorted(len(r["devices"]) for r in results) == [1] * 7 + [2]
    for r in results:
        assert r["cvd"] == ",".join(r["devices"]) and set(r["devices"]) <= {"0", "1", "2"}
        assert len(set(r["devices"])) == len(r["devices"])
    for a in results:  # two jobs holding the same device never overlap in time
        for b in results:
            if a is not b and set(a["devices"]) & set(b["devices"]):
                assert a["t1"] <= b["t0"] or b["t1"] <= a["t0"], (a, b)
    # side by side, not one after another: some jobs held distinct devices at the same time
    assert any(a["t0"] < b["t1"] and b["t0"] < a["t1"] for a in results for b in results if a is not b)


def test_a_sigkilled_holder_frees_its_device(tmp_path):
    pool = tmp_path / "pool"
    holder = _job(pool, "0", hold=120)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(TimeoutError):
        gpu_pool.acquire(1, pool, ["0"], timeout_s=0.5, poll_s=0.1)
    assert f"pid {holder.pid} " in (pool / "gpu-0.lock").read_text()
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=30)
    t0 = time.monotonic()
    lease = gpu_pool.acquire(1, pool, ["0"], timeout_s=10, poll_s=0.1)
    assert lease.devices == ["0"] and time.monotonic() - t0 < 5
    assert f"pid {os.getpid()} " in (pool / "gpu-0.lock").read_text()
    lease.release()


def test_what_a_job_claims(tmp_path, monkeypatch):
    env = {gpu_pool.POOL_ENV: str(tmp_path / "p"), gpu_pool.DEVICES_ENV: "GPU-aa,GPU-bb"}
    assert gpu_pool.gpus_needed("hidden_states", SimpleNamespace(device="auto", devices=0)) == 1
    assert gpu_pool.gpus_needed("target_costs", SimpleNamespace(device="cuda", devices=3)) == 3
    assert gpu_pool.gpus_needed("evaluate", SimpleNamespace(device="cpu")) == 0
    assert gpu_pool.gpus_needed("summary", SimpleNamespace()) == 0
    assert gpu_pool.gpus_needed("completions", SimpleNamespace(device="auto", source="openai", serve=None)) == 0
    assert gpu_pool.gpus_needed("completions", SimpleNamespace(device="auto", source="openai", serve="vllm")) == 1
    server = SimpleNamespace(url="", tensor_parallel_size=4)  # engine_parity's own vLLM server for an hf run
    assert gpu_pool.gpus_needed("engine_parity", SimpleNamespace(device="auto", devices=2, source="hf", vllm=server)) == 4
    assert gpu_pool.gpus_needed("engine_parity", SimpleNamespace(device="auto", devices=2, source="vllm", vllm=server)) == 2
    user = SimpleNamespace(url="http://h:8000", tensor_parallel_size=1)
    assert gpu_pool.gpus_needed("engine_parity", SimpleNamespace(device="auto", devices=0, source="hf", vllm=user)) == 1
    lease = gpu_pool.claim("evaluate", SimpleNamespace(device="auto"), env=env)
    assert lease.devices == ["GPU-aa"] and env["CUDA_VISIBLE_DEVICES"] == "GPU-aa"
    assert (tmp_path / "p" / "gpu-GPU-aa.lock").is_file()
    lease.release()
    assert gpu_pool.claim("evaluate", SimpleNamespace(device="auto"), env={**env, "SLURM_JOB_ID": "7"}) is None
    assert gpu_pool.claim("evaluate", SimpleNamespace(device="auto"), env={gpu_pool.DEVICES_ENV: "0"}) is None
    assert gpu_pool.claim("evaluate", SimpleNamespace(device="auto"),
                          env={gpu_pool.POOL_ENV: str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}) is None
    assert gpu_pool.pool_devices({"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert gpu_pool.pool_devices({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    with pytest.raises(InputError, match="needs 3 GPUs, the pool has 2"):
        gpu_pool.claim("hidden_states", SimpleNamespace(device="auto", devices=3), env=env)


def test_workflow_asks_target_devices_gpus(tmp_path):
    """Dry-run: the target-loading jobs ask gpu=target.devices, the others gpu=1 (the shell prefix that exports
    the pool folder is not printed by a dry-run)."""
    import re

    from test_workflow import copy_workflow, smk

    wd = copy_workflow(tmp_path / "wf")
    (wd / "two.yaml").write_text("target: {devices: 2}\ngpu_pool: /tmp/shared-pool\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "two.yaml").stdout
    gpu = {}
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", out):
        m, r = re.match(r"(?:local)?rule (\w+):", block), re.search(r"resources: .*?\bgpu=(\d+)", block)
        if m and r:
            gpu.setdefault(m.group(1), set()).add(int(r.group(1)))
    assert gpu["hidden_states"] == gpu["completions"] == gpu["target_costs"] == {2} and gpu["evaluate"] == {1}
