"""vLLM as the acceptance judge, without a server: counters, the stop-token conversion, both per-position
conventions, divergence kinds, and the CPU ``rms_norm`` work-around. Real-server runs: ``tests/serving/test_vllm_engine.py``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest

from dflash_eval.core.errors import InputError

from dflash_eval.serving.vllm.engine import (SpecCounters, compare, cpu_fix_dir, dflash_args, engine_acceptance_lengths,
                                     EngineRequest, latency_summary, parse_counters, per_position, raw_per_position)

METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_dflash_flags():
    args = dflash_args("/d/step3", 8)
    assert json.loads(args[1]) == {"method": "dflash", "model": "/d/step3", "num_speculative_tokens": 7}
    assert args[2:] == ["--no-enable-prefix-caching", "--per-request-spec-decode-metrics", "detailed"]


def test_prometheus_counters_are_parsed_summed_over_engines_and_subtracted():
    c = parse_counters(METRICS)
    assert c == SpecCounters(10.0, 70.0, 9.0, (7.0, 2.0, 1.0))
    assert c.mean_acceptance_length == pytest.approx(1.9)
    d = c - SpecCounters(4.0, 28.0, 3.0, (3.0,))
    assert d == SpecCounters(6.0, 42.0, 6.0, (4.0, 2.0, 1.0))
    assert parse_counters("") == SpecCounters()


def test_conversion_cuts_drafts_counted_past_the_stop_token():
    # 10 completion tokens (prefill token x0 .. stop token x9): 9 to commit after the prefill token.
    # vLLM: steps accepted 3, 1, 4 -> 4 + 2 + 5 = 11 > 9: the last step accepted 2 drafts past the stop.
    assert engine_acceptance_lengths([3, 1, 4], 10) == ([4, 2, 3], 2)
    assert engine_acceptance_lengths([3, 1, 2], 10) == ([4, 2, 3], 0)  # ended exactly at the stop
    with pytest.raises(ValueError, match="steps left after the end"):
        engine_acceptance_lengths([3, 1, 4, 0], 10)
    with pytest.raises(ValueError, match="commit 8 tokens after the prefill token, the response has 9"):
        engine_acceptance_lengths([3, 1, 1], 10)


def test_both_per_position_conventions_on_a_hand_built_case():
    B = 4
    # two responses of 8 and 4 completion tokens; their last steps commit exactly the tokens left (censored)
    lengths = [[4, 2, 1], [3]]
    pp = per_position(lengths, B)
    # unconditional P(slots 1..k accepted) over all 4 steps, censored ones counted as not accepted (vLLM's way):
    # k=1: steps 4, 2, 3 -> 3/4; k=2: 4, 3 -> 2/4; k=3: 4 -> 1/4
    assert pp["unconditional"] == {1: 0.75, 2: 0.5, 3: 0.25}
    # conditional, censored slots left out: slot 1 compared in steps 4, 2, 3 (the final 1 ended the response),
    # all accepted; slot 2 in 4, 2 (refused), 3 -> 2/3; slot 3 in step 4 only (step 3 ended its response)
    assert pp["conditional"] == {1: 1.0, 2: pytest.approx(2 / 3), 3: 1.0}
    assert raw_per_position([[3, 1, 0], [2]], B) == {1: 0.75, 2: 0.5, 3: 0.25}


def _req(sid, ids, acc, lat=1.0):
    return EngineRequest(sid, ids, "stop", lat, acc, [3] * len(acc))


def test_compare_names_each_divergence_kind():
    rows = [{"id": "a", "completion_ids": list(range(10))}, {"id": "b", "completion_ids": list(range(10))},
            {"id": "c", "completion_ids": list(range(10))}, {"id": "d", "completion_ids": list(range(10))},
            {"id": "e", "completion_ids": [5, 2]}]
    offline = {"samples": [{"id": k, "acceptance_lengths": v} for k, v in
                           [("a", [4, 2, 3]), ("b", [4, 2, 3]), ("c", [4, 2, 3]), ("d", [4, 2, 3]), ("e", [1])]]}
    reqs = [_req("a", list(range(10)), [3, 1, 2]), _req("b", list(range(10)), [3, 1, 4]),
            _req("c", list(range(10)), [1, 3, 3]), _req("d", list(range(9)) + [7], [3, 1, 2]),
            EngineRequest("e", [5, 2], "stop", 0.5)]
    got = compare(rows, offline, reqs, block_size=4)
    kinds = {r["id"]: r["kind"] for r in got["requests"]}
    assert kinds == {"a": "none", "b": "stop-counting", "c": "drafts", "d": "generation", "e": "no-trace"}
    rb = next(r for r in got["requests"] if r["id"] == "b")
    assert rb["past_end"] == 2 and rb["engine"] == [4, 2, 3] and rb["accepted_engine_raw"] == 8
    rc = next(r for r in got["requests"] if r["id"] == "c")
    assert rc["first_step_diff"] == 0 and rc["engine"] == [2, 4, 3]
    assert next(r for r in got["requests"] if r["id"] == "d")["first_token_diff"] == 9
    assert got["n_compared"] == 3  # a, b, c: same tokens and a trace
    # raw: (1 + (6 + 8 + 7) / 9); converted: 27 tokens / 9 steps
    assert got["engine"]["mean_acceptance_length_raw"] == pytest.approx(1 + 21 / 9)
    assert got["engine"]["tau_tokens_per_step"] == pytest.approx(27 / 9)
    assert got["offline"]["tau_tokens_per_step"] == pytest.approx(27 / 9)


def test_latency_summary():
    reqs = [_req(str(i), [0] * n, [], lat) for i, (n, lat) in enumerate([(10, 1.0), (30, 3.0), (20, 2.0)])]
    s = latency_summary(reqs, wall_s=4.0)
    assert s["output_tokens"] == 60 and s["output_tok_per_s"] == 15.0
    assert s["latency_s"] == {"mean": 2.0, "p50": 2.0, "p90": 3.0}


def test_cpu_fix_makes_a_grouped_rms_norm_apply_each_row(tmp_path):
    # a stand-in for vllm._custom_ops whose rms_norm has the CPU build's flaw: row 0 of a 2-D weight for all rows
    fake = tmp_path / "fake" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").touch()
    (fake / "_custom_ops.py").write_text(textwrap.dedent("""
        import torch
        def rms_norm(out, x, w, eps):
            w0 = w[0] if w.dim() == 2 else w
            out.copy_(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w0)
    """))
    code = textwrap.dedent("""
        import torch
        from vllm import _custom_ops as ops
        torch.manual_seed(0)
        x, w = torch.randn(2, 5, 3, 8), torch.rand(2, 8) + 0.5
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w[:, None, None, :]
        one = torch.empty(5, 8); ops.rms_norm(one, x[0, :, 0], w[1], 1e-6)
        print((out - ref).abs().max().item(), getattr(ops.rms_norm, "dflash_eval_patched", False),
              (one - x[0, :, 0] * torch.rsqrt(x[0, :, 0].pow(2).mean(-1, keepdim=True) + 1e-6) * w[1]).abs().max().item())
    """)
    env = {"PYTHONPATH": str(tmp_path / "fake"), "PATH": "/usr/bin:/bin"}
    flawed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert float(flawed.stdout.split()[0]) > 0.1, flawed.stderr
    fixed_env = {**env, "PYTHONPATH": f"{cpu_fix_dir(tmp_path)}:{tmp_path / 'fake'}"}
    fixed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=fixed_env)
    err, patched, one = fixed.stdout.split()
    assert float(err) < 1e-6 and patched == "True" and float(one) < 1e-6, fixed.stderr


def test_validate_engine_stage_bookkeeping_without_a_server(tmp_path, monkeypatch):
    """The stage's numbers on hand-built engine runs (no vLLM): conversion, ok, measured and estimated speedup,
    the report section; mismatched inputs refused."""
    from dflash_eval.core.errors import InputError
    from dflash_eval.stages import validate_engine as stage

    comp = tmp_path / "c.jsonl"
    rows = [{"id": k, "prompt_ids": [1, 2], "completion_ids": list(range(10)), "stop_reason": "eos",
             "max_new_tokens": 16} for k in ("a", "b")]
    comp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = tmp_path / "ev.json"
    ev.write_text(json.dumps({"block_size": 4, "checkpoint": "ck", "prompt_set": "he",
                              "samples": [{"id": "a", "acceptance_lengths": [4, 2, 3]},
                                          {"id": "b", "acceptance_lengths": [4, 2, 3]}]}))
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"format": "dflash-eval/target-costs", "format_version": 1, "decode_s": 0.01,
                                 "verify": [{"n": 4, "mask": "causal", "median_s": 0.02}],
                                 "drafters": {"ck": {"draft_s": 0.005}}, "device": "cpu", "device_name": "test cpu",
                                 "dtype": "float32", "threads": 2}))
    calls = []

    def fake(target_dir, rows_, max_new, work, log_path, opts, drafter_dir=None, block_size=0, more_concurrencies=()):
        calls.append((drafter_dir, block_size, max_new, len(rows_), tuple(more_concurrencies)))
        wall = 2.0 if drafter_dir is None else 0.8  # 20 tokens: 10 tok/s plain, 25 tok/s DFlash
        reqs = [_req("a", list(range(10)), [3, 1, 2] if drafter_dir else []),
                _req("b", list(range(10)), [3, 1, 4] if drafter_dir else [])]
        extra = {c: {"requests": reqs, "timing": latency_summary(reqs, wall / 2)} for c in more_concurrencies
                 if c != opts.concurrency}
        return {"requests": reqs, "timing": latency_summary(reqs, wall), "device": "test cpu", "extra": extra,
                "counters": SpecCounters(6, 18, 14, (5, 3, 1)) if drafter_dir else None,
                "server": {"engine": "vllm", "version": "0.32.0", "dtype": "float32", "concurrency": 1,
                           "cpu_fix": bool(drafter_dir), "flags": []}}

    monkeypatch.setattr(stage, "serve_and_measure", fake)
    r = stage.validate_engine("t", comp, ["d/ck"], [str(ev)], tmp_path / "ve.json", target_costs=str(costs))
    # plain first, then the drafter with its block size; each also at load_concurrency (8), the drafter at 1 too
    assert calls == [(None, 0, 16, 2, (8,)), ("d/ck", 4, 16, 2, (1, 8))]
    tc = r["lossless"]  # every request equal: no target forward, no fault
    assert tc["judged_requests"] == 0 and tc["n_faults"] == 0 and tc["load_concurrency"] == 8
    assert [(p["concurrency"], p["counts"]["equal"]) for p in tc["plain"]] == [(1, 2), (8, 2)]
    assert [(x["concurrency"], x["counts"]["equal"], x["n_faults"], x["acceptance_raw"])
            for x in tc["checkpoints"][0]["runs"]] == [(1, 2, 0, 1 + 14 / 6), (8, 2, 0, 1 + 14 / 6)]  # 14 accepted, 6 steps
    assert r["markdown"].startswith("**Token check**: lossless: every request at concurrency 1, 8")
    (c,) = r["checkpoints"]
    assert c["kinds"]["none"] == 1 and c["kinds"]["stop-counting"] == 1
    assert c["mean_acceptance_length_raw"] == pytest.approx(1 + 14 / 6)  # vLLM's own count
    assert c["tau_tokens_per_step_engine"] == c["tau_tokens_per_step_offline"] == pytest.approx(3.0)
    assert c["rel_diff"] == 0.0 and c["max_pos_diff"] == 0.0 and c["ok"]
    assert c["speedup_measured"] == pytest.approx(2.5)
    assert c["speedup_estimated"] == pytest.approx(c["tau_offline"] * 0.01 / (0.02 + 0.005))
    assert "| ck | he | 3.3333 | 3.0000 | 3.0000 | +0.00 % | 0.0000 | yes | 2/2 | 2.50x |" in r["markdown"]
    assert "CPU (test cpu, float32, 2 threads)" in r["markdown"]
    assert json.loads((tmp_path / "ve.json").read_text())["title"] == r["title"]
    with pytest.raises(InputError, match="1 drafters but 2 evaluations"):
        stage.validate_engine("t", comp, ["d/ck"], [str(ev), str(ev)], tmp_path / "x.json")
    ev.write_text(json.dumps({"block_size": 4, "checkpoint": "ck", "prompt_set": "he",
                              "samples": [{"id": "a", "acceptance_lengths": [4, 2, 3]}]}))
    with pytest.raises(InputError, match=r"no offline result for \['b'\]"):
        stage.validate_engine("t", comp, ["d/ck"], [str(ev)], tmp_path / "x.json")


def test_validate_engine_at_temperature_1_flags_names_failures_and_ranks(tmp_path, monkeypatch):
    """validate_engine at T > 0 on hand-built engine runs (no vLLM): each policy served with its
    draft_sample_method, each prompt once per seed; the engine's tau (mean +- s.e., paired by prompt) beside the
    offline expectation of the same policy; a difference beyond 3 s.e. flagged; a crashing server named with its
    cause and workaround (not a traceback); the checkpoint order compared (Spearman, best checkpoint)."""
    from dflash_eval.serving.clients import ServerError
    from dflash_eval.stages import validate_engine as stage

    comp = tmp_path / "c.jsonl"
    ids = ("a", "b", "c")
    comp.write_text("".join(json.dumps({"id": k, "prompt_ids": [1, 2], "completion_ids": list(range(10)),
                                        "stop_reason": "eos", "max_new_tokens": 16}) + "\n" for k in ids))
    t1 = {"label": "T1", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "draft": ["reference", "argmax"]}
    tk = {"label": "T1_k20", "temperature": 1.0, "top_p": 1.0, "top_k": 20, "draft": ["argmax"]}

    def ev(name, ref, arg):
        path = tmp_path / f"{name}.json"
        exp = lambda taus: {"samples": [{"tau": t} for t in taus]}  # noqa: E731
        path.write_text(json.dumps({"block_size": 4, "checkpoint": name, "prompt_set": "s", "variant": "dflash",
                                    "completion_sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
                                    "sampling_settings": [t1, tk],
                                    "samples": [{"id": k, "acceptance_lengths": [1]} for k in ids],
                                    "expected": {"T1": exp(ref), "T1:argmax": exp(arg), "T1_k20:argmax": exp(arg)}}))
        return str(path)

    # per-step accepted drafts: 9 tokens after the prefill token; [2, 2, 2] -> tau 3; [0] * 9 -> tau 1
    served = {"probabilistic": {"good": [2, 2, 2], "bad": [1, 2, 0, 2]}, "greedy": {"good": [0] * 9, "bad": [0] * 9}}
    calls = []

    def fake(target_dir, rows_, max_new, work, log_path, opts, drafter_dir=None, block_size=0,
             draft_sample_method=None, sampling=None, seeds=1):
        calls.append((drafter_dir, draft_sample_method, sampling and sampling["top_k"], seeds))
        if sampling and sampling["top_k"]:  # the CPU build's crash, as its log shows it
            log_path.write_text("Traceback ...\n  File \"topk_topp_sampler.py\", in apply_top_k_top_p_pytorch\n"
                                "RuntimeError: index 20 is out of bounds: index out of bounds\n")
            raise ServerError("http://127.0.0.1:1/v1/completions: connection refused")
        acc = served[draft_sample_method][drafter_dir]
        reqs = [EngineRequest(k, list(range(10)), "stop", 1.0, acc, [3] * len(acc), seed=s)
                for k in ids for s in range(seeds)]
        return {"requests": reqs, "timing": latency_summary(reqs, 1.0), "device": "test cpu", "counters": None,
                "server": {"engine": "vllm", "version": "0.32.0", "dtype": "float32", "concurrency": 1,
                           "cpu_fix": True, "flags": []}}

    monkeypatch.setattr(stage, "serve_and_measure", fake)
    evs = [ev("good", [3.0, 2.9, 3.1], [1.3, 1.2, 1.25]), ev("bad", [2.0, 1.9, 2.1], [1.0, 1.0, 1.0])]
    r = stage.validate_engine("t", comp, ["good", "bad"], evs, tmp_path / "ve.json", seeds=2,
                              sampling=[{"temperature": 1.0}, {"temperature": 1.0, "top_k": 20}])
    assert "plain" not in r and r["checkpoints"] == []  # no T = 0 entry: no greedy check, no plain server
    assert calls[0] == ("good", "probabilistic", 0, 2) and calls[1] == ("good", "greedy", 0, 2)
    by = {(x["checkpoint"], x["sampling"], x["draft"]): x for x in r["sampled"]}
    ok = by[("good", "T1", "reference")]
    assert ok["tau_engine"] == pytest.approx(3.0) and ok["tau_offline"] == pytest.approx(3.0)
    assert ok["n_requests"] == 6 and ok["flag"] is False and ok["draft_sample_method"] == "probabilistic"
    wrong = by[("good", "T1", "argmax")]  # the engine accepts nothing: 1.000 vs 1.25 offline
    assert wrong["tau_engine"] == 1.0 and wrong["diff"] == pytest.approx(-0.25)
    assert wrong["diff_se"] == pytest.approx(0.05 / math.sqrt(3)) and wrong["flag"] is True
    crash = by[("good", "T1_k20", "argmax")]
    assert "apply_top_k_top_p_pytorch" in crash["error"]["cause"] and "plain temperature" in crash["error"]["workaround"]
    md = r["markdown"]
    assert md.startswith("**ENGINE DISAGREES with the offline expectation beyond 3 standard errors** for good at T1 "
                         "[argmax, vLLM draft_sample_method=greedy]")
    assert r["title"].endswith("ENGINE DISAGREES OR FAILED at T > 0")
    assert "**ENGINE FAILED** for good at T1_k20 [argmax]: vLLM's rejection sampler failed" in md
    assert "Traceback" not in md
    rank = {(g["sampling"], g["draft"]): g for g in r["ranking"]}
    assert rank[("T1", "reference")]["best_offline"] == "good" and rank[("T1", "reference")]["same_best"]
    assert rank[("T1", "reference")]["spearman"] == pytest.approx(1.0)
    assert "| T1 | reference | 2 | +1.000 | good | good | yes |" in md
    with pytest.raises(InputError, match=r"expected\.T1:probabilistic") as err:
        stage.validate_engine("t", comp, ["good"], evs[:1], tmp_path / "x.json",
                              sampling=[{"temperature": 1.0, "draft": ["probabilistic"]}])
    assert "draft: [probabilistic]" in err.value.fix


def test_compare_names_a_first_difference_in_a_block_max_new_tokens_shortens_last_block():
    """B = 4, 10 new tokens of at most 10: after 7 committed tokens the reference drafts a shortened block where vLLM
    drafts a full one (a convention); the same difference with room for a full block (at most 20), or earlier, is a
    drafter difference."""
    offline = {"samples": [{"id": k, "acceptance_lengths": [4, 3, 1, 1]} for k in "fgh"]}
    rows = [{"id": "f", "completion_ids": list(range(10)), "max_new_tokens": 10},
            {"id": "g", "completion_ids": list(range(10)), "max_new_tokens": 20},
            {"id": "h", "completion_ids": list(range(10)), "max_new_tokens": 10}]
    # f, g: [4, 3, 2] (one more draft accepted at step 2, after 7 committed tokens); h: [4, 2, 3] (at step 1, after 4)
    reqs = [_req("f", list(range(10)), [3, 2, 1]), _req("g", list(range(10)), [3, 2, 1]),
            _req("h", list(range(10)), [3, 1, 2])]
    got = {r["id"]: r for r in compare(rows, offline, reqs, block_size=4)["requests"]}
    assert {k: (r["kind"], r["first_step_diff"]) for k, r in got.items()} == {
        "f": ("last-block", 2), "g": ("drafts", 2), "h": ("drafts", 1)}
