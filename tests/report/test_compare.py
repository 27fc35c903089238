"""Paired checkpoint comparisons (dflash_eval.report.compare): hand-built per-prompt taus whose interval is known."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from dflash_eval.replay.metrics import standard_error
from dflash_eval.report import compare as K
from dflash_eval.report.tau_table import summary_frame
from dflash_eval.stages.report import write_report
from dflash_eval.stages.summary import write_summary


def _eval(tmp_path, ckpt, step, samples, ps="humaneval", block=8, **extra):
    r = {"checkpoint": ckpt, "prompt_set": ps, "block_size": block, "step": step, "random_init": False,
         "device": "cpu", "dtype": "float32",
         "samples": [{"id": f"p{i}", "acceptance_lengths": s} for i, s in enumerate(samples)], **extra}
    p = tmp_path / f"{ckpt}-{ps}.json"
    p.write_text(json.dumps(r))
    return str(p)


def _compare(evals, **kw):
    return K.comparisons(evals, summary_frame(evals), **kw).set_index("checkpoint")


# per-prompt taus 1.5, 5/3, 3, 1 and a response without a verify step (left out of tau and of the pairing)
BASE = [[1, 2], [2, 2, 1], [3], [1, 1], []]


def test_identical_values_give_zero_and_a_tie(tmp_path):
    evals = [_eval(tmp_path, "a", 100, BASE), _eval(tmp_path, "b", 200, BASE)]
    c = _compare(evals)
    # the same taus: the best is the earlier step; b against it and against its previous (a): 0, interval [0, 0]
    assert c.loc["b", ["previous", "best", "n_paired_prev", "diff_prev", "lo_prev", "hi_prev"]].tolist() \
        == ["a", "a", 4, 0.0, 0.0, 0.0]
    assert c.loc["b", ["diff_best", "lo_best", "hi_best"]].tolist() == [0.0, 0.0, 0.0]
    assert c.loc["a", "verdict"] == "tied with b" and c.loc["b", "verdict"] == K.TIED_BEST
    assert pd.isna(c.loc["a", "previous"]) and pd.isna(c.loc["a", "n_paired_prev"]) and pd.isna(c.loc["a", "diff_best"])


def test_a_constant_shift_of_one_token_per_step_is_the_interval(tmp_path):
    """+1 committed token on every verify step of every prompt: every per-prompt tau +1, so every resample's
    difference is 1 and the interval is [1, 1]; the previous checkpoint is behind beyond noise."""
    up = [[n + 1 for n in s] for s in BASE]
    c = _compare([_eval(tmp_path, "a", 100, BASE), _eval(tmp_path, "b", 200, up)])
    assert c.loc["b", "tau"] - c.loc["a", "tau"] == pytest.approx(1.0, abs=1e-12)
    assert c.loc["b", ["diff_prev", "lo_prev", "hi_prev"]].tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-12)
    assert c.loc["a", ["diff_best", "lo_best", "hi_best"]].tolist() == pytest.approx([-1.0, -1.0, -1.0], abs=1e-12)
    assert (c.loc["b", "verdict"], c.loc["a", "verdict"]) == (K.AHEAD, K.BEHIND)


def test_pairing_separates_what_the_unpaired_standard_errors_cannot(tmp_path):
    """20 prompts with taus 1..5 (ten steps of k tokens each); the next checkpoint commits one extra token on one
    step of each odd prompt and on two steps of each even one: +0.2 / +0.1 per prompt. The unpaired 95% intervals
    tau +- 1.96 SE overlap widely (SE = sd(1..5 x 4) / sqrt(20) = 0.324), but every paired difference lies in
    [0.1, 0.2], so every resample's mean does: the paired interval excludes 0."""
    ks = [1 + i % 5 for i in range(20)]
    a = [[k] * 10 for k in ks]
    b = [[k] * (8 + i % 2) + [k + 1] * (2 - i % 2) for i, k in enumerate(ks)]
    c = _compare([_eval(tmp_path, "a", 100, a), _eval(tmp_path, "b", 200, b)])
    se = standard_error([float(k) for k in ks])
    assert c.loc["a", "tau_se"] == pytest.approx(se) == pytest.approx(math.sqrt(40 / 19 / 20))
    assert c.loc["a", "tau"] + 1.96 * c.loc["a", "tau_se"] > c.loc["b", "tau"] - 1.96 * c.loc["b", "tau_se"]
    diff, lo, hi = c.loc["b", ["diff_prev", "lo_prev", "hi_prev"]]
    assert diff == pytest.approx(0.15) and 0.1 - 1e-12 <= lo < diff < hi <= 0.2 + 1e-12
    assert c.loc["b", "verdict"] == K.AHEAD


