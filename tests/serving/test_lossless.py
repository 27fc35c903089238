"""The greedy token check under load (dflash_eval.serving.lossless) without vLLM: near-tie or break on hand-built
logits; engine faults only where the plain server does not break; and the validate_engine stage on a corrupted
engine, the stand-in server (tests/standin_server.py) answering with one token swapped, judged by the tiny target's
float32 logits. The real vLLM: tests/serving/test_vllm_engine.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from dflash_eval.serving import lossless
from dflash_eval.serving.lossless import (
    bf16_ulp,
    classify,
    first_difference,
    token_check,
)


def _req(sid, ids):
    return SimpleNamespace(sample_id=sid, completion_ids=list(ids))


def test_bf16_ulp_and_first_difference():
    assert bf16_ulp(16.0) == 0.125 and bf16_ulp(-17.5) == 0.125 and bf16_ulp(0.75) == 2 ** -8
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter one's length


def test_near_tie_or_break_on_hand_built_logits():
    """Top logit 16.0: one bf16 ulp is 0.125. The second choice 3 ulps below is a near-tie at the default bound (4),
    5 ulps below a break; a token far down is a break even where the top two are tied; a missing token too."""
    lg = torch.tensor([16.0, 16.0 - 3 * 0.125, 10.0, 0.0])
    c = classify(lg, cached=0, engine=1)
    assert c["class"] == "near-tie" and (c["top1"], c["top2"]) == (0, 1)
    assert c["margin"] == 0.375 and c["margin_ulps"] == 3.0 and c["engine_gap_ulps"] == 3.0 and c["cached_gap_ulps"] == 0
    assert classify(lg, 0, 1, near_tie_ulps=2.9)["class"] == "break"  # the bound is an option
    assert classify(lg, 0, 2)["class"] == "break" and classify(lg, 0, 2)["engine_gap_ulps"] == 48.0
    lg5 = torch.tensor([16.0, 16.0 - 5 * 0.125, 0.0])
    c5 = classify(lg5, 0, 1)
    assert c5["class"] == "break" and c5["margin_ulps"] == 5.0
    assert classify(lg, 0, None)["class"] == "break"  # the engine's response ended there
    # the cached token need not be the float32 argmax (it was made in bf16): both within the bound is a near-tie
    assert classify(lg, 1, 0)["class"] == "near-tie"


def test_engine_fault_only_where_the_plain_server_does_not_break():
    """Three requests; with the drafter at 8 'a' and 'b' break and 'c' is a near-tie; the plain server at 8 breaks
    'b' too: one engine fault ('a'). The target is asked once, for every first difference of every run."""
    rows = [{"id": k, "prompt_ids": [1], "completion_ids": [5, 6, 7, 8]} for k in "abc"]
    tied = torch.tensor([0.0] * 5 + [4.0, 4.0 - 0.03125, 4.0, 4.0])  # top 4.0 (ulp 2**-5): token 6 one ulp below 5
    asked = []

    def judge(needed):
        asked.append({k: sorted(v) for k, v in needed.items()})
        return {(s, k): tied for s, ks in needed.items() for k in ks}

    d1 = [_req(k, [5, 6, 7, 8]) for k in "abc"]
    d8 = [_req("a", [5, 6, 0, 8]), _req("b", [5, 0, 7, 8]), _req("c", [6, 6, 7, 8])]
    p8 = [_req("a", [5, 6, 7, 8]), _req("b", [5, 0, 7, 8]), _req("c", [5, 6, 7, 8])]
    out = token_check(rows, [{"concurrency": 8, "requests": p8}],
                      [{"checkpoint": "ck", "runs": [{"concurrency": 8, "requests": d8},
                                                     {"concurrency": 1, "requests": d1}]}], judge)
    assert asked == [{"a": [2], "b": [1], "c": [0]}]
    r1, r8 = out["checkpoints"][0]["runs"]  # sorted by concurrency
    assert r1["concurrency"] == 1 and r1["counts"] == {"equal": 3, "near-tie": 0, "break": 0} and r1["faults"] == []
    assert r8["counts"] == {"equal": 0, "near-tie": 1, "break": 2} and r8["faults"] == ["a"] and out["n_faults"] == 1
    a = r8["requests"][0]
    assert (a["first_token_diff"], a["cached_token"], a["engine_token"]) == (2, 7, 0)
    assert out["plain"][0]["counts"]["break"] == 1 and "faults" not in out["plain"][0]
    head = lossless.headline(out["checkpoints"], out["plain"])
    assert head == ("**ENGINE FAULT: 1 of 3 requests break at concurrency 8 with the drafter ck, 1 without (plain "
                    "server at concurrency 8)**: the engine is not lossless (first breaks: a).")
    assert "| ck | 8 | 0 | 1 | 2 | **1** |" in lossless.table(out["checkpoints"], out["plain"], 4)
    # the same break in the plain server too: not the drafter's fault
    out = token_check(rows, [{"concurrency": 8, "requests": d8}], [{"checkpoint": "ck", "runs": [
        {"concurrency": 8, "requests": d8}]}], judge)
    assert out["n_faults"] == 0 and lossless.headline(out["checkpoints"], out["plain"]) == (
        "**Token check**: no engine fault (every break with the drafter also happens without it), but the plain "
        "server breaks 2 of 3 requests at concurrency 8: the engine's target computation itself leaves the greedy "
        "completion beyond near-ties.")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random llama target and its greedy float32 completions of 3 prompts (12 new tokens)."""
    from tiny import make_tiny_target

    from dflash_eval.data.completions import read_completions
    from dflash_eval.data.prompts import build_prompt_set, write_prompts
    from dflash_eval.stages.completions import generate_completions

    root = tmp_path_factory.mktemp("lossless")
    target = make_tiny_target(root / "target", arch="llama", seed=5)
    txt = root / "p.txt"
    txt.write_text("def add(a, b): return a + b\nThe quick brown fox jumps over the lazy dog.\nTell me about Paris.\n")
    prompts = write_prompts(build_prompt_set("file", target, n=0, seed=0, path=txt), root / "prompts.jsonl")
    comp = generate_completions(target, prompts, root / "c.jsonl", max_new_tokens=12, batch_size=1, device="cpu",
                                dtype="float32")
    return target, comp, read_completions(comp)


