"""Per-request records: one schema for evaluate, validate_online and validate_engine; tau.csv and the paired
bootstrap computed from them; reslice by new bins on hand-built records."""

from __future__ import annotations

import json
import math

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tiny import make_random_drafter, make_tiny_target

from dflash_eval.core.errors import InputError
from dflash_eval.replay.metrics import POSITION_BINS
from dflash_eval.report.compare import sample_values
from dflash_eval.report.records import (SCHEMA, evaluate_records, frame, job_view, load_offline, read_records,
                                        records_path, write_records)
from dflash_eval.report.reslice import reslice
from dflash_eval.report.tau_table import summary_frame


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target, a random drafter (block 5), 3 greedy completions of 24 tokens, their cache, the evaluate job
    (chain + DDTree 4) and validate_online (chain, 2 prompts), all on the CPU in float32."""
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.stages.validate_online import validate_online

    d = tmp_path_factory.mktemp("records")
    target = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    make_random_drafter(d / "drafter", target, [1, 3], block_size=5)
    prompts = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p} for i, p in
               enumerate([[1, 40, 41, 42, 2, 1, 50], [1, 60, 61, 2, 1, 50, 51, 52], [1, 70, 2, 1, 50]])]
    (d / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    generate_completions(target, d / "prompts.jsonl", d / "c.jsonl", max_new_tokens=24, batch_size=3, device="cpu",
                         dtype="float32")
    extract_hidden_states(target, d / "c.jsonl", d / "c.h5", layer_ids=[1, 3], device="cpu", dtype="float32")
    ev = evaluate(d / "drafter", d / "c.h5", target, d / "ev.json", device="cpu", dtype="float32",
                  ddtree_budgets=[4], run="tiny")
    vo = validate_online(target, d / "c.jsonl", [d / "drafter"], [d / "ev.json"], d / "vo.json", n_samples=2,
                         ddtree_budget=0, device="cpu", dtype="float32", run="tiny")
    return {"dir": d, "ev": ev, "vo": vo}


def _engine_records(tmp_path, monkeypatch):
    """validate_engine on hand-built engine runs (the stand-in of tests/serving/test_vllm_engine_unit.py)."""
    from test_vllm_engine_unit import _req

    from dflash_eval.serving.vllm.engine import SpecCounters, latency_summary
    from dflash_eval.stages import validate_engine as stage

    comp = tmp_path / "c.jsonl"
    comp.write_text("".join(json.dumps({"id": k, "prompt_ids": [1, 2, 3], "completion_ids": list(range(10)),
                                        "stop_reason": "eos", "max_new_tokens": 16}) + "\n" for k in ("a", "b")))
    ev = tmp_path / "ev.json"
    ev.write_text(json.dumps({"block_size": 4, "checkpoint": "ck", "prompt_set": "he", "step": 7,
                              "samples": [{"id": "a", "acceptance_lengths": [4, 2, 3]},
                                          {"id": "b", "acceptance_lengths": [4, 2, 3]}]}))

    def fake(target_dir, rows_, max_new, work, log_path, opts, drafter_dir=None, block_size=0, more_concurrencies=()):
        reqs = [_req("a", list(range(10)), [3, 1, 2] if drafter_dir else []),
                _req("b", list(range(10)), [3, 1, 4] if drafter_dir else [], lat=0.5)]
        extra = {c: {"requests": reqs, "timing": latency_summary(reqs, 1.0)} for c in more_concurrencies
                 if c != opts.concurrency}
        return {"requests": reqs, "timing": latency_summary(reqs, 1.0), "device": "test cpu", "extra": extra,
                "counters": SpecCounters(6, 18, 14, (5, 3, 1)) if drafter_dir else None,
                "server": {"engine": "vllm", "version": "0.32.0", "dtype": "float32", "concurrency": 1,
                           "cpu_fix": bool(drafter_dir), "flags": []}}

    monkeypatch.setattr(stage, "serve_and_measure", fake)
    r = stage.validate_engine("t", comp, ["d/ck"], [str(ev)], tmp_path / "ve.json", run="tiny")
    return r, tmp_path / "ve.records.parquet"


def test_one_schema_for_offline_online_and_engine_records(tiny_run, tmp_path, monkeypatch):
    d = tiny_run["dir"]
    r_engine, engine_file = _engine_records(tmp_path, monkeypatch)
    files = {"offline": records_path(d / "ev.json"), "online": d / "vo.records.parquet", "engine": engine_file}
    assert files["offline"] == d / "ev.records.parquet"
    for source, f in files.items():
        assert pq.read_schema(f).remove_metadata() == SCHEMA  # the same Arrow schema, column for column
        df, jobs = read_records([f])
        assert set(df["source"]) == {source} and set(df["run"]) == {"tiny"}, source
        assert [j["source"] for j in jobs] == [source], source
    off, _ = read_records([files["offline"]])
    # per sample: the greedy chain and DDTree 4 at T0; chain = the JSON's per-sample lists
    assert sorted(set(off["method"])) == ["chain", "ddtree_4"] and len(off) == 2 * 3
    chain = off[off["method"] == "chain"].set_index("sample_id")
    for s in tiny_run["ev"]["samples"]:
        assert list(chain.loc[s["id"], "accepted_lengths"]) == s["acceptance_lengths"]
        assert chain.loc[s["id"], "response_len"] == s["n_tokens"] == 1 + sum(s["acceptance_lengths"])
        assert chain.loc[s["id"], "prompt_len"] == s["prompt_len"]
    # the loop measure evaluate takes from the cached tokens is the completions file's
    stored = {json.loads(x)["id"]: json.loads(x)["repeated_8gram_fraction"] for x in (d / "c.jsonl").open()}
    assert chain["repeated_8gram_fraction"].to_dict() == stored
    # online, float32: the same outputs, so the same per-step lengths as the replay
    on, _ = read_records([files["online"]])
    assert list(on["sample_id"]) == ["p0", "p1"] and on["same_output"].all()
    for sid, lens in zip(on["sample_id"], on["accepted_lengths"]):
        assert list(lens) == list(chain.loc[sid, "accepted_lengths"])
    # engine: vLLM's accepted drafts [3, 1, 2] over 10 tokens -> the replay's convention [4, 2, 3] (tau 3.0)
    eng, _ = read_records([engine_file])
    a = eng.set_index("sample_id").loc["a"]
    assert list(a["accepted_lengths"]) == [4, 2, 3] and a["tau"] == 3.0 and a["response_len"] == 10
    assert a["divergence"] == "none" and bool(a["same_output"]) and a["prompt_len"] == 3 and a["step"] == 7
    req = {q["id"]: q for q in r_engine["checkpoints"][0]["requests"]}
    assert eng.set_index("sample_id").loc["b", "divergence"] == req["b"]["kind"] == "stop-counting"
    assert eng.set_index("sample_id").loc["b", "latency_s"] == 0.5


def test_records_refuse_another_schema(tmp_path):
    df = frame([{"source": "offline", "block_size": 4, "accepted_lengths": [1, 2]}])
    with pytest.raises(InputError, match="source: .*'replay'.* is not one of"):
        write_records(tmp_path / "x.records.parquet", df.assign(source="replay"), [])
    with pytest.raises(InputError, match=r"accepted_lengths: an entry of \[1, 5\] is outside 1..4"):
        frame([{"source": "offline", "block_size": 4, "accepted_lengths": [1, 5]}])
    with pytest.raises(InputError, match="differ from the record schema"):
        write_records(tmp_path / "x.records.parquet", df.drop(columns="tau"), [])
    other = SCHEMA.set(SCHEMA.get_field_index("tau"), pa.field("tau", pa.string()))  # tau as text
    pq.write_table(pa.Table.from_pandas(df.astype({"tau": str}), schema=other, preserve_index=False),
                   tmp_path / "y.records.parquet")
    with pytest.raises(InputError, match=r"schema: not the record schema \(\['tau: string'\]\)"):
        read_records([tmp_path / "y.records.parquet"])


def test_tau_from_records_equals_the_json(tiny_run):
    d = tiny_run["dir"]
    from_records = summary_frame([str(d / "ev.records.parquet")])
    from_json = summary_frame([str(d / "ev.json")])
    pd.testing.assert_frame_equal(from_records, from_json)
    assert from_records.loc[0, "tau"] == pytest.approx(tiny_run["ev"]["tau"], abs=0, rel=0)
    assert from_records.loc[0, "tau_ddtree_4"] == pytest.approx(tiny_run["ev"]["ddtree"]["4"]["tau"], abs=0, rel=0)
    # the paired bootstrap's per-prompt taus: the records' chain rows
    vals = sample_values(load_offline([str(d / "ev.records.parquet")]).records)
    assert list(vals["sample"]) == ["p0", "p1", "p2"]
    assert list(vals["tau"]) == [s["tau"] for s in tiny_run["ev"]["samples"]]
    # reslice at the tau table's bins gives the tau table's columns
    again = reslice(read_records([d / "ev.records.parquet"])[0])
    row = again[again["method"] == "chain"].iloc[0]
    for col in ["tau", "tau_se", "tau_tokens_per_step", "tau_pos_0_64", "tau_prompt_0_128"]:
        assert row[col] == pytest.approx(from_records.loc[0, col], abs=1e-12), col


def _hand_records():
    # a: steps [3, 1, 2, 4] anchored at positions 0, 3, 4, 6; b: [1, 1, 5] at 0, 1, 2
    return frame([
        {"run": "r", "source": "offline", "checkpoint": "ck", "prompt_set": "s", "block_size": 5, "sample_index": 0,
         "sample_id": "a", "method": "chain", "sampling": "T0", "draft": "reference", "prompt_len": 100,
         "accepted_lengths": [3, 1, 2, 4], "tau": 2.5},
        {"run": "r", "source": "offline", "checkpoint": "ck", "prompt_set": "s", "block_size": 5, "sample_index": 1,
         "sample_id": "b", "method": "chain", "sampling": "T0", "draft": "reference", "prompt_len": 300,
         "accepted_lengths": [1, 1, 5], "tau": 7 / 3}])


def test_reslice_by_new_position_and_prompt_bins():
    t = reslice(_hand_records(), position_bins=[0, 4], prompt_len_bins=[0, 200]).iloc[0]
    assert (t["n_samples"], t["tau"], t["tau_tokens_per_step"]) == (2, pytest.approx(29 / 12), pytest.approx(17 / 7))
    # positions < 4: a's 3 + 1 and b's 1 + 1 + 5 over 5 steps; >= 4: a's 2 + 4 over 2 steps
    assert t["tau_pos_0_4"] == pytest.approx(11 / 5) and t["steps_pos_0_4"] == 5
    assert t["tau_pos_4_inf"] == pytest.approx(3.0) and t["steps_pos_4_inf"] == 2
    assert t["tau_prompt_0_200"] == 2.5 and t["n_prompt_0_200"] == 1 and t["tau_prompt_200_inf"] == pytest.approx(7 / 3)
    only_b = reslice(_hand_records(), position_bins=[0, 4], samples=["b"]).iloc[0]
    assert only_b["n_samples"] == 1 and only_b["tau_pos_0_4"] == pytest.approx(7 / 3)
    assert math.isnan(only_b["tau_pos_4_inf"]) and math.isnan(only_b["tau_se"])
    with pytest.raises(InputError, match="reslice.position_bins"):
        reslice(_hand_records(), position_bins=[64, 0])
    with pytest.raises(InputError, match="reslice.samples: none of"):
        reslice(_hand_records(), samples=["zz"])


def test_reslice_merges_the_expected_counts_at_temperature_above_0():
    tokens, steps = [2.0, 4.0, 6.0] + [0.0] * 5, [1.0, 2.0, 3.0] + [0.0] * 5  # per POSITION_BINS bin
    assert len(tokens) == len(POSITION_BINS)
    rec = frame([{"run": "r", "source": "offline", "checkpoint": "ck", "prompt_set": "s", "block_size": 5,
                  "sample_index": 0, "sample_id": "a", "method": "chain", "sampling": "T1", "temperature": 1.0,
                  "draft": "reference", "prompt_len": 10, "tau": 2.0, "expected_steps": 6.0, "expected_committed": 12,
                  "expected_bin_tokens": tokens, "expected_bin_steps": steps}])
    t = reslice(rec, position_bins=[0, 128]).iloc[0]
    assert t["tau_pos_0_128"] == 2.0 and t["steps_pos_0_128"] == 3.0 and t["tau_pos_128_inf"] == 2.0
    assert t["tau"] == 2.0 and t["tau_tokens_per_step"] == 2.0
    assert math.isnan(reslice(rec, position_bins=[0, 100]).iloc[0]["tau_pos_0_100"])  # 100 is no edge of those


def test_evaluate_records_of_a_sampled_job_rebuild_its_expectations():
    exp = {"tau": 2.0, "tau_sglang": 2.5, "steps": 2.0, "committed": 4, "histogram": [0, 1, 0.5, 0.5, 0],
           "slot_accepted": [0, 1.5, 0.5, 0], "slot_compared": [0, 2, 1.5, 0.5], "bin_tokens": [4.0] + [0.0] * 7,
           "bin_steps": [2.0] + [0.0] * 7}
    r = {"checkpoint": "ck", "prompt_set": "s", "block_size": 4,
         "sampling_settings": [{"label": "T1", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "draft": ["reference"]}],
         "completion_sampling": {"temperature": 1.0},
         "samples": [{"id": "a", "acceptance_lengths": [2, 3], "prompt_len": 5},
                     {"id": "b", "acceptance_lengths": [], "prompt_len": 6}],
         "expected": {"T1": {"samples": [exp, None]}}}
    df, job = evaluate_records(r)
    assert list(zip(df["sample_id"], df["sampling"])) == [("a", "T0"), ("b", "T0"), ("a", "T1"), ("b", "T1")]
    assert set(df["trajectory"]) == {"T1"} and job["sampling_settings"] == r["sampling_settings"]
    view = job_view(df, job)  # what the tau table reads: the JSON's per-sample lists and expectations again
    assert view["expected"]["T1"]["samples"] == [exp, None]
    assert [s["acceptance_lengths"] for s in view["samples"]] == [[2, 3], []]


def test_validation_records_of_sampled_runs():
    """validate_online at T > 0: one row per prompt and seed (seed = seed + i * seeds + k); validate_engine at T > 0:
    one row per prompt holding the mean over its runs."""
    from dflash_eval.report.records import engine_records, online_records

    ev = {"checkpoint": "ck", "prompt_set": "s", "block_size": 4, "step": 3, "completion_sampling": {"temperature": 1.0},
          "sampling_settings": [{"label": "T1", "temperature": 1.0, "top_p": 1.0, "top_k": 0}]}
    rows = [{"id": "a", "prompt_ids": [1, 2], "max_new_tokens": 8}, {"id": "b", "prompt_ids": [1], "max_new_tokens": 8}]
    online = {"seed": 100, "seeds": 2, "checkpoints": [{"checkpoint": "ck", "prompt_set": "s", "modes": {
        "chain": {"samples": [{"id": "a", "online": [2, 3], "same_output": True},
                              {"id": "b", "online": [1], "same_output": False}]}},
        "sampling": {"T1": {"samples": [{"id": "a", "taus": [2.0, 3.0]}, {"id": "b", "taus": [None, 1.5]}]}}}]}
    on = online_records(online, [ev], rows, "r")
    greedy = on[on["sampling"] == "T0"]
    assert list(greedy["response_len"]) == [6, 2] and list(greedy["same_output"]) == [True, False]
    assert list(greedy["truncated"]) == [False, False] and list(greedy["prompt_len"]) == [2, 1]
    t1 = on[on["sampling"] == "T1"]
    assert list(t1["seed"]) == [100, 101, 102, 103] and list(t1["sample_id"]) == ["a", "a", "b", "b"]
    assert t1["tau"].tolist()[:2] == [2.0, 3.0] and math.isnan(t1["tau"].iloc[2]) and t1["tau"].iloc[3] == 1.5
    assert set(t1["temperature"]) == {1.0} and t1["accepted_lengths"].isna().all()
    engine = {"checkpoints": [], "sampled": [{"checkpoint": "ck", "prompt_set": "s", "sampling": "T1",
                                              "draft": "argmax", "per_prompt": [{"id": "b", "engine": 1.75, "n": 4}]}]}
    eng = engine_records(engine, [ev], rows, "r")
    assert eng[["sample_id", "sample_index", "runs", "tau", "draft"]].values.tolist() == [["b", 1, 4, 1.75, "argmax"]]
    assert set(on["source"]) == {"online"} and set(eng["source"]) == {"engine"} and list(eng.columns) == SCHEMA.names
