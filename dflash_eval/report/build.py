"""The run's report, built: its data, tables, figures, markdown and HTML (written by :mod:`dflash_eval.stages.report`).

Everything is recomputed from the per-sample acceptance lists of the evaluate JSONs
(:func:`dflash_eval.report.tau_table.summary_frame`, :mod:`dflash_eval.replay.metrics`), the caches'
attributes and the measured target costs -- the same data as ``tau.csv`` -- and rendered
twice: as HTML (matplotlib figures as base64 PNG, tables by pandas' ``Styler``, the extra
sections' markdown by python-markdown, the page by a Jinja2 template, ``templates/report.html.j2``;
no network access needed to view it)
and as markdown for terminals and CI logs. ``--figures-dir`` also writes each figure as a
PNG file, which Snakemake's own report (``snakemake --report``) shows.

Contents, each adapting to what the data has:

* tau against training step: one panel per method -- the DFlash chain and each DDTree
  budget whose ``tau_ddtree_<budget>`` column the tau table has -- one line per prompt set
  (per variant and prompt set when DFlash 1 and DFlash 2 checkpoints share the table);
* DFlash 1 vs DFlash 2: the best checkpoint of each variant per prompt set
  (:func:`dflash_eval.report.tables.variant_comparison`);
* the DFlash 2 selector diagnostics: a compact table (:func:`dflash_eval.report.tables.selector_table`)
  and their per-slot rates as a figure; no table of the report has a column per slot;
* the tau table: checkpoints grouped by run (DFlash 1, then DFlash 2), each run in training
  order, per prompt set tau and its change against the run's previous step, the best checkpoint
  per prompt set highlighted; DDTree budgets side by side when present (checkpoints without a
  DDTree value, DFlash 2's, left out); the full tau.csv at the end;
* the estimated decode speedup ``tau * t_decode / (t_verify(n) + t_draft)`` per checkpoint
  and method, the best method per checkpoint, from costs measured on the run's own device
  (:mod:`dflash_eval.target.costs`), labelled as an estimate with that device; with costs timed
  at 2+ contexts, the break-even tau and the speedup per prompt-length bin against context (:mod:`dflash_eval.report.speed`);
* tau without the samples whose completion loops beside tau in the headline table, and a note per prompt set
  (:mod:`dflash_eval.report.loops`, the loop columns of ``tau.csv``);
* acceptance-length histograms per checkpoint and prompt set;
* tau against context: per prompt set with responses in 2 or more prompt-length bins, tau per bin with +-1.96 SE
  and the bins past the drafter's trained length marked (:mod:`dflash_eval.report.context`); the tau table notes
  a set that mixes prompts within and beyond it;
* per-slot conditional acceptance ``P(slot k accepted | slots < k accepted)`` of the chain
  and tau by position in the response, when the tau table has them (``accept_slot_<k>``,
  ``tau_pos_<lo>_<hi>`` columns, computed by :mod:`dflash_eval.replay.metrics`);
* target agreement per prompt set: the share of completion tokens equal to the target's
  teacher-forced argmax in the cache (sample attribute ``argmax_agreement``, pooled over
  completion tokens);
* provenance: target fingerprint, cached layer ids, kernels, versions, devices, dtypes,
  the workflow config's hash, and the cost measurement's device.
"""

from __future__ import annotations

import base64
import html as html_lib
import json
import math
import re
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape

from dflash_eval import __version__
from dflash_eval.core.io import read_json_object
from dflash_eval.data.provenance import read_prompt_meta, skip_table_rows
from dflash_eval.report import compare as K
from dflash_eval.report import context as C
from dflash_eval.report.agreement import agreement_frame
from dflash_eval.report.loops import NOLOOP_HEADER, has_loops, loop_notes, side_by_side, with_loop_columns
from dflash_eval.report.records import job_histogram, load_offline
from dflash_eval.report.tables import (COMPARISON_NOTE, FULL_NOTE, SAMPLING_NOTE, SELECTOR_NOTE, best_rows,
                                       costs_table, markdown_html, prompt_length_table, sampling_tables, selector_rows,
                                       selector_slot_text, selector_table, selector_title, slot_text, variant_comparison,
                                       variants_title, without_slot_columns)
from dflash_eval.report.tau_table import (TABLE_KEY, checkpoint_order, method_columns, primary_rows,
                                          sampled_sets_note, speedup_frame, summary_frame, with_speedups)
