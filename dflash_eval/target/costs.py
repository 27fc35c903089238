"""The decode-cost model and the tau -> speedup estimate; the format of ``target_costs.json``.

Why: tau (acceptance length) counts tokens per verify step; what a user wants is wall-clock
speed on their hardware. With greedy speculative decoding each verify step costs one drafter
pass plus one target forward over ``n`` tokens and commits ``tau`` tokens on average, while
autoregressive decoding commits one token per single-token target forward. Hence the
estimate used in the report (costs measured by the ``target_costs`` stage,
:mod:`dflash_eval.stages.target_costs`)::

    speedup(n) = tau * t_decode / (t_verify(n) + t_draft)

* ``t_decode``: one autoregressive decode step of the target (1 new token) at batch 1;
* ``t_verify(n)``: one target forward over ``n`` new tokens at batch 1 -- ``n = block_size``
  for the DFlash chain (``[bonus, B-1 drafts]``, causal), ``n = budget + 1`` for a DDTree of
  ``budget`` drafted nodes (root + nodes, ancestor-only 4-D mask);
* ``t_draft``: one drafter pass over one block (context K/V of the newly committed
  positions, the block forward, the target LM head over the ``B - 1`` draft slots, argmax;
  for a tree also the full-vocabulary log-softmax + top-``budget`` per slot).

All three are the minimum of ``repeats`` timed runs after ``warmup`` untimed ones (interleaved
across shapes; verify costs fitted non-decreasing in ``n``; the statistic, the spread and the
``estimate_reliable`` flag: :mod:`dflash_eval.target.cost_stats`), with the
target's KV cache prefilled to ``context_tokens`` random tokens (copied before every timed
forward, outside the timed region), ``torch.cuda.synchronize()`` around each timed call on
GPU. Random token ids and random drafter weights: the costs depend on shapes, not values.

Sources of the cost model:

* DFlash (Chen, Liang, Liu, arXiv:2602.06036): one drafter pass per block instead of
  ``B - 1`` sequential drafter steps, so the drafting term stays a single forward; the
  per-token latency of speculative decoding is (draft time + verify time) / tau.
* DDTree (Ringel, Romano, arXiv:2604.12989; ``liranringel/ddtree``): a budget-``B`` tree is
  verified in one target forward over ``B + 1`` rows; its speedup peaks at a budget where
  the growth of tau no longer pays for the larger verify forward (paper Fig. 3).
* CaDDTree (arXiv:2606.01813; ``ZhangShuai1230/CaDDTree`` ``cost_model.py``): the
  throughput-optimal budget maximises ``(1 + Phi(n)) / (C_d + C_v(n; l))`` with a measured
  draft cost ``C_d`` and verify cost ``C_v`` for ``n`` nodes at context length ``l`` -- the
  same ratio as above with ``tau = 1 + Phi(n)``; the report picks the best measured budget
  per checkpoint with it (per run, not per round as CaDDTree does).

What the estimate leaves out (so it is an upper bound on what an implementation with the
same kernels gets): KV-cache bookkeeping, host-side tree construction, sampling, the
prefill, the drafter's own context prefill, and any difference between offline and online
tau. Costs are measured on the run's own device and never hard-coded.

Output JSON (``results/<run>/target_costs.json``, ``format = "dflash-eval/target-costs"``)::

    device, device_name, dtype, threads, torch_version, transformers_version, dflash_eval_version,
    target {path, sha256, model_type, num_layers, hidden_size, params},
    context_tokens, repeats, warmup, statistic = "min" (format 1: "median"),
    decode_s, decode_samples_s,
    verify: [{n, mask: "causal" | "tree", min_s, fit_s (non-decreasing in n: the one used), median_s,
              spread, samples_s}, ...],
    drafters: {<checkpoint>: {config, config_sha256, block_size, num_layers, draft_s,
                              draft_tree_s {<budget>: s}}},
    estimate_reliable, reliability {reliable, bound, worst_spread, worst, non_monotone, reasons},
    measured_at
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from dflash_eval.target.cost_stats import assess
from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/target-costs"
FORMAT_VERSION = 2
#: versions :func:`read_costs` reads (1: medians, no fit; assessed from its samples all the same)
READABLE_VERSIONS = (1, 2)
#: the formula as printed in the reports
FORMULA = "tau * t_decode / (t_verify(n) + t_draft)"


# --------------------------------------------------------------------------- estimate

def read_costs(path, expected: dict | None = None) -> dict:
    """Load a ``target_costs.json``.

    Args:
        expected: the settings the config gives (:meth:`dflash_eval.workflow.plan.Plan.expected_settings`; summary passes
            them): the file's provenance block must record its ``target_costs`` entry; None: not compared.

    Raises:
        InputError: unreadable, or not a dflash-eval target-costs file of this version; made with other
            target_costs settings than ``expected`` gives.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(path, None, f"cannot read the target costs ({err})", "re-run the target_costs rule") from None
    if data.get("format") != FORMAT or data.get("format_version") not in READABLE_VERSIONS:
        raise InputError(path, "format", f"expected {FORMAT} v{FORMAT_VERSION}, got {data.get('format')} "
                         f"v{data.get('format_version')}", "re-run the target_costs rule")
    if expected:
        from dflash_eval.data.provenance import check_settings

        check_settings(path, data.get("provenance"), expected, "run", "target_costs",
                       "rerun it with this config: snakemake --forcerun target_costs")
    return data


