"""The report's speedup sections: the single-context estimate's pivot and warning, and the speedup and
break-even against context (:mod:`dflash_eval.target.cost_context`) when ``target_costs`` timed 2+ contexts.

Rendered by :mod:`dflash_eval.report.build` (markdown and HTML) from its ``ReportData``; the figure is
:func:`dflash_eval.report.figures.break_even_vs_context`.

Against context, per prompt set and checkpoint (the tau table's primary rows: each pair's first sampling
setting): the chain's tau per prompt-length bin (``tau_prompt_<lo>_<hi>``) turned into a speedup at the
bin's representative context and each timed batch size, and the context up to which the checkpoint pays;
the break-even tau of every drafter configuration (chain and DDTree budgets) at each timed context and batch.
"""
from __future__ import annotations

import re

import pandas as pd

from dflash_eval.report.tau_table import checkpoint_order
from dflash_eval.target import cost_context as CC
from dflash_eval.target.cost_stats import assess

PROMPT_PREFIX = "tau_prompt_"

CONTEXT_NOTE = (
    "Break-even tau = (t_verify(n) + t_draft) / t_decode: the acceptance length at which speculative decoding "
    "only matches plain decoding, from the costs timed at each context and batch size (random KV caches of that "
    "shape). Between timed contexts the costs are interpolated linearly in the context, outside them held at the "
    "nearest timed value. Speedup per prompt-length bin = tau_bin * t_decode(c) / (t_verify(c, n) + t_draft(c)) "
    "at the bin's representative context c: its midpoint, 1.5 x its lower edge for the open last bin (the "
    "generated tokens come on top). *pays up to context X*: the first bin (with prompts) whose tau is at or below "
    "the break-even starts at X. Chain (DFlash block) only: the tau table has no DDTree tau per bin. Sources: "
    "DFlash arXiv:2602.06036; CaDDTree arXiv:2606.01813 cost_model.py.")


# --------------------------------------------------------------------------- single context (moved from build.py)

def speedup_pivot(data, prompt_set: str) -> pd.DataFrame:
    """One prompt set: checkpoints x methods estimated speedup, plus the best method."""
    s = data.speedups[data.speedups["prompt_set"] == prompt_set]
    piv = s.pivot_table(index="checkpoint", columns="method", values="speedup", dropna=False).reindex(data.checkpoints)
    methods = sorted(piv.columns, key=lambda m: (m != "chain", int(m.split("_")[-1]) if m != "chain" else 0))
    out = pd.DataFrame({"checkpoint": data.checkpoints})
    for m in methods:
        out[m] = piv[m].to_numpy(dtype=float)
    best = s[s["best"]].set_index("checkpoint")["method"].reindex(data.checkpoints)
    out["best"] = best.fillna("").to_numpy()
    return out


def costs_warning(data) -> str | None:
    """The warnings of the speedup section: costs of another target; a noisy estimate (:mod:`dflash_eval.target.cost_stats`)."""
    if not data.costs:
        return None
    warnings = []
    shas = {a.get("target_sha256") for a in data.caches.values()} - {None}
    if shas and data.costs["target"]["sha256"] not in shas:
        warnings.append(f"the costs were measured on a target with sha256 {data.costs['target']['sha256'][:16]}, the "
                        f"caches hold {sorted(s[:16] for s in shas)}: re-run target_costs")
    verdict = assess(data.costs)
    if not verdict["reliable"]:
        warnings.append(f"unreliable estimate (estimate_reliable = False): the timings are too noisy for these "
                        f"numbers to mean much ({'; '.join(verdict['reasons'])}; bound {verdict['bound']:.0%}). "
                        "Re-run target_costs on a quiet machine, or with more target_costs.repeats")
    return " — ".join(warnings) or None


# --------------------------------------------------------------------------- against context

def has_context_section(data) -> bool:
    """Whether the report gets the section: costs timed at 2+ contexts and a tau table."""
    return bool(data.costs) and len(CC.contexts(data.costs)) >= 2 and len(data.frame) > 0


