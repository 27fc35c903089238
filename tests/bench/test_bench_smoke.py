"""The GPU benches' CPU smoke runs (``--smoke``): each script runs end to end and prints its side-by-side figures.

The figures themselves say nothing on this CPU; the runs check that the scripts the GPU host runs
(docs/measurements.md) work, and the values they print that do not depend on speed: identical ids
or acceptance between the loops compared, identical tau across the replay's layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(name: str, *argv: str, timeout: int = 900) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / name), "--smoke", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_replay_real_size_case_smoke(tmp_path):
    out = bench("replay.py", "--case", "real", "--out", str(tmp_path / "r.json"))
    assert "tau identical across layouts: True" in out
    assert out.count("projected") == 3 and ".. [real] batched groups" in out
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert set(row["layouts"]) == {"rows", "packed", "groups"} and row["tokens_per_sample"] == 64


def test_completions_gpu_smoke(tmp_path):
    out = bench("completions_gpu.py", "--out", str(tmp_path / "c.json"))
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["batch"] for r in rows] == [2, 4, 16] and rows[-1]["auto"]  # CPU: memory-sized = 16
    for r in rows:  # float32 on the CPU: every variant decodes the stage's ids
        assert {v["same_ids_as_stage"] for v in r["variants"].values()} == {1.0}
    assert "ratio stage / generate" in out


def test_online_smoke(tmp_path):
    out = bench("online.py", "--out", str(tmp_path / "o.json"))
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert rows and all(r["same_output"] and r["same_acceptance"] for r in rows)
    assert "(goal <= 1.5x)" in out


def test_extraction_smoke():
    out = bench("extraction.py", "--models", "llama-1.66b")
    assert "forward only" in out and "ratio dflash-eval / forward-only ceiling" in out
    assert "argmax agreement 1.0000" in out



def test_hybrid_gpu_driver_smoke(tmp_path):
    """bench/hybrid_gpu.sh --smoke: the four runs the GPU host makes (completions and extraction, tiny hybrid with
    torch GDN kernels and tiny llama), their files and the ratio summary."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "hybrid_gpu.sh"), "--smoke"], capture_output=True, text=True,
                          cwd=REPO, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("ratio stage / generate") == 2 and summary.count("ratio dflash-eval / loop") == 2
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hybrid_gpu.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "hybrid_gpu.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    (row,) = json.loads((tmp_path / "completions_hybrid.json").read_text())
    assert row["batch"] == 4 and set(row["variants"]) == {"stage", "stage, plain sdpa", "generate"}
    assert {v["same_ids_as_stage"] for v in row["variants"].values()} == {1.0}  # float32: same ids everywhere
    assert all(len(v["runs_s"]) == 2 for v in row["variants"].values())  # the warm figure + the first call apart
    hyb = (tmp_path / "extraction_hybrid.txt").read_text()
    assert "right-padded" in hyb and "stage, first run" in hyb and "argmax agreement 1.0000" in hyb
    assert "linear-attention kernel: torch" in (tmp_path / "completions_hybrid.txt").read_text()
