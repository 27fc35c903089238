"""DFlash 1 and DFlash 2 runs side by side in the report, from a hand-built tau table (the columns tau.csv has,
real-looking values): tau against step per variant, the compact DFlash 2 selector table and its per-slot figure,
the best checkpoint per variant, and no per-slot column in any table of the markdown or HTML report."""

from __future__ import annotations

import itertools
import math
import re

import pandas as pd
import pytest

from dflash_eval.report import build as R
from dflash_eval.report import figures as F
from dflash_eval.drafter.families import DFLASH2
from dflash_eval.report.tau_table import COLUMNS, VARIANT_COLUMNS, primary_rows

T1 = "T1_p0.95_k20"
STEPS = (1000, 2000, 3000)
#: chain tau per (variant, prompt set) at steps 1000, 2000, 3000 (DFlash 2 peaks at 2000 on humaneval)
TAU = {("dflash", "humaneval"): [2.10, 2.60, 2.90], ("dflash", "sharegpt"): [1.80, 2.05, 2.20],
       ("dflash", "sharegpt-t1"): [1.60, 1.75, 1.85],
       ("dflash2", "humaneval"): [2.40, 3.20, 3.10], ("dflash2", "sharegpt"): [1.90, 2.30, 2.45],
       ("dflash2", "sharegpt-t1"): [1.70, 1.90, 2.00]}
#: DFlash 2 per-slot top-K recall of step s (block 8: slots 1..7; slot 7 never compared: NaN)
RECALL = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, math.nan]
PICK = [0.95, 0.9, 0.85, 0.8, 0.75, 0.7, math.nan]


def _row(variant, ps, i, sampling="T0", draft="reference", temperature=0.0, tau=None):
    step = STEPS[i]
    name = f"{'dflash2' if variant == 'dflash2' else 'dflash'}-smollm2-b8-step{step}"
    tau = TAU[(variant, ps)][i] if tau is None else tau
    r = {"checkpoint": name, "step": step, "prompt_set": ps, "sampling": sampling, "draft": draft,
         "temperature": temperature, "top_p": 0.95 if temperature else 1.0, "top_k": 20 if temperature else 0,
         "expected": temperature > 0, "trajectory": sampling, "engine": "dflash 0.1.0 dflash_generate",
         "n_samples": 16, "tau": tau, "tau_tokens_per_step": tau - 0.05, "mean_accepted": tau - 1.0, "block_size": 8,
         "random_init": False, "device": "cuda", "dtype": "bfloat16", "variant": variant,
         "ddtree_applicable": variant == "dflash", "accept_slot_1": 0.7, "accept_slot_2": 0.5,
         "tau_ddtree_8": tau + 0.8 if variant == "dflash" else math.nan}
    if variant == "dflash2":
        r.update({"tau_unary": tau - 0.3, "tau_oracle": tau + 1.1 + 0.1 * i, "sel_accepted": tau - 1.0,
                  "sel_oracle_accepted": tau + 0.1, "sel_pick_rate": 0.80 + 0.05 * i, "sel_oracle_path_rate": 0.5 + 0.1 * i})
        r.update({f"topk_recall_slot_{k}": v - 0.01 * (2 - i) if not math.isnan(v) else v for k, v in enumerate(RECALL, 1)})
        r.update({f"pick_rate_slot_{k}": v for k, v in enumerate(PICK, 1)})
    return r


def table(variants=("dflash", "dflash2")) -> pd.DataFrame:
    """tau.csv of two runs: humaneval and sharegpt at T = 0, sharegpt-t1 at T = 1 with three draft policies (the
    DDTree column equal across them)."""
    rows = []
    for v in variants:
        for ps in ("humaneval", "sharegpt", "sharegpt-t1"):
            for i in range(3):
                if ps == "sharegpt-t1":
                    rows += [_row(v, ps, i, T1, d, 1.0, tau=TAU[(v, ps)][i] - off)
                             for d, off in (("reference", 0.0), ("argmax", 0.2), ("probabilistic", 0.1))]
                else:
                    rows.append(_row(v, ps, i))
    cols = COLUMNS + ["tau_ddtree_8", "accept_slot_1", "accept_slot_2"] + VARIANT_COLUMNS
    if "dflash2" in variants:
        cols += DFLASH2.table_columns(8)
    return pd.DataFrame(rows, columns=cols).astype({"step": "Int64"})


