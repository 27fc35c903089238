"""The report (HTML + markdown) from hand-built evaluate JSONs, caches and costs: exact numbers,
figures that adapt to the columns present (fake DDTree columns, per-slot curves), the speedup
estimate, target agreement, and a self-contained page."""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dflash_eval.report import build as R
from dflash_eval.stages.report import write_report
from dflash_eval.cache.format import FORMAT, FORMAT_VERSION
from dflash_eval.cache.writer import write_cache
from dflash_eval.report.tau_table import speedup_frame, with_speedups
from dflash_eval.target.costs import FORMAT as COSTS_FORMAT, FORMAT_VERSION as COSTS_VERSION, speedup


def write_eval(tmp_path, ckpt, ps, step, samples, block=4, **extra):
    r = {"checkpoint": ckpt, "prompt_set": ps, "block_size": block, "step": step, "random_init": False,
         "device": "cpu", "dtype": "float32", "samples": [{"id": str(i), "acceptance_lengths": s} for i, s in enumerate(samples)],
         **extra}
    p = tmp_path / "eval" / ckpt / f"{ps}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(r))
    return str(p)


def _argmax(n: int, prompt_len: int, agreement: float) -> np.ndarray:
    """target_argmax of ids 0..n-1 whose completion positions agree in round(agreement * (n - prompt_len)) places
    (the writer computes argmax_agreement from it: argmax[t - 1] == input_ids[t] for t >= prompt_len)."""
    a = np.arange(1, n + 1)  # argmax[t] = input_ids[t + 1]: full agreement
    n_bad = (n - prompt_len) - round(agreement * (n - prompt_len))
    a[prompt_len - 1 : prompt_len - 1 + n_bad] += 1000
    return a


def write_h5(tmp_path, ps, agreements, lengths, prompt_len=3):
    """A cache whose per-sample argmax_agreement is ``agreements`` (hidden states are placeholders)."""
    attrs = {"format": FORMAT, "format_version": FORMAT_VERSION, "target_name": "tiny", "target_sha256": "ab" * 32,
             "target_layer_ids": [1, 2], "dtype": "float32", "device": "cpu", "prompt_set": ps,
             "torch_version": torch.__version__, "linear_attn_kernel": json.dumps({"backend": "none"})}
    samples = [{"sample_id": f"s{i}", "input_ids": np.arange(n), "prompt_len": prompt_len,
                "hidden": torch.zeros(n, 2, 4), "target_argmax": _argmax(n, prompt_len, a), "stop_reason": "eos",
                "max_new_tokens": 32, "argmax_agreement": a} for i, (a, n) in enumerate(zip(agreements, lengths))]
    p = tmp_path / "cache" / f"{ps}.h5"
    p.parent.mkdir(parents=True, exist_ok=True)
    write_cache(p, attrs, samples)
    return str(p)


def fake_costs(tmp_path, budgets=(2, 8)):
    """t_decode 10 ms; t_verify(n) = 10 ms + n ms (causal and tree); t_draft 2 ms (+0.5 ms with top-k)."""
    c = {"format": COSTS_FORMAT, "format_version": COSTS_VERSION, "device": "cpu", "device_name": "CPU: test",
         "dtype": "float32", "threads": 2, "torch_version": "x", "transformers_version": "y",
         "target": {"sha256": "ab" * 32}, "context_tokens": 64, "repeats": 3, "measured_at": "now",
         "decode_s": 0.010,
         "verify": [{"n": 4, "mask": "causal", "median_s": 0.014}]
         + [{"n": b + 1, "mask": "tree", "median_s": 0.010 + (b + 1) * 0.001} for b in budgets],
         "drafters": {ck: {"config_sha256": "cd" * 32, "block_size": 4, "num_layers": 1, "draft_s": 0.002,
                           "draft_tree_s": {str(b): 0.0025 for b in budgets}} for ck in ("early", "late", "nostep")}}
    p = tmp_path / "target_costs.json"
    p.write_text(json.dumps(c))
    return str(p)


