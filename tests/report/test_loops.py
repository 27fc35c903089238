"""Looping samples in tau.csv and the report (dflash_eval/report/loops.py): n_loop, tau_noloop, tau_noloop_se on
hand-built completions and evaluate outputs, greedy and expected (T > 0) rows; config section loops reaching summary."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pandas as pd
import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.stages.report import write_report
from dflash_eval.stages.summary import write_summary

#: completion ids per sample and their repeated 8-gram fractions, by hand
COMPLETIONS = {
    "0": [1, 2, 3, 4, 5] * 4,  # 13 8-grams, 5 distinct: 8/13 = 0.615 -> loops at 0.3
    "1": list(range(20)),  # no 8-gram twice: 0.0
    "2": [5, 6, 7],  # shorter than 8: 0.0
    "3": [9] * 12,  # 5 8-grams, 1 distinct: 4/5 = 0.8 -> loops at 0.3 and at 0.7
}
#: greedy acceptance per sample: taus 4, 1.5, 2, 3 -> tau 2.625; without samples 0 and 3: (1.5 + 2) / 2 = 1.75
ACCEPT = [[4, 4], [1, 2], [2], [3, 3, 3]]


def completions(path: Path, stored: dict | None = None) -> str:
    """A completions file of COMPLETIONS (rows written before the stored field existed, or with ``stored`` values)."""
    rows = [{"id": i, "prompt_ids": [1, 2], "completion_ids": ids, "max_new_tokens": 32,
             **({"repeated_8gram_fraction": stored[i]} if stored and i in stored else {})}
            for i, ids in COMPLETIONS.items()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def evaluate_output(path: Path, ckpt: str, step: int, prompt_set: str = "chat", accept=ACCEPT, expected_taus=None) -> str:
    """An evaluate output with per-sample acceptance (and, given ``expected_taus``, a T = 1 setting whose per-sample
    expected taus are those, block size 2)."""
    r = {"checkpoint": ckpt, "prompt_set": prompt_set, "block_size": 8, "step": step, "random_init": False,
         "device": "cpu", "dtype": "float32",
         "samples": [{"id": str(i), "acceptance_lengths": a} for i, a in enumerate(accept)]}
    if expected_taus is not None:
        r["block_size"] = 2
        r["samples"] = [{"id": str(i), "acceptance_lengths": [1, 1]} for i in range(len(expected_taus))]
        r["completion_sampling"] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
        r["sampling_settings"] = [{"label": "T1", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "draft": ["reference"]}]
        r["expected"] = {"T1": {"samples": [
            {"tau": t, "tau_sglang": t + 0.5, "steps": 2.0, "committed": 2, "histogram": [0.0, 1.0, 1.0],
             "slot_accepted": [0.0, 1.0], "slot_compared": [0.0, 2.0], "bin_tokens": [2.0] + [0.0] * 7,
             "bin_steps": [2.0] + [0.0] * 7} for t in expected_taus]}}
    out = path / f"{ckpt}-{prompt_set}.json"
    out.write_text(json.dumps(r))
    return str(out)


def test_greedy_rows_by_hand(tmp_path):
    evals = [evaluate_output(tmp_path, "ck", 10)]
    comp = [completions(tmp_path / "chat.jsonl")]
    row = write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet", completions=comp).iloc[0]
    assert row["tau"] == 2.625 and row["n_loop"] == 2 and row["tau_noloop"] == 1.75
    # SE of the kept taus 1.5 and 2: sd sqrt(0.125) / sqrt(2) = 0.25 (the same formula as tau_se)
    assert row["tau_noloop_se"] == pytest.approx(0.25)
    csv = pd.read_csv(tmp_path / "tau.csv").iloc[0]
    assert (csv["n_loop"], csv["tau_noloop"], csv["tau_noloop_se"]) == (2, 1.75, 0.25)
    # without completions the columns are there, empty
    bare = write_summary(evals, tmp_path / "b.csv", tmp_path / "b.parquet").iloc[0]
    assert pd.isna(bare["n_loop"]) and math.isnan(bare["tau_noloop"]) and math.isnan(bare["tau_noloop_se"])


def test_threshold_and_ngram_options(tmp_path):
    from dflash_eval.core import options

    evals = [evaluate_output(tmp_path, "ck", 10)]
    comp = [completions(tmp_path / "chat.jsonl")]
    strict = write_summary(evals, tmp_path / "t.csv", tmp_path / "t.parquet", completions=comp,
                           opts=options.make("summary", threshold=0.7)).iloc[0]
    assert strict["n_loop"] == 1 and strict["tau_noloop"] == pytest.approx((4 + 1.5 + 2) / 3)  # only sample 3
    none = write_summary(evals, tmp_path / "n.csv", tmp_path / "n.parquet", completions=comp,
                         opts=options.make("summary", threshold=1.0)).iloc[0]
    assert none["n_loop"] == 0 and none["tau_noloop"] == none["tau"] == 2.625
    # a stored value is used at its n (sample 1 says 0.9: it loops); another n measures the ids (sample 1: 0.0)
    stored = [completions(tmp_path / "chat.jsonl", {"1": 0.9})]
    at8 = write_summary(evals, tmp_path / "s.csv", tmp_path / "s.parquet", completions=stored).iloc[0]
    at7 = write_summary(evals, tmp_path / "s.csv", tmp_path / "s.parquet", completions=stored,
                        opts=options.make("summary", ngram=7)).iloc[0]
    assert (at8["n_loop"], at8["tau_noloop"]) == (3, 2.0) and (at7["n_loop"], at7["tau_noloop"]) == (2, 1.75)


def test_expected_rows_use_the_expected_taus(tmp_path):
    """At T > 0 tau is the mean of the per-sample expected taus; tau_noloop the mean of the kept ones."""
    evals = [evaluate_output(tmp_path, "ck", 10, prompt_set="chat-t1", expected_taus=[1.2, 1.8, 1.4, 1.6])]
    comp = [completions(tmp_path / "chat-t1.jsonl")]
    row = write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet", completions=comp).iloc[0]
    assert row["sampling"] == "T1" and bool(row["expected"])
    assert row["tau"] == pytest.approx(1.5) and row["n_loop"] == 2
    assert row["tau_noloop"] == pytest.approx(1.6) and row["tau_noloop_se"] == pytest.approx(0.2)


def test_samples_missing_from_the_completions_are_refused(tmp_path):
    evals = [evaluate_output(tmp_path, "ck", 10, accept=ACCEPT + [[2]])]  # a 5th sample, id "4"
    with pytest.raises(InputError) as err:
        write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet",
                      completions=[completions(tmp_path / "chat.jsonl")])
    assert err.value.field == "samples[].id" and "['4']" in err.value.problem and "chat" in err.value.problem


def test_report_shows_tau_without_loops(tmp_path):
    evals = [evaluate_output(tmp_path, "early", 10, accept=[[1, 1], [1, 1], [1], [2, 2]]),  # taus 1, 1, 1, 2
             evaluate_output(tmp_path, "late", 20)]
    comp = [completions(tmp_path / "chat.jsonl")]
    write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet", completions=comp,
                  out_provenance=tmp_path / "tau.provenance.json")
    data = write_report(tmp_path / "tau.csv", evals, [], tmp_path / "report.md", out_html=tmp_path / "report.html",
                        provenance=tmp_path / "tau.provenance.json")
    md = (tmp_path / "report.md").read_text()
    # headline: early tau 1.25 (1, 1, 1, 2), without samples 0 and 3: 1.0; late 2.625 and 1.75
    assert "| checkpoint | step | chat | chat no loops |" in md
    assert "| early | 10 | 1.250 | 1.000 |" in md and "| late | 20 | 2.625 | 1.750 |" in md
    assert "more than 0.3 of its token 8-grams" in md
    assert "chat: 2 of 4 samples loop; at `late` tau 2.625 with them, 1.750 without." in md
    html = (tmp_path / "report.html").read_text()
    assert "tau no loops" in html and "chat: 2 of 4 samples loop; at <code>late</code>" in html
    assert list(data.frame["n_loop"]) == [2, 2]
    # a tau.csv of an earlier version (no loop columns): the report has none either
    old = pd.read_csv(tmp_path / "tau.csv").drop(columns=["n_loop", "tau_noloop", "tau_noloop_se"])
    old.to_csv(tmp_path / "old.csv", index=False)
    write_report(tmp_path / "old.csv", evals, [], tmp_path / "old.md")
    assert "no loops" not in (tmp_path / "old.md").read_text()


def test_the_config_threshold_reaches_the_summary_rule(monkeypatch):
    """loops.* of the config are rule summary's flags (a params change: only summary and report rerun), parsed back
    by the stage into the same options; the rule passes every prompt set's completions."""
    import argparse
    import os

    import yaml
    from snakemake.utils import validate

    from dflash_eval.core import options
    from dflash_eval.workflow.plan import build_plan

    repo = Path(__file__).resolve().parents[2]
    rule = (repo / "rules" / "evaluate.smk").read_text()
    summary_rule = rule[rule.index("rule summary:"):rule.index("rule report:")]
    assert 'options=PLAN.stage_flags("summary")' in summary_rule and "{params.options}" in summary_rule
    assert "completions=lambda wildcards: PLAN.completions(wildcards.run)" in summary_rule
    assert "--completions {input.completions:q}" in summary_rule
    cfg = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    cfg["loops"] = {"ngram": 6, "threshold": 0.45}
    validate(cfg, str(repo / "dflash_eval" / "schemas" / "config.schema.yaml"))
    monkeypatch.chdir(repo)
    plan = build_plan(cfg)
    flags = plan.stage_flags("summary")
    parser = argparse.ArgumentParser()
    options.add_flags(parser, "summary")
    opts = options.from_args("summary", parser.parse_args(shlex.split(flags)))
    assert (opts.ngram, opts.threshold) == (6, 0.45)
    assert plan.completions() == [os.path.join("results", plan.run, "completions", f"{p}.jsonl")
                                  for p in plan.prompt_sets]
    # the defaults: on, 8-grams, 0.3
    assert (options.make("summary").ngram, options.make("summary").threshold) == (8, 0.3)
    assert "summary" not in json.loads(plan.expected_settings())  # evaluate's settings: never a loops option
