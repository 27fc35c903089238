"""``bench/sampling_cost.py --smoke``: the script runs on CPU, the sampled pass leaves the greedy chain unchanged
(the script asserts it) and prints every timing, ratio and tau."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # about a minute on 2 loaded CPU cores
def test_sampling_cost_bench_smoke():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sampling_cost.py"), "--smoke", "--repeats", "1"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    print(out)
    assert re.search(r"chain [\d.]+ s; greedy \(chain \+ DDTree\) [\d.]+ s; chain \+ settings [\d.]+ s; all", out)
    assert re.search(r"cost: all / greedy [\d.]+x; chain \+ settings / chain [\d.]+x", out)
    m = re.search(r"tau: T0 ([\d.]+); T1_p0.95_k20 ([\d.]+) \(expected\)", out)
    assert m and all(1.0 <= float(x) <= 4.0 for x in m.groups()), out  # smoke: B = 4
