"""bench/replay.py's CPU smoke run: the DFlash 2 case beside DFlash 1 (same target, samples and block size)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["big", "dflash2"])
def test_replay_bench_smoke(tmp_path, case):
    """Both replays of the smoke case agree per sample in float32 and every time is printed."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "replay.py"), "--smoke", "--case", case, "--out",
                           str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (res,) = json.loads(out.read_text())
    assert res["case"] == ("big" if case == "big" else "big dflash2") and res["n"] == 3
    assert res["differ"] == {"rows": 0, "packed": 0, "groups": 0}
    assert (res["tau_batched"]["rows"] == res["tau_batched"]["packed"] == res["tau_batched"]["groups"]
            == res["tau_sequential"] >= 1.0)
    assert res["sequential_s"] > 0 and all(t > 0 for t in res["batched_s"].values())
    assert "batched rows" in proc.stdout and "sequential" in proc.stdout
