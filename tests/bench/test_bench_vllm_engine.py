"""``bench/vllm_engine.py --smoke`` on the vLLM CPU server: the script the lead runs on a GPU host, checked end to end
(2 HumanEval prompts x 16 tokens, the step-2283 demo drafter; starts vLLM three times). Skipped without a vLLM venv."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_vllm import VLLM_PYTHON, _env

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed: run "
                                                                                "`make venv-vllm`")]
REPO = Path(__file__).resolve().parents[2]


def test_bench_smoke(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "bench" / "vllm_engine.py"), "--smoke", "--vllm-python", VLLM_PYTHON,
                        "--out", str(tmp_path)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=3000)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "vllm_engine.json").read_text())
    assert r["n"] == 2 and r["dtype"] == "float32" and r["device"].startswith("CPU")
    s = r["states"]
    assert s["ids_identical"] and s["argmax_identical"] and max(s["max_rel_l2"]) < 1e-5
    (c,) = r["checkpoints"]
    assert c["checkpoint"] == "dflash-smollm2-b8-step2283" and c["cpu_fix"]
    assert c["samples_same_tau"] == 2 and c["tau_hf_cache"] == c["tau_vllm_cache"]
    assert set(c["kinds"]) <= {"none", "stop-counting"}
    assert c["tau_tokens_per_step_engine"] == c["tau_tokens_per_step_offline"]
    assert c["speedup_measured"] > 0 and r["plain"]["output_tokens"] > 0
    md = (tmp_path / "vllm_engine.md").read_text()
    assert "| dflash-smollm2-b8-step2283 |" in md and md.strip() in p.stdout
