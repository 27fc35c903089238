"""bench/multi_gpu.py --smoke on CPU: the script a multi-GPU session runs works end to end (not GPU figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_multi_gpu_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "multi_gpu.py"), "--smoke", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    n_tokens = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    res, same = out["results"], out["identical"]
    assert set(res) == {"one-gpu", "split", "two-shards"}
    assert res["one-gpu"]["tokens"] == res["split"]["tokens"] == res["two-shards"]["tokens"] == n_tokens
    # the two shard jobs took distinct (fake) pool devices; on CPU every run computes the same float32 states
    assert sorted(res["two-shards"]["cuda_visible_devices"].split("|")) == ["0", "1"]
    assert all(c["identical"] and c["max_abs"] == 0.0 and c["argmax_agree"] == 1.0 for c in same.values())
    assert "two-shard wall / one-job wall:" in proc.stdout
