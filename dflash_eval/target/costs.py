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

from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/target-costs"
FORMAT_VERSION = 2
#: versions :func:`read_costs` reads (1: medians, no fit; assessed from its samples all the same)
READABLE_VERSIONS = (1, 2)
#: the formula as printed in the reports
FORMULA = "tau * t_decode / (t_verify(n) + t_draft)"


# --------------------------------------------------------------------------- estimate

def read_costs(path) -> dict:
    """Load a ``target_costs.json`` (summary compares its provenance block with the config's settings).

    Raises:
        InputError: unreadable, or not a dflash-eval target-costs file of this version.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(path, None, f"cannot read the target costs ({err})", "re-run the target_costs rule") from None
    if data.get("format") != FORMAT or data.get("format_version") not in READABLE_VERSIONS:
        raise InputError(path, "format", f"expected {FORMAT} v{FORMAT_VERSION}, got {data.get('format')} "
                         f"v{data.get('format_version')}", "re-run the target_costs rule")
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


def device_label(costs: dict) -> str:
    """e.g. ``"CPU (CPU: Intel Xeon ..., float32, 2 threads)"`` or ``"GPU (NVIDIA H200, bfloat16)"``."""
    if costs["device"] == "cuda":
        return f"GPU ({costs['device_name']}, {costs['dtype']})"
    return f"{costs['device'].upper()} ({costs['device_name']}, {costs['dtype']}, {costs['threads']} threads)"