def test_verdicts_name_the_ties_and_runs_keep_their_own_previous():
    """Three DFlash 1 checkpoints and one DFlash 2 one on 3 prompts (values by hand): c is best; a is behind on
    every prompt by 1..2 (c ahead of it beyond noise); b differs by -0.5 / +0.5 / -0.5 (tied); d (another run) ties
    too."""
    frame = pd.DataFrame({"checkpoint": ["a", "b", "c", "d"], "step": [1, 2, 3, 1], "prompt_set": "s",
                          "sampling": "T0", "draft": "reference", "n_samples": 3,
                          "variant": ["dflash", "dflash", "dflash", "dflash2"]})
    vals = {"a": [1.0, 1.0, 2.0], "b": [2.5, 3.5, 2.5], "c": [3.0, 3.0, 3.0], "d": [3.0, 3.0, 2.75]}
    frame["tau"] = [np.mean(vals[c]) for c in frame["checkpoint"]]
    frame["tau_se"] = math.nan
    values = pd.DataFrame([{"checkpoint": c, "prompt_set": "s", "sampling": "T0", "draft": "reference",
                            "sample": f"p{i}", "tau": v} for c, vs in vals.items() for i, v in enumerate(vs)])
    c = K.compare_frame(frame, values).set_index("checkpoint")
    assert c["best"].unique().tolist() == ["c"]
    assert c.loc["c", "verdict"] == "tied with b, d"
    assert c.loc["a", "verdict"] == K.BEHIND and c.loc["b", "verdict"] == K.TIED_BEST
    assert c.loc["a", "hi_best"] <= -1.0 and c.loc["a", "lo_best"] >= -2.0  # every prompt behind by 1 or 2
    assert c.index.tolist() == ["a", "b", "c", "d"]  # grouped by run: DFlash 1 by step, then DFlash 2
    assert c["previous"].fillna("").tolist() == ["", "a", "b", ""]  # d: its run's first
    # without d and b's tie: ahead beyond noise; a single checkpoint: the only one
    c2 = K.compare_frame(frame[frame["checkpoint"].isin(["a", "c"])], values).set_index("checkpoint")
    assert c2.loc["c", "verdict"] == K.AHEAD
    assert K.compare_frame(frame[frame["checkpoint"] == "a"], values)["verdict"].tolist() == [K.ONLY]
    tables = K.display_tables(K.compare_frame(frame, values))
    assert list(tables) == ["s"]
    t = tables["s"].set_index("checkpoint")
    assert t.loc["b", "vs previous"].startswith("+1.500 [") and t.loc["c", "vs best"] == ""
    assert t.loc["c", "verdict"] == "tied with b, d (few prompts (n = 3 < 10): interval not reliable)"


def test_bootstrap_is_seeded_and_close_to_the_normal_interval():
    """The same call twice gives the same interval; another seed another one. On 400 normal per-prompt differences
    (sd 1) the percentile interval and the normal-approximation paired interval mean +- 1.96 sd / sqrt(n) agree to
    0.25 SE: the Monte Carlo error of a 2.5% quantile of 2000 resamples is sqrt(0.025 * 0.975 / 2000) / phi(1.96)
    = 0.06 SE, and the bootstrap's n-denominator sd is 0.1% smaller, so 0.25 SE is four Monte Carlo errors."""
    d = np.random.default_rng(7).normal(0.3, 1.0, 400)
    zeros = np.zeros(400)
    first = K.paired_interval(d, zeros)
    assert K.paired_interval(d, zeros) == first and K.paired_interval(d, zeros, seed=1) != first
    diff, lo, hi, n = first
    se = d.std(ddof=1) / math.sqrt(n)
    assert n == 400 and diff == pytest.approx(d.mean())
    assert abs(lo - (diff - 1.96 * se)) < 0.25 * se and abs(hi - (diff + 1.96 * se)) < 0.25 * se
    assert K.paired_interval([1.0], [0.0])[:3] == (1.0, *[pytest.approx(math.nan, nan_ok=True)] * 2)
    assert K.paired_interval([math.nan, 2.0, 3.0], [1.0, math.nan, 1.0])[3] == 1  # NaN drops the prompt from both


