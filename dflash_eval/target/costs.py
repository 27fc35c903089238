"""The decode-cost model and the tau -> speedup estimate; the format of ``target_costs.json``.

Estimate: ``speedup(n) = tau * t_decode / (t_verify(n) + t_draft)``, ``n = block_size`` for the
DFlash chain and ``budget + 1`` for a DDTree (sources: DFlash arXiv:2602.06036, DDTree
arXiv:2604.12989, CaDDTree arXiv:2606.01813 ``cost_model.py``); costs measured on the run's own
device by :mod:`dflash_eval.stages.target_costs`, statistics in :mod:`dflash_eval.target.cost_stats`.

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
