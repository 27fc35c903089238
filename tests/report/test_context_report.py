"""The report's "speedup and break-even against context" section: exact numbers from hand-built costs at 2 contexts
x 2 batches and evaluate outputs with prompt lengths; absent with one timed context; its figure in Chromium."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_eval.report import build as R  # noqa: E402
from dflash_eval.report import speed as S  # noqa: E402
from dflash_eval.target.costs import FORMAT  # noqa: E402
from test_report import fake_costs, write_h5  # noqa: E402


def _eval(tmp_path, ck, ps, step, samples):
    """``samples``: [(prompt_len, acceptance lengths)]."""
    r = {"checkpoint": ck, "prompt_set": ps, "block_size": 4, "step": step, "random_init": False, "device": "cpu",
         "dtype": "float32", "samples": [{"id": str(i), "prompt_len": p, "acceptance_lengths": a}
                                         for i, (p, a) in enumerate(samples)]}
    p = tmp_path / "eval" / ck / f"{ps}.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(r))
    return str(p)


def _entry(c, b, dec, ver, draft):
    return {"context_tokens": c, "batch_size": b, "decode_s": dec, "decode_samples_s": [dec],
            "verify": [{"n": 4, "mask": "causal", "fit_s": ver, "median_s": ver, "samples_s": [ver]}],
            "drafters": {ck: {"draft_s": draft, "draft_samples_s": [draft], "draft_tree_s": {}} for ck in ("early", "late")}}


def grid_costs(tmp_path):
    """Batch 1: contexts 1000 / 5000 -> decode 10 / 20 ms, verify(4) 14 / 40 ms, draft 2 / 4 ms (break-even 1.6 / 2.2);
    batch 16: decode 20 / 40, verify 80 / 200, draft 4 / 8 (break-even 4.2 / 5.2)."""
    grid = [_entry(1000, 1, 0.010, 0.014, 0.002), _entry(5000, 1, 0.020, 0.040, 0.004),
            _entry(1000, 16, 0.020, 0.080, 0.004), _entry(5000, 16, 0.040, 0.200, 0.008)]
    c = {"format": FORMAT, "format_version": 3, "device": "cpu", "device_name": "CPU: test", "dtype": "float32",
         "threads": 2, "torch_version": "x", "transformers_version": "y", "target": {"sha256": "ab" * 32},
         "context_tokens": 1000, "batch_size": 1, "repeats": 1, "measured_at": "now",
         "decode_s": 0.010, "decode_samples_s": [0.010], "verify": grid[0]["verify"],
         "drafters": {ck: {"config_sha256": "cd" * 32, "block_size": 4, "num_layers": 1, "draft_s": 0.002,
                           "draft_samples_s": [0.002], "draft_tree_s": {}} for ck in ("early", "late")},
         "contexts": [1000, 5000], "batch_sizes": [1, 16], "grid": grid}
    p = tmp_path / "target_costs_grid.json"
    p.write_text(json.dumps(c))
    return str(p)


@pytest.fixture
def ctx_run(tmp_path):
    # late: a 100-token prompt with steps [4, 4] (tau 4) and a 3000-token one with [2, 2] (tau 2); early: [2] and [1]
    evals = [_eval(tmp_path, "early", "humaneval", 100, [(100, [2]), (3000, [1])]),
             _eval(tmp_path, "late", "humaneval", 200, [(100, [4, 4]), (3000, [2, 2])])]
    return tmp_path, evals, [write_h5(tmp_path, "humaneval", [1.0], [7])]


def test_context_section_exact(ctx_run):
    tmp_path, evals, caches = ctx_run
    data = R.load_report_data(evals, caches, costs=grid_costs(tmp_path))
    be = S.break_even_table(data.costs)
    assert be.to_dict("records") == [
        {"drafter": "early (+1 same config)", "batch": 1, "method": "chain", "1000": pytest.approx(1.6),
         "5000": pytest.approx(2.2)},
        {"drafter": "early (+1 same config)", "batch": 16, "method": "chain", "1000": pytest.approx(4.2),
         "5000": pytest.approx(5.2)}]
    cf = S.context_frame(data).set_index(["checkpoint", "batch"])
    assert list(cf.columns) == ["prompt_set", "0-128", "2048-4096", "pays"]
    # late, batch 1, bin 0-128 at context 64 (flat below 1000): 4 * 10 / (14 + 2) = 2.5
    assert cf.loc[("late", 1), "0-128"] == pytest.approx(2.5)
    # bin 2048-4096 at context 3072: decode 15.18 ms, verify 27.468, draft 3.036 -> break-even 2.0095 >= tau 2
    assert cf.loc[("late", 1), "2048-4096"] == pytest.approx(2 * 0.01518 / 0.030504)
    assert cf.loc[("late", 1), "pays"] == "pays up to context 2048"
    # batch 16: 4 * 20 / (80 + 4) < 1 already in the first bin
    assert cf.loc[("late", 16), "0-128"] == pytest.approx(80 / 84) and cf.loc[("late", 16), "pays"] == "never pays"
    assert cf.loc[("early", 1), "pays"] == "pays up to context 2048"  # tau 2 > 1.6, then tau 1 <= 2.0095
    md = R.render_markdown(data)
    assert "## Speedup and break-even against context" in md
    assert "| early (+1 same config) | 1 | chain | 1.60 | 2.20 |" in md
    assert "| late | 1 | 2.50 | 1.00 | pays up to context 2048 |" in md
    assert "| late | 16 | 0.95 | 0.41 | never pays |" in md  # 2 * 30.36 / (142.16 + 6.072) at context 3072
    assert "Warning:** unreliable timings" not in md  # one sample per measurement: no spread
    figs = R.build_figures(data)
    assert "break_even_context.png" in figs
    costs = json.loads(Path(grid_costs(tmp_path)).read_text())
    costs["grid"][3]["decode_samples_s"] = [0.04, 0.12, 0.12]  # 5000 x 16: median 3x the minimum
    assert S.grid_warning(costs) == ("unreliable timings (runs spread beyond the bound, or a verify cost falling as n "
                                     "grows) at context x batch 5000 x 16: re-run target_costs on a quiet machine")
    html = R.render_html(data, figs)
    assert "Speedup and break-even against context" in html and 'alt="break_even_context.png"' in html


def test_context_section_absent_with_one_context(ctx_run):
    tmp_path, evals, caches = ctx_run
    data = R.load_report_data(evals, caches, costs=fake_costs(tmp_path))  # format 2 layout: one context
    assert not S.has_context_section(data)
    assert "break-even against context" not in R.render_markdown(data)  # (tau against context may show: pooled sets)
    figs = R.build_figures(data)
    assert "break_even_context.png" not in figs and "speedup.png" in figs
    assert "Speedup and break-even against context" not in R.render_html(data, figs)


@pytest.mark.browser
def test_context_figure_renders_in_chromium(ctx_run):
    import browser

    browser.need_chromium()
    tmp_path, evals, caches = ctx_run
    data = R.load_report_data(evals, caches, costs=grid_costs(tmp_path))
    page = tmp_path / "report.html"
    page.write_text(R.render_html(data, R.build_figures(data)))
    seen = browser.render(page, tmp_path)
    fig = [i for i in seen["images"] if i["alt"] == "break_even_context.png"]
    assert len(fig) == 1 and fig[0]["complete"] and fig[0]["width"] > 300 and fig[0]["height"] > 150, seen["images"]
    assert seen["tables"]["break-even"][0] == ["drafter", "batch", "method", "1000", "5000"]
    assert seen["tables"]["break-even"][1] == ["early (+1 same config)", "1", "chain", "1.60", "2.20"]