def test_expected_rows_pair_their_expectations_and_the_summary_and_report_show_them(tmp_path):
    """A T > 0 row's per-prompt values are the expectations E[tau_r] (expected.<label>.samples[].tau); the summary
    writes tau_compare.csv and the report a "Checkpoints within noise" section."""
    st = [{"label": "T0", "temperature": 0.0}, {"label": "T1", "temperature": 1.0}]

    def exp(taus):  # the serialised ResponseExpectation fields (dflash_eval.replay.expected), block size 8
        return {"T1": {"samples": [None if t is None else {
            "tau": t, "tau_sglang": t, "steps": 1.0, "committed": 1, "histogram": [0.0] * 9, "slot_accepted": [0.0] * 8,
            "slot_compared": [0.0] * 8, "bin_tokens": [0.0] * 8, "bin_steps": [0.0] * 8} for t in taus]}}

    evals = [_eval(tmp_path, "a", 100, BASE, sampling_settings=st, expected=exp([1.25, 1.5, 2.0, 1.0, None])),
             _eval(tmp_path, "b", 200, BASE, sampling_settings=st, expected=exp([1.75, 2.0, 2.5, 1.5, None]))]
    v = K.sample_values(evals)
    assert v[(v["checkpoint"] == "b") & (v["sampling"] == "T1")]["tau"].tolist()[:4] == [1.75, 2.0, 2.5, 1.5]
    write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet", out_compare=tmp_path / "tau_compare.csv")
    csv = pd.read_csv(tmp_path / "tau_compare.csv")
    assert list(csv.columns) == K.COLUMNS
    t1 = csv[csv["sampling"] == "T1"].set_index("checkpoint")
    assert t1.loc["b", ["diff_prev", "lo_prev", "hi_prev"]].tolist() == [0.5, 0.5, 0.5]
    assert t1.loc["b", "verdict"] == K.AHEAD
    assert csv[csv["sampling"] == "T0"].set_index("checkpoint").loc["a", "verdict"] == "tied with b"
    write_report(tmp_path / "tau.csv", evals, [], tmp_path / "report.md", out_html=tmp_path / "report.html")
    md = (tmp_path / "report.md").read_text()
    assert "## Checkpoints within noise" in md and "### humaneval @ T1" in md
    assert "| b | 1.938 | +0.500 [+0.500, +0.500] |  | ahead beyond noise (few prompts (n = 4 < 10): interval not " \
           "reliable) |" in md
    html = (tmp_path / "report.html").read_text()
    assert 'id="noise"' in html and \
        '(<a href="#noise">tied with b (few prompts (n = 4 &lt; 10): interval not reliable)</a>)' in html


def test_few_prompts_are_flagged_and_ten_are_not():
    """The caution below MIN_PROMPTS = 10 paired prompts (Efron & Tibshirani 1993; DiCiccio & Efron 1996): a and b on
    9 prompts (b +1 on each: interval [1, 1], b ahead beyond noise) are flagged on both rows, the verdict kept; on 10
    prompts neither is. The best's row takes the fewest prompts of its comparisons: c shares 4 prompts with b."""
    def frame_values(vals):
        frame = pd.DataFrame({"checkpoint": list(vals), "step": range(1, len(vals) + 1), "prompt_set": "s",
                              "sampling": "T0", "draft": "reference", "n_samples": [len(v) for v in vals.values()]})
        frame["tau"] = [np.nanmean(v) for v in vals.values()]
        frame["tau_se"] = math.nan
        values = pd.DataFrame([{"checkpoint": c, "prompt_set": "s", "sampling": "T0", "draft": "reference",
                                "sample": f"p{i}", "tau": v} for c, vs in vals.items() for i, v in enumerate(vs)])
        return K.compare_frame(frame, values).set_index("checkpoint")

    few = "few prompts (n = 9 < 10): interval not reliable"
    c = frame_values({"a": [1.0] * 9, "b": [2.0] * 9})
    assert c.loc["b", ["diff_prev", "lo_prev", "hi_prev"]].tolist() == [1.0, 1.0, 1.0]
    assert c["verdict"].tolist() == [K.BEHIND, K.AHEAD] and c["caution"].tolist() == [few, few]
    assert K.caution(9) == few and K.caution(10) == "" and K.caution(pd.NA) == ""
    c10 = frame_values({"a": [1.0] * 10, "b": [2.0] * 10})
    assert c10["verdict"].tolist() == [K.BEHIND, K.AHEAD] and c10["caution"].tolist() == ["", ""]
    # c: 12 prompts, 4 of them shared with b (NaN elsewhere drops them from the pairing)
    c3 = frame_values({"a": [1.0] * 12, "b": [2.0] * 12, "c": [5.0] * 4 + [math.nan] * 8})
    assert c3.loc["a", "n_paired_best"] == 4 and c3.loc["c", "caution"] == "few prompts (n = 4 < 10): interval not reliable"
    assert c3.loc["b", "caution"] == c3.loc["a", "caution"] == c3.loc["c", "caution"]
    t = K.display_tables(c3.reset_index())["s"].set_index("checkpoint")
    assert t.loc["c", "verdict"] == "ahead beyond noise (few prompts (n = 4 < 10): interval not reliable)"
