"""The report's tables that need no run files: plain frames from the tau table (:mod:`dflash_eval.report.tau_table`)
and the measured costs, each rendered by :mod:`dflash_eval.report.build` as markdown and HTML.

DFlash 1 against DFlash 2 (:func:`variant_comparison`), the DFlash 2 selector diagnostics (:func:`selector_table`,
:func:`selector_slot_text`; their per-slot columns are drawn by :func:`dflash_eval.report.figures.selector_slots`
and never shown as table columns, :func:`without_slot_columns`), tau per sampling setting and draft policy
(:func:`sampling_tables`), tau by prompt length, the measured costs, and the extra sections' markdown as HTML
(:func:`markdown_html`).
"""

from __future__ import annotations

import math
import re

import markdown
import pandas as pd

from dflash_eval.drafter import families
from dflash_eval.drafter.families import FAMILIES
from dflash_eval.report.tau_table import checkpoint_order, variant_label, variant_order


def prompt_length_table(frame: pd.DataFrame, cols: list[tuple[str, str]]) -> pd.DataFrame:
    """Checkpoint, prompt set and ``"<tau> (<responses>)"`` per prompt-length bin (empty where none)."""
    out = frame[["checkpoint", "prompt_set"]].copy()
    for label, c in cols:
        n = frame.get("n" + c[len("tau"):])
        out[f"{label} tokens"] = [f"{t:.3f} ({int(k)})" if pd.notna(t) else ""
                                  for t, k in zip(frame[c], n if n is not None else [0] * len(frame))]
    return out


SAMPLING_NOTE = (
    "tau (mean over responses of tokens per verify step) at each `evaluate.sampling` setting and draft "
    "policy. *(expected)*: the expectation of that policy's speculative sampler given the cached "
    "completions (docs/design.md, Acceptance at temperature > 0 and Draft policies); *on T0 completions*: "
    "evaluated with evaluate.cross_temperature on completions drawn at another setting: not an "
    "expectation. At T > 0 the accepted length depends on how the engine drafts: [reference] drafts "
    "sampled from the drafter's q (dflash 0.1.0), [argmax] the drafter's argmax with one-hot q (vLLM's "
    "default), [probabilistic] q at the temperature only (vLLM draft_sample_method=probabilistic). "
    "The DDTree columns of tau.csv are the same in every draft-policy row of a checkpoint at T > 0, by "
    "design: the tree is built from the drafter's log-probabilities, whatever the engine's draft policy "
    "(docs/design.md, Acceptance at temperature > 0).")


def sampling_tables(every: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame | None]:
    """tau per checkpoint x (prompt set, sampling setting, draft policy): every row of tau.csv (the report's other
    tables show each pair's first configured setting); and the engine setting that gives each policy's number at
    T > 0 (``sampling``, ``draft``, ``engine``; None without an ``engine`` column)."""
    f = every.copy()
    drafts = f["draft"] if "draft" in f else pd.Series(["reference"] * len(f), index=f.index)
    f["column"] = [f"{ps} {s}" + (f" [{d}]" if float(t) > 0 else "") + (" (expected)" if e else "")
                   + (f" on {tr} completions" if tr != s else "")
                   for ps, s, d, t, e, tr in zip(f["prompt_set"], f["sampling"], drafts, f["temperature"],
                                                 f["expected"], f["trajectory"])]
    piv = f.pivot_table(index="checkpoint", columns="column", values="tau", sort=False).reset_index()
    piv.columns.name = None
    if "engine" not in f:
        return piv, None
    engines = f[f["temperature"].astype(float) > 0].assign(draft=drafts).drop_duplicates(["sampling", "draft"])
    return piv, pd.DataFrame({"sampling": engines["sampling"], "draft": engines["draft"],
                              "engine": engines["engine"].fillna("").replace("", "no engine known")})


