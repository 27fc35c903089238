"""tau tables and the report.

``tau.csv`` / ``tau.parquet`` (the output contract other tools read): one row per
(checkpoint, prompt set) with columns

======================  =====================================================================
checkpoint              drafter name (the ``{ckpt}`` wildcard)
step                    training step (checkpoint metadata or name), empty when unknown
prompt_set              prompt set name
n_samples               responses with at least one verify step
tau                     mean over responses of (mean over verify steps of a+1), bonus included,
                        prefill token excluded (z-lab ``dflash/benchmark.py``)
tau_tokens_per_step     committed tokens / verify steps, pooled over responses
mean_accepted           tau - 1: accepted drafts per verify step (macro)
block_size              B used in the replay
n_skipped               responses with no verify step (prefill token ended them)
verify_steps            total verify steps (= target forwards after prefill)
committed_tokens        total tokens committed by verify steps
random_init             True for randomly initialised (untrained) demo drafters
device, dtype           where and in which precision the replay ran
======================  =====================================================================
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd

from .errors import atomic_path

log = logging.getLogger(__name__)

COLUMNS = ["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step", "mean_accepted",
           "block_size", "n_skipped", "verify_steps", "committed_tokens", "random_init", "device", "dtype"]


def summary_frame(evals: list[str]) -> pd.DataFrame:
    """Rows of the tau table from evaluate outputs (see module docstring)."""
    rows = []
    for path in evals:
        r = json.loads(Path(path).read_text())
        rows.append({
            "checkpoint": r["checkpoint"],
            "step": r.get("step"),
            "prompt_set": r["prompt_set"],
            "n_samples": r["n_samples"],
            "tau": r["tau"],
            "tau_tokens_per_step": r["tau_tokens_per_step"],
            "mean_accepted": r["tau"] - 1.0,
            "block_size": r["block_size"],
            "n_skipped": r["n_skipped"],
            "verify_steps": r["verify_steps"],
            "committed_tokens": r["committed_tokens"],
            "random_init": r.get("random_init", False),
            "device": r.get("device"),
            "dtype": r.get("dtype"),
        })
    df = pd.DataFrame(rows, columns=COLUMNS)
    df["step"] = df["step"].astype("Int64")
    return df.sort_values(["prompt_set", "step", "checkpoint"], na_position="last").reset_index(drop=True)


def write_summary(evals: list[str], out_csv, out_parquet) -> pd.DataFrame:
    """Write ``tau.csv`` and ``tau.parquet`` atomically; returns the frame."""
    df = summary_frame(evals)
    with atomic_path(out_csv) as tmp:
        df.to_csv(tmp, index=False, float_format="%.4f")
    with atomic_path(out_parquet) as tmp:
        df.to_parquet(tmp, index=False)
    log.info("tau table:\n%s", df[["checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step"]].to_string(index=False))
    return df


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


def write_report(summary_csv, evals: list[str], caches: list[str], out, extra: list[str] | None = None) -> None:
    """Markdown report: tau pivot, acceptance histograms, cache provenance, extra JSON sections.

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
        total = sum(r["histogram"].values()) or 1
        hist = " ".join(f"{k}:{v / total:.2f}" for k, v in r["histogram"].items() if v)
        parts.append(f"- `{r['checkpoint']}` / `{r['prompt_set']}`: {hist}")
    parts.append("")
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