def report_data(every: pd.DataFrame) -> R.ReportData:
    frame = primary_rows(every)
    hists = {(ck, ps): (8, {1: 3, 2: 2, 3: 1}) for ck, ps in zip(frame["checkpoint"], frame["prompt_set"])}
    data = R.ReportData(frame=frame, hists=hists, slot_curves=R.slot_curves(frame), positions=[],
                        agreement=pd.DataFrame(), caches={}, table=every)
    data.extra.insert(0, R.sampling_extra(every))
    return data


def test_selector_table_is_compact_with_exact_values():
    sel = R.selector_table(primary_rows(table()))
    assert list(sel.columns) == ["checkpoint", "step", "prompt_set", "tau", "tau_unary", "tau_oracle", "recall@K",
                                 "pick rate", "oracle path"]
    # T = 0 sets only (sharegpt-t1's selector columns are the greedy path's, the same in each policy row)
    assert list(zip(sel["prompt_set"], sel["step"])) == [("humaneval", 1000), ("humaneval", 2000), ("humaneval", 3000),
                                                         ("sharegpt", 1000), ("sharegpt", 2000), ("sharegpt", 3000)]
    last = sel.iloc[2]
    assert last["checkpoint"] == "dflash2-smollm2-b8-step3000"
    assert (last["tau"], last["tau_unary"], last["tau_oracle"]) == pytest.approx((3.10, 2.80, 4.40))
    assert last["recall@K"] == pytest.approx(0.75)  # mean of 1.0 .. 0.5 over the six compared slots
    assert sel.iloc[0]["recall@K"] == pytest.approx(0.73)  # step 1000: every slot 0.02 lower
    assert (last["pick rate"], last["oracle path"]) == pytest.approx((0.90, 0.70))
    assert R.selector_table(primary_rows(table(("dflash",)))) is None


def test_comparison_picks_the_best_checkpoint_per_variant():
    cmp = R.variant_comparison(primary_rows(table()))
    assert list(cmp.columns) == ["prompt_set", "DFlash 1 best", "DFlash 1 tau", "DFlash 2 best", "DFlash 2 tau", "Δ tau"]
    h = cmp.set_index("prompt_set").loc["humaneval"]
    assert h["DFlash 1 best"] == "dflash-smollm2-b8-step3000" and h["DFlash 1 tau"] == pytest.approx(2.90)
    assert h["DFlash 2 best"] == "dflash2-smollm2-b8-step2000" and h["DFlash 2 tau"] == pytest.approx(3.20)
    assert h["Δ tau"] == pytest.approx(0.30)
    t1 = cmp.set_index("prompt_set").loc["sharegpt-t1"]  # the reference policy row, as the tau table
    assert (t1["DFlash 1 tau"], t1["DFlash 2 tau"]) == pytest.approx((1.85, 2.00))
    assert R.variant_comparison(primary_rows(table(("dflash",)))) is None


def test_tau_vs_step_one_line_per_variant_and_prompt_set():
    fig = F.tau_vs_step(primary_rows(table()))
    chain, tree = [ax for ax in fig.axes if ax.get_visible()]
    lines = {ln.get_label(): ln for ln in chain.get_lines()}
    assert sorted(lines) == sorted(f"{ps} [DFlash {n}]" for n in (1, 2)
                                   for ps in ("humaneval", "sharegpt", f"sharegpt-t1 ({T1})"))
    d1, d2 = lines["humaneval [DFlash 1]"], lines["humaneval [DFlash 2]"]
    assert list(d2.get_xdata()) == list(STEPS) and list(d2.get_ydata()) == TAU[("dflash2", "humaneval")]
    assert (d1.get_linestyle(), d2.get_linestyle()) == ("-", "--") and d1.get_color() == d2.get_color()
    assert lines["sharegpt [DFlash 1]"].get_color() != d1.get_color()
    assert sorted(ln.get_label() for ln in tree.get_lines()) == [  # DFlash 2's DDTree cells are NaN: no line
        "humaneval [DFlash 1]", "sharegpt [DFlash 1]", f"sharegpt-t1 ({T1}) [DFlash 1]"]
    one = F.tau_vs_step(primary_rows(table(("dflash",)))).axes[0]  # one variant: the plain look
    assert sorted(ln.get_label() for ln in one.get_lines()) == ["humaneval", "sharegpt", f"sharegpt-t1 ({T1})"]
    assert {ln.get_linestyle() for ln in one.get_lines()} == {"-"}