def drafter_groups(costs: dict) -> list[tuple[str, list[str], dict]]:
    """``[(label, checkpoints, drafter entry)]``: one per drafter configuration (``config_sha256``) of the costs."""
    groups: dict[str, list[str]] = {}
    for name, d in costs.get("drafters", {}).items():
        groups.setdefault(d.get("config_sha256", name), []).append(name)
    out = []
    for names in groups.values():
        d = costs["drafters"][names[0]]
        label = f"{names[0]}" + (f" (+{len(names) - 1} same config)" if len(names) > 1 else "")
        out.append((label, names, d))
    return out


def break_even_table(costs: dict) -> pd.DataFrame:
    """Break-even tau per drafter configuration, batch and method (rows) at each timed context (columns, tokens).

    Methods: ``chain`` (n = block size, causal) and ``ddtree_<budget>`` (n = budget + 1, tree mask), those timed at
    that batch; NaN where a context was not timed at that batch.
    """
    budgets = sorted({int(b) for e in costs["grid"] for d in e["drafters"].values() for b in d.get("draft_tree_s", {})})
    cs = CC.contexts(costs)
    rows = []
    for label, names, d in drafter_groups(costs):
        for b in CC.batch_sizes(costs):
            timed = {int(e["context_tokens"]) for e in CC.grid(costs, b)}
            methods = [("chain", int(d["block_size"]), "causal", None)] + [
                (f"ddtree_{k}", k + 1, "tree", k) for k in budgets]
            for method, n, mask, k in methods:
                vals = {str(c): CC.break_even_at(costs, c, b, names[0], n, mask, k) if c in timed else float("nan")
                        for c in cs}
                if all(pd.isna(v) for v in vals.values()):
                    continue
                rows.append({"drafter": label, "batch": b, "method": method, **vals})
    return pd.DataFrame(rows, columns=["drafter", "batch", "method", *map(str, cs)])


def bin_columns(frame: pd.DataFrame) -> list[str]:
    """Bin labels (``<lo>_<hi>``) of the ``tau_prompt_`` columns with any value, ascending."""
    cols = [c for c in frame.columns if c.startswith(PROMPT_PREFIX) and frame[c].notna().any()]
    return sorted((c[len(PROMPT_PREFIX):] for c in cols), key=lambda b: CC.parse_bin(b)[0])


def context_frame(data) -> pd.DataFrame:
    """Per (prompt set, checkpoint, batch): the chain speedup per prompt-length bin and the "pays up to" verdict.

    Returns:
        DataFrame with ``prompt_set, checkpoint, batch``, one column per bin with data (the bin label, ``<lo>-<hi>``:
        the speedup, NaN where the bin has no prompt) and ``pays`` (:func:`dflash_eval.target.cost_context.pays_label`).
    """
    f, costs = data.frame, data.costs
    bins = bin_columns(f)
    rows = []
    for r in f.to_dict("records"):
        if r["checkpoint"] not in costs.get("drafters", {}):
            continue
        taus = {b: r.get(PROMPT_PREFIX + b) for b in bins}
        for batch in CC.batch_sizes(costs):
            per_bin = CC.bin_speedups(costs, taus, batch, r["checkpoint"], int(r["block_size"]))
            rows.append({"prompt_set": r["prompt_set"], "checkpoint": r["checkpoint"], "batch": batch,
                         **{x["bin"].replace("_", "-"): x["speedup"] for x in per_bin},
                         "pays": CC.pays_label(CC.pays_up_to(per_bin))})
    out = pd.DataFrame(rows, columns=["prompt_set", "checkpoint", "batch", *(b.replace("_", "-") for b in bins), "pays"])
    order = {c: i for i, c in enumerate(checkpoint_order(f))}
    return out.sort_values(["prompt_set", "checkpoint", "batch"], key=lambda s: s.map(order) if s.name == "checkpoint"
                           else s, kind="stable").reset_index(drop=True)


