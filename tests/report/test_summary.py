"""tau table and report: the output contract, recomputed from per-sample acceptance, rows without a step."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from dflash_eval.stages.report import write_report
from dflash_eval.stages.summary import write_summary
from dflash_eval.report.tau_table import COLUMNS, VARIANT_COLUMNS, slot_columns


def _eval(tmp_path, ckpt, ps, step, samples, block=8):
    # evaluate's JSON with per-sample acceptance only; the aggregates below are deliberately wrong:
    # the table must be recomputed from the samples, never copied from these fields.
    r = {"checkpoint": ckpt, "prompt_set": ps, "block_size": block, "tau": -1.0, "tau_tokens_per_step": -1.0,
         "n_samples": -1, "histogram": {}, "step": step, "random_init": False, "device": "cpu", "dtype": "float32",
         "samples": [{"id": str(i), "acceptance_lengths": s} for i, s in enumerate(samples)]}
    p = tmp_path / f"{ckpt}-{ps}.json"
    p.write_text(json.dumps(r))
    return str(p)


def test_summary_and_report(tmp_path):
    # two responses: [3, 1] (mean 2.0) and [1, 1, 1, 1] (mean 1.0): macro tau 1.5, micro 8/6; one skipped
    evals = [_eval(tmp_path, "step100", "humaneval", 100, [[3, 1], [1, 1, 1, 1], []]),
             _eval(tmp_path, "final", "humaneval", None, [[2, 2]])]
    df = write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet")
    # the speedup columns last, empty: no target costs (tests/report/test_report.py fills them)
    assert list(df.columns) == COLUMNS + slot_columns(8) + VARIANT_COLUMNS + ["speedup_chain", "estimate_reliable"]
    row = df.set_index("checkpoint").loc["step100"]
    assert row["tau"] == 1.5 and abs(row["tau_tokens_per_step"] - 8 / 6) < 1e-12 and row["mean_accepted"] == 0.5
    assert row["tau_sglang"] == (5 / 2 + 5 / 4) / 2  # (1 + 4) / 2 steps and (1 + 4) / 4 steps
    # [3, 1]: slots 1, 2 accepted then slot 3 refused (3 < 5 left), last step censored; [1, 1, 1, 1]:
    # slot 1 refused three times, the last step censored
    assert (row["accept_slot_1"], row["accept_slot_2"], row["accept_slot_3"]) == (1 / 4, 1.0, 0.0)
    assert pd.isna(row["accept_slot_4"])
    assert row["tau_pos_0_64"] == 8 / 6 and pd.isna(row["tau_pos_64_128"])
    assert (row["n_samples"], row["n_skipped"], row["verify_steps"], row["committed_tokens"]) == (2, 1, 6, 8)
    assert pd.read_parquet(tmp_path / "tau.parquet").equals(df)
    assert pd.isna(df.set_index("checkpoint").loc["final", "step"])
    csv = (tmp_path / "tau.csv").read_text().splitlines()
    assert csv[1].startswith("step100,100,humaneval,T0,reference,0.0000,1.0000,0,False,T0,dflash 0.1.0 "
                             "dflash_generate; vLLM (any draft_sample_method),2,1.5000,1.3333,0.5000,8,1,6,8,")
    write_report(tmp_path / "tau.csv", evals, [], tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    assert "| step100 | 100 | 1.500 |" in text
    assert "| final |  | 2.000 |" in text  # a checkpoint without a step keeps its row
    assert "nan" not in text.split("## Full table")[0]
    # histogram fractions of step100: 5 of 6 steps committed 1 token, 1 of 6 committed 3
    assert "`step100` / `humaneval`: 1:0.83 3:0.17" in text


def test_tau_by_prompt_length_bins(tmp_path):
    ev = json.loads(open(_eval(tmp_path, "step1", "long", 1, [[3, 1], [1, 1, 1, 1], [2, 2]])).read())
    for s, n in zip(ev["samples"], [100, 300, 9000]):
        s["prompt_len"] = n
    p = tmp_path / "long.json"
    p.write_text(json.dumps(ev))
    row = write_summary([str(p)], tmp_path / "t.csv", tmp_path / "t.parquet").iloc[0]
    assert (row["tau_prompt_0_128"], row["n_prompt_0_128"]) == (2.0, 1)
    assert (row["tau_prompt_256_512"], row["n_prompt_256_512"]) == (1.0, 1)
    assert (row["tau_prompt_8192_16384"], row["n_prompt_8192_16384"]) == (2.0, 1)
    assert pd.isna(row["tau_prompt_128_256"]) and row["n_prompt_128_256"] == 0
    # evaluate outputs without prompt_len (older): the bins stay empty
    old = write_summary([_eval(tmp_path, "s2", "x", 2, [[2]])], tmp_path / "u.csv", tmp_path / "u.parquet").iloc[0]
    assert pd.isna(old["tau_prompt_0_128"]) and old["n_prompt_0_128"] == 0


def test_standard_errors_and_trained_length_columns(tmp_path):
    """tau_se over prompts (taus 1.0, 2.0, 3.0 -> 1/sqrt(3)), se_prompt_<lo>_<hi> per bin, trained_max_len from the
    evaluate output and n_beyond_trained (prompts of at least that many tokens); empty where unknown."""
    ev = json.loads(open(_eval(tmp_path, "step1", "ctx", 1, [[1, 1], [2, 2], [3, 3, 3], []])).read())
    for s, n in zip(ev["samples"], [300, 400, 700, 5000]):
        s["prompt_len"] = n
    ev["trained_max_len"] = 640
    p = tmp_path / "ctx.json"
    p.write_text(json.dumps(ev))
    df = write_summary([str(p)], tmp_path / "t.csv", tmp_path / "t.parquet")
    row = df.iloc[0]
    assert row["tau"] == 2.0 and abs(row["tau_se"] - 3 ** -0.5) < 1e-12
    # bin 256-512: taus 1.0 and 2.0 -> sd sqrt(0.5), SE 0.5; bin 512-1024: one response -> no SE
    assert (row["tau_prompt_256_512"], row["n_prompt_256_512"], row["se_prompt_256_512"]) == (1.5, 2, 0.5)
    assert row["n_prompt_512_1024"] == 1 and pd.isna(row["se_prompt_512_1024"])
    assert row["trained_max_len"] == 640 and row["n_beyond_trained"] == 1  # 700 >= 640; 5000 has no verify step
    assert str(df["trained_max_len"].dtype) == "Int64"
    csv = pd.read_csv(tmp_path / "t.csv")
    assert csv.loc[0, "tau_se"] == 0.5774 and csv.loc[0, "se_prompt_256_512"] == 0.5
    i = list(df.columns).index("se_prompt_32768_inf")  # after the prompt-length bins, before the slot columns
    assert list(df.columns[i + 1:i + 8]) == ["tau_se", "trained_max_len", "n_beyond_trained", "n_loop", "tau_noloop",
                                             "tau_noloop_se", "accept_slot_1"]
    old = write_summary([_eval(tmp_path, "s2", "x", 2, [[2]])], tmp_path / "u.csv", tmp_path / "u.parquet").iloc[0]
    assert pd.isna(old["trained_max_len"]) and pd.isna(old["n_beyond_trained"]) and pd.isna(old["tau_se"])


def _with_settings(path, **options):
    """An evaluate output ``path`` with the provenance block evaluate writes, made with the evaluate ``options``."""
    from dflash_eval.core import options as options_mod
    from dflash_eval.data.provenance import stage_block

    r = json.loads(Path(path).read_text())
    r["provenance"] = stage_block("evaluate", options_mod.make("evaluate", **options))
    Path(path).write_text(json.dumps(r))
    return path


def _expected(prompt_sets, **options) -> dict:
    """What rule summary passes (--expected-settings) for a config whose evaluate section holds ``options``."""
    from dflash_eval.data.provenance import settings_of

    return {"evaluate": {p: settings_of("evaluate", {"ddtree_budgets": [], **options}) for p in prompt_sets}}


def test_summary_refuses_outputs_of_other_settings_naming_the_fix(tmp_path):
    """Results copied without .snakemake/ (Snakemake's params trigger then sees no change), then an option changed:
    an evaluate output made with the old value is refused at summary, naming the file, the option, both values and
    the fix; outputs of this config's settings pass, and the tables record them (tau.provenance.json, parquet)."""
    import pyarrow.parquet as pq
    import pytest

    from dflash_eval.core.errors import InputError
    from dflash_eval.report.tau_table import PARQUET_PROVENANCE

    old = _with_settings(_eval(tmp_path, "ckA", "humaneval", 100, [[3, 1]]), ddtree_budgets=[], max_samples=4)
    new = _with_settings(_eval(tmp_path, "ckB", "humaneval", 200, [[2, 2]]), ddtree_budgets=[], max_samples=8)
    expected = _expected(["humaneval"], max_samples=8)
    with pytest.raises(InputError) as err:
        write_summary([old, new], tmp_path / "tau.csv", tmp_path / "tau.parquet", expected=expected)
    assert Path(err.value.file) == Path(old) and err.value.field == "provenance.settings.evaluate.max_samples"
    assert "evaluate.max_samples = 4, but the config now gives 8" in err.value.problem
    assert "snakemake --forcerun evaluate" in err.value.fix and not (tmp_path / "tau.csv").exists()
    bare = _eval(tmp_path, "ckC", "humaneval", 300, [[2, 2]])  # no provenance block: an earlier version's output
    with pytest.raises(InputError, match="records no evaluate settings"):
        write_summary([bare], tmp_path / "tau.csv", tmp_path / "tau.parquet", expected=expected)

    write_summary([new], tmp_path / "tau.csv", tmp_path / "tau.parquet", expected=expected,
                  out_provenance=tmp_path / "tau.provenance.json")
    prov = json.loads((tmp_path / "tau.provenance.json").read_text())
    # with summary's own settings (config section loops, the schema's defaults here)
    assert prov["settings"] == {**expected, "summary": {"run": {"ngram": 8, "threshold": 0.3}}}
    assert prov["stage"] == "summary" and list(prov["inputs_sha256"]) == [new]
    assert set(prov["dflash_eval"]) == {"version", "commit", "dirty"} and "python" in prov["packages"]
    meta = pq.read_table(tmp_path / "tau.parquet").schema.metadata[PARQUET_PROVENANCE]
    assert json.loads(meta) == prov
    write_summary([old], tmp_path / "x.csv", tmp_path / "x.parquet")  # a direct call without settings: not compared


def test_the_workflow_passes_the_configs_settings_to_summary():
    """Rule summary's params.expected is the settings each evaluate job records: the same options, parsed back from
    the flags the rule passes, give the same values (so an unchanged config is never refused)."""
    import argparse
    import shlex

    import yaml

    from dflash_eval.core import options
    from dflash_eval.workflow.plan import build_plan
    from dflash_eval.data.provenance import settings_of

    repo = Path(__file__).resolve().parents[2]
    rule = (repo / "rules" / "evaluate.smk").read_text()
    assert "expected=PLAN.expected_settings()" in rule and "--expected-settings {params.expected:q}" in rule
    from snakemake.utils import validate

    cfg = yaml.safe_load((repo / "config" / "config.yaml").read_text())
    cfg["evaluate"] = {"ddtree_budgets": [2, 8], "cross_temperature": True,
                       "sampling": [{"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}]}
    validate(cfg, str(repo / "config" / "schemas" / "config.schema.yaml"))
    import os

    cwd = os.getcwd()
    os.chdir(repo)
    try:
        plan = build_plan(cfg)
    finally:
        os.chdir(cwd)
    expected = json.loads(plan.expected_settings())
    for stage, keys in expected.items():
        for key, want in keys.items():
            parser = argparse.ArgumentParser()
            options.add_flags(parser, stage)
            args = parser.parse_args(shlex.split(plan.stage_flags(stage, None if key == "run" else key)))
            assert settings_of(stage, options.from_args(stage, args)) == want, (stage, key)


def test_a_table_of_other_settings_is_named_at_parse_time(tmp_path):
    """Without .snakemake/metadata an option changed reruns nothing at all, not even summary: the parse compares
    tau.provenance.json with the config and names the option and the fix."""
    from dflash_eval.data.provenance import stale_table_note

    new = _with_settings(_eval(tmp_path, "ckB", "humaneval", 200, [[2, 2]]), ddtree_budgets=[], max_samples=8)
    write_summary([new], tmp_path / "tau.csv", tmp_path / "tau.parquet", expected=_expected(["humaneval"], max_samples=8),
                  out_provenance=tmp_path / "tau.provenance.json")
    assert stale_table_note(tmp_path, _expected(["humaneval"], max_samples=8)) is None
    assert stale_table_note(tmp_path, _expected(["humaneval", "chat"], max_samples=8)) is None  # a new set: it runs
    note = stale_table_note(tmp_path, _expected(["humaneval"], max_samples=2))
    assert "provenance.settings.evaluate.max_samples" in note and "= 8, but the config now gives 2" in note
    assert "snakemake --forcerun evaluate" in note
    assert stale_table_note(tmp_path / "none", _expected(["humaneval"])) is None


def test_provenance_names_the_commit_of_the_checkout_it_runs_from():
    """Every output's provenance block (and so the report) carries the git commit of the checkout the package runs
    from: the tests run from one."""
    import subprocess
    from pathlib import Path

    from dflash_eval.data.provenance import code_version

    repo = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    got = code_version()
    assert got["commit"] == head and got["dirty"] in (True, False)
