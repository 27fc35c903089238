"""Is the engine lossless under load? Its greedy tokens against the target's cached greedy completion, per request
and per run, with each first difference called a near-tie or a break.

Greedy speculative decoding is lossless only if the engine's verify pass computes what the target alone computes.
Concurrent requests change what the engine runs (batch shapes, kernels, padding, the scheduler's mixing of
prefill, verify and draft work), so a fault can show at a higher concurrency only: a public report on
Qwen3.6-27B with the z-lab DFlash drafter on vLLM 0.21 (greedy) scored as the baseline with one request at a time
and 10/32 on HumanEval+ at concurrency 8, while acceptance looked healthy. ``validate_engine`` therefore sends the
same prompts with the drafter at concurrency 1 and at a higher one, and through the plain server (no drafter) at
the higher one; this module judges each run's tokens.

**Near-tie or break.** At a request's first position ``k`` where the engine's token ``e`` differs from the cached
token ``c``, the same target is run in float32 (:func:`target_logits`: one HF forward of prompt + the cached
completion's first ``k`` tokens; only for requests that differ). With ``l1`` the top-1 logit there and ``u`` the
bfloat16 unit in the last place at ``|l1|`` (:func:`bf16_ulp`), the difference is a **near-tie** when both ``e``
and ``c`` lie within ``near_tie_ulps * u`` of ``l1`` (so the top-2 margin ``l1 - l2`` does too), else a **break**.
The unit and the default bound (4) are dflash-eval's own near-tie convention:
:func:`dflash_eval.replay.chain.explain_differences` measures a flipped decision as its top-2 gap in ulps of the
compute dtype at the top-1 logit, and the replay's bf16 flips are tested to be at most 4 of them
(``tests/replay/test_parity.py``). Here the unit is bf16's whatever the engine's dtype: a bf16 engine's rounding can
flip such a token, one further apart is no rounding. (A float32 engine flips far closer ties; counting its flips
within 4 bf16 ulps as near-ties errs towards not flagging.)

**Engine fault.** A request that breaks in a run with the drafter but in no run of the plain server (equal or a
near-tie there): the drafter's path, not the target's arithmetic, changed the output (:func:`mark_faults`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from dflash_eval.replay.metrics import ulp_at
from dflash_eval.target.model import load_target

log = logging.getLogger(__name__)

#: per-request classes of the token check, in the order they are shown
CLASSES = {
    "equal": "the engine's tokens equal the cached greedy completion",
    "near-tie": "first differs where both tokens are within near_tie_ulps bf16 ulps of the float32 target's top logit",
    "break": "first differs where the engine's (or the cached) token is further from the float32 top logit: "
             "not rounding",
}
#: dflash-eval's near-tie bound in bf16 ulps at the top-1 logit (replay.chain.explain_differences; tests/replay/test_parity.py)
NEAR_TIE_ULPS = 4.0


def bf16_ulp(x: float) -> float:
    """The bfloat16 unit in the last place at ``|x|``: ``2**-7 * 2**floor(log2 |x|)`` (``eps`` at 0), as
    :func:`dflash_eval.replay.chain.explain_differences` computes it for its compute dtype."""
    return ulp_at(x, torch.finfo(torch.bfloat16).eps)


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """Index of the first completion position where ``got`` differs from ``want`` (the shorter one's length when one
    is a prefix of the other), None when they are equal."""
    got, want = list(got), list(want)
    if got == want:
        return None
    return next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def classify(logits: torch.Tensor, cached: int | None, engine: int | None,
             near_tie_ulps: float = NEAR_TIE_ULPS) -> dict:
    """Near-tie or break at one differing position, from the target's logits there.

    Args:
        logits: ``(V,)`` the target's logits predicting that position (any float dtype; read as float32).
        cached: the cached completion's token there (None past its end).
        engine: the engine's token there (None past the end of its response).
        near_tie_ulps: the bound, in bf16 ulps at the top-1 logit (:data:`NEAR_TIE_ULPS`).

    Returns:
        ``class`` (``near-tie`` / ``break``), ``top1`` / ``top2`` (token ids), ``top1_logit``, ``margin`` (top-1 minus
        top-2 logit), ``margin_ulps``, ``engine_gap_ulps`` / ``cached_gap_ulps`` (top-1 logit minus that token's,
        in bf16 ulps; None for a missing token); a missing token is a break.
    """
    lg = logits.detach().float().reshape(-1)
    top = torch.topk(lg, 2)
    l1 = float(top.values[0])
    u = bf16_ulp(l1)

    def gap(t):
        return None if t is None or not 0 <= int(t) < lg.numel() else (l1 - float(lg[int(t)])) / u

    eg, cg = gap(engine), gap(cached)
    near = eg is not None and cg is not None and max(eg, cg) <= near_tie_ulps
    margin = l1 - float(top.values[1])
    return {"class": "near-tie" if near else "break", "top1": int(top.indices[0]), "top2": int(top.indices[1]),
            "top1_logit": l1, "margin": margin, "margin_ulps": margin / u, "engine_gap_ulps": eg,
            "cached_gap_ulps": cg}


def differences(rows: Sequence[Mapping], requests: Iterable) -> dict[str, int]:
    """``{request id: first differing completion position}`` of the requests whose tokens differ from their row's
    ``completion_ids`` (``requests``: objects with ``sample_id`` and ``completion_ids``)."""
    want = {str(r["id"]): r["completion_ids"] for r in rows}
    out = {}
    for q in requests:
        k = first_difference(q.completion_ids, want[str(q.sample_id)])
        if k is not None:
            out[str(q.sample_id)] = k
    return out


def target_logits(model, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                  positions: Iterable[int]) -> dict[int, torch.Tensor]:
    """The target's logits predicting completion positions ``positions``, from one forward (teacher-forced).

    Args:
        model: an HF causal LM (:func:`dflash_eval.target.model.load_target`).
        prompt_ids, completion_ids: the row's token ids; position ``k`` is predicted from prompt + ``completion_ids[:k]``
            (``0 <= k <= len(completion_ids)``).

    Returns:
        ``{k: (V,) float32 CPU tensor}``; one forward over prompt + ``completion_ids[:max(positions)]`` with
        ``logits_to_keep`` at the ``P - 1 + k`` rows only.
    """
    ks = sorted({int(k) for k in positions})
    P = len(prompt_ids)
    dev = model.get_input_embeddings().weight.device
    ids = torch.tensor([[int(t) for t in prompt_ids] + [int(t) for t in completion_ids[:ks[-1]]]], device=dev)
    keep = torch.tensor([P - 1 + k for k in ks], device=dev)
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False, logits_to_keep=keep)
    return {k: out.logits[0, i].float().cpu() for i, k in enumerate(ks)}


def judge_logits(target_dir, rows: Sequence[Mapping], needed: Mapping[str, Iterable[int]], device: str = "auto",
                 backend: str = "auto") -> dict[tuple[str, int], torch.Tensor]:
    """Load the target in float32 (:func:`dflash_eval.target.model.load_target`, only when ``needed`` is not empty)
    and return ``{(request id, position): (V,) float32 logits}`` for every needed position, one forward per request.

    ``device`` ``auto``: the GPU(s) when the float32 target fits there, else the CPU (a CUDA out-of-memory error,
    at load or in a forward, moves the whole computation to the CPU once).
    """
    needed = {str(k): set(v) for k, v in needed.items() if v}
    if not needed:
        return {}
    by_id = {str(r["id"]): r for r in rows}

    def run(dev):
        model, _, _ = load_target(target_dir, device=dev, dtype="float32", backend=backend)
        try:
            out = {}
            for sid, ks in needed.items():
                r = by_id[sid]
                for k, lg in target_logits(model, r["prompt_ids"], r["completion_ids"], ks).items():
                    out[(sid, k)] = lg
            return out
        finally:
            del model

    try:
        return run(device)
    except torch.OutOfMemoryError:
        if device != "auto":
            raise
        log.warning("the float32 target does not fit the GPU for the near-tie check: computing it on the CPU")
        torch.cuda.empty_cache()
        return run("cpu")


def check_run(rows: Sequence[Mapping], requests: Iterable, logits_at: Callable[[str, int], torch.Tensor],
              near_tie_ulps: float = NEAR_TIE_ULPS) -> dict:
    """One run's token check: every request equal, a near-tie or a break (:data:`CLASSES`).

    Args:
        rows: completions rows (``id``, ``completion_ids``).
        requests: the run's responses (``sample_id``, ``completion_ids``), e.g.
            :class:`dflash_eval.serving.vllm.engine.EngineRequest`.
        logits_at: ``(request id, position) -> (V,) logits`` of the target there (:func:`judge_logits`); called only
            for requests that differ.
        near_tie_ulps: :func:`classify`'s bound.

    Returns:
        ``{"n", "counts": {class: n}, "requests": [...]}``; a request has ``id``, ``class``, and where it differs
        ``first_token_diff``, ``cached_token``, ``engine_token`` and :func:`classify`'s fields.
    """
    want = {str(r["id"]): list(r["completion_ids"]) for r in rows}
    out, counts = [], {c: 0 for c in CLASSES}
    for q in requests:
        sid = str(q.sample_id)
        got, ref = list(q.completion_ids), want[sid]
        k = first_difference(got, ref)
        if k is None:
            rec = {"id": sid, "class": "equal"}
        else:
            c, e = (ref[k] if k < len(ref) else None), (got[k] if k < len(got) else None)
            rec = {"id": sid, "first_token_diff": k, "cached_token": c, "engine_token": e,
                   **classify(logits_at(sid, k), c, e, near_tie_ulps)}
        counts[rec["class"]] += 1
        out.append(rec)
    return {"n": len(out), "counts": counts, "requests": out}


def mark_faults(drafter_runs: Sequence[dict], plain_runs: Sequence[dict]) -> None:
    """Set each drafter run's ``faults``: the ids that break there and in no plain run (equal or a near-tie
    there), and ``n_faults``; runs are :func:`check_run` outputs."""
    plain_breaks = {q["id"] for p in plain_runs for q in p["requests"] if q["class"] == "break"}
    for run in drafter_runs:
        run["faults"] = [q["id"] for q in run["requests"] if q["class"] == "break" and q["id"] not in plain_breaks]
        run["n_faults"] = len(run["faults"])


def _plain_for(run: dict, plain_runs: Sequence[dict]) -> dict | None:
    """The plain run at the drafter run's concurrency, else the plain run at the highest concurrency."""
    same = [p for p in plain_runs if p["concurrency"] == run["concurrency"]]
    return same[0] if same else max(plain_runs, key=lambda p: p["concurrency"], default=None)


