"""The cost model against context and batch: interpolated costs, break-even tau, speedup per prompt-length bin.

Pure functions over a ``target_costs.json`` dict (:func:`dflash_eval.target.costs.read_costs`, format 3 ``grid``).

* **Costs at a context.** Each cost ``t`` (decode step, verify of ``n`` tokens, drafter block pass) is
  timed at contexts ``c_1 < ... < c_k`` for each batch size ``b``; ``t(c, b)`` is interpolated
  piecewise-linearly in ``c`` between them and held **flat outside** ``[c_1, c_k]`` (the nearest timed
  value: no extrapolation; :func:`numpy.interp`).
* **Speedup** (DFlash arXiv:2602.06036; CaDDTree arXiv:2606.01813 ``cost_model.py``):
  ``speedup(c, b, n) = tau * t_decode(c, b) / (t_verify(c, b, n) + t_draft(c, b))``, with
  ``n = block_size`` (chain, causal mask) or ``budget + 1`` (DDTree, tree mask, the drafter's top-budget pass).
* **Break-even tau**: the acceptance length at which the speedup is 1,
  ``tau*(c, b, n) = (t_verify(c, b, n) + t_draft(c, b)) / t_decode(c, b)``. It is what an engine measures
  with the drafter on and every draft rejected: the per-token latency with the drafter over the one
  without (the vLLM synthetic rejection sampler at acceptance 0).
* **Prompt-length bins.** tau.csv's ``tau_prompt_<lo>_<hi>`` columns
  (:data:`dflash_eval.replay.metrics.PROMPT_BINS`) give tau per bin ``[lo, hi)`` of the prompt length;
  a bin's representative context is its midpoint ``(lo + hi) / 2``, and ``1.5 * lo`` for the open last
  bin ``[lo, inf)`` (:func:`bin_context`; the generated tokens add to the context as a response goes
  on, so the midpoint is a lower estimate of the mean context a verify sees).
* **Pays up to.** Walking the bins in order (bins without prompts skipped), the first bin where
  ``tau_bin <= tau*(c_bin, b, n)`` ends it: the checkpoint pays up to that bin's lower edge; "never pays"
  when it is the first bin with prompts, "pays everywhere measured" when there is none (:func:`pays_up_to`).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

#: verdicts of :func:`pays_up_to`
PAYS_EVERYWHERE, NEVER_PAYS, NO_DATA = "pays everywhere measured", "never pays", "no prompts"


def _nan(x) -> float:
    return math.nan if x is None else float(x)


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """``y(x)`` piecewise-linear through the points ``(xs, ys)`` (any order), flat outside their range.

    Points whose ``y`` is NaN are dropped; NaN when none remains. Units: those of ``ys``.
    """
    pts = sorted((float(a), float(b)) for a, b in zip(xs, ys) if b is not None and not math.isnan(float(b)))
    if not pts:
        return math.nan
    return float(np.interp(float(x), [p[0] for p in pts], [p[1] for p in pts]))


def grid(costs: dict, batch: int) -> list[dict]:
    """The grid entries of ``costs`` at ``batch``, by ascending context (``[]`` when that batch was not timed)."""
    return sorted((e for e in costs.get("grid", []) if int(e["batch_size"]) == int(batch)),
                  key=lambda e: int(e["context_tokens"]))


def batch_sizes(costs: dict) -> list[int]:
    """Batch sizes with at least one timed entry, ascending."""
    return sorted({int(e["batch_size"]) for e in costs.get("grid", [])})


def contexts(costs: dict) -> list[int]:
    """Timed contexts (any batch), ascending."""
    return sorted({int(e["context_tokens"]) for e in costs.get("grid", [])})


def entry_terms(entry: dict, checkpoint: str, n: int, mask: str, budget: int | None = None) -> tuple[float, float, float]:
    """``(t_decode, t_verify(n, mask), t_draft)`` seconds of one grid entry; NaN for what it did not time.

    ``t_verify``: the non-decreasing fit (``fit_s``) when present, else the median (format 1). ``t_draft``: the
    chain block pass (``budget`` None) or the top-``budget`` pass of DDTree.
    """
    verify = {(int(v["n"]), v["mask"]): v.get("fit_s", v.get("median_s")) for v in entry["verify"]}
    d = entry.get("drafters", {}).get(checkpoint, {})
    draft = d.get("draft_s") if budget is None else (d.get("draft_tree_s") or {}).get(str(budget))
    return _nan(entry["decode_s"]), _nan(verify.get((int(n), mask))), _nan(draft)


def terms_at(costs: dict, context: float, batch: int, checkpoint: str, n: int, mask: str,
             budget: int | None = None) -> tuple[float, float, float]:
    """``(t_decode, t_verify, t_draft)`` seconds at ``context`` tokens and ``batch`` rows, each interpolated
    (:func:`interpolate`) over the contexts timed at that batch; all NaN when the batch was not timed."""
    entries = grid(costs, batch)
    cs = [int(e["context_tokens"]) for e in entries]
    cols = list(zip(*[entry_terms(e, checkpoint, n, mask, budget) for e in entries])) or [(), (), ()]
    return tuple(interpolate(cs, col, context) for col in cols)


def break_even(t_decode: float, t_verify: float, t_draft: float) -> float:
    """``(t_verify + t_draft) / t_decode``: the tau at which speculative decoding equals plain decoding (NaN if a term is)."""
    return (t_verify + t_draft) / t_decode


def break_even_at(costs: dict, context: float, batch: int, checkpoint: str, n: int, mask: str,
                  budget: int | None = None) -> float:
    """:func:`break_even` of :func:`terms_at`."""
    return break_even(*terms_at(costs, context, batch, checkpoint, n, mask, budget))


def parse_bin(label: str) -> tuple[int, float]:
    """``"512_1024"`` or ``"512-1024"`` (tau.csv suffix / metrics label) -> ``(512, 1024.0)``; ``"32768_inf"`` -> ``(32768, inf)``."""
    lo, hi = label.replace("-", "_").split("_")
    return int(lo), math.inf if hi == "inf" else float(hi)


def bin_context(lo: int, hi: float) -> float:
    """Representative context of the prompt-length bin ``[lo, hi)``: ``(lo + hi) / 2``; ``1.5 * lo`` when ``hi`` is inf."""
    return 1.5 * lo if math.isinf(hi) else (lo + hi) / 2


def bin_speedups(costs: dict, taus: dict[str, float], batch: int, checkpoint: str, block_size: int) -> list[dict]:
    """The chain estimate per prompt-length bin.

    Args:
        costs: :func:`dflash_eval.target.costs.read_costs` output.
        taus: bin label (``"<lo>_<hi>"``) -> tau of the responses whose prompt lies in the bin (NaN: none).
        batch: batch size of the costs.
        checkpoint: name in ``costs["drafters"]``.
        block_size: the chain's verify width n (causal mask).

    Returns:
        one dict per bin in ascending order: ``bin``, ``lo``, ``hi``, ``context`` (:func:`bin_context`), ``tau``,
        ``break_even`` and ``speedup`` (NaN where tau or a cost is missing).
    """
    out = []
    for label, tau in sorted(taus.items(), key=lambda kv: parse_bin(kv[0])[0]):
        lo, hi = parse_bin(label)
        c = bin_context(lo, hi)
        t_dec, t_ver, t_draft = terms_at(costs, c, batch, checkpoint, block_size, "causal")
        tau = _nan(tau)
        out.append({"bin": label, "lo": lo, "hi": hi, "context": c, "tau": tau,
                    "break_even": break_even(t_dec, t_ver, t_draft), "speedup": tau * t_dec / (t_ver + t_draft)})
    return out


def pays_up_to(bins: Iterable[dict]) -> tuple[str, int | None]:
    """``(verdict, context)`` from :func:`bin_speedups` rows: the lower edge ``lo`` of the first bin (with a tau)
    whose ``tau <= break_even`` -> ``("pays up to", lo)``; ``(NEVER_PAYS, None)`` when that is the first such bin,
    ``(PAYS_EVERYWHERE, None)`` when no bin fails, ``(NO_DATA, None)`` when no bin has a tau and a break-even."""
    seen = False
    for b in bins:
        if math.isnan(b["tau"]) or math.isnan(b["break_even"]):
            continue
        if b["tau"] <= b["break_even"]:
            return (NEVER_PAYS, None) if not seen else ("pays up to", int(b["lo"]))
        seen = True
    return (PAYS_EVERYWHERE, None) if seen else (NO_DATA, None)


def pays_label(verdict: tuple[str, int | None]) -> str:
    """``("pays up to", 2048)`` -> ``"pays up to context 2048"``; the other verdicts as they are."""
    what, c = verdict
    return f"{what} context {c}" if c is not None else what


def nearest_context(costs: dict, context: int, batch: int = 1) -> int | None:
    """The timed context at ``batch`` nearest to ``context`` (the smaller on a tie); None when that batch was not timed."""
    cs = [int(e["context_tokens"]) for e in grid(costs, batch)]
    return min(cs, key=lambda c: (abs(c - context), c)) if cs else None