def test_selector_slot_figure_lines():
    fig = F.selector_slots(R.selector_rows(primary_rows(table())))
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title().split(":")[0] for ax in axes] == ["humaneval", "humaneval", "sharegpt", "sharegpt"]
    recall, pick = axes[0].get_lines(), axes[1].get_lines()
    assert [ln.get_label() for ln in recall] == [f"dflash2-smollm2-b8-step{s}" for s in STEPS]
    assert list(recall[2].get_xdata()) == [1, 2, 3, 4, 5, 6]  # slot 7 never compared: left out
    assert list(recall[2].get_ydata()) == pytest.approx(RECALL[:6])
    assert list(pick[0].get_ydata()) == pytest.approx(PICK[:6])


def _headers(md: str, html: str) -> list[str]:
    lines = md.splitlines()
    heads = [c.strip() for above, rule in itertools.pairwise(lines) if rule.startswith("|---") for c in above.split("|")]
    return heads + re.findall(r"<th[^>]*>([^<]*)</th>", html)


def test_report_sections_and_no_slot_columns():
    every = table()
    data = report_data(every)
    md = R.render_markdown(data)
    figs = {name: ("caption", b"png") for name in ("tau_vs_step.png", "selector_slots.png")}
    html = R.render_html(data, figs)
    heads = _headers(md, html)
    assert heads and not [h for h in heads if "_slot_" in h]
    assert "topk_recall_slot_3" in every and "pick rate" in heads and "recall@K" in heads
    # the compact selector rows and the per-slot rates as one text cell
    assert "| dflash2-smollm2-b8-step3000 | 3000 | humaneval | 3.100 | 2.800 | 4.400 | 0.750 | 0.900 | 0.700 |" in md
    assert "| dflash2-smollm2-b8-step3000 | humaneval | 1.00 0.90 0.80 0.70 0.60 0.50 | 0.95 0.90 0.85 0.80 0.75 0.70 |" in md
    assert ("| humaneval | dflash-smollm2-b8-step3000 | 2.900 | dflash2-smollm2-b8-step2000 | 3.200 | 0.300 |" in md
            and "## DFlash 1 vs DFlash 2" in md)
    assert 'data-table="variants"' in html and 'data-table="selector"' in html and 'alt="selector_slots.png"' in html
    # extra sections: HTML tables, not markdown in <pre>; the DDTree sentence once in each report
    assert 'data-table="sampling"' in html and 'data-table="engines"' in html
    assert not re.search(r"<pre>[^<]*\| checkpoint", html)
    ddtree = "The DDTree columns of tau.csv are the same in every draft-policy row of a checkpoint at T &gt; 0"
    assert ddtree in html and ddtree.replace("&gt;", ">") in md
    # the full table: every row of tau.csv (three policy rows at T = 1), no per-slot column
    full = md.split("## Full table")[1].split("##")[0]
    assert full.count("| dflash2-smollm2-b8-step3000 | 3000 | sharegpt-t1 |") == 3


def test_prompt_sets_section_is_an_html_table(tmp_path):
    meta = {"sharegpt": {"source": "sharegpt", "available": 20, "written": 16, "skipped": {"assistant_first": 3,
                                                                                          "too_long": 1}}}
    title, md, html = R.prompt_sets_section(meta)
    assert title == "Prompt sets" and "| sharegpt | sharegpt | 20 | 16 | 3 | 1 |" in md
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", html)
    assert cells == ["sharegpt", "sharegpt", "20", "16", "3", "1"] and "starts with an assistant turn" in html