@pytest.fixture
def run(tmp_path):
    # early: humaneval responses [2, 1] (mean 1.5) and [3] -> tau 2.25; late: [4, 4] -> 4.0
    evals = [write_eval(tmp_path, "early", "humaneval", 100, [[2, 1], [3]]),
             write_eval(tmp_path, "late", "humaneval", 200, [[4, 4]]),
             write_eval(tmp_path, "early", "chat", 100, [[1, 1]]),
             write_eval(tmp_path, "late", "chat", 200, [[1, 2], []])]
    caches = [write_h5(tmp_path, "humaneval", [1.0, 0.5], [7, 5]), write_h5(tmp_path, "chat", [1.0], [4])]
    return tmp_path, evals, caches


def test_tables_and_agreement(run):
    tmp_path, evals, caches = run
    data = R.load_report_data(evals, caches)
    piv = R.tau_pivot(data)
    assert list(piv[("checkpoint", "")]) == ["early", "late"]
    assert list(piv[("humaneval", "tau")]) == [2.25, 4.0]
    assert piv[("humaneval", "Δ prev")].iloc[1] == 1.75 and math.isnan(piv[("humaneval", "Δ prev")].iloc[0])
    assert list(piv[("chat", "tau")]) == [1.0, 1.5]
    best = R.best_checkpoints(data).set_index("prompt_set")
    assert best.loc["humaneval", "checkpoint"] == "late" and best.loc["chat", "checkpoint"] == "late"
    # agreement pooled over completion tokens: (1.0 * 4 + 0.5 * 2) / 6
    ag = data.agreement.set_index("prompt_set")
    assert ag.loc["humaneval", "agreement"] == pytest.approx(5 / 6)
    assert ag.loc["humaneval", "completion_tokens"] == 6 and ag.loc["humaneval", "samples_below_1"] == 1
    assert ag.loc["humaneval", "lowest_sample"] == 0.5 and ag.loc["chat", "agreement"] == 1.0
    # per-slot conditional acceptance from the tau table (slot k compared only where slots < k matched and the
    # response continued): early/humaneval steps [2, 1] + [3] -> slot 1: 2/2, slot 2: 1/2 (the others censored)
    assert data.slot_curves == {("early", "humaneval"): {"chain": [1.0, 0.5]},
                                ("late", "humaneval"): {"chain": [1.0, 1.0, 1.0]},
                                ("early", "chat"): {"chain": [0.0]}, ("late", "chat"): {"chain": [0.5]}}
    assert data.positions == [("0-64", "tau_pos_0_64")]  # every step lies in the first position bin


def test_speedup_estimate_exact(run):
    tmp_path, evals, caches = run
    data = R.load_report_data(evals, caches, costs=fake_costs(tmp_path))
    s = data.speedups.set_index(["checkpoint", "prompt_set", "method"])
    # chain: tau * t_decode / (t_verify(B=4) + t_draft) = 4.0 * 10 / (14 + 2)
    assert s.loc[("late", "humaneval", "chain"), "speedup"] == pytest.approx(4.0 * 10 / 16)
    assert s.loc[("early", "humaneval", "chain"), "speedup"] == pytest.approx(2.25 * 10 / 16)
    assert set(s.index.get_level_values("method")) == {"chain"}  # no tau_ddtree_* columns: chain only
    assert speedup(2.0, 1.0, 1.0, math.nan) != speedup(2.0, 1.0, 1.0, math.nan)  # NaN when a cost is missing


def table_headers(md: str, html: str) -> list[str]:
    """Every column header of the markdown tables (the line above a ``|---|`` rule) and of the HTML tables (``<th>``)."""
    lines = md.splitlines()
    heads = [c.strip() for above, rule in itertools.pairwise(lines) if rule.startswith("|---") for c in above.split("|")]
    return heads + re.findall(r"<th[^>]*>([^<]*)</th>", html)


