"""The decode-cost model and the tau -> speedup estimate; the format of ``target_costs.json``.

Estimate: ``speedup(n) = tau * t_decode / (t_verify(n) + t_draft)``, ``n = block_size`` for the
DFlash chain and ``budget + 1`` for a DDTree (sources: DFlash arXiv:2602.06036, DDTree
arXiv:2604.12989, CaDDTree arXiv:2606.01813 ``cost_model.py``); costs measured on the run's own
device by :mod:`dflash_eval.stages.target_costs`, statistics in :mod:`dflash_eval.target.cost_stats`.

Against context and batch (format 3, :mod:`dflash_eval.target.cost_context`): every cost is timed at
several contexts ``c`` and batch sizes ``b``; ``t(c, b)`` is interpolated piecewise-linearly in ``c``
between the timed contexts, and the break-even acceptance is ``(t_verify + t_draft) / t_decode``.

Model, what it leaves out, and the JSON format: docs/outputs.md, "The cost model and target_costs.json".
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/target-costs"
FORMAT_VERSION = 3
#: versions :func:`read_costs` reads (1: medians, no fit; assessed from its samples all the same; 1 and 2: one
#: context at batch 1, read as a grid of one entry)
READABLE_VERSIONS = (1, 2, 3)
#: a grid entry's per-drafter timing keys (format 3: the top-level ``drafters`` hold them for the primary entry too)
DRAFT_KEYS = ("draft_s", "draft_samples_s", "draft_tree_s")
#: the formula as printed in the reports
FORMULA = "tau * t_decode / (t_verify(n) + t_draft)"


# --------------------------------------------------------------------------- estimate

def read_costs(path) -> dict:
    """Load a ``target_costs.json`` (summary compares its provenance block with the config's settings).

    Every version reads with the top-level single-context fields (``context_tokens``, ``decode_s``,
    ``verify``, ``drafters``: batch 1) and a ``grid`` of per-(context, batch) entries; versions 1 and 2
    get a grid of that one entry (:func:`with_grid`).

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
    return with_grid(data)


def with_grid(data: dict) -> dict:
    """A format 1/2 dict (one context, batch 1) with ``grid``, ``contexts`` and ``batch_sizes`` as format 3 has them;
    a dict that has a ``grid`` is returned as is, one without ``context_tokens`` gets an empty grid."""
    if "grid" in data:
        return data
    if data.get("context_tokens") is None:
        return {**data, "grid": [], "contexts": [], "batch_sizes": []}
    entry = {"context_tokens": int(data["context_tokens"]), "batch_size": int(data.get("batch_size", 1)),
             "decode_s": data["decode_s"], "decode_samples_s": data.get("decode_samples_s"), "verify": data["verify"],
             "drafters": {k: {x: d[x] for x in DRAFT_KEYS if x in d} for k, d in data.get("drafters", {}).items()}}
    return {**data, "grid": [entry], "contexts": [entry["context_tokens"]], "batch_sizes": [entry["batch_size"]]}


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