def test_tau_table_groups_checkpoints_by_run():
    """DFlash 1's checkpoints, then DFlash 2's, each in step order (tau.csv interleaves them by step); Δ prev within
    a run."""
    every = table().sort_values(["prompt_set", "step", "checkpoint"], kind="stable")  # tau.csv's order
    data = report_data(every)
    runs = [f"dflash-smollm2-b8-step{s}" for s in STEPS] + [f"dflash2-smollm2-b8-step{s}" for s in STEPS]
    piv = R.tau_pivot(data)
    assert list(piv[("checkpoint", "")]) == runs
    delta = piv[("humaneval", "Δ prev")].tolist()
    assert math.isnan(delta[0]) and math.isnan(delta[3])  # each run's first checkpoint
    assert delta[4] == pytest.approx(3.20 - 2.40) and delta[2] == pytest.approx(2.90 - 2.60)
    md = R.render_markdown(data)
    tau_md = md.split("## Acceptance length tau")[1].split("##")[0]
    assert [ln.split(" | ")[0].lstrip("| ") for ln in tau_md.splitlines() if ln.startswith("| dflash")] == runs
    html = R.render_html(data, {n: ("caption", b"png") for n in ("tau_vs_step.png", "selector_slots.png")})
    tau_html = html.split('data-table="tau-table"')[1].split("</table>")[0]
    assert re.findall(r">(dflash2?-smollm2-b8-step\d+)<", tau_html) == runs
    assert list(data.table["checkpoint"]) == list(every["checkpoint"])  # the full table keeps tau.csv's order


def test_ddtree_tables_leave_out_dflash2_rows():
    """DFlash 2 drafters have no DDTree values: not listed in the DDTree tables; the selector note says why."""
    data = report_data(table())
    t = R.ddtree_pivot(data, "humaneval")
    assert list(t["checkpoint"]) == [f"dflash-smollm2-b8-step{s}" for s in STEPS]
    assert t["budget 8"].tolist() == pytest.approx([2.90, 3.40, 3.70])
    md = R.render_markdown(data)
    html = R.render_html(data, {n: ("caption", b"png") for n in ("tau_vs_step.png", "selector_slots.png")})
    ddtree_md = md.split("## DDTree: tau per node budget")[1].split("\n## ")[0]
    ddtree_html = html.split('<h2 id="ddtree">')[1].split("<h2")[0]
    assert "dflash-smollm2-b8-step3000" in ddtree_md and "dflash-smollm2-b8-step3000" in ddtree_html
    assert "dflash2-" not in ddtree_md and "dflash2-" not in ddtree_html
    assert "the DDTree tables leave them out" in md and "the DDTree tables leave them out" in html
    # a run of DFlash 2 drafters only: tau.csv has the budget's column, all NaN; no DDTree section
    only2 = report_data(table(("dflash2",)))
    assert R.ddtree_tables(only2) == {} and "## DDTree" not in R.render_markdown(only2)
    assert 'id="ddtree"' not in R.render_html(only2, {n: ("c", b"png") for n in ("tau_vs_step.png", "selector_slots.png")})


def test_section_titles_name_the_families_present():
    """The families-side-by-side and candidate-walk titles list the families of the frame in report order (DFlash 1,
    DFlash 2, LiLiCorr), the walk title only those that walk candidates, at temperature 0."""
    from dflash_eval.report.tables import selector_title, variants_title
    frame = pd.DataFrame({"variant": ["lilicorr", "dflash", "dflash2", "dflash2"], "tau_oracle": [2.0, None, 2.5, 2.5],
                          "temperature": [0.0, 0.0, 0.0, 1.0]})
    assert variants_title(frame) == "DFlash 1 vs DFlash 2 vs LiLiCorr"
    assert selector_title(frame) == "Candidate walks: DFlash 2, LiLiCorr"
    assert selector_title(frame[frame["variant"] != "lilicorr"]) == "Candidate walks: DFlash 2"