def best_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Per prompt set of ``frame`` the row with the highest tau (ties: the earlier step)."""
    f = frame.dropna(subset=["tau"])
    rows = []
    for ps, sub in f.groupby("prompt_set"):
        r = sub.sort_values(["tau", "step"], ascending=[False, True], na_position="last").iloc[0]
        rows.append({"prompt_set": ps, "checkpoint": r["checkpoint"], "step": r["step"], "tau": r["tau"]})
    return pd.DataFrame(rows, columns=["prompt_set", "checkpoint", "step", "tau"])


#: the note of the report's selector section: the ``report_note`` of each family with that section (DFlash 2's)
SELECTOR_NOTE = " ".join(f.report_note for f in FAMILIES.values() if "selector" in f.report_sections and f.report_note)

#: the per-slot columns of the tau table: in tau.csv, drawn as figures (never a column of a report table)
PER_SLOT = re.compile(r"^(accept|topk_recall|pick_rate)_slot_\d+$")


def without_slot_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` without its per-slot columns (``accept_slot_<k>``, ``topk_recall_slot_<k>``, ``pick_rate_slot_<k>``)."""
    return frame.drop(columns=[c for c in frame.columns if PER_SLOT.match(str(c))])


def variants_title(frame: pd.DataFrame) -> str:
    """The title of the report's families-side-by-side section: the labels of the families in ``frame``'s
    ``variant`` column in report order, e.g. ``"DFlash 1 vs DFlash 2 vs LiLiCorr"``."""
    return " vs ".join(families.label(v) for v in families.ordered(frame["variant"].dropna().unique()))


def selector_title(frame: pd.DataFrame) -> str:
    """The title of the report's candidate-walk section: the labels of the families in ``frame`` that walk
    candidates (``"selector"`` in their ``report_sections``), e.g. ``"Candidate walks: DFlash 2, LiLiCorr"``."""
    names = families.ordered(v for v in selector_rows(frame)["variant"].dropna().unique())
    return "Candidate walks: " + ", ".join(families.label(v) for v in names)


def selector_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows at temperature 0 (every column) of the families with the report's selector section (their
    ``report_sections``: DFlash 2), or an empty frame."""
    if "tau_oracle" not in frame.columns or "variant" not in frame.columns:
        return frame.iloc[:0]
    keep = frame["variant"].map(lambda v: v in FAMILIES and "selector" in FAMILIES[v].report_sections).astype(bool)
    if "temperature" in frame:
        keep &= frame["temperature"].astype(float) == 0
    return frame[keep]


def _by_set_then_training(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` sorted by prompt set, then training order (:func:`checkpoint_order`)."""
    rank = {c: i for i, c in enumerate(checkpoint_order(rows))}
    return rows.sort_values(["prompt_set", "checkpoint"], key=lambda c: c.map(rank) if c.name == "checkpoint" else c,
                            kind="stable")


def selector_table(frame: pd.DataFrame) -> pd.DataFrame | None:
    """The DFlash 2 selector diagnostics, one row per DFlash 2 checkpoint x prompt set at temperature 0 (prompt
    set, then training order), or None without any.

    Columns: ``checkpoint``, ``step``, ``prompt_set``, ``tau``, ``tau_unary``, ``tau_oracle``, ``recall@K`` (the
    unweighted mean over slots of ``topk_recall_slot_<k>``, slots without a value skipped), ``pick rate``
    (``sel_pick_rate``, pooled over slots) and ``oracle path`` (``sel_oracle_path_rate``); floats (rates in [0, 1]).
    """
    rows = _by_set_then_training(selector_rows(frame))
    if not len(rows):
        return None
    recall = [c for c in rows.columns if str(c).startswith("topk_recall_slot_")]
    out = pd.DataFrame({"checkpoint": rows["checkpoint"], "step": rows["step"].astype("Int64"),
                        "prompt_set": rows["prompt_set"], "tau": rows["tau"].astype(float),
                        "tau_unary": rows["tau_unary"].astype(float), "tau_oracle": rows["tau_oracle"].astype(float),
                        "recall@K": rows[recall].astype(float).mean(axis=1) if recall else math.nan,
                        "pick rate": rows["sel_pick_rate"].astype(float),
                        "oracle path": rows["sel_oracle_path_rate"].astype(float)})
    return out.reset_index(drop=True)


def variant_comparison(frame: pd.DataFrame) -> pd.DataFrame | None:
    """DFlash 1 against DFlash 2: per prompt set, the best checkpoint of each variant (highest ``tau``, ties: the
    earlier step) and its tau, side by side; None unless ``frame`` holds more than one ``variant``.

    Columns: ``prompt_set``, then per variant (DFlash 1 first) ``<label> best`` (checkpoint) and ``<label> tau``;
    with exactly two variants also ``Δ tau`` (the second's best minus the first's)."""
    if "variant" not in frame or frame["variant"].nunique() < 2:
        return None
    variants = variant_order(frame)
    out = pd.DataFrame({"prompt_set": sorted(frame["prompt_set"].unique())})
    for v in variants:
        best = best_rows(frame[frame["variant"] == v]).set_index("prompt_set").reindex(out["prompt_set"])
        label = variant_label(v)
        out[f"{label} best"] = best["checkpoint"].fillna("").to_numpy()
        out[f"{label} tau"] = best["tau"].to_numpy(dtype=float)
    if len(variants) == 2:
        out["Δ tau"] = out.iloc[:, 4] - out.iloc[:, 2]
    return out


