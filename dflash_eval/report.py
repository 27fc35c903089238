"""The markdown report of a run (``results/<run>/report.md``), built from the same data as tau.csv."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from .errors import atomic_path
from .metrics import aggregate
from .summary import summary_frame


def _md_table(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(map(str, cols)) + " |", "|" + "---|" * len(cols)]
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            cells.append(f"{v:.3f}" if isinstance(v, float) else ("" if pd.isna(v) else str(v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_report(summary_csv, evals: list[str], caches: list[str], out, extra: list[str] | None = None,
                 prompts_meta: list[str] | None = None) -> None:
    """Markdown report: tau pivot, acceptance histograms, prompt-set skip counts, cache provenance, extra JSON sections.

    ``prompts_meta``: ``<set>.meta.json`` files of the prompts stage
    (:func:`dflash_eval.prompts.read_prompt_meta`), shown as one table of skip counts per reason.

    ``summary_csv`` is the run's tau.csv (a dependency: the tables are rebuilt from ``evals`` at full
    precision, tau.csv being rounded to 4 decimals).
    """
    df = summary_frame(evals)  # full precision (tau.csv is rounded to 4 decimals)
    parts = ["# dflash-eval report", ""]
    if df["random_init"].any():
        parts += ["> **Random-init drafters** (marked `random_init`) are untrained: their tau only shows that the "
                  "pipeline runs. It is not a measurement of a drafter.", ""]
    keyed = df.assign(step=df["step"].astype("string").fillna(""))  # a missing step must not drop the row
    pivot = keyed.pivot_table(index=["checkpoint", "step"], columns="prompt_set", values="tau").reset_index()
    pivot = pivot.sort_values(["step", "checkpoint"], key=lambda c: pd.to_numeric(c, errors="coerce") if c.name == "step" else c)
    parts += ["## Acceptance length tau (per verify step, bonus token included)", "", _md_table(pivot), "",
              "## Full table", "", _md_table(df), ""]
    parts += ["## Acceptance histograms", "",
              "Fraction of verify steps that committed k tokens (k = accepted drafts + bonus).", ""]
    results = [json.loads(Path(p).read_text()) for p in evals]
    results.sort(key=lambda r: (r["prompt_set"], r.get("step") is None, r.get("step") or 0, r["checkpoint"]))
    for r in results:
        histogram = aggregate([s["acceptance_lengths"] for s in r["samples"]], r["block_size"]).histogram
        total = sum(histogram.values()) or 1
        hist = " ".join(f"{k}:{v / total:.2f}" for k, v in histogram.items() if v)
        parts.append(f"- `{r['checkpoint']}` / `{r['prompt_set']}`: {hist}")
    parts.append("")
    if prompts_meta:
        from .prompts import read_prompt_meta, skip_table_markdown

        metas = {Path(p).name[: -len(".meta.json")]: read_prompt_meta(p) for p in prompts_meta}
        parts += ["## Prompt sets", "", "Prompts available in each source, written to the set, and left out "
                  "per reason (loader skips over the whole source; too long: met before n were taken).", "",
                  skip_table_markdown(metas), ""]
    if caches:
        from .cache import CacheReader

        parts += ["## Hidden-state caches", ""]
        for c in caches:
            with CacheReader(c) as rd:
                a = rd.attrs
                keys = ["target_name", "target_sha256", "target_layer_ids", "dtype", "device", "device_name",
                        "torch_version", "transformers_version", "fla_version", "linear_attn_kernel", "n_samples"]
                parts.append(f"- `{Path(c).name}`: " + ", ".join(f"{k}={a.get(k)}" for k in keys))
        parts.append("")
    for path in extra or []:
        data = json.loads(Path(path).read_text())
        parts += [f"## {data.get('title', Path(path).stem)}", "", data.get("markdown", "```\n" + json.dumps(data, indent=1) + "\n```"), ""]
    with atomic_path(out) as tmp:
        tmp.write_text("\n".join(parts))
