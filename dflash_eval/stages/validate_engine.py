"""Stage ``validate_engine`` (rule ``validate_engine``): acceptance and speed measured by vLLM vs the offline replay.

For the first ``n_samples`` prompts of one prompt set: one plain vLLM server (the speed baseline),
then per selected checkpoint one vLLM server running the stripped drafter with ``method: dflash``
(:func:`dflash_eval.serving.vllm.engine.serve_and_measure`); each is sent the prompts greedily, the
Prometheus counters are read before and after, and the per-request step arrays are compared with
the checkpoint's evaluate JSON of the same samples after the stop-token conversion
(:func:`dflash_eval.serving.vllm.engine.compare`; conventions and the traced divergences:
``docs/serving-engines.md``). Measured speedup = DFlash output tokens/s / plain output tokens/s
(same prompts, same concurrency, same host), shown next to the cost-model estimate
(:mod:`dflash_eval.target.costs`) when ``target_costs.json`` is given. Options: config section
``validate_engine`` (:mod:`dflash_eval.core.options`).

Greedy tokens under load (:mod:`dflash_eval.serving.lossless`): each server, after its measured run, gets the same
prompts again at ``load_concurrency`` (the drafter's also at concurrency 1); every request is equal to the cached
greedy completion, a near-tie or a break (the float32 target's logits at the first difference), and a break with
the drafter on a request the plain server does not break is an engine fault, shown first in the section.

At temperature > 0 (``validate_engine.sampling``) each checkpoint is served once per draft policy with that
policy's vLLM ``draft_sample_method`` (:mod:`dflash_eval.replay.policies`), each prompt sent ``seeds`` times; the
engine's tau (mean +- standard error) is set beside evaluate's expected tau of the same setting and policy and
flagged beyond 3 standard errors (:mod:`dflash_eval.serving.vllm.sampled`; docs/serving-engines.md, "Engine at
T > 0"), and the checkpoint order by offline and by engine tau is compared.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import fields
from pathlib import Path

from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError
from dflash_eval.data.completions import read_completions
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.drafter.families import family_of
from dflash_eval.replay.sampling import SamplingSetting
from dflash_eval.report.records import engine_records, read_eval, records_path, validation_jobs, write_records
from dflash_eval.report.tau_table import policy_label
from dflash_eval.serving import lossless
from dflash_eval.serving.clients import ServerError, ServerUnavailable
from dflash_eval.serving.vllm.engine import DIVERGENCES, EngineOptions, compare, serve_and_measure
from dflash_eval.serving.vllm.sampled import FLAG_SE, engine_failure, ranking, sampled_compare
from dflash_eval.target.costs import device_label as costs_device
from dflash_eval.target.costs import read_costs, speedup

log = logging.getLogger(__name__)

STAGE = "validate_engine"
#: done-when thresholds: converted engine tau/step within 1 % of the replay's, per-position rates within 0.02
REL_TOL, POS_TOL = 0.01, 0.02


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder (served by vLLM)")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first n_samples "
                                                        "prompts are sent")
    p.add_argument("--drafter", nargs="+", required=True, help="stripped drafter folders")
    p.add_argument("--evals", nargs="+", required=True,
                   help="evaluate JSONs of those drafters on this prompt set, in the order of --drafter")
    p.add_argument("--target-costs", default=None, help="target_costs.json: the cost-model speedup beside the measured one")
    p.add_argument("--work-dir", default=None, help="scratch folder for the servers' logs and helper modules "
                                                    "(default: beside --out)")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the numbers")
    p.add_argument("--out-records", default=None, help="per-request records (default: <out>.records.parquet beside "
                                                       "--out; dflash_eval.report.records)")
    p.add_argument("--run", default=None, help="the run's name, the records' run column (the workflow passes it)")


def main(args, opts) -> None:
    validate_engine(args.target, args.completions, args.drafter, args.evals, args.out, opts,
                    target_costs=args.target_costs, work_dir=args.work_dir, out_records=args.out_records, run=args.run)


def _engine_options(opts) -> EngineOptions:
    names = {f.name for f in fields(EngineOptions)}
    vals = {k: getattr(opts, k) for k in names if hasattr(opts, k)}
    return EngineOptions(**{k: (list(v) if k == "args" else dict(v) if k == "env" else v) for k, v in vals.items()})


def _estimate(costs: dict | None, checkpoint: str, tau: float, block_size: int) -> float:
    if not costs:
        return math.nan
    verify = {(int(v["n"]), v["mask"]): float(v["median_s"]) for v in costs["verify"]}
    d = costs["drafters"].get(checkpoint, {})
    return speedup(tau, float(costs["decode_s"]), verify.get((block_size, "causal"), math.nan),
                   float(d["draft_s"]) if d.get("draft_s") is not None else math.nan)


def validate_engine(target_dir, completions_path, drafters: list[str], evals: list[str], out, opts=None, *,
                    target_costs=None, work_dir=None, out_records=None, run: str | None = None,
                    **overrides) -> dict:
    """vLLM's acceptance and speed for every drafter next to the offline replay of the same samples.

    Args:
        target_dir: HF target folder.
        completions_path: completions JSONL the evaluations used (the engine must reproduce these tokens).
        drafters: stripped drafter folders, in the order of ``evals``.
        evals: evaluate JSONs (per-sample ``acceptance_lengths``), one per drafter.
        out: JSON path. Keys: ``title``, ``markdown`` (``report --extra``), ``device``, ``server``, ``plain``
            (timing), ``checkpoints``: per drafter ``mean_acceptance_length_raw`` (vLLM's 1 + accepted /
            drafts, Prometheus), ``tau_tokens_per_step_engine`` (converted), ``tau_tokens_per_step_offline``,
            ``rel_diff``, ``per_position`` (``engine`` / ``offline`` / ``engine_raw``; both conventions),
            ``max_pos_diff``, ``ok`` (within :data:`REL_TOL` and :data:`POS_TOL`), ``kinds`` (divergence kind
            counts, :data:`dflash_eval.serving.vllm.engine.DIVERGENCES`), ``timing``, ``speedup_measured``,
            ``speedup_estimated``, ``counters``, ``requests`` (the greedy check: only with a temperature-0
            entry in ``sampling``); ``sampled``: per checkpoint, setting above temperature 0 and draft policy
            (:func:`_sampled_run`): ``draft_sample_method``, ``tau_engine`` / ``tau_engine_se``, ``tau_offline``,
            ``diff`` / ``diff_se`` / ``z`` / ``flag`` (:func:`dflash_eval.serving.vllm.sampled.sampled_compare`),
            ``expectation`` (the prompt set is drawn at the setting), or ``error`` (``cause``, ``workaround``,
            ``detail``: :func:`dflash_eval.serving.vllm.sampled.engine_failure`); ``ranking``: per setting and
            policy with two checkpoints or more, Spearman's rho of offline vs engine tau and the best checkpoint
            by each (:func:`dflash_eval.serving.vllm.sampled.ranking`); ``seeds``; ``lossless`` (with a temperature-0
            entry): the token check under load, :func:`dflash_eval.serving.lossless.token_check`'s output plus
            ``load_concurrency`` (each checkpoint entry also has ``engine_faults``: concurrency -> faults); the
            markdown opens with it.
        opts: the stage's options (config section ``validate_engine``): ``n_samples``, ``sampling`` (default
            greedy only), ``seeds``, ``load_concurrency``, ``near_tie_ulps``, ``margin_device`` (the token check) and
            the server settings of :class:`dflash_eval.serving.vllm.engine.EngineOptions`.
        target_costs: ``target_costs.json`` (optional) for the cost-model estimate.
        work_dir: scratch folder (default ``<out>.work``).
        out_records: the per-request records (source ``engine``,
            :func:`dflash_eval.report.records.engine_records`); None: ``<out stem>.records.parquet`` beside ``out``.
        run: the records' ``run`` column (None: null).


    Raises:
        InputError: drafters/evals of different lengths, an evaluation without one of the samples, or (above
            temperature 0) without the expectation of a setting and policy asked for; all before a server starts.
            An engine that fails at temperature > 0 is recorded (``sampled[].error``), not raised.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    if len(drafters) != len(evals):
        raise InputError(None, "--drafter/--evals", f"{len(drafters)} drafters but {len(evals)} evaluations",
                         "pass one evaluate JSON per drafter, in the same order")
    eng = _engine_options(opts)
    out = Path(out)
    work = Path(work_dir) if work_dir else out.with_name(out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    loaded = [read_eval(e) for e in evals]  # read before any server starts
    rows = read_completions(Path(completions_path))[: opts.n_samples]
    max_new = max(int(r["max_new_tokens"]) for r in rows)
    costs = read_costs(target_costs) if target_costs else None
    entries = list(getattr(opts, "sampling", None) or [{"temperature": 0}])
    greedy = any(float(e.get("temperature", 0)) == 0 for e in entries)
    planned = _sampled_plan(entries, drafters, evals, loaded, rows)  # refusals before any server starts
    t0 = time.perf_counter()
    result: dict = {"title": "Acceptance and speed measured by vLLM vs offline replay", "n_samples": len(rows),
                    "completions": str(completions_path), "checkpoints": [], "sampled": [],
                    "seeds": int(getattr(opts, "seeds", 1))}
    if greedy:
        _greedy(result, target_dir, rows, max_new, work, eng, drafters, evals, loaded, costs, opts)
    for job in planned:
        result["sampled"].append(_sampled_run(job, target_dir, rows, max_new, work, eng, result["seeds"]))
    result["ranking"] = _rankings(result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    alerts = _alerts(result)
    if alerts:  # the report's section heading carries it
        result["title"] += ": ENGINE DISAGREES OR FAILED at T > 0"
    check = result.get("lossless")
    if check and check["n_faults"]:
        result["title"] += ": ENGINE FAULT (greedy tokens break with the drafter)"
    tokens = "\n\n".join((lossless.headline(check["checkpoints"], check["plain"]),
                           lossless.table(check["checkpoints"], check["plain"], check["near_tie_ulps"]))) if check else ""
    result["markdown"] = "\n\n".join(x for x in (tokens, alerts, _markdown(result) if greedy else "",
                                                   _sampled_markdown(result)) if x)
    result["provenance"] = stage_block(STAGE, opts)
    result.update(write_json(out, result, default=float))
    records = engine_records(result, loaded, rows, run)
    write_records(out_records or records_path(out), records, validation_jobs(records, result))
    return result


def _runs(run: dict, eng, drafter: bool) -> list[dict]:
    """A server's token-check runs: the measured one and those of ``extra``; with the drafter each with
    ``acceptance_raw``, vLLM's 1 + accepted / drafts over every request's steps (wrong ones too: what a user sees)."""
    out = [{"concurrency": eng.concurrency, "requests": run["requests"],
            "output_tok_per_s": run["timing"]["output_tok_per_s"]}]
    out += [{"concurrency": int(c), "requests": x["requests"], "output_tok_per_s": x["timing"]["output_tok_per_s"]}
            for c, x in (run.get("extra") or {}).items()]
    for r in out if drafter else ():
        steps = sum(len(q.per_step_accepted) for q in r["requests"])
        r["acceptance_raw"] = 1 + sum(sum(q.per_step_accepted) for q in r["requests"]) / steps if steps else math.nan
    return out


def _greedy(result, target_dir, rows, max_new, work, eng, drafters, evals, loaded, costs, opts) -> None:
    """The greedy check (every request equal to the replay after the stop-token conversion), the measured
    speedup and the token check under load (:mod:`dflash_eval.serving.lossless`: the drafter at concurrency 1 and
    ``load_concurrency``, the plain server at ``load_concurrency``, each on the server of the measured run): fills
    ``result``'s ``device``, ``server``, ``plain``, ``costs_device``, ``checkpoints`` and ``lossless``."""
    n_load = int(opts.load_concurrency)
    plain = serve_and_measure(target_dir, rows, max_new, work, work / "plain.vllm.log", eng,
                              more_concurrencies=[n_load])
    plain_runs, drafter_runs = _runs(plain, eng, False), []
    log.info("plain vLLM: %.1f output tok/s over %d requests (%s)", plain["timing"]["output_tok_per_s"], len(rows),
             plain["device"])
    result.update({"device": plain["device"], "server": plain["server"], "plain": plain["timing"],
                   "costs_device": costs_device(costs) if costs else None})
    for drafter_dir, eval_path, ev in zip(drafters, evals, loaded):
        have = {s["id"] for s in ev["samples"]}
        missing = [r["id"] for r in rows if r["id"] not in have]
        if missing:
            raise InputError(eval_path, "samples", f"no offline result for {missing[:5]}",
                             "evaluate the drafter on the cache built from these completions")
        B = int(ev["block_size"])
        name = ev.get("checkpoint", Path(drafter_dir).name)
        run = serve_and_measure(target_dir, rows, max_new, work, work / f"{name}.vllm.log", eng,
                                drafter_dir=drafter_dir, block_size=B, more_concurrencies=[1, n_load])
        drafter_runs.append({"checkpoint": name, "runs": _runs(run, eng, True)})
        cmp = compare(rows, ev, run["requests"], B)
        e, o = cmp["engine"], cmp["offline"]
        rel = (e["tau_tokens_per_step"] - o["tau_tokens_per_step"]) / o["tau_tokens_per_step"]
        pos = max([abs(e["per_position"][c][k] - o["per_position"][c][k]) for c in ("unconditional", "conditional")
                   for k in o["per_position"][c]
                   if not math.isnan(e["per_position"][c][k]) and not math.isnan(o["per_position"][c][k])] or [0.0])
        speed = run["timing"]["output_tok_per_s"] / plain["timing"]["output_tok_per_s"]
        entry = {"checkpoint": name, "prompt_set": ev.get("prompt_set"), "block_size": B,
                 "mean_acceptance_length_raw": run["counters"].mean_acceptance_length,
                 "tau_tokens_per_step_engine": e["tau_tokens_per_step"],
                 "tau_tokens_per_step_offline": o["tau_tokens_per_step"], "tau_engine": e["tau"], "tau_offline": o["tau"],
                 "rel_diff": rel, "max_pos_diff": pos, "ok": abs(rel) <= REL_TOL and pos <= POS_TOL,
                 "per_position": {"engine": e["per_position"], "offline": o["per_position"],
                                  "engine_raw_unconditional": e["per_position_raw"]},
                 "kinds": cmp["kinds"], "n_compared": cmp["n_compared"], "timing": run["timing"],
                 "speedup_measured": speed, "speedup_estimated": _estimate(costs, name, o["tau"], B),
                 "cpu_fix": run["server"]["cpu_fix"], "counters": run["counters"].as_dict(),
                 "requests": cmp["requests"]}
        log.info("%s: vLLM raw %.4f, converted %.4f vs offline %.4f tokens/step (%+.2f %%), max per-position diff "
                 "%.4f; kinds %s; measured speedup %.2fx", name, entry["mean_acceptance_length_raw"],
                 e["tau_tokens_per_step"], o["tau_tokens_per_step"], 100 * rel, pos,
                 {k: v for k, v in cmp["kinds"].items() if v}, speed)
        result["checkpoints"].append(entry)
    result["lossless"] = lossless.token_check(
        rows, plain_runs, drafter_runs, lambda needed: lossless.judge_logits(target_dir, rows, needed,
                                                                             device=opts.margin_device),
        float(opts.near_tie_ulps))
    result["lossless"]["load_concurrency"] = n_load
    for entry, check in zip(result["checkpoints"], result["lossless"]["checkpoints"]):
        entry["engine_faults"] = {r["concurrency"]: r["n_faults"] for r in check["runs"]}
    log.info("token check: %d engine faults; %s", result["lossless"]["n_faults"], "; ".join(
        f"{c['checkpoint']}@{r['concurrency']}: {r['counts']}" for c in result["lossless"]["checkpoints"]
        for r in c["runs"]))


def _f(x, fmt="{:.4f}"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _markdown(r: dict) -> str:
    fix = any(c["cpu_fix"] for c in r["checkpoints"])
    lines = [f"vLLM {r['server'].get('version')} ({r['device']}, {r['server']['dtype']}) served the first "
             f"{r['n_samples']} prompts of `{r['completions']}` greedily, one plain server and one per checkpoint "
             "with `method: dflash`. *raw*: vLLM's mean acceptance length 1 + accepted / drafts (Prometheus); it counts "
             "drafts accepted past the stop token / max_tokens. *converted*: vLLM's per-request steps cut at the end "
             "as the replay does; *offline*: the replay of the same samples (tokens per verify step, pooled). "
             "*ok*: converted within 1 % and every per-position rate (both conventions) within 0.02."
             + (" The CPU server ran with dflash-eval's work-around for vLLM CPU's grouped `rms_norm` "
                "(docs/serving-engines.md)." if fix else ""), "",
             "| checkpoint | prompt set | raw | converted | offline | diff | max pos. diff | ok | requests equal | "
             "speedup measured | speedup estimated |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for c in r["checkpoints"]:
        eq = c["kinds"]["none"] + c["kinds"]["stop-counting"]
        lines.append(f"| {c['checkpoint']} | {c['prompt_set']} | {_f(c['mean_acceptance_length_raw'])} | "
                     f"{_f(c['tau_tokens_per_step_engine'])} | {_f(c['tau_tokens_per_step_offline'])} | "
                     f"{100 * c['rel_diff']:+.2f} % | {_f(c['max_pos_diff'])} | {'yes' if c['ok'] else '**no**'} | "
                     f"{eq}/{len(c['requests'])} | {_f(c['speedup_measured'], '{:.2f}x')} | "
                     f"{_f(c['speedup_estimated'], '{:.2f}x')} |")
    p = r["plain"]
    lines += ["", f"Measured on {r['device']}: plain vLLM {_f(p['output_tok_per_s'], '{:.1f}')} output tok/s, "
              f"mean latency {_f(p['latency_s']['mean'], '{:.2f}')} s per request (concurrency "
              f"{r['server']['concurrency']}); the estimate is the cost model on "
              f"{r['costs_device'] or 'no target_costs.json'}."]
    kinds = {k: sum(c["kinds"][k] for c in r["checkpoints"]) for k in DIVERGENCES}
    lines += ["", "Divergence kinds over all requests: " + ", ".join(f"*{k}* {v} ({DIVERGENCES[k]})"
                                                                        for k, v in kinds.items() if v) + "."]
    pos_rows = []
    for c in r["checkpoints"]:
        for conv in ("unconditional", "conditional"):
            e, o = c["per_position"]["engine"][conv], c["per_position"]["offline"][conv]
            pos_rows.append(f"| {c['checkpoint']} | {conv} | " + " | ".join(
                f"{_f(e[k], '{:.3f}')} / {_f(o[k], '{:.3f}')}" for k in sorted(o, key=int)) + " |")
    if pos_rows:
        B = r["checkpoints"][0]["block_size"]
        lines += ["", "Per-position acceptance, engine (converted) / offline; unconditional = P(slots 1..k accepted), "
                      "conditional = P(slot k | slots < k):", "",
                  "| checkpoint | convention | " + " | ".join(f"slot {k}" for k in range(1, B)) + " |",
                  "|---|---|" + "---:|" * (B - 1)] + pos_rows
    return "\n".join(lines)


# --------------------------------------------------------------------------- temperature > 0

def _sampled_plan(entries: list[dict], drafters, evals, loaded, rows) -> list[dict]:
    """Every (checkpoint, setting, draft policy) served at temperature > 0, checked before any server starts.

    Policies: the entry's ``draft``, else those its evaluate output holds for the setting, else every policy that
    applies to the drafter's family (:meth:`dflash_eval.drafter.families.DrafterFamily.draft_policies`).

    Raises:
        InputError: an evaluate output without the setting's expectation for a policy, or without one of the
            prompts.
    """
    jobs = []
    for drafter_dir, eval_path, ev in zip(drafters, evals, loaded):
        family = family_of(ev.get("variant"))  # an output without variant: DFlash 1 (the default family)
        variant = family.name
        have = {s["id"] for s in ev["samples"]}
        missing = [r["id"] for r in rows if r["id"] not in have]
        for i, e in enumerate(entries):
            st = SamplingSetting(float(e.get("temperature", 0)), float(e.get("top_p", 1.0)), int(e.get("top_k", 0)))
            if st.greedy:
                continue
            if missing:
                raise InputError(eval_path, "samples", f"no offline result for {missing[:5]}",
                                 "evaluate the drafter on the cache built from these completions")
            recorded = next((x.get("draft") for x in ev.get("sampling_settings") or [] if x["label"] == st.label), None)
            for pol in e.get("draft") or recorded or family.draft_policies(st):
                key = policy_label(st.label, pol)
                if key not in (ev.get("expected") or {}):
                    raise InputError(eval_path, f"expected.{key}", f"validate_engine.sampling[{i}] asks for {st.label} "
                                     f"with draft policy {pol}, but this evaluate output has no such expectation",
                                     f"add {{temperature: {st.temperature:g}, top_p: {st.top_p:g}, top_k: {st.top_k}, "
                                     f"draft: [{pol}]}} to evaluate.sampling for this prompt set and rerun evaluate")
                drawn = ev.get("completion_sampling") or {"temperature": 0.0}
                drawn_label = SamplingSetting(float(drawn["temperature"]), float(drawn.get("top_p", 1.0)),
                                              int(drawn.get("top_k", 0))).label
                jobs.append({"drafter": drafter_dir, "eval": ev, "setting": st, "policy": pol, "key": key,
                             "variant": variant, "block_size": int(ev["block_size"]),
                             "checkpoint": ev.get("checkpoint", Path(drafter_dir).name),
                             "method": family.vllm_draft_sample_method(st, pol),
                             "expectation": drawn_label == st.label, "trajectory": drawn_label})
    return jobs


def _log_tail(path: Path, chars: int = 20000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _sampled_run(job: dict, target_dir, rows, max_new, work, eng, seeds: int) -> dict:
    """Serve one checkpoint with the policy's ``draft_sample_method``, each prompt ``seeds`` times at the setting;
    the engine's tau (mean +- s.e.) beside the offline expectation (:func:`dflash_eval.serving.vllm.sampled.sampled_compare`),
    or the engine's failure named with its cause and workaround."""
    st, pol = job["setting"], job["policy"]
    out = {"checkpoint": job["checkpoint"], "prompt_set": job["eval"].get("prompt_set"), "sampling": st.label,
           "draft": pol, "draft_sample_method": job["method"], "variant": job["variant"],
           "expectation": job["expectation"], "trajectory": job["trajectory"], "error": None}
    if job["method"] is None:
        out["error"] = {"cause": f"no vLLM draft_sample_method drafts as the {pol} policy at {st.label} (vLLM's "
                                 "probabilistic q ignores top-p / top-k: that is the probabilistic policy)",
                        "workaround": "compare the probabilistic policy's row with vLLM probabilistic", "detail": None}
        return out
    log_path = work / f"{job['checkpoint']}.{st.label}.{pol}.vllm.log"
    start_error = None
    try:
        run = serve_and_measure(target_dir, rows, max_new, work, log_path, eng, drafter_dir=job["drafter"],
                                block_size=job["block_size"], draft_sample_method=job["method"],
                                sampling={"temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k},
                                seeds=seeds)
    except (ServerError, ServerUnavailable, RuntimeError, OSError) as err:
        run, start_error = {"requests": [], "server": {}, "counters": None}, f"{type(err).__name__}: {str(err)[:500]}"
    fail = engine_failure(run["requests"], _log_tail(log_path), start_error)
    out["server_version"] = (run.get("server") or {}).get("version")
    out["counters"] = run["counters"].as_dict() if run.get("counters") is not None else None
    if fail:
        out["error"] = fail
        log.warning("%s at %s, draft %s (vLLM %s): %s; workaround: %s", job["checkpoint"], st.label, pol,
                    job["method"], fail["cause"], fail["workaround"])
        return out
    out.update(sampled_compare(rows, job["eval"], run["requests"], job["key"]))
    out["n_failed_requests"] = sum(1 for r in run["requests"] if r.error)
    log.info("%s at %s, draft %s (vLLM draft_sample_method=%s): engine tau %.4f +- %.4f vs offline %.4f (z %+.1f)%s",
             job["checkpoint"], st.label, pol, job["method"], out["tau_engine"], out["tau_engine_se"],
             out["tau_offline"], out["z"], " FLAGGED" if out["flag"] else "")
    return out


def _rankings(result: dict) -> list[dict]:
    """Per (setting, policy) with at least two checkpoints, and for the greedy check: does the checkpoint order by
    offline tau hold on the engine (:func:`dflash_eval.serving.vllm.sampled.ranking`)."""
    out = []
    if len(result["checkpoints"]) >= 2:
        c = result["checkpoints"]
        out.append({"sampling": "T0", "draft": "reference", **ranking(
            [x["checkpoint"] for x in c], [x["tau_offline"] for x in c], [x["tau_engine"] for x in c])})
    groups: dict[tuple, list] = {}
    for x in result["sampled"]:
        if x.get("error") is None:
            groups.setdefault((x["sampling"], x["draft"]), []).append(x)
    for (lab, pol), xs in groups.items():
        if len(xs) >= 2:
            out.append({"sampling": lab, "draft": pol, **ranking([x["checkpoint"] for x in xs],
                                                                  [x["tau_offline"] for x in xs],
                                                                  [x["tau_engine"] for x in xs])})
    return out


def _alerts(r: dict) -> str:
    """The lines the report shows first: engine runs flagged beyond :data:`FLAG_SE` standard errors, and failed ones
    with their cause and workaround ("" when none)."""
    flagged = [x for x in r["sampled"] if x.get("flag")]
    failed = [x for x in r["sampled"] if x.get("error")]
    lines = []
    if flagged:
        lines.append(f"**ENGINE DISAGREES with the offline expectation beyond {FLAG_SE:g} standard errors** for "
                     + ", ".join(f"{x['checkpoint']} at {x['sampling']} [{x['draft']}, vLLM "
                                 f"draft_sample_method={x['draft_sample_method']}] (z {x['z']:+.1f})" for x in flagged)
                     + ": an engine or drafter problem (docs/serving-engines.md, Engine at T > 0).")
    lines += [f"**ENGINE FAILED** for {x['checkpoint']} at {x['sampling']} [{x['draft']}]: "
              f"{x['error']['cause']}. Workaround: {x['error']['workaround']}." for x in failed]
    return "\n\n".join(lines)


def _sampled_markdown(r: dict) -> str:
    if not r["sampled"] and not r.get("ranking"):
        return ""
    lines = []
    if r["sampled"]:
        lines += [f"vLLM served each of the first {r['n_samples']} prompts {r['seeds']} times per setting (request "
                  "seeds 0..), the drafter with the draft policy's `draft_sample_method`. *engine*: the mean over "
                  "prompts of each prompt's mean tau over its requests (tokens per verify step after the stop-token "
                  "cut) +- its standard error; *offline*: evaluate's expected tau of the same policy given the "
                  "cached completions; *z*: the paired difference (per prompt) over its standard error; *flag*: "
                  f"|z| > {FLAG_SE:g}. A row on completions drawn at another setting is not an expectation.", "",
                  "| checkpoint | setting | draft policy | vLLM draft_sample_method | engine | offline | diff | z | "
                  "flag |", "|---|---|---|---|---:|---:|---:|---:|---|"]
        for x in r["sampled"]:
            head = (f"| {x['checkpoint']} | {x['sampling']} | {x['draft']} | {x['draft_sample_method'] or 'none'} | ")
            if x.get("error"):
                lines.append(head + "failed | " + f"n/a | n/a | n/a | **engine failed** ({x['error']['cause']}) |")
                continue
            off = _f(x["tau_offline"]) + ("" if x["expectation"] else f" (on {x['trajectory']}: not an expectation)")
            lines.append(head + f"{_f(x['tau_engine'])} +- {_f(x['tau_engine_se'])} | {off} | {x['diff']:+.4f} | "
                         f"{_f(x['z'], '{:+.1f}')} | {'**DISAGREE**' if x['flag'] else 'ok' if x['flag'] is False else 'n/a'} |")
    if r.get("ranking"):
        lines += ["", "Does the checkpoint order hold on the engine? Spearman's rho between the checkpoints' offline "
                      "and engine tau, and the best checkpoint by each:", "",
                  "| setting | draft policy | checkpoints | Spearman rho | best offline | best engine | same best |",
                  "|---|---|---:|---:|---|---|---|"]
        for g in r["ranking"]:
            lines.append(f"| {g['sampling']} | {g['draft']} | {g['n']} | {_f(g['spearman'], '{:+.3f}')} | "
                         f"{g['best_offline']} | {g['best_engine']} | {'yes' if g['same_best'] else '**no**'} |")
    return "\n".join(lines)