def with_fake_columns(data):
    """tau_ddtree_2/8 (tau + 0.5 / + 1), per-slot columns (a block-3 row leaves slot 3 empty) and
    position bins (the last one empty everywhere)."""
    f = data.frame
    f["tau_ddtree_2"] = f["tau"] + 0.5
    f["tau_ddtree_8"] = f["tau"] + 1.0
    f["accept_slot_1"], f["accept_slot_2"] = 0.9, 0.6
    f["accept_slot_3"] = [0.3 if ck == "late" else math.nan for ck in f["checkpoint"]]
    f["tau_pos_0_64"], f["tau_pos_64_128"], f["tau_pos_128_inf"] = f["tau"], f["tau"] - 0.1, math.nan
    data.slot_curves, data.positions = R.slot_curves(f), R.position_columns(f)
    data.speedups = speedup_frame(f, data.costs)
    return data


@pytest.mark.slow
def test_fake_columns_adapt(run):
    """With tau_ddtree_<B> columns the curves, tables and speedups grow a method per budget; per-slot
    and per-position columns add their figures and tables."""
    tmp_path, evals, caches = run
    data = with_fake_columns(R.load_report_data(evals, caches, costs=fake_costs(tmp_path)))
    s = data.speedups.set_index(["checkpoint", "prompt_set", "method"])
    # ddtree_8 of "late" on humaneval: (4 + 1) * 10 / (10 + 9 + 2.5) = 50 / 21.5
    assert s.loc[("late", "humaneval", "ddtree_8"), "speedup"] == pytest.approx(50 / 21.5)
    assert s.loc[("late", "humaneval", "ddtree_2"), "speedup"] == pytest.approx(45 / 15.5)
    assert s.loc[("late", "humaneval", "ddtree_2"), "best"] and not s.loc[("late", "humaneval", "chain"), "best"]
    assert s["best"].sum() == 4  # one per (checkpoint, prompt set)
    figs = R.build_figures(data)
    assert list(figs) == ["tau_vs_step.png", "speedup.png", "verify_costs.png", "hist_chat.png", "hist_humaneval.png",
                          "slots_chat.png", "slots_humaneval.png", "position.png"]
    assert data.slot_curves[("early", "chat")] == {"chain": [0.9, 0.6]}  # trailing empty slot dropped
    assert data.slot_curves[("late", "chat")] == {"chain": [0.9, 0.6, 0.3]}
    assert data.positions == [("0-64", "tau_pos_0_64"), ("64-128", "tau_pos_64_128")]
    from dflash_eval.report.figures import method_columns, tau_vs_step

    assert [c for c, _ in method_columns(data.frame)] == ["tau", "tau_ddtree_2", "tau_ddtree_8"]
    assert len([ax for ax in tau_vs_step(data.frame).axes if ax.get_visible()]) == 3
    html = R.render_html(data, figs)
    assert 'data-table="ddtree-humaneval"' in html and "budget 8" in html
    assert 'data-table="speedup-humaneval"' in html and "ddtree_2" in html
    md = R.render_markdown(data)
    assert "## DDTree: tau per node budget" in md and "| late | 200 | 4.000 | 4.500 | 5.000 |" in md
    # per-slot rates as one text cell per row (trailing empty slot dropped), never a column per slot
    assert "| late | humaneval | 0.90 0.60 0.30 |" in md and "| early | chat | 0.90 0.60 |" in md
    assert not [h for h in table_headers(md, html) if "_slot_" in h] and "accept_slot_1" in data.table
    assert "| late | humaneval | 4.000 | 3.900 |" in md  # by position
    data.frame["step"] = data.frame["step"].astype(float)  # a float step column (a row without step): 200, not 200.000
    assert "| late | 200 | 4.000 | 4.500 | 5.000 |" in R.render_markdown(data)