def test_stage_reports_a_corrupted_engine(tiny, tmp_path, monkeypatch):
    """validate_engine with every server replaced by the in-process stand-in (a greedy float32 HF server over HTTP),
    its answers edited per run: with the drafter at concurrency 4 request 0 gets its 4th token swapped for the
    target's least likely one (a break at position 3), request 1 the target's second choice where the top two are
    closest (a near-tie under a bound just above that margin) and request 2 a least-likely token at position 5, which
    the plain server at 4 gets too. So: one engine fault (request 0), the section opens with it, and at concurrency
    1 every request is equal."""
    from standin_server import StandIn

    from dflash_eval.serving.clients import OpenAIClient
    from dflash_eval.serving.generation import stop_token_ids
    from dflash_eval.serving.vllm.engine import (
        SpecCounters,
        latency_summary,
        run_requests,
    )
    from dflash_eval.stages import validate_engine as stage

    target, comp, rows = tiny
    ids = [str(r["id"]) for r in rows]
    P = {i: list(r["prompt_ids"]) for i, r in zip(ids, rows)}
    C = {i: list(r["completion_ids"]) for i, r in zip(ids, rows)}
    assert all(len(c) == 12 for c in C.values())  # no stop in 12 tokens: every position below exists
    logits = lossless.judge_logits(target, rows, {i: set(range(12)) for i in ids}, device="cpu")
    worst = {(i, k): int(logits[(i, k)].argmin()) for i in ids for k in range(12)}
    info = {k: classify(logits[(ids[1], k)], C[ids[1]][k], None) for k in range(12)}
    tie_pos = min(range(12), key=lambda k: info[k]["margin_ulps"])
    tie = info[tie_pos]
    assert tie["top1"] == C[ids[1]][tie_pos]  # the completion is the float32 argmax
    bound = tie["margin_ulps"] * 1.01
    swaps = {(True, 4): {ids[0]: (3, worst[(ids[0], 3)]), ids[1]: (tie_pos, tie["top2"]),
                         ids[2]: (5, worst[(ids[2], 5)])},
             (False, 4): {ids[2]: (5, worst[(ids[2], 5)])}}
    by_prompt = {tuple(p): i for i, p in P.items()}

    def fake(target_dir, rows_, max_new, work, log_path, opts, drafter_dir=None, block_size=0, more_concurrencies=()):
        runs = {}
        with StandIn(target, mode="openai") as s, OpenAIClient(s.url, concurrency=4) as client:
            client.info()
            for c in [opts.concurrency] + sorted(set(more_concurrencies) - {opts.concurrency}):
                sw = swaps.get((drafter_dir is not None, c), {})

                def edit(prompt, out, sw=sw):
                    pos, tok = sw.get(by_prompt[tuple(prompt)], (None, None))
                    return out if pos is None else out[:pos] + [tok] + out[pos + 1:]

                s.edit = edit
                reqs, wall = run_requests(client, rows_, max_new, stop_token_ids(target_dir)[0], c)
                for q in reqs:  # one token per step, as the hand-made evaluation below says
                    q.per_step_accepted = [0] * (len(q.completion_ids) - 1) if drafter_dir else []
                runs[c] = {"requests": reqs, "timing": latency_summary(reqs, wall)}
        first = runs.pop(opts.concurrency)
        steps = sum(len(q.per_step_accepted) for q in first["requests"])
        return {**first, "extra": runs, "device": "test cpu",
                "counters": SpecCounters(steps, 3 * steps, 0.0, (0.0, 0.0, 0.0)) if drafter_dir else None,
                "server": {"engine": "vllm", "version": "standin", "dtype": "float32", "concurrency": 1,
                           "cpu_fix": False, "flags": []}}

    ev = tmp_path / "ev.json"
    ev.write_text(json.dumps({"block_size": 4, "checkpoint": "ck", "prompt_set": "p",
                              "samples": [{"id": i, "acceptance_lengths": [1] * 11} for i in ids]}))
    monkeypatch.setattr(stage, "serve_and_measure", fake)
    r = stage.validate_engine(target, comp, ["ck-dir"], [str(ev)], tmp_path / "ve.json", load_concurrency=4,
                              near_tie_ulps=bound, margin_device="cpu")
    tc = r["lossless"]
    assert tc["judged_requests"] == 3 and tc["near_tie_ulps"] == pytest.approx(bound)
    plain = {p["concurrency"]: p for p in tc["plain"]}
    assert plain[1]["counts"]["equal"] == 3 and plain[4]["counts"] == {"equal": 2, "near-tie": 0, "break": 1}
    d = {x["concurrency"]: x for x in tc["checkpoints"][0]["runs"]}
    assert set(d) == {1, 4} and d[1]["counts"]["equal"] == 3 and d[1]["faults"] == []
    q = {x["id"]: x for x in d[4]["requests"]}
    assert (q[ids[0]]["class"], q[ids[0]]["first_token_diff"], q[ids[0]]["engine_token"]) == (
        "break", 3, worst[(ids[0], 3)])
    assert (q[ids[1]]["class"], q[ids[1]]["first_token_diff"], q[ids[1]]["engine_token"]) == (
        "near-tie", tie_pos, tie["top2"])
    assert q[ids[1]]["margin_ulps"] == pytest.approx(tie["margin_ulps"], rel=1e-4)  # a shorter forward: float32 rounding
    assert q[ids[2]]["class"] == "break" and q[ids[2]]["first_token_diff"] == 5
    assert d[4]["faults"] == [ids[0]] and tc["n_faults"] == 1
    assert r["title"].endswith("ENGINE FAULT (greedy tokens break with the drafter)")
    assert r["markdown"].startswith("**ENGINE FAULT: 1 of 3 requests break at concurrency 4 with the drafter ck, "
                                    "1 without (plain server at concurrency 4)**")
    assert r["checkpoints"][0]["kinds"]["none"] == 3  # the measured run (concurrency 1) is clean
    assert d[4]["acceptance_raw"] == 1.0 and "| ck | 4 | 0 | 1 | 2 | **1** | 1.0000 |" in r["markdown"]
    # the same swap under a bound just below its margin is a break
    assert classify(logits[(ids[1], tie_pos)], C[ids[1]][tie_pos], tie["top2"],
                    near_tie_ulps=tie["margin_ulps"] * 0.99)["class"] == "break"


