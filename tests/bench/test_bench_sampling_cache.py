"""``bench/sampling_cache.py --smoke``: the script runs on CPU and its sizes and exactness checks hold."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # 5-7 s on 2 cores
def test_sampling_cache_bench_smoke(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sampling_cache.py"), "--smoke", "--repeats", "1",
                           "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    print(out)
    # smoke model: hidden 128, 2 stored layers, float32 (4 bytes): 2*128*4 + 4 (argmax) + 4 (ids)
    assert "bytes/token computed: stage 1032, + final hidden 512 (+49.6 %), + top-20 logits 160 (+15.5 %), " \
           "+ top-64 logits 512 (+49.6 %)" in out
    m = re.search(r"bytes/token measured \(HDF5, (\d+) samples, ([\d,]+) tokens\): stage ([\d.]+), final ([\d.]+), "
                  r"top20 ([\d.]+), top64 ([\d.]+)", out)
    assert m, out
    samples, tokens = int(m.group(1)), int(m.group(2).replace(",", ""))
    for got, want, datasets in zip(map(float, m.group(3, 4, 5, 6)), (1032, 512, 160, 512), (3, 1, 2, 2)):
        overhead = (got - want) * tokens / (samples * datasets)  # HDF5 bytes per dataset beyond the data
        assert 0 <= overhead <= 4096, (got, want, overhead)
    hf = float(re.search(r"p from final hidden vs HF logits max abs diff ([\d.e+-]+)", out).group(1))
    assert hf < 1e-5
    assert "top-20: p at top-k 20 identical" in out and "top-64: p at top-k 20 identical" in out
    assert re.search(r"extraction tok/s: stage forward [\d,]+; \+ final hidden [\d,]+", out)