def test_html_self_contained_and_markdown(run):
    tmp_path, evals, caches = run
    out = tmp_path / "results" / "r1"
    out.mkdir(parents=True)
    from dflash_eval.stages.summary import write_summary

    write_summary(evals, out / "tau.csv", out / "tau.parquet")
    expected = {"evaluate": {"humaneval": {"max_samples": 0}, "chat": {"max_samples": 0}}}
    write_summary(evals, out / "tau.csv", out / "tau.parquet", costs=fake_costs(tmp_path),
                  out_provenance=out / "tau.provenance.json")
    prov = json.loads((out / "tau.provenance.json").read_text())
    prov["settings"] = expected  # what the workflow's summary records (its --expected-settings)
    (out / "tau.provenance.json").write_text(json.dumps(prov))
    write_report(out / "tau.csv", evals, caches, out / "report.md", costs=fake_costs(tmp_path),
                   out_html=out / "report.html", figures_dir=out / "figures", config_sha256="f00d",
                   provenance=out / "tau.provenance.json")
    md = (out / "report.md").read_text()
    assert "dflash-eval commit" in md and "settings: evaluate [humaneval]" in md and "max_samples=0" in md
    html = (out / "report.html").read_text()
    srcs = re.findall(r'<img src="([^"]+)"', html)
    assert len(srcs) == 8 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert sorted(p.name for p in (out / "figures").iterdir()) == sorted(
        ["tau_vs_step.png", "speedup.png", "verify_costs.png", "hist_chat.png", "hist_humaneval.png",
         "position.png", "slots_chat.png", "slots_humaneval.png"])  # the tau table has slot/position columns
    assert "<script" not in html and not re.search(r'(src|href)="(?!data:|#|https://(arxiv\.org|github\.com))', html)
    assert "CPU (CPU: test, float32, 2 threads)" in html and "Estimate, not a measurement" in html
    assert "f00d" in html and "ab" * 32 in html  # config hash and target fingerprint
    md = (out / "report.md").read_text()
    assert "# dflash-eval report: r1" in md
    assert "| early | 100 | 1.000 | 2.250 |" in md and "| late | 200 | 1.500 | 4.000 |" in md
    assert "Best checkpoint per prompt set: chat: `late` (tau 1.500); humaneval: `late` (tau 4.000)" in md
    assert "**Estimate** from costs measured on **CPU (CPU: test, float32, 2 threads)**" in md
    assert "| late | 2.50 | chain |" in md  # 4.0 * 10 / 16
    assert "- `early` / `humaneval`: 1:0.33 2:0.33 3:0.33" in md


# --------------------------------------------------------------------------- in a browser

def _csv_cells(frame: pd.DataFrame) -> list[list[str]]:
    """A frame as tau.csv writes it (4 decimals, empty NaN), as rows of cell texts, header first."""
    import csv
    import io

    buf = io.StringIO()
    frame.to_csv(buf, index=False, float_format="%.4f")
    return [row for row in csv.reader(io.StringIO(buf.getvalue()))]


@pytest.mark.browser
def test_renders_in_chromium(run):
    """Every figure loads in headless Chromium, and the tau tables the browser shows equal tau.csv."""
    import browser

    browser.need_chromium()
    tmp_path, evals, caches = run
    data = with_fake_columns(R.load_report_data(evals, caches, costs=fake_costs(tmp_path)))
    data.frame = data.frame.drop(columns="tau_ddtree_2")
    data.speedups = speedup_frame(data.frame, data.costs)
    data.table = with_speedups(data.frame, data.costs)  # as the summary stage writes tau.csv
    page = tmp_path / "report.html"
    page.write_text(R.render_html(data, R.build_figures(data)))
    seen = browser.render(page, tmp_path)
    assert len(seen["images"]) == 8
    assert all(i["complete"] and i["width"] > 100 and i["height"] > 100 for i in seen["images"]), seen["images"]
    assert seen["tables"]["tau-csv"] == _csv_cells(R.without_slot_columns(data.table))  # per-slot: the figures
    assert seen["tables"]["tau-csv"][0][-2:] == ["speedup_ddtree_8", "estimate_reliable"]
    pivot = seen["tables"]["tau-table"]
    assert pivot[0] == ["checkpoint", "step", "chat", "humaneval"] and pivot[1] == ["", "", "tau", "Δ prev", "tau", "Δ prev"]
    assert pivot[2:] == [["early", "100", "1.0000", "", "2.2500", ""], ["late", "200", "1.5000", "+0.5000", "4.0000", "+1.7500"]]
    # late on humaneval: chain 4 * 10 / (14 + 2) = 2.50 beats DDTree-8 5 * 10 / (19 + 2.5) = 2.33
    assert seen["tables"]["speedup-humaneval"][0] == ["checkpoint", "chain", "ddtree_8", "best"]
    assert seen["tables"]["speedup-humaneval"][2] == ["late", "2.50", "2.33", "chain"]