def speedup(tau: float, t_decode: float, t_verify: float, t_draft: float) -> float:
    """``tau * t_decode / (t_verify + t_draft)`` (all times in seconds; NaN when a term is missing)."""
    if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in (tau, t_decode, t_verify, t_draft)):
        return math.nan
    return tau * t_decode / (t_verify + t_draft)


def ddtree_budgets(frame) -> list[int]:
    """Budgets of the ``tau_ddtree_<budget>`` columns of a tau table, ascending (``[]`` when none)."""
    return sorted(int(c[len("tau_ddtree_"):]) for c in frame.columns
                  if c.startswith("tau_ddtree_") and c[len("tau_ddtree_"):].isdigit())


def method_speedups(r: dict, costs: dict, budgets: list[int]) -> list[dict]:
    """The estimate of every method of one tau-table row (the one place the report and ``tau.csv`` get it).

    Args:
        r: a tau-table row (``checkpoint``, ``block_size``, ``tau``, ``tau_ddtree_<budget>`` per budget).
        costs: :func:`read_costs` output.
        budgets: the DDTree budgets of the table (:func:`ddtree_budgets`).

    Returns:
        one dict per method, chain first: ``method`` (``chain`` or ``ddtree_<budget>``), ``budget`` (nodes;
        None for the chain), ``verify_tokens`` (n: the block size, or budget + 1), ``tau``, ``t_verify_s``,
        ``t_draft_s``, ``t_decode_s`` (seconds; NaN where not measured) and ``speedup`` (:func:`speedup`).
    """
    import pandas as pd

    verify = {(int(v["n"]), v["mask"]): float(v.get("fit_s", v["median_s"])) for v in costs["verify"]}
    t_dec = float(costs["decode_s"])
    d = costs["drafters"].get(r["checkpoint"], {})
    if d.get("block_size") is not None and int(d["block_size"]) != int(r["block_size"]):
        raise InputError(costs.get("output") or "target_costs.json", f"drafters.{r['checkpoint']}.block_size",
                         f"{d['block_size']}, but {r['checkpoint']} was evaluated at block size {r['block_size']}: the "
                         "costs were timed from another drafter config", "rerun target_costs (snakemake --forcerun "
                         "target_costs) after the run's strip_drafter jobs")
    methods = [("chain", None, int(r["block_size"]), "causal", r["tau"], d.get("draft_s"))]
    for b in budgets:
        methods.append((f"ddtree_{b}", b, b + 1, "tree", r.get(f"tau_ddtree_{b}"), d.get("draft_tree_s", {}).get(str(b))))
    out = []
    for method, b, n, mask, tau, t_draft in methods:
        t_ver = verify.get((n, mask), math.nan)
        t_draft = math.nan if t_draft is None else float(t_draft)
        tau = float(tau) if tau is not None and pd.notna(tau) else math.nan
        out.append({"method": method, "budget": b, "verify_tokens": n, "tau": tau, "t_verify_s": t_ver,
                    "t_draft_s": t_draft, "t_decode_s": t_dec, "speedup": speedup(tau, t_dec, t_ver, t_draft)})
    return out


