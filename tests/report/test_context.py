"""The report's tau against context (dflash_eval.report.context): per-bin tau, n and SE from hand-built evaluate JSONs,
the bins past the trained length marked, the mixed-regime note on the headline table, the section absent with one
bin, and the figure in headless Chromium."""

from __future__ import annotations

import json
import math
import re

import pytest

from dflash_eval.report import build as R
from dflash_eval.report import context as C
from test_report import write_eval

#: (acceptance lengths, prompt tokens) per response of the "ctx" set. early: taus 1.0 and 2.0 at 300 / 400 prompt
#: tokens (bin 256-512: tau 1.5, SE sd(1, 2) / sqrt 2 = 0.5) and 3.0, 2.0 at 1500 / 1600 (bin 1024-2048: tau 2.5,
#: SE 0.5); late: 2.0, 4.0 (tau 3.0, SE 1.0) and 2.0, 2.0 (tau 2.0, SE 0).
CTX = {"early": [([1, 1], 300), ([2, 2, 2], 400), ([3], 1500), ([1, 3], 1600)],
       "late": [([2, 2], 300), ([4], 400), ([2, 2], 1500), ([2], 1600)]}


def _eval(tmp_path, ckpt, ps, step, rows, trained):
    p = write_eval(tmp_path, ckpt, ps, step, [a for a, _ in rows], trained_max_len=trained)
    r = json.loads(open(p).read())
    for s, (_, n) in zip(r["samples"], rows):
        s["prompt_len"] = n
    open(p, "w").write(json.dumps(r))
    return p


@pytest.fixture
def ctx(tmp_path):
    """"ctx": 2 bins (early trained on 640 tokens, late: unknown); "short": every prompt in one bin."""
    return [_eval(tmp_path, "early", "ctx", 100, CTX["early"], 640),
            _eval(tmp_path, "late", "ctx", 200, CTX["late"], None),
            _eval(tmp_path, "early", "short", 100, [([2], 10), ([3], 20)], 640)]


def test_per_bin_tau_n_se_and_beyond_the_trained_length(ctx, tmp_path):
    data = R.load_report_data(ctx)
    assert C.context_sets(data.frame) == ["ctx"]  # "short" has one bin
    t = C.context_table(data.frame, "ctx")
    assert list(t.columns) == ["checkpoint", "prompt tokens", "n", "tau", "SE", "trained length", "beyond trained"]
    assert t[["checkpoint", "prompt tokens", "n", "tau", "beyond trained"]].values.tolist() == [
        ["early", "256-512", 2, 1.5, ""], ["early", "1024-2048", 2, 2.5, "yes"],  # lower edge 1024 >= 640
        ["late", "256-512", 2, 3.0, ""], ["late", "1024-2048", 2, 2.0, ""]]  # late: trained length unknown
    assert t["SE"].tolist() == pytest.approx([0.5, 0.5, 1.0, 0.0], abs=1e-12)
    assert t["trained length"].tolist()[:2] == [640, 640] and t["trained length"].isna().tolist()[2:] == [True, True]
    # the rule is tau.csv's per prompt (n_beyond_trained): a bin is beyond when all its prompts are, "partly" when the
    # trained length falls inside it (trained 1500: bin 1024-2048 holds prompts of 1500 and 1600 tokens, and could
    # hold shorter ones)
    long = C.context_frame(R.load_report_data([_eval(tmp_path, "mid", "ctx2", 100, CTX["early"], 1500)]).frame)
    assert long[["bin", "beyond", "partly"]].values.tolist() == [["256-512", False, False], ["1024-2048", False, True]]
    assert C.bin_context(1024, 2048) == pytest.approx(1024 * math.sqrt(2))
    assert C.bin_context(0, 128) == pytest.approx(64 * math.sqrt(2)) and C.bin_context(32768, math.inf) == pytest.approx(
        32768 * math.sqrt(2))


def test_mixed_regime_note_and_markdown(ctx):
    data = R.load_report_data(ctx)
    note = "ctx, `early`: mixes 2 prompts within and 2 beyond the trained length 640: see tau against context"
    assert C.regime_notes(data.frame) == [note]  # short: both prompts within; late: trained length unknown
    md = R.render_markdown(data)
    head, rest = md.split("## Full table")
    assert f"> Mixed regimes: {note}" in head.split("## ")[1]  # under the headline tau table
    section = rest.split("## tau against context")[1]
    assert "### ctx" in section and "### short" not in section
    assert "| early | 256-512 | 2 | 1.500 | 0.500 | 640 |  |" in section
    assert "| early | 1024-2048 | 2 | 2.500 | 0.500 | 640 | yes |" in section
    assert "| late | 256-512 | 2 | 3.000 | 1.000 |  |  |" in section


def test_section_absent_with_one_bin(ctx):
    data = R.load_report_data(ctx[2:])  # "short" only: one bin
    assert C.context_sets(data.frame) == [] and C.regime_notes(data.frame) == []
    assert "tau against context" not in R.render_markdown(data)
    figs = R.build_figures(data)
    assert not [n for n in figs if n.startswith("context_")]
    html = R.render_html(data, figs)
    assert 'id="context"' not in html and "Mixed regimes" not in html