COMPARISON_NOTE = ("Per prompt set, the best checkpoint of each drafter variant (highest chain tau, each pair's "
                   "first sampling setting as in the tau table) and its tau; Δ tau: DFlash 2's minus DFlash 1's.")
FULL_NOTE = ("Every row and column of tau.csv except the per-slot columns (accept_slot_k, topk_recall_slot_k, "
             "pick_rate_slot_k: drawn in the per-slot figures, kept in tau.csv).")


def slot_text(frame: pd.DataFrame, cols: list[str], label: str, digits: int = 2) -> pd.DataFrame:
    """``checkpoint``, ``prompt_set`` and the per-slot values of ``cols`` (in that order) as one text cell
    ``"0.98 0.91 0.85"`` per row (trailing empty slots dropped, an empty one inside as ``-``): a per-slot table
    a terminal can show."""
    def cell(values) -> str:
        vals = [float(v) for v in values]
        while vals and math.isnan(vals[-1]):
            vals.pop()
        return " ".join("-" if math.isnan(v) else f"{v:.{digits}f}" for v in vals)

    out = frame[["checkpoint", "prompt_set"]].reset_index(drop=True)
    out[label] = [cell(r) for r in frame[cols].itertuples(index=False)] if cols else ""
    return out


def selector_slot_text(frame: pd.DataFrame) -> pd.DataFrame:
    """The DFlash 2 rows of :func:`selector_table` with their top-K recall and pick rate by slot as text cells."""
    rows = _by_set_then_training(selector_rows(frame))

    def cols(kind):
        return [c for _, c in sorted((int(c.rsplit("_", 1)[1]), c) for c in rows.columns
                                     if str(c).startswith(f"{kind}_slot_"))]

    recall = slot_text(rows, cols("topk_recall"), "recall@K by slot")
    return recall.assign(**{"pick rate by slot": slot_text(rows, cols("pick_rate"), "p")["p"]})


def costs_table(costs: dict) -> pd.DataFrame:
    """Measured costs (ms) and their ratio to one decode step."""
    t_dec = costs["decode_s"]
    rows = [{"quantity": "t_decode: decode step (1 token)", "ms": 1e3 * t_dec, "× t_decode": 1.0}]
    for v in sorted(costs["verify"], key=lambda v: (v["n"], v["mask"])):
        rows.append({"quantity": f"t_verify({v['n']}): verify forward, {v['mask']} mask", "ms": 1e3 * v.get("fit_s", v["median_s"]),
                     "× t_decode": v.get("fit_s", v["median_s"]) / t_dec})
    seen = set()
    for d in costs["drafters"].values():
        if d["config_sha256"] in seen:
            continue
        seen.add(d["config_sha256"])
        tag = f"drafter {d['config_sha256'][:8]} ({d['num_layers']} layers, block {d['block_size']})"
        rows.append({"quantity": f"t_draft: {tag}, chain", "ms": 1e3 * d["draft_s"], "× t_decode": d["draft_s"] / t_dec})
        for b, t in d.get("draft_tree_s", {}).items():
            rows.append({"quantity": f"t_draft: {tag}, top-{b} per slot", "ms": 1e3 * t, "× t_decode": t / t_dec})
    return pd.DataFrame(rows)


def markdown_html(text: str) -> str:
    """An extra section's markdown (:attr:`dflash_eval.report.build.ReportData.extra`) as HTML: python-markdown with its ``tables`` and
    ``fenced_code`` extensions, pipe tables as the report's tables (``table.data``, each scrollable); raw HTML in
    ``text`` is escaped, not passed through (the page stays self-contained)."""
    md = markdown.Markdown(extensions=["tables", "fenced_code"], output_format="html")
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    html = md.convert(text)
    return html.replace("<table>", '<div class="scroll"><table class="data">').replace("</table>", "</table></div>")