from dflash_eval.report.speed import context_figures, context_html, context_markdown, speedup_pivot
from dflash_eval.report.speed import costs_warning as _costs_mismatch
from dflash_eval.target.costs import FORMULA, ddtree_budgets, device_label, read_costs

SLOT_PREFIX, POS_PREFIX, PROMPT_PREFIX = "accept_slot_", "tau_pos_", "tau_prompt_"

CITATIONS = [
    ("DFlash: Block Diffusion for Flash Speculative Decoding (Chen, Liang, Liu), arXiv:2602.06036",
     "https://arxiv.org/abs/2602.06036"),
    ("Accelerating Speculative Decoding with Block Diffusion Draft Trees (DDTree; Ringel, Romano), arXiv:2604.12989",
     "https://arxiv.org/abs/2604.12989"),
    ("liranringel/ddtree (reference code: budget = drafted nodes, verify of budget + 1 rows)",
     "https://github.com/liranringel/ddtree"),
    ("CaDDTree: Cost-Aware Diffusion Draft Trees, arXiv:2606.01813; ZhangShuai1230/CaDDTree cost_model.py "
     "(throughput-optimal budget: max (1 + Phi(n)) / (C_d + C_v(n)))", "https://github.com/ZhangShuai1230/CaDDTree"),
]


# --------------------------------------------------------------------------- data

@dataclass
class ReportData:
    """Everything the report shows; built by :func:`load_report_data`, rendered by the writers."""

    frame: pd.DataFrame  #: the tau table at full precision (plus any tau_ddtree_<B> columns)
    hists: dict  #: (checkpoint, prompt_set) -> (block_size, {k: verify steps})
    slot_curves: dict  #: (checkpoint, prompt_set) -> {method: [p_1, ...]} (only where available)
    positions: list  #: [(bin label, tau_pos column)] with data
    agreement: pd.DataFrame  #: one row per prompt set
    caches: dict  #: prompt_set -> cache attributes
    costs: dict | None = None
    speedups: pd.DataFrame | None = None
    extra: list = field(default_factory=list)  #: (title, markdown, HTML or None: rendered from the markdown) of extra sections
    config_sha256: str | None = None
    run: str | None = None
    provenance: dict | None = None  #: tau.provenance.json: the dflash-eval commit and the settings
    prompt_lengths: list = field(default_factory=list)  #: [(bin label, tau_prompt column)] with data
    table: pd.DataFrame | None = None  #: tau.csv's rows and columns (every sampling setting, speedup columns)
    comparisons: pd.DataFrame | None = None  #: paired checkpoint comparisons (:func:`dflash_eval.report.compare.compare_frame`)

    @property
    def checkpoints(self) -> list[str]:
        return checkpoint_order(self.frame)

    @property
    def prompt_sets(self) -> list[str]:
        return sorted(self.frame["prompt_set"].unique())


def slot_columns(frame: pd.DataFrame) -> list[tuple[int, str]]:
    """``[(k, "accept_slot_<k>")]`` of the tau table, by slot."""
    cols = [(int(c[len(SLOT_PREFIX):]), c) for c in frame.columns if c.startswith(SLOT_PREFIX) and c[len(SLOT_PREFIX):].isdigit()]
    return sorted(cols)