def curve_frame(data) -> pd.DataFrame:
    """The figure's points: per (prompt set, checkpoint) the chain tau at each bin's representative context
    (``kind`` = ``tau``), and per (drafter configuration, batch) the chain break-even at the timed contexts
    (``kind`` = ``break_even``). Columns: ``kind, prompt_set, series, batch, context, value``."""
    f, costs = data.frame, data.costs
    rows = []
    for r in f.to_dict("records"):
        for b in bin_columns(f):
            v = r.get(PROMPT_PREFIX + b)
            if pd.notna(v):
                rows.append({"kind": "tau", "prompt_set": r["prompt_set"], "series": r["checkpoint"], "batch": pd.NA,
                             "context": CC.bin_context(*CC.parse_bin(b)), "value": float(v)})
    for label, names, d in drafter_groups(costs):
        for batch in CC.batch_sizes(costs):
            for e in CC.grid(costs, batch):
                c = int(e["context_tokens"])
                rows.append({"kind": "break_even", "prompt_set": None, "series": label, "batch": batch, "context": c,
                             "value": CC.break_even_at(costs, c, batch, names[0], int(d["block_size"]), "causal")})
    return pd.DataFrame(rows, columns=["kind", "prompt_set", "series", "batch", "context", "value"])


def grid_warning(costs: dict) -> str | None:
    """Which (context, batch) entries :func:`dflash_eval.target.cost_stats.assess` finds too noisy, or None."""
    bad = [f"{e['context_tokens']} x {e['batch_size']}" for e in costs["grid"] if not assess(e)["reliable"]]
    return (f"unreliable timings (runs spread beyond the bound, or a verify cost falling as n grows) at context x "
            f"batch {', '.join(bad)}: re-run target_costs on a quiet machine") if bad else None


def context_markdown(data, md_table) -> list[str]:
    """The section's markdown lines (``[]`` without 2+ timed contexts); ``md_table(df, digits)`` renders a table."""
    if not has_context_section(data):
        return []
    warn = grid_warning(data.costs)
    parts = ["## Speedup and break-even against context", "", CONTEXT_NOTE, "",
             *([f"> **Warning:** {warn}", ""] if warn else []), "### Break-even tau per context (tokens) and batch", "", md_table(break_even_table(data.costs), 2), "",
             "### Chain speedup per prompt-length bin (tokens) and batch", ""]
    cf = context_frame(data)
    for ps in data.prompt_sets:
        parts += [f"#### {ps}", "", md_table(cf[cf["prompt_set"] == ps].drop(columns="prompt_set"), 2), ""]
    return parts


def context_html(data, styled) -> dict | None:
    """The section's HTML parts for the template (None without 2+ timed contexts): ``note``, ``break_even`` and
    ``tables`` (prompt set -> HTML); ``styled(df, digits, table_id)`` is the report's Styler."""
    if not has_context_section(data):
        return None
    cf = context_frame(data)
    return {"note": CONTEXT_NOTE, "warning": grid_warning(data.costs), "break_even": styled(break_even_table(data.costs), 2, "break-even").to_html(),
            "tables": {ps: styled(cf[cf["prompt_set"] == ps].drop(columns="prompt_set"), 2,
                                  "context-speedup-" + re.sub(r"[^A-Za-z0-9_.-]", "_", ps)).to_html() for ps in data.prompt_sets}}


def context_figures(data, label: str, figures) -> dict:
    """``{"break_even_context.png": (caption, Figure)}`` when the section applies, else ``{}``; ``figures``: the module
    :mod:`dflash_eval.report.figures` (imported by the caller, when it draws: matplotlib)."""
    if not has_context_section(data):
        return {}
    return {"break_even_context.png": (
        f"Chain tau per prompt-length bin (at the bin's representative context) per checkpoint against the break-even "
        f"tau (t_verify + t_draft) / t_decode per batch size and drafter configuration, costs timed on {label}; a "
        "checkpoint pays where its tau lies above the break-even curve.", figures.break_even_vs_context(curve_frame(data)))}