def test_figure_marks_bins_past_the_trained_length(ctx):
    from matplotlib.colors import to_rgba

    from dflash_eval.report.figures import tau_vs_context

    data = R.load_report_data(ctx)
    ax = tau_vs_context(data.frame, "ctx").axes[0]
    hollow = [ln for ln in ax.lines if len(ln.get_xdata()) and to_rgba(ln.get_markerfacecolor()) == to_rgba("white")]
    # early's 1024-2048 only, at its midpoint (shifted left by figures.context_dodge: the first of two checkpoints)
    assert [list(ln.get_xdata()) for ln in hollow] == [pytest.approx([1024 * math.sqrt(2) * 2 ** -0.025])]
    assert ax.get_xscale() == "log"
    spans = [p for p in ax.patches if p.get_x() == 640]  # the shaded region starts at the trained length
    assert len(spans) == 1 and "past trained length 640" in [t.get_text() for t in ax.texts]
    # error bars +-1.96 SE: early's 256-512 bar spans 1.5 -+ 0.98
    segs = [s for c in ax.collections for s in c.get_segments()]
    assert any(s[0][1] == pytest.approx(1.5 - 0.98) and s[1][1] == pytest.approx(1.5 + 0.98) for s in segs)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["early (trained length 640)",
                                                                   "late (trained length unknown)"]


def test_html_section_and_headline_note(ctx):
    data = R.load_report_data(ctx)
    figs = R.build_figures(data)
    assert "context_ctx.png" in figs and "context_short.png" not in figs
    html = R.render_html(data, figs)
    assert html.index('id="table"') < html.index("Mixed regimes") < html.index('id="context"')
    assert re.search(r'<img src="data:image/png;base64,[^"]+" alt="context ctx">', html)
    assert 'data-table="context-ctx"' in html
    assert ('<b>Mixed regimes:</b> ctx, <code>early</code>: mixes 2 prompts within and 2 beyond the trained length 640: '
            'see <a href="#context">tau against context</a>') in html


@pytest.mark.browser
def test_context_figure_renders_in_chromium(ctx, tmp_path):
    import browser

    browser.need_chromium()
    data = R.load_report_data(ctx)
    page = tmp_path / "report.html"
    page.write_text(R.render_html(data, R.build_figures(data)))
    seen = browser.render(page, tmp_path)
    fig = [i for i in seen["images"] if i["alt"] == "context ctx"]
    assert len(fig) == 1 and fig[0]["complete"] and fig[0]["width"] > 300 and fig[0]["height"] > 200, fig
    assert seen["tables"]["context-ctx"][0] == ["checkpoint", "prompt tokens", "n", "tau", "SE", "trained length",
                                               "beyond trained"]
    assert seen["tables"]["context-ctx"][2] == ["early", "1024-2048", "2", "2.500", "0.500", "640", "yes"]


def test_greedy_sets_pooled_per_bin_hand_computed():
    """with_pooled: one checkpoint's two greedy sets pooled per bin, the T > 0 set left out. Bin 0-128: set a has
    taus {1, 3} (n 2, mean 2, se 1), set b {4} (n 1): pooled n 3, tau 8/3, union variance of {1, 3, 4} = 7/3, se
    sqrt(7/9). Bin 2048-4096: only b, n 2, tau 1.5, se 0.5 as given."""
    import math

    import pandas as pd

    from dflash_eval.report.context import POOLED, context_sets, with_pooled

    def row(ps, sampling, n0, t0, s0, n1, t1, s1):
        return {"checkpoint": "ck", "step": 5, "prompt_set": ps, "sampling": sampling, "trained_max_len": 640,
                "tau_prompt_0_128": t0, "n_prompt_0_128": n0, "se_prompt_0_128": s0,
                "tau_prompt_2048_4096": t1, "n_prompt_2048_4096": n1, "se_prompt_2048_4096": s1}

    frame = pd.DataFrame([row("a", "T0", 2, 2.0, 1.0, 0, math.nan, math.nan),
                          row("b", "T0", 1, 4.0, math.nan, 2, 1.5, 0.5),
                          row("c", "T1_p0.95_k20", 5, 9.0, 0.1, 5, 9.0, 0.1)])
    pooled = with_pooled(frame)
    p = pooled[pooled["prompt_set"] == POOLED].iloc[0]
    assert p["n_prompt_0_128"] == 3 and abs(p["tau_prompt_0_128"] - 8 / 3) < 1e-12
    assert abs(p["se_prompt_0_128"] - math.sqrt(7 / 9)) < 1e-12
    assert p["n_prompt_2048_4096"] == 2 and p["tau_prompt_2048_4096"] == 1.5 and abs(p["se_prompt_2048_4096"] - 0.5) < 1e-12
    assert context_sets(pooled)[0] == POOLED
    # one greedy set only: nothing pooled
    assert POOLED not in set(with_pooled(frame.iloc[[0, 2]])["prompt_set"])