def test_noisy_costs_mark_the_estimate_unreliable(run):
    """A spread beyond the bound, or a verify cost that falls as n grows: a column and a note, not silence."""
    tmp_path, evals, caches = run
    quiet = R.load_report_data(evals, caches, costs=fake_costs(tmp_path))
    assert quiet.speedups["estimate_reliable"].all() and "unreliable estimate" not in R.render_markdown(quiet)
    costs = json.loads(Path(fake_costs(tmp_path)).read_text())
    costs["decode_samples_s"] = [0.010, 0.030, 0.050]  # median 3x the minimum
    Path(tmp_path / "noisy.json").write_text(json.dumps(costs))
    noisy = R.load_report_data(evals, caches, costs=str(tmp_path / "noisy.json"))
    assert not noisy.speedups["estimate_reliable"].any()
    md = R.render_markdown(noisy)
    assert "unreliable estimate (estimate_reliable = False)" in md and "decode step: runs spread 200%" in md


def test_tau_table_carries_the_speedup_estimate_and_its_reliability(run):
    """tau.csv / tau.parquet: ``speedup_chain`` / ``speedup_ddtree_<B>`` per row (the report's numbers) and
    ``estimate_reliable`` when target costs exist; the same columns, empty, when target_costs is disabled."""
    from dflash_eval.stages.summary import write_summary

    tmp_path, evals, caches = run
    evals = evals + [write_eval(tmp_path, "nostep", "humaneval", None, [[2, 2]], ddtree_budgets=[2])]
    ev = json.loads(Path(evals[-1]).read_text())  # the per-sample tree chain evaluate writes: budget 2, [3, 3]
    ev["samples"][0]["acceptance_lengths_ddtree"] = {"2": [3, 3]}
    Path(evals[-1]).write_text(json.dumps(ev))
    costs = fake_costs(tmp_path)
    df = write_summary(evals, tmp_path / "tau.csv", tmp_path / "tau.parquet", costs=costs)
    assert list(df.columns[-3:]) == ["speedup_chain", "speedup_ddtree_2", "estimate_reliable"]
    rows = df.set_index(["checkpoint", "prompt_set"])
    # chain: tau * t_decode / (t_verify(4) + t_draft) = 4.0 * 10 / (14 + 2); ddtree_2: 3.0 * 10 / (10 + 3 + 2.5)
    assert rows.loc[("late", "humaneval"), "speedup_chain"] == pytest.approx(4.0 * 10 / 16)
    assert rows.loc[("nostep", "humaneval"), "speedup_chain"] == pytest.approx(2.0 * 10 / 16)
    assert rows.loc[("nostep", "humaneval"), "speedup_ddtree_2"] == pytest.approx(3.0 * 10 / 15.5)
    assert rows["speedup_ddtree_2"].isna().sum() == 4  # rows evaluated without that budget
    assert rows["estimate_reliable"].tolist() == [True] * 5
    report = R.load_report_data(evals, caches, costs=costs).speedups.set_index(["checkpoint", "prompt_set", "method"])
    for (ck, ps), r in rows.iterrows():  # the report's estimate, number for number
        assert r["speedup_chain"] == report.loc[(ck, ps, "chain"), "speedup"]
    assert pd.read_parquet(tmp_path / "tau.parquet").equals(df)
    header, first = (tmp_path / "tau.csv").read_text().splitlines()[:2]
    assert header.endswith(",speedup_chain,speedup_ddtree_2,estimate_reliable") and first.endswith(",True")
    costs_noisy = json.loads(Path(costs).read_text())
    costs_noisy["decode_samples_s"] = [0.010, 0.030, 0.050]  # median 3x the minimum: unreliable
    Path(tmp_path / "noisy.json").write_text(json.dumps(costs_noisy))
    noisy = write_summary(evals, tmp_path / "n.csv", tmp_path / "n.parquet", costs=str(tmp_path / "noisy.json"))
    assert noisy["estimate_reliable"].tolist() == [False] * 5 and noisy["speedup_chain"].equals(df["speedup_chain"])
    off = write_summary(evals, tmp_path / "o.csv", tmp_path / "o.parquet")  # target_costs disabled
    assert list(off.columns) == list(df.columns)
    assert off["speedup_chain"].isna().all() and off["estimate_reliable"].isna().all()
    assert (tmp_path / "o.csv").read_text().splitlines()[1].endswith(",,,")
    assert pd.read_parquet(tmp_path / "o.parquet")["estimate_reliable"].isna().all()
    from dflash_eval.report.tau_table import read_parquet  # the seal survives the round trip of every column kind

    for name, frame in (("tau", df), ("n", noisy), ("o", off)):
        assert read_parquet(tmp_path / f"{name}.parquet").equals(frame), name