@pytest.mark.slow  # 5-7 s on 2 cores
def test_serve_and_measure_reuses_its_server_for_more_concurrencies(tiny, tmp_path):
    """serve_and_measure on a job-owned server (the stand-in as a fake vLLM entry point, tests/serving/test_serving.py):
    the measured run at concurrency 1, then the same prompts at 3 on the same server (one start: one log, one
    ``--port``); concurrency 1 asked again is not run twice. Every response equals the cached completion."""
    import sys

    from dflash_eval.serving.vllm.engine import EngineOptions, serve_and_measure
    from test_serving import _fake_vllm

    target, _, rows = tiny
    log_path = tmp_path / "plain.log"
    run = serve_and_measure(target, rows, 12, tmp_path, log_path, EngineOptions(python=sys.executable,
                            env=_fake_vllm(tmp_path), dtype="float32", start_timeout_s=120),
                            more_concurrencies=[1, 3])
    assert sorted(run["extra"]) == [3] and run["server"]["concurrency"] == 1
    for reqs in (run["requests"], run["extra"][3]["requests"]):
        assert [q.completion_ids for q in reqs] == [r["completion_ids"] for r in rows]
    assert run["extra"][3]["timing"]["requests"] == len(rows)
    assert log_path.read_text().count("stand-in vLLM serving") == 1


def test_judge_logits_on_a_hybrid_target(tmp_path):
    """The float32 forward behind the near-tie check on a tiny Qwen3.5 hybrid in the VLM layout (Gated DeltaNet +
    attention, the family of the report's Qwen3.6 target): the logits kept at positions 0, 5 and 9 of a completion
    equal those rows of a plain full forward."""
    from dflash_eval.target.model import load_target
    from tiny_hybrid import save_target, write_completions

    target = save_target(tmp_path / "hybrid", kind="qwen3_5_vlm", seed=1)  # Qwen3_5ForConditionalGeneration
    row = json.loads(write_completions(tmp_path / "c.jsonl", 1, completion_len=(12, 12)).read_text())
    got = lossless.judge_logits(target, [row], {row["id"]: {9, 0, 5}}, device="cpu")
    assert sorted(got) == [(row["id"], k) for k in (0, 5, 9)]
    model, _, _ = load_target(target, device="cpu", dtype="float32")
    P = len(row["prompt_ids"])
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([row["prompt_ids"] + row["completion_ids"]])).logits[0].float()
    for k in (0, 5, 9):
        assert torch.allclose(got[(row["id"], k)], full[P - 1 + k], atol=1e-4), k
