"""bench/fp8_cache.py --smoke: the GPU bench's CPU run writes float32, bf16 and FP8 caches through the stage's batch
loop and prints the sizes, read ratios and per-layer error; the values that do not depend on speed are checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fp8_cache_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "fp8_cache.py"), "--smoke", "--out-dir",
                           str(tmp_path / "c"), "--out", str(tmp_path / "r.json")], capture_output=True, text=True,
                          cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads((tmp_path / "r.json").read_text())
    assert set(row["bytes"]) == {"f32", "bf16", "fp8"} and row["bytes"]["f32"] > row["bytes"]["bf16"] > row["bytes"]["fp8"]
    # hidden 64 (the smoke shape): 2 x 64 bytes against 64 + 4 per layer, less HDF5's per-sample overhead
    assert 1.3 < row["size_ratio"] < 2 * 64 / 68
    assert all(0.01 < e < 0.04 for e in row["rel_l2_vs_f32"]) and all(e < 0.003 for e in row["rel_l2_bf16_vs_f32"])
    assert row["read_ratio"] > 0 and "size ratio bf16 / fp8" in proc.stdout and "read ratio fp8 / bf16" in proc.stdout
