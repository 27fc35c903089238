"""tau table and report: columns of the output contract, macro vs micro tau, rows without a step."""

from __future__ import annotations

import json

import pandas as pd

from dflash_eval.summary import COLUMNS, write_report, write_summary


def _eval(tmp_path, ckpt, ps, step, samples, block=8):
    hist = {str(k): 0 for k in range(1, block + 1)}
    for s in samples:
        for a in s:
            hist[str(a)] += 1
    steps = sum(len(s) for s in samples)
    tokens = sum(sum(s) for s in samples)
    r = {"checkpoint": ckpt, "prompt_set": ps, "block_size": block, "n_samples": len(samples), "n_skipped": 0,
         "tau": sum(sum(s) / len(s) for s in samples) / len(samples), "tau_tokens_per_step": tokens / steps,
         "verify_steps": steps, "committed_tokens": tokens, "histogram": hist, "step": step, "random_init": False,
         "device": "cpu", "dtype": "float32"}
    p = tmp_path / f"{ckpt}-{ps}.json"
    p.write_text(json.dumps(r))
    return str(p)


def test_summary_and_report(tmp_path):
    # two responses: [3, 1] (mean 2.0) and [1, 1, 1, 1] (mean 1.0): macro tau 1.5, micro 8/6
    evals = [_eval(tmp_path, "step100", "humaneval", 100, [[3, 1], [1, 1, 1, 1]]),
             _eval(tmp_path, "final", "humaneval", None, [[2, 2]])]
    df = write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet")
    assert list(df.columns) == COLUMNS
    row = df.set_index("checkpoint").loc["step100"]
    assert row["tau"] == 1.5 and abs(row["tau_tokens_per_step"] - 8 / 6) < 1e-12 and row["mean_accepted"] == 0.5
    assert pd.read_parquet(tmp_path / "tau.parquet").equals(df)
    assert pd.isna(df.set_index("checkpoint").loc["final", "step"])
    write_report(tmp_path / "tau.csv", evals, [], tmp_path / "report.md")
    text = (tmp_path / "report.md").read_text()
    assert "| step100 | 100 | 1.500 |" in text
    assert "| final |  | 2.000 |" in text  # a checkpoint without a step keeps its row
    assert "nan" not in text.split("## Full table")[0]