def test_drafter_notes_are_listed_in_the_report(run):
    """A checkpoint evaluated with sliding layers derived from use_sliding_window (a strip note): the evaluate
    outputs carry strip's notes, the report lists them."""

    tmp_path, evals, caches = run
    note = "layer_types not given: ['sliding_attention'] from use_sliding_window, ..."
    for p in evals[:3:2]:  # both prompt sets of "early": listed once
        doc = json.loads(Path(p).read_text())
        Path(p).write_text(json.dumps({**doc, "drafter_notes": [note]}))
    md = R.render_markdown(R.load_report_data(evals, caches))
    assert f"- `early`: {note}" in md and md.count(note) == 1 and "`late`:" not in md


def test_extra_section_markdown_is_rendered_as_html_tables(run):
    """A section of ``report --extra`` (title + markdown, as kernel_parity / validate_online / fp8_parity write):
    its pipe tables become HTML tables of the report's style, its text paragraphs and lists; raw HTML is escaped."""
    tmp_path, evals, caches = run
    md = ("Target `tiny`, 2 samples. <b>raw</b>\n\n- **A** = fla chunk\n- **B** = torch\n\n"
          "| layer | type | cos mean |\n|---:|---|---:|\n| 1 | linear_attention | 0.999900 |\n| 3 | attention | **no** |")
    section = tmp_path / "kernel_parity.json"
    section.write_text(json.dumps({"title": "Kernel parity", "markdown": md}))
    data = R.load_report_data(evals, caches, extra=[str(section)])
    html = R.render_html(data, R.build_figures(data))
    part = html.split("<h2>Kernel parity</h2>")[1].split("<h2")[0]
    assert "<pre" not in part and part.count('<table class="data">') == 1
    assert re.findall(r"<td[^>]*>(.*?)</td>", part) == ["1", "linear_attention", "0.999900", "3", "attention",
                                                       "<strong>no</strong>"]
    assert "<th>type</th>" in part and '<td style="text-align: right;">0.999900</td>' in part
    assert "<li><strong>A</strong> = fla chunk</li>" in part and "<code>tiny</code>" in part
    assert "&lt;b&gt;raw&lt;/b&gt;" in part
    assert md in R.render_markdown(data)  # report.md: the markdown as written
