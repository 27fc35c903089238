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
    # the speedup columns last, empty: no target costs (tests/test_report.py fills them)
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
    assert csv[1].startswith("step100,100,humaneval,T0,0.0000,1.0000,0,False,T0,2,1.5000,1.3333,0.5000,8,1,6,8,")
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


def test_tau_parquet_is_sealed_and_verified(tmp_path, monkeypatch, caplog):
    """The seventh trial's U1: tau.parquet (what the trackers log) edited after summary reached TensorBoard
    unchecked. summary seals it (schema metadata); read_parquet refuses an edit, and inside the workflow a
    file without the seal (rewritten by pandas, which drops it)."""
    import pyarrow.parquet as pq
    import pytest

    from dflash_eval.core.errors import InputError
    from dflash_eval.row_checksum import SEALED_ENV
    from dflash_eval.report.tau_table import PARQUET_SEAL, read_parquet
    from dflash_eval.trackers.log import read_table

    evals = [_eval(tmp_path, "step100", "humaneval", 100, [[3, 1], [1, 1, 1, 1]]),
             _eval(tmp_path, "final", "humaneval", None, [[2, 2]])]
    path = tmp_path / "tau.parquet"
    df = write_summary(evals, tmp_path / "tau.csv", path)
    assert read_parquet(path).equals(df) and read_table(path).equals(df)  # a round trip keeps the seal's values
    table = pq.read_table(path)
    assert len(table.schema.metadata[PARQUET_SEAL]) == 64
    edited = table.to_pandas()
    edited.loc[0, "tau"] = 1.9782
    import pyarrow as pa

    pq.write_table(pa.Table.from_pandas(edited, preserve_index=False).replace_schema_metadata(
        table.schema.metadata), tmp_path / "edited.parquet")  # the edit with the old seal kept
    for bad in (tmp_path / "edited.parquet",):
        with pytest.raises(InputError) as err:
            read_table(bad)
        assert Path(err.value.file) == bad and err.value.field == "dflash_eval.content_sha256"
        assert "changed after the summary stage wrote it" in err.value.problem and "--forcerun" in err.value.fix
    edited.to_parquet(tmp_path / "pandas.parquet", index=False)  # rewritten by pandas: no seal
    monkeypatch.delenv(SEALED_ENV, raising=False)
    with caplog.at_level("WARNING", logger="dflash_eval"):
        assert read_table(tmp_path / "pandas.parquet").loc[0, "tau"] == 1.9782  # a direct call: with a warning
    assert any("read unverified" in m and "pandas.parquet" in m for m in caplog.messages)
    monkeypatch.setenv(SEALED_ENV, "1")
    with pytest.raises(InputError, match="inside the workflow every tau.parquet is written and sealed"):
        read_table(tmp_path / "pandas.parquet")
    assert read_table(path).equals(df)


def test_trackers_refuse_a_table_that_is_not_the_runs(tmp_path, monkeypatch):
    """The eighth trial's S1: another run's tau.parquet (validly sealed) copied over the run's was logged to the
    run's TensorBoard, exit 0. The trackers stage compares the table with the run's evaluate outputs (as report
    does tau.csv): another run's rows, or an edited tau, log nothing."""
    import argparse

    import pytest

    from dflash_eval.core.errors import InputError
    from dflash_eval.stages import trackers as stage

    mine = [_eval(tmp_path, "ckA", "humaneval", 788, [[3, 1], [1, 1, 1, 1]]),
            _eval(tmp_path, "ckB", "humaneval", 3507, [[2, 2]])]
    (tmp_path / "other").mkdir()
    theirs = [_eval(tmp_path / "other", "ckX", "humaneval", 2000, [[1, 1]])]
    write_summary(mine, tmp_path / "tau.csv", tmp_path / "tau.parquet")
    write_summary(theirs, tmp_path / "x.csv", tmp_path / "x.parquet")
    monkeypatch.chdir(tmp_path)
    cfg = {"tensorboard": {"enabled": True}}

    def run(table, evals):
        args = argparse.Namespace(table=str(table), run="r", out=str(tmp_path / "trackers.json"), evals=evals,
                                  costs=None, run_settings=None)
        stage.main(args, cfg)
        return json.loads((tmp_path / "trackers.json").read_text())

    with pytest.raises(InputError) as err:
        run(tmp_path / "x.parquet", mine)
    assert err.value.field == "rows" and "x.parquet was edited, is stale or is another run's" in err.value.problem
    assert "--forcerun" in err.value.fix and not (tmp_path / "results").exists()  # nothing logged
    edited = pd.read_csv(tmp_path / "tau.csv")
    edited.loc[0, "tau"] += 0.25
    edited.to_csv(tmp_path / "edited.csv", index=False)
    with pytest.raises(InputError) as err:
        run(tmp_path / "edited.csv", mine)
    assert err.value.field == "tau" and "but summary makes 1.5000 of the run's evaluate outputs: edited.csv was edited" \
        in err.value.problem
    from dflash_eval.target.costs import with_speedups
    from dflash_eval.report.tau_table import check_table, summary_frame

    want = with_speedups(summary_frame(mine), None)
    check_table((tmp_path / "tau.csv").read_text(), "tau.csv", want)  # as summary wrote it
    pd.read_csv(tmp_path / "tau.csv").to_csv(tmp_path / "saved.csv", index=False)  # saved again: 0.0 for 0.0000
    check_table((tmp_path / "saved.csv").read_text(), "saved.csv", want)  # the same values: accepted
    # the tenth trial's F5: another run's tau.parquet of the same evaluate outputs but other target costs (its
    # speedup columns) was logged; with the run's target_costs.json (the workflow passes it) every cell is compared
    from test_report import fake_costs

    ours, other = (tmp_path / "ours").mkdir() or tmp_path / "ours", (tmp_path / "other2").mkdir() or tmp_path / "other2"
    for folder, decode_s in ((ours, 0.010), (other, 0.012)):
        c = json.loads(Path(fake_costs(folder)).read_text())
        c["decode_s"] = decode_s
        c["drafters"] = {k: {**c["drafters"]["early"], "block_size": 8} for k in ("ckA", "ckB")}
        c["verify"].append({"n": 8, "mask": "causal", "median_s": 0.018})  # block size 8
        (folder / "target_costs.json").write_text(json.dumps(c))
        write_summary(mine, folder / "tau.csv", folder / "tau.parquet", costs=str(folder / "target_costs.json"))
    args = argparse.Namespace(table=str(other / "tau.parquet"), run="r-other", out=str(tmp_path / "t.json"), evals=mine,
                              costs=str(ours / "target_costs.json"), run_settings=None)
    with pytest.raises(InputError) as err:
        stage.main(args, cfg)
    assert err.value.field == "speedup_chain" and "of the run's evaluate outputs and target costs" in err.value.problem
    assert pd.read_parquet(ours / "tau.parquet")["speedup_chain"].notna().all()
    args.costs, args.run = None, "r-other"  # without the costs (target_costs disabled): speedups not compared
    stage.main(args, cfg)
    args.table, args.costs, args.run = str(ours / "tau.parquet"), str(ours / "target_costs.json"), "r-ours"
    stage.main(args, cfg)
    assert run(tmp_path / "tau.parquet", mine)["tensorboard"]["logged"] > 0
    rule = (Path(__file__).resolve().parents[1] / "rules" / "trackers.smk").read_text()
    assert "--evals {input.evals:q}" in rule  # the workflow always compares
    assert "costs=PLAN.target_costs_outputs()" in rule and "PLAN.summary_args(input.get(\"costs\", [])" in rule