def headline(checks: Sequence[dict], plain_runs: Sequence[dict]) -> str:
    """The token check's lines, shown first in ``validate_engine``'s section: one **ENGINE FAULT** line per drafter
    run with faults (``ENGINE FAULT: 3 of 16 requests break at concurrency 8 with the drafter ck, 0 without``), or
    one line saying every run is lossless up to near-ties; ``checks``: per checkpoint ``{"checkpoint", "runs"}``."""
    lines = []
    for c in checks:
        for run in c["runs"]:
            if run.get("n_faults"):
                p = _plain_for(run, plain_runs)
                without = (f", {p['counts']['break']} without (plain server at concurrency {p['concurrency']})"
                           if p else "")
                lines.append(f"**ENGINE FAULT: {run['n_faults']} of {run['n']} requests break at concurrency "
                             f"{run['concurrency']} with the drafter {c['checkpoint']}{without}**: the engine is not "
                             f"lossless (first breaks: {', '.join(run['faults'][:5])}).")
    if lines:
        return "\n\n".join(lines)
    runs = [r for c in checks for r in c["runs"]] + list(plain_runs)
    conc = sorted({r["concurrency"] for r in runs})
    plain_breaks = [p for p in plain_runs if p["counts"]["break"]]
    if plain_breaks:
        return ("**Token check**: no engine fault (every break with the drafter also happens without it), but the "
                "plain server breaks " + ", ".join(f"{p['counts']['break']} of {p['n']} requests at concurrency "
                                                  f"{p['concurrency']}" for p in plain_breaks)
                + ": the engine's target computation itself leaves the greedy completion beyond near-ties.")
    return (f"**Token check**: lossless: every request at concurrency {', '.join(map(str, conc))}, with and without "
            "the drafter, equals the cached greedy completion or first differs at a near-tie.")


