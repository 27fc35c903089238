"""scripts/gpu_pins_check.sh's Python half (scripts/gpu_pins_tiny.py): the CUDA overlay and the
GPU-vs-CPU comparison, on hand-made and real tiny runs. The whole script runs on a GPU host (the
lead's device run) and, on a CPU, with SMOKE=1 by hand (docs/cluster-and-containers.md)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from test_workflow import REPO

TINY = REPO / "scripts" / "gpu_pins_tiny.py"


def _tiny(*args, check=True):
    return subprocess.run([sys.executable, str(TINY), *map(str, args)], capture_output=True, text=True, check=check)


def test_gpu_config(tmp_path):
    _tiny("gpu-config", "hybrid", tmp_path / "h.yaml")
    _tiny("gpu-config", "llama", tmp_path / "l.yaml")
    _tiny("gpu-config", "hybrid", tmp_path / "s.yaml", "cpu")
    cuda = {s: {"device": "cuda"} for s in ("generation", "cache", "evaluate", "target_costs")}
    assert yaml.safe_load((tmp_path / "h.yaml").read_text()) == {**cuda, "target": {"linear_attn_backend": "fla"}}
    assert yaml.safe_load((tmp_path / "l.yaml").read_text()) == cuda
    assert yaml.safe_load((tmp_path / "s.yaml").read_text()) == {s: {"device": "cpu"} for s in cuda}


def _run_dir(root, taus, completions):
    (root / "completions").mkdir(parents=True)
    rows = ["checkpoint,step,prompt_set,n_samples,tau"] + [f"{c},1,{p},2,{t}" for (c, p), t in taus.items()]
    (root / "tau.csv").write_text("\n".join(rows) + "\n")
    for ps, comps in completions.items():
        (root / "completions" / f"{ps}.jsonl").write_text(
            "".join(json.dumps({"id": i, "prompt_ids": [1], "completion_ids": c}) + "\n" for i, c in comps.items()))
    return root


def test_compare_hand_made(tmp_path):
    """Exact lines: the tau difference per row, identical completions counted per sample."""
    cpu = _run_dir(tmp_path / "cpu", {("s1", "a"): 1.5, ("s2", "a"): 2.0},
                   {"a": {"x": [5, 6], "y": [7, 8]}})
    gpu = _run_dir(tmp_path / "gpu", {("s1", "a"): 1.5, ("s2", "a"): 2.25},
                   {"a": {"x": [5, 6], "y": [7, 9]}})
    out = _tiny("compare", cpu, gpu).stdout
    assert "greedy completions identical on CPU and GPU: 1 of 2" in out
    assert "max |tau_gpu - tau_cpu|: 0.2500" in out
    assert [line.split() for line in out.splitlines()[1:3]] == [
        ["s1", "a", "2", "1.5", "2", "1.50", "0.00"], ["s2", "a", "2", "2.0", "2", "2.25", "0.25"]]
    # a row missing on one side fails the comparison
    (gpu / "tau.csv").write_text("checkpoint,step,prompt_set,n_samples,tau\ns1,1,a,2,1.5\n")
    assert _tiny("compare", cpu, gpu, check=False).returncode == 1


@pytest.mark.slow  # the session's tiny Snakemake run (74 s of make test-fast's 4 min 44 s when it was the only user there)
def test_compare_a_real_run_with_itself(tiny_run, tmp_path):
    """On the tiny workflow's own results (with its HDF5 caches): zero difference, every completion
    identical, the caches' provenance printed."""
    run = tiny_run / "results" / "tiny"
    shutil.copytree(run, tmp_path / "copy", ignore=shutil.ignore_patterns("*.h5.partial"))
    out = _tiny("compare", run, tmp_path / "copy").stdout
    n = sum(len(p.read_text().splitlines()) for p in (run / "completions").glob("*.jsonl"))
    assert f"greedy completions identical on CPU and GPU: {n} of {n}" in out
    assert "max |tau_gpu - tau_cpu|: 0.0000" in out
    assert "GPU cache set_a.h5: torch 2.13.0+cpu, device " in out and "linear-attention kernel none" in out
    line = next(x for x in out.splitlines() if x.startswith("hidden-state cache set_a.h5, CPU vs GPU: "))
    assert re.search(r": [1-9]\d* float datasets compared, max rel-L2 0\.00e\+00 \(.+\); 0 not comparable",
                     line), line