def position_columns(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """``[("0-64", "tau_pos_0_64"), ...]``: position-bin columns holding any value, in table order."""
    return [(c[len(POS_PREFIX):].replace("_", "-"), c) for c in frame.columns
            if c.startswith(POS_PREFIX) and frame[c].notna().any()]


def prompt_length_columns(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """``[("0-128", "tau_prompt_0_128"), ...]``: prompt-length bins holding any response, in table order."""
    return [(c[len(PROMPT_PREFIX):].replace("_", "-"), c) for c in frame.columns
            if c.startswith(PROMPT_PREFIX) and frame[c].notna().any()]


def slot_curves(frame: pd.DataFrame) -> dict:
    """``{(checkpoint, prompt_set): {"chain": [p_1, ..., p_m]}}`` from the ``accept_slot_<k>`` columns
    (trailing empty slots of smaller block sizes dropped; rows without any value left out)."""
    cols = slot_columns(frame)
    out = {}
    for r in frame.to_dict("records"):
        ys = [float(r[c]) if pd.notna(r[c]) else math.nan for _, c in cols]
        while ys and math.isnan(ys[-1]):
            ys.pop()
        if ys:
            out[(r["checkpoint"], r["prompt_set"])] = {"chain": ys}
    return out


def load_report_data(evals: list[str], caches: list[str] = (), costs=None, extra: list[str] | None = None,
                     config_sha256: str | None = None, run: str | None = None,
                     prompts_meta: list[str] | None = None, provenance=None, summary=None) -> ReportData:
    """Collect the report's data from the run's files.

    Args:
        evals: the evaluate jobs' records (``results/<run>/eval/<ckpt>/<prompt_set>.records.parquet``; the rule
            passes these: tables, comparisons, histograms and drafter notes all come from them) or their JSONs
            (made into the same records: :func:`dflash_eval.report.records.load_offline`).
        caches: HDF5 caches (agreement and provenance).
        costs: ``target_costs.json`` path, or None (no speedup section).
        extra: JSON files with ``title`` + ``markdown`` (e.g. kernel parity).
        config_sha256: hash of the workflow config (provenance).
        run: run name (title).
        prompts_meta: ``<set>.meta.json`` files of the prompts stage (:func:`dflash_eval.data.provenance.read_prompt_meta`),
            shown as one section with the skip counts per reason.
        provenance: ``tau.provenance.json`` (summary's block): the commit and the settings under provenance.
        summary: ``tau.csv`` / ``tau.parquet``: the loop columns (:func:`dflash_eval.report.loops.with_loop_columns`).

    Raises:
        InputError: unreadable inputs."""
    offline = load_offline(evals)  # the evaluate outputs as records, read once: the tables and the paired bootstrap
    every = with_loop_columns(summary_frame(offline), summary, TABLE_KEY)
    frame = primary_rows(every)  # one row per pair: its first sampling setting; all settings: sampling_section
    hists, drafter_notes = {}, {}
    for _, r in offline.jobs:  # each job's records as its evaluate output (records.job_view): the metadata's notes
        hists[(r["checkpoint"], r["prompt_set"])] = (int(r["block_size"]), job_histogram(r))
        drafter_notes.update({f"- `{r['checkpoint']}`: {n}": None for n in r.get("drafter_notes") or []})  # once each
    agreement, cache_attrs = agreement_frame(list(caches))
    data = ReportData(frame=frame, hists=hists, slot_curves=slot_curves(frame), positions=position_columns(frame),
                      prompt_lengths=prompt_length_columns(frame), agreement=agreement, caches=cache_attrs,
                      config_sha256=config_sha256, run=run, provenance=read_json_object(provenance, "provenance",
                                                                                         "rerun summary") if provenance else None)
    if costs:
        data.costs = read_costs(costs)
        data.speedups = speedup_frame(frame, data.costs)
    data.table = with_speedups(every, data.costs)
    data.comparisons = K.comparisons(offline, every)  # every row kind: paired bootstrap intervals
    if prompts_meta:
        metas = {Path(p).name[: -len(".meta.json")]: read_prompt_meta(p) for p in prompts_meta}
        data.extra.append(prompt_sets_section(metas))
    if every["sampling"].nunique() > 1 or ("draft" in every and every["draft"].nunique() > 1):
        data.extra.insert(0, sampling_extra(every))
    if drafter_notes:  # strip's notes that need a look: sliding layers derived from use_sliding_window, huge weights
        data.extra.append(("Drafter notes", "What strip noted (strip_info.json).\n\n" + "\n".join(sorted(drafter_notes)),
                           None))
    for path in extra or []:
        d = read_json_object(path, "report section", f"rerun it: snakemake --forcerun {path}")
        data.extra.append((d.get("title", Path(path).stem), d.get("markdown", "```\n" + json.dumps(d, indent=1) + "\n```"),
                           None))
    return data


# --------------------------------------------------------------------------- tables

def sampling_section(every: pd.DataFrame) -> str:
    """Markdown of :func:`sampling_tables`, under :data:`SAMPLING_NOTE`."""
    piv, engines = sampling_tables(every)
    legend = "\n".join(f"- `{r.sampling}` [{r.draft}]: {r.engine}" for r in engines.itertuples()) \
        if engines is not None else ""
    return (SAMPLING_NOTE + "\n\n" + _md_table(piv)
            + (("\n\nThe engine setting that gives each column:\n\n" + legend) if legend else ""))


def sampling_extra(every: pd.DataFrame) -> tuple[str, str, str]:
    """The "Acceptance by sampling setting" section of :class:`ReportData` ``extra``: (title, markdown, HTML)."""
    piv, engines = sampling_tables(every)
    html = [_styled(piv, 4, "sampling").to_html()]
    if engines is not None and len(engines):
        html += ["<p>The engine setting that gives each column:</p>", _styled(engines, 0, "engines").to_html()]
    return "Acceptance by sampling setting", sampling_section(every), _html_section(SAMPLING_NOTE, html)


def prompt_sets_section(metas: dict[str, dict]) -> tuple[str, str, str]:
    """The "Prompt sets" section (skip counts per reason, :func:`dflash_eval.data.provenance.skip_table_rows`, of
    ``{prompt set: prompts meta}``): (title, markdown, HTML)."""
    note = ("Prompts available in each source, written to the set, and left out per reason (loader skips over the "
            "whole source; too long: met before n were taken).")
    head, rows = skip_table_rows(metas)
    skips = pd.DataFrame(rows, columns=head)
    return "Prompt sets", note + "\n\n" + _md_table(skips), _html_section(note, [_styled(skips, 0, "prompt-sets").to_html()])


def tau_pivot(data: ReportData, col: str = "tau") -> pd.DataFrame:
    """Checkpoints (training order, runs grouped: :func:`~dflash_eval.report.tau_table.checkpoint_order`) x prompt
    sets of ``col``, with the change against the previous checkpoint of the same run (``variant``).

    Columns: ``checkpoint``, ``step``, then per prompt set ``(<set>, "tau")`` and ``(<set>, "Δ prev")``
    as a two-level header (``Δ prev`` NaN on each run's first checkpoint); ``random_init`` appended when any
    checkpoint is random-init.
    """
    f = data.frame
    order = data.checkpoints
    piv = f.pivot_table(index="checkpoint", columns="prompt_set", values=col, dropna=False).reindex(order)
    first = f.drop_duplicates("checkpoint").set_index("checkpoint").reindex(order)
    runs = (first["variant"] if "variant" in first else pd.Series("", index=first.index)).fillna("").to_numpy()
    out = pd.DataFrame({("checkpoint", ""): order, ("step", ""): first["step"].to_numpy()})
    for ps in data.prompt_sets:
        v = piv[ps].to_numpy(dtype=float) if ps in piv else [math.nan] * len(order)
        out[(ps, "tau")] = v
        if has_loops(f):  # tau over the samples that do not loop, beside tau
            noloop = f[f["prompt_set"] == ps].set_index("checkpoint")["tau_noloop"]
            out[(ps, NOLOOP_HEADER)] = noloop.reindex(order).to_numpy(dtype=float)
        out[(ps, "Δ prev")] = pd.Series(v).groupby(runs).diff().to_numpy()
    if f["random_init"].any():
        out[("random_init", "")] = first["random_init"].to_numpy()
    out.columns = pd.MultiIndex.from_tuples(out.columns)
    return out


def best_checkpoints(data: ReportData) -> pd.DataFrame:
    """Per prompt set the checkpoint with the highest chain tau (ties: the earlier step)."""
    return best_rows(data.frame)


def ddtree_pivot(data: ReportData, prompt_set: str) -> pd.DataFrame:
    """One prompt set: checkpoints (training order) x (chain, DDTree budgets) tau.

    Columns ``checkpoint``, ``step`` (text), ``chain``, ``budget <B>`` per budget (floats). Checkpoints without any
    DDTree value on the set are left out: DFlash 2 drafters (``ddtree_applicable`` false, :data:`SELECTOR_NOTE`) and
    checkpoints not evaluated on it; the frame may be empty."""
    f = data.frame[data.frame["prompt_set"] == prompt_set].set_index("checkpoint").reindex(data.checkpoints)
    steps = f["step"].astype("Int64").astype("string").fillna("")  # 3507, not 3507.000
    out = pd.DataFrame({"checkpoint": data.checkpoints, "step": steps.to_numpy()})
    for col, label in method_columns(data.frame):
        out["chain" if col == "tau" else f"budget {col[len('tau_ddtree_'):]}"] = f[col].to_numpy(dtype=float)
    return out.dropna(subset=[c for c in out.columns if c.startswith("budget ")], how="all").reset_index(drop=True)


def ddtree_tables(data: ReportData) -> dict[str, pd.DataFrame]:
    """``{prompt set: ddtree_pivot}`` of the prompt sets with any DDTree value (``{}`` without DDTree budgets)."""
    if not ddtree_budgets(data.frame):
        return {}
    return {ps: t for ps in data.prompt_sets if len(t := ddtree_pivot(data, ps))}


def provenance(data: ReportData) -> pd.DataFrame:
    """Field x prompt set: target fingerprint, layers, kernels, versions, devices, dtypes."""
    fields = ["target_name", "target_sha256", "target_model_type", "num_target_layers", "target_layer_ids", "dtype",
              "storage", "device", "device_name", "torch_version", "transformers_version", "fla_version",
              "causal_conv1d_version", "linear_attn_backend", "linear_attn_kernel", "image", "completions_sha256",
              "n_samples", "created_at", "dflash_eval_version"]
    cols = {}
    for ps, a in data.caches.items():
        vals = {}
        for k in fields:
            v = a.get(k)
            if k == "linear_attn_kernel" and isinstance(v, str) and v.startswith("{"):
                try:
                    v = json.loads(v).get("backend", v)
                except ValueError:
                    pass
            vals[f"cache: {k}"] = "" if v is None else str(v)
        cols[ps] = vals
    f = data.frame
    run = {
        "evaluate: device": ", ".join(sorted(map(str, f["device"].dropna().unique()))),
        "evaluate: dtype": ", ".join(sorted(map(str, f["dtype"].dropna().unique()))),
        "evaluate: block sizes": ", ".join(str(b) for b in sorted(f["block_size"].unique())),
        "workflow config sha256": data.config_sha256 or "",
    }
    code = (data.provenance or {}).get("dflash_eval") or {}
    if code:  # tau.provenance.json: the commit (and below the settings) the table was made with
        run["dflash-eval commit"] = f"{code.get('commit') or 'no git checkout'}{' (dirty)' if code.get('dirty') else ''}"
    for stage, by_key in sorted(((data.provenance or {}).get("settings") or {}).items()):
        run.update({f"settings: {stage}" + ("" if key == "run" else f" [{key}]"): ", ".join(
            f"{k}={json.dumps(v)}" for k, v in sorted(values.items())) for key, values in sorted(by_key.items())})
    if data.costs:
        c = data.costs
        run.update({"costs: device": f"{c['device']} ({c['device_name']})", "costs: dtype": c["dtype"],
                    "costs: target sha256": c["target"]["sha256"],
                    "costs: torch / transformers": f"{c['torch_version']} / {c['transformers_version']}",
                    "costs: measured at": c["measured_at"]})
    run["report: dflash-eval / pandas / matplotlib"] = (f"{__version__} / {pd.__version__} / "
                                                       f"{metadata.version('matplotlib')}")
    table = pd.DataFrame(cols) if cols else pd.DataFrame()
    run_rows = pd.DataFrame({ps: run for ps in (cols or {"run": None})})
    return pd.concat([table, run_rows]) if len(table) else run_rows


# --------------------------------------------------------------------------- markdown

def _fmt(v, digits: int) -> str:
    if isinstance(v, (bool,)) or v is pd.NA:
        return "" if v is pd.NA else str(v)
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.{digits}f}"
    return "" if pd.isna(v) else str(v)


def _md_table(df: pd.DataFrame, digits: int = 3) -> str:
    cols = [" ".join(str(x) for x in c if x) if isinstance(c, tuple) else str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in df.itertuples(index=False):
        lines.append("| " + " | ".join(_fmt(v, digits) for v in row) + " |")
    return "\n".join(lines)


def render_markdown(data: ReportData) -> str:
    """``report.md``: the same numbers as the HTML, as markdown tables and text histograms."""
    f = data.frame
    parts = [f"# dflash-eval report{f': {data.run}' if data.run else ''}", ""]
    if f["random_init"].any():
        parts += ["> **Random-init drafters** (marked `random_init`) are untrained: their tau only shows that the "
                  "pipeline runs. It is not a measurement of a drafter.", ""]
    loops = has_loops(f)  # then each set's tau without the looping samples beside its tau
    piv = f.assign(step=f["step"].astype("string").fillna("")).pivot_table(
        index=["checkpoint", "step"], columns="prompt_set", values=["tau", "tau_noloop"] if loops else "tau").reset_index()
    piv = side_by_side(piv) if loops else piv
    piv = piv.set_index("checkpoint").reindex(data.checkpoints).reset_index()
    parts += ["## Acceptance length tau (per verify step, bonus token included)", "", _md_table(piv), ""]
    note = sampled_sets_note(f)
    if note:
        parts += [note, ""]
    parts += [f"> Mixed regimes: {n}\n" for n in C.regime_notes(f)]  # tau against context
    parts += [f"{n}\n" for n in loop_notes(f, _summary_settings(data))]
    best = best_checkpoints(data)
    parts += ["Best checkpoint per prompt set: " + "; ".join(
        f"{r.prompt_set}: `{r.checkpoint}` (tau {r.tau:.3f})" for r in best.itertuples()), ""]
    noise = K.section(data.comparisons, _md_table, _styled)
    parts += ["## Checkpoints within noise", "", noise[0], ""] if noise else []

    cmp = variant_comparison(f)
    if cmp is not None:
        parts += [f"## {variants_title(f)}", "", COMPARISON_NOTE, "", _md_table(cmp), ""]
    ddtree = ddtree_tables(data)
    if ddtree:
        parts += ["## DDTree: tau per node budget", ""]
        for ps, t in ddtree.items():
            parts += [f"### {ps}", "", _md_table(t), ""]
    sel = selector_table(f)
    if sel is not None:
        parts += [f"## {selector_title(f)}", "", SELECTOR_NOTE, "", _md_table(sel), "",
                  "By draft slot (slots 1, 2, ...; 2 decimals):", "", _md_table(selector_slot_text(f)), ""]
    if data.speedups is not None and len(data.speedups):
        c = data.costs
        parts += ["## Estimated decode speedup", "",
                  f"**Estimate** from costs measured on **{device_label(c)}**, batch 1, context "
                  f"{c['context_tokens']} tokens: `{FORMULA}` (DFlash arXiv:2602.06036; DDTree arXiv:2604.12989; "
                  "CaDDTree arXiv:2606.01813). Not a measured end-to-end speedup.", ""]
        warn = _costs_mismatch(data)
        if warn:
            parts += [f"> **Warning:** {warn}", ""]
        for ps in data.prompt_sets:
            parts += [f"### {ps}", "", _md_table(speedup_pivot(data, ps), 2), ""]
        parts += context_markdown(data, _md_table)  # speedup and break-even against context (2+ timed contexts)
    parts += ["## Full table", "", FULL_NOTE, "", _md_table(without_slot_columns(data.table if data.table is not None
                                                                                 else f)), ""]
    parts += ["## Acceptance histograms", "",
              "Fraction of verify steps that committed k tokens (k = accepted drafts + bonus).", ""]
    for ps in data.prompt_sets:
        for ck in data.checkpoints:
            if (ck, ps) not in data.hists:
                continue
            _, h = data.hists[(ck, ps)]
            total = sum(h.values()) or 1
            parts.append(f"- `{ck}` / `{ps}`: " + " ".join(f"{k}:{v / total:.2f}" for k, v in h.items() if v))
    parts.append("")
    if data.slot_curves:
        parts += ["## Per-slot conditional acceptance", "",
                  "P(draft slot k accepted | slots 1..k-1 accepted), pooled over verify steps.", "",
                  _md_table(slot_text(f, [c for _, c in slot_columns(f)], "P(accepted), slots 1, 2, ...")), ""]
    if data.positions:
        parts += ["## Acceptance by position in the response", "",
                  "Tokens per verify step over the steps whose anchor lies at that completion position.", "",
                  _md_table(f[["checkpoint", "prompt_set"] + [c for _, c in data.positions]]), ""]
    if data.prompt_lengths:
        parts += ["## Acceptance by prompt length", "",
                  "tau of the responses whose templated prompt has that many tokens (responses in brackets).", "",
                  _md_table(prompt_length_table(f, data.prompt_lengths)), ""]
    parts += C.markdown(f, _md_table)
    if len(data.agreement):
        parts += ["## Target agreement", "",
                  "Share of completion tokens equal to the target's teacher-forced argmax in the cache.", "",
                  _md_table(data.agreement, 4), ""]
    if data.caches:
        parts += ["## Provenance", "", _md_table(provenance(data).reset_index(names="field"), 4), ""]
    for title, md, _ in data.extra:
        parts += [f"## {title}", "", md, ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- HTML

_BEST = "background-color: #c8f0c8; font-weight: bold"


def _styled(df: pd.DataFrame, digits: int = 4, table_id: str = "table"):
    """A Styler with ``digits`` decimals, NaN as empty, no index; the table's id is ``T_<table_id>``."""
    st = df.style.format(precision=digits, na_rep="", thousands=None, escape="html").hide(axis="index")
    return st.set_uuid(table_id).set_table_attributes(f'class="data" data-table="{table_id}"')


def _inline_html(text: str) -> str:
    """A markdown sentence as HTML: escaped, `code` and *italics* kept."""
    t = html_lib.escape(text, quote=False)
    return re.sub(r"\*([^*]+)\*", r"<i>\1</i>", re.sub(r"`([^`]+)`", r"<code>\1</code>", t))


def _html_section(note: str, tables: list[str]) -> str:
    """An extra section's HTML: the note as a paragraph, then the tables (Styler HTML), each scrollable."""
    return f"<p>{_inline_html(note)}</p>" + "".join(t if t.startswith("<p>") else f'<div class="scroll">{t}</div>'
                                                    for t in tables)


def _tau_table_html(data: ReportData) -> str:
    piv = tau_pivot(data)
    st = _styled(piv, table_id="tau-table")
    tau_cols = [c for c in piv.columns if c[1] == "tau"]
    delta_cols = [c for c in piv.columns if c[1] == "Δ prev"]
    st = st.highlight_max(subset=tau_cols, axis=0, props=_BEST)
    st = st.format("{:+.4f}", subset=delta_cols, na_rep="")
    st = st.map(lambda v: "color: #1a7f1a" if v > 0 else ("color: #b00020" if v < 0 else ""), subset=delta_cols)
    return st.to_html()


def _row_best_html(df: pd.DataFrame, numeric: list[str], digits: int, table_id: str) -> str:
    st = _styled(df, digits, table_id).highlight_max(subset=numeric, axis=1, props=_BEST)
    return st.to_html()


def _img(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def build_figures(data: ReportData) -> dict[str, tuple[str, bytes]]:
    """``{file name: (caption, PNG bytes)}`` of every figure the data supports, in page order."""
    from dflash_eval.report import figures as F  # deferred: matplotlib (1 s); report --help stays matplotlib-free (tests/core/test_startup.py)

    out = {}

    def add(name, caption, fig):
        out[name] = (caption, F.png(fig))

    add("tau_vs_step.png", "tau against training step, one line per prompt set (per variant and prompt set with "
        "DFlash 1 and DFlash 2 checkpoints: solid DFlash 1, dashed DFlash 2); one panel per method "
        "(the DFlash chain, and each DDTree budget when the tau table has it).", F.tau_vs_step(data.frame))
    if data.speedups is not None and len(data.speedups):
        label = device_label(data.costs)
        add("speedup.png", f"Estimated decode speedup per checkpoint against tokens per verify forward; {label}.",
            F.speedup_vs_budget(data.speedups, label))
        add("verify_costs.png", f"Measured target forward time over one decode step; {label}.",
            F.verify_costs(data.costs, label))
        out.update({k: (cap, F.png(fig)) for k, (cap, fig) in context_figures(data, label, F).items()})
    for ps in data.prompt_sets:
        cks = [c for c in data.checkpoints if (c, ps) in data.hists]
        add(f"hist_{_slug(ps)}.png", f"Acceptance-length histograms, {ps}: fraction of verify steps that committed "
            "k tokens (accepted drafts + bonus).", F.histograms(ps, cks, data.hists))
    for ps in data.prompt_sets:
        cks = [c for c in data.checkpoints if (c, ps) in data.slot_curves]
        if cks:
            add(f"slots_{_slug(ps)}.png", f"Per-slot conditional acceptance, {ps}: P(draft slot k accepted | "
                "slots 1..k-1 accepted), pooled over verify steps.", F.slot_curves(ps, cks, data.slot_curves))
    sel = selector_rows(data.frame)
    if len(sel):
        add("selector_slots.png", f"{selector_title(data.frame)} by draft slot, per prompt set (temperature 0): top-K "
            "recall (the target token is among the slot's candidates) and pick rate (the selector picks it, given "
            "the earlier picks were right), one line per checkpoint.", F.selector_slots(sel))
    if data.positions:
        add("position.png", "Tokens per verify step by the anchor's position in the response (bins of completion "
            "tokens), one line per checkpoint.", F.position_tau(data.frame, data.positions))
    pooled = C.with_pooled(data.frame)
    for ps in C.context_sets(pooled):  # tau against context (every greedy set pooled first)
        add(C.figure_name(ps), C.CAPTION.format(ps=ps), F.tau_vs_context(pooled, ps))
    return out


def _best_lines(data: ReportData) -> list[dict]:
    """Best checkpoint per prompt set (chain tau) and, with costs, the fastest (checkpoint, method) estimate."""
    lines = []
    for r in best_checkpoints(data).itertuples():
        line = {"prompt_set": r.prompt_set, "checkpoint": r.checkpoint, "tau": f"{r.tau:.4f}",
                "step": "" if pd.isna(r.step) else str(int(r.step)), "speedup": "",
                "noise": K.best_verdict(data.comparisons, data.frame, r.prompt_set, r.checkpoint)}
        if data.speedups is not None and len(data.speedups):
            s = data.speedups[(data.speedups["prompt_set"] == r.prompt_set)].dropna(subset=["speedup"])
            if len(s):
                top = s.loc[s["speedup"].idxmax()]
                line["speedup"] = f"{top['speedup']:.2f}× with {top['method']} on {top['checkpoint']}"
        lines.append(line)
    return lines


def _summary_settings(data: ReportData) -> dict | None:
    """The ``summary`` settings (``loops``) recorded in ``tau.provenance.json``, or None."""
    return (((data.provenance or {}).get("settings") or {}).get("summary") or {}).get("run")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def render_html(data: ReportData, figures: dict[str, tuple[str, bytes]]) -> str:
    """``report.html``: one self-contained page (inline CSS, figures as data: URIs, no scripts)."""
    f = data.frame
    ddtree = {ps: _row_best_html(d, [c for c in d.columns if c not in ("checkpoint", "step")], 4, f"ddtree-{_slug(ps)}")
              for ps, d in ddtree_tables(data).items()}
    speed = None
    if data.speedups is not None and len(data.speedups):
        speed = {
            "label": device_label(data.costs),
            "costs": data.costs,
            "formula": FORMULA,
            "warning": _costs_mismatch(data),
            "tables": {ps: _row_best_html(d := speedup_pivot(data, ps), [c for c in d.columns if c not in ("checkpoint", "best")],
                                          2, f"speedup-{_slug(ps)}") for ps in data.prompt_sets},
            "costs_table": _styled(costs_table(data.costs), 3, "costs").to_html(),
            "context": context_html(data, _styled),  # against context: None with one timed context
        }
    full = _styled(without_slot_columns(data.table if data.table is not None else f), 4, "tau-csv").to_html()
    sel = selector_table(f)
    cmp = variant_comparison(f)
    env = Environment(loader=PackageLoader("dflash_eval", "templates"), autoescape=select_autoescape(["html", "j2"]))
    return env.get_template("report.html.j2").render(
        run=data.run, generated=time.strftime("%Y-%m-%d %H:%M:%S %Z"), random_init=bool(f["random_init"].any()),
        methods=[label for _, label in method_columns(f)], prompt_sets=data.prompt_sets,
        checkpoints=data.checkpoints, best=_best_lines(data), tau_table=_tau_table_html(data),
        ddtree=ddtree, speed=speed, figures={k: (cap, _img(b)) for k, (cap, b) in figures.items()},
        slots=bool(data.slot_curves), positions=bool(data.positions),
        prompt_lengths=_styled(prompt_length_table(f, data.prompt_lengths), 3, "prompt-lengths").to_html()
        if data.prompt_lengths else None,
        agreement=_styled(data.agreement, 4, "agreement").to_html() if len(data.agreement) else None,
        provenance=_styled(provenance(data).reset_index(names="field"), 4, "provenance").to_html(),
        extra=[(title, html or markdown_html(md)) for title, md, html in data.extra], full_table=full, citations=CITATIONS, selector_note=SELECTOR_NOTE,
        sampled_note=sampled_sets_note(f), regime_notes=C.regime_notes_html(f, _inline_html),
        loop_notes=[_inline_html(n) for n in loop_notes(f, _summary_settings(data))],
        context=C.html(f, {k: (cap, _img(b)) for k, (cap, b) in figures.items()}, _styled, _inline_html),
        selector=_styled(sel, 4, "selector").to_html() if sel is not None else None, full_note=FULL_NOTE,
        selector_title=selector_title(f) if sel is not None else None,
        variants_title=variants_title(f) if cmp is not None else None,
        comparison=_styled(cmp, 4, "variants").to_html() if cmp is not None else None, comparison_note=COMPARISON_NOTE,
        noise=(K.section(data.comparisons, _md_table, _styled) or (None, None))[1])