def table(checks: Sequence[dict], plain_runs: Sequence[dict], near_tie_ulps: float) -> str:
    """The per-run table of the token check (markdown), with the drafter's acceptance as vLLM counts it
    (``acceptance_raw``: 1 + accepted / drafts over every request, wrong ones too) beside it."""
    lines = [(f"Token check against the cached greedy completions: *near-tie* = the first differing token and the "
              f"cached one both within {near_tie_ulps:g} bf16 ulps of the float32 target's top logit there, *break* = "
              "further; *engine fault* = breaks with the drafter on a request the plain server does not break; "
              "*acceptance*: vLLM's 1 + accepted / drafts over every request of the run (docs/serving-engines.md, "
              "Lossless under load)."), "",
             "| server | concurrency | equal | near-tie | break | engine fault | acceptance (vLLM raw) | output tok/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = [("plain", p) for p in plain_runs] + [(c["checkpoint"], r) for c in checks for r in c["runs"]]
    for name, r in rows:
        k = r["counts"]
        tau = r.get("acceptance_raw")
        tps = r.get("output_tok_per_s")
        fault = r.get("n_faults")
        lines.append(f"| {name} | {r['concurrency']} | {k['equal']} | {k['near-tie']} | {k['break']} | "
                     f"{'n/a' if fault is None else ('**' + str(fault) + '**' if fault else '0')} | "
                     f"{'n/a' if tau is None or math.isnan(tau) else f'{tau:.4f}'} | "
                     f"{'n/a' if tps is None else f'{tps:.1f}'} |")
    return "\n".join(lines)


def token_check(rows: Sequence[Mapping], plain: Sequence[dict], drafters: Sequence[dict],
                judge: Callable[[dict[str, set[int]]], dict], near_tie_ulps: float = NEAR_TIE_ULPS) -> dict:
    """The whole check of one ``validate_engine`` job: every run judged, faults marked.

    Args:
        rows: completions rows (``id``, ``prompt_ids``, ``completion_ids``).
        plain: the plain server's runs, each ``{"concurrency", "requests", ...}`` (other keys are kept, e.g.
            ``output_tok_per_s``).
        drafters: per checkpoint ``{"checkpoint", "runs": [run as in plain, e.g. with ``acceptance_raw``]}``.
        judge: ``{request id: positions} -> {(id, position): (V,) logits}`` (:func:`judge_logits`), called once with
            every first difference of every run.
        near_tie_ulps: :func:`classify`'s bound.

    Returns:
        ``{"near_tie_ulps", "judged_requests" (requests the target was run on), "n_faults" (over every drafter run),
        "plain": [run], "checkpoints": [{"checkpoint", "runs": [run]}]}``; a run is its input less ``requests`` plus
        :func:`check_run`'s keys, and with the drafter :func:`mark_faults`' ``faults`` / ``n_faults``.
    """
    needed: dict[str, set[int]] = {}
    for run in list(plain) + [r for d in drafters for r in d["runs"]]:
        for sid, k in differences(rows, run["requests"]).items():
            needed.setdefault(sid, set()).add(k)
    logits = judge(needed) if needed else {}

    def checked(run):
        return {**{k: v for k, v in run.items() if k != "requests"},
                **check_run(rows, run["requests"], lambda s, k: logits[(s, k)], near_tie_ulps)}

    p = [checked(r) for r in sorted(plain, key=lambda r: r["concurrency"])]
    d = [{"checkpoint": x["checkpoint"], "runs": [checked(r) for r in sorted(x["runs"], key=lambda r: r["concurrency"])]}
         for x in drafters]
    mark_faults([r for x in d for r in x["runs"]], p)
    return {"near_tie_ulps": near_tie_ulps, "judged_requests": len(needed),
            "n_faults": sum(r["n_faults"] for x in d for r in x["runs"]), "plain": p, "checkpoints": d}