def speedup_frame(frame, costs: dict):
    """Estimated speedup per (checkpoint, prompt set, method).

    Args:
        frame: the tau table (:func:`dflash_eval.report.tau_table.summary_frame`): ``checkpoint``, ``step``,
            ``prompt_set``, ``block_size``, ``tau`` and any ``tau_ddtree_<budget>`` columns.
        costs: :func:`read_costs` output.

    Returns:
        DataFrame with ``checkpoint, step, prompt_set, method`` (``chain`` or ``ddtree_<budget>``),
        ``budget`` (nodes; NA for the chain), ``verify_tokens`` (n), ``tau``, ``t_verify_s``,
        ``t_draft_s``, ``t_decode_s``, ``speedup`` (NaN where a cost was not measured) and
        ``estimate_reliable`` (:func:`dflash_eval.target.cost_stats.assess`: the same for every row) and ``best``
        (True on the fastest method per checkpoint and prompt set).
    """
    import pandas as pd

    reliable = assess(costs)["reliable"]
    budgets = ddtree_budgets(frame)
    rows = [{"checkpoint": r["checkpoint"], "step": r["step"], "prompt_set": r["prompt_set"], **m,
             "estimate_reliable": reliable}
            for r in frame.to_dict("records") for m in method_speedups(r, costs, budgets)]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["budget"] = df["budget"].astype("Int64")
    key = ["checkpoint", "prompt_set"]
    best = df.dropna(subset=["speedup"]).groupby(key)["speedup"].idxmax()
    df["best"] = df.index.isin(best.values)
    return df


def speedup_columns(frame, costs: dict | None):
    """The tau table's speedup columns (:mod:`dflash_eval.report.tau_table`), aligned with ``frame``'s rows.

    Args:
        frame: the tau table (every row, every sampling setting).
        costs: :func:`read_costs` output, or None (``target_costs`` disabled: the columns are empty).

    Returns:
        DataFrame with ``speedup_chain``, ``speedup_ddtree_<budget>`` per budget of the table (the
        report's estimate, :func:`method_speedups`, on the row's own tau; NaN where a cost was not
        measured or the tau is NaN) and ``estimate_reliable`` (nullable bool: :func:`dflash_eval.target.cost_stats.assess`
        of the costs, the same on every row; NA without costs).
    """
    import pandas as pd

    budgets = ddtree_budgets(frame)
    names = ["speedup_chain"] + [f"speedup_ddtree_{b}" for b in budgets]
    if costs is None:
        out = pd.DataFrame({n: math.nan for n in names}, index=frame.index)
        out["estimate_reliable"] = pd.array([pd.NA] * len(frame), dtype="boolean")
        return out
    reliable = bool(assess(costs)["reliable"])
    rows = [{f"speedup_{m['method']}": m["speedup"] for m in method_speedups(r, costs, budgets)}
            for r in frame.to_dict("records")]
    out = pd.DataFrame(rows, index=frame.index, columns=names, dtype=float)
    out["estimate_reliable"] = pd.array([reliable] * len(frame), dtype="boolean")
    return out


def with_speedups(frame, costs: dict | None):
    """``frame`` (the tau table, :func:`dflash_eval.report.tau_table.summary_frame`) with :func:`speedup_columns`
    appended: the content of ``tau.csv``, for the summary stage and the report's full table."""
    import pandas as pd

    return pd.concat([frame, speedup_columns(frame, costs)], axis=1)


def device_label(costs: dict) -> str:
    """e.g. ``"CPU (CPU: Intel Xeon ..., float32, 2 threads)"`` or ``"GPU (NVIDIA H200, bfloat16)"``."""
    if costs["device"] == "cuda":
        return f"GPU ({costs['device_name']}, {costs['dtype']})"
    return f"{costs['device'].upper()} ({costs['device_name']}, {costs['dtype']}, {costs['threads']} threads)"
