"""Stage ``validate_online`` (rule ``validate_online``): true speculative decoding of a few prompts vs the offline replay.

The online loop (target in the loop: chain and DDTree, greedy; the chain with dflash==0.1.0's
speculative sampler at temperature > 0) is :func:`dflash_eval.replay.online.spec_generate`; this stage runs
it on the first ``n_samples`` prompts of one prompt set for every selected drafter and compares per
sample with that drafter's evaluate JSON: greedy runs step by step with the offline replay, sampled
runs (``seeds`` of them per prompt and setting) with the offline expected tau of the setting.
Options: config section ``validate_online`` (:mod:`dflash_eval.core.options`).
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch

from dflash_eval.cache.format import CacheSample
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.data.completions import read_completions
from dflash_eval.data.provenance import meta_path, read_meta, stage_block, write_json
from dflash_eval.drafter.model import NONFINITE_FIX, load_drafter
from dflash_eval.replay.anchors import iter_anchor_drafts
from dflash_eval.replay.expected import response_expectations
from dflash_eval.replay.metrics import aggregate
from dflash_eval.replay.online import check_target_supported, spec_generate
from dflash_eval.replay.sampling import SamplingSetting, token_probs
from dflash_eval.report.records import online_records, read_eval, records_path, validation_jobs, write_records
from dflash_eval.serving.generation import stop_token_ids
from dflash_eval.target.model import load_target
from dflash_eval.target.spec import TargetSpec, load_embed_and_head

log = logging.getLogger(__name__)

STAGE = "validate_online"
#: goal of the macro offline-vs-online tau difference at temperature > 0, relative to the online tau
SAMPLED_GOAL = 0.03


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder (full-attention targets only)")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first n_samples "
                                                        "prompts are decoded")
    p.add_argument("--drafter", nargs="+", required=True, help="stripped drafter folders")
    p.add_argument("--evals", nargs="+", required=True,
                   help="evaluate JSONs of those drafters on this prompt set, in the order of --drafter")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="the target's fingerprint record (resources/targets/<name>.fingerprint.json): the target's "
                        "weights sha256 is verified through it and compared with the completions' (the workflow "
                        "passes it)")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the per-sample "
                                                "comparison")
    p.add_argument("--out-records", default=None, help="per-request records (default: <out>.records.parquet beside "
                                                       "--out; dflash_eval.report.records)")
    p.add_argument("--run", default=None, help="the run's name, the records' run column (the workflow passes it)")


def main(args, opts) -> None:
    validate_online(args.target, args.completions, args.drafter, args.evals, args.out, opts,
                    target_fingerprint=args.target_fingerprint, out_records=args.out_records, run=args.run)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing entry (``None`` if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def validate_online(target_dir, completions_path, drafters: list[str], evals: list[str], out, opts=None,
                    target_fingerprint=None, out_records=None, run: str | None = None, **overrides) -> dict:
    """Online speculative decoding of the first ``n_samples`` prompts vs the offline replay of the same samples.

    Per drafter (paired with its evaluate JSON on the same prompt set) and per mode (``chain``, and
    ``ddtree_<budget>`` when ``budget > 0``): run :func:`spec_generate` on each prompt and compare with the
    cached greedy completion and the offline per-step acceptance lengths. Where the online output equals
    the cached completion, the per-step acceptance lengths should be identical (exactly so in float32);
    in bf16 the online trajectory can leave the cached completion at a near-tie, so the summary is the
    macro tau difference over all compared samples, ``(online - offline) / offline`` (goal |.| <= 2 %).

    At temperature > 0 (``opts.sampling``; default every T > 0 setting the evaluation holds): per setting,
    prompt and seed one run of the chain with the speculative sampler (:func:`spec_generate` with
    ``sampling``); its context is the target's own trajectory as sampled online. Per sample the mean tau over
    the runs and its standard error (sd / sqrt(runs)) against the evaluation's expected tau of that sample,
    which is the expectation given the *cached* completion (teacher-forced on it, :mod:`dflash_eval.replay.expected`).
    The two share their mean over trajectories, not per sample, so the SE of the difference adds the spread
    of that expectation over trajectories, estimated from the expectation given each online run's own
    trajectory; that per-run expectation also gives a paired check (online tau minus it, 0 in expectation).
    The macro over samples is the measure (goal ``|diff| <= 3 %`` of the online tau).

    Args:
        target_dir: HF target folder (full attention only, :func:`check_target_supported`).
        completions_path: completions JSONL of the prompt set the evaluations used.
        drafters: stripped drafter folders, in the order of ``evals``.
        evals: evaluate JSONs (per-sample ``acceptance_lengths``; ``acceptance_lengths_ddtree`` when
            ``budget > 0``), one per drafter.
        out: JSON path. Keys: ``title`` and ``markdown`` (for ``report --extra``), ``budget``, ``device``,
            ``dtype``, ``checkpoints``: per drafter and mode ``tau_online``, ``tau_offline``, ``rel_diff``,
            ``n_same_output``, ``n_identical_steps``, ``ok`` (every same-output sample has identical steps, and at
            least one sample has the same output: none compared validates nothing),
            ``seconds`` and ``samples`` (``id``, ``same_output``, ``identical_steps``, ``first_step_diff``,
            ``first_token_diff``, ``online``, ``offline``); per drafter ``sampling`` ``{setting label: ...}``
            (:func:`_sampled_entry`: macro ``tau_online`` (mean over samples of the per-sample mean over
            seeds), ``tau_online_se``, ``tau_offline`` (mean expected tau of the same samples), ``diff``,
            ``diff_se``, ``diff_over_se``, ``rel_diff``, ``within_goal``, ``tau_expected_online``,
            ``paired_diff``, ``paired_se``, ``paired_over_se``, and per sample the same fields plus ``taus``
            and ``expected_taus``, one per run); per drafter ``completion_sampling`` (the trajectory's
            setting, from the evaluation); top level ``seeds``, ``seed`` and ``sampling_settings``.
        opts: the stage's options (config section ``validate_online``): ``n_samples`` (prompts to decode,
            the first of the completions file, >= 1), ``ddtree_budget`` (DDTree node budget to validate,
            one of the evaluation's ``ddtree_budgets``; 0 or null = chain only; the workflow passes the
            smallest of ``evaluate.ddtree_budgets`` by default), ``sampling`` (settings with temperature
            > 0, each one the evaluation holds; null = all of them; [] = greedy only), ``seeds`` (runs per
            prompt and setting), ``seed`` (run k of the i-th prompt draws from a ``torch.Generator``
            seeded with ``seed + i * seeds + k``), ``device``, ``dtype`` (``auto``: cuda/bf16 if
            available, else cpu/float32).
        out_records: the per-request records (source ``online``,
            :func:`dflash_eval.report.records.online_records`); None: ``<out stem>.records.parquet`` beside ``out``.
        run: the records' ``run`` column (None: null).
        **overrides: option values, when ``opts`` is not given.

    Raises:
        InputError: ``n_samples < 1``, drafters/evals of different lengths, an evaluation without the budget
            or without one of the samples, or an unsupported (hybrid / sliding-window) target; a
            ``sampling`` entry at temperature 0 (schema) or one the evaluation has no expected tau for.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    n_samples, budget = opts.n_samples, opts.ddtree_budget or 0
    if len(drafters) != len(evals):
        raise InputError(None, "--drafter/--evals", f"{len(drafters)} drafters but {len(evals)} evaluations",
                         "pass one evaluate JSON per drafter, in the same order")
    asked = _asked_settings(opts.sampling)
    loaded = [read_eval(e) for e in evals]
    # checked before the target is loaded: a refused setting costs no target load
    settings_of = [_settings_for(ev, e, asked) for ev, e in zip(loaded, evals)]
    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    target_sha = _check_target(spec, completions_path) if target_fingerprint else None
    target, tok, _ = load_target(spec, dev, dt)
    check_target_supported(target, str(Path(target_dir) / "config.json"))
    stop_ids, _ = stop_token_ids(target_dir, tok)  # the ids the completions stage stopped on
    embed, head = (w.to(device=dev, dtype=dt) for w in load_embed_and_head(spec))
    rows = read_completions(Path(completions_path))[:n_samples]
    modes = [("chain", None)] + ([(f"ddtree_{budget}", budget)] if budget else [])
    result: dict = {"title": "Online speculative decoding vs offline replay", "budget": budget or None,
                    "device": str(dev), "dtype": dtype_name(dt), "n_samples": len(rows), "target_sha256": target_sha,
                    "completions": str(completions_path), "seeds": opts.seeds, "seed": opts.seed,
                    "sampling_settings": [], "checkpoints": []}
    for drafter_dir, eval_path, ev, settings in zip(drafters, evals, loaded, settings_of):
        offline = {s["id"]: s for s in ev["samples"]}
        if budget and budget not in ev.get("ddtree_budgets", []):
            raise InputError(eval_path, "ddtree_budgets", f"{ev.get('ddtree_budgets', [])} lacks budget {budget}",
                             "validate a budget listed in evaluate.ddtree_budgets")
        missing = [r["id"] for r in rows if r["id"] not in offline]
        if missing:
            raise InputError(eval_path, "samples", f"no offline result for {missing[:5]}",
                             "evaluate the drafter on the cache built from these completions")
        drafter = load_drafter(drafter_dir, device=dev, dtype=dt)
        entry = {"checkpoint": ev.get("checkpoint", Path(drafter_dir).name), "prompt_set": ev.get("prompt_set"),
                 "modes": {}}
        for name, b in modes:
            if b is not None and ev.get("ddtree_applicable") is False:  # DFlash 2: chain only (docs/design.md)
                log.info("%s: DDTree not applicable (DFlash 2 drafter), chain validated only", entry["checkpoint"])
                continue
            samples, t_mode = [], 0.0
            for r in rows:
                o = spec_generate(target, drafter, embed, head, r["prompt_ids"], r["max_new_tokens"], stop_ids,
                                  ev.get("block_size"), b)
                t_mode += o.seconds
                off = offline[r["id"]]
                off_steps = off["acceptance_lengths"] if b is None else off["acceptance_lengths_ddtree"][str(b)]
                same = o.completion_ids == r["completion_ids"]
                samples.append({"id": r["id"], "same_output": same,
                                "identical_steps": same and o.acceptance_lengths == off_steps,
                                "first_token_diff": _first_diff(o.completion_ids, r["completion_ids"]),
                                "first_step_diff": _first_diff(o.acceptance_lengths, off_steps),
                                "online": o.acceptance_lengths, "offline": off_steps})
            on = aggregate([s["online"] for s in samples], ev["block_size"]).tau
            offt = aggregate([s["offline"] for s in samples], ev["block_size"]).tau
            same_n = sum(s["same_output"] for s in samples)
            ident_n = sum(s["identical_steps"] for s in samples)
            entry["modes"][name] = {"tau_online": on, "tau_offline": offt, "rel_diff": (on - offt) / offt,
                                    "n_same_output": same_n, "n_identical_steps": ident_n,
                                    "ok": same_n == ident_n and same_n > 0,  # no sample compared: nothing validated
                                    "seconds": round(t_mode, 3), "samples": samples}
            log.log(logging.INFO if entry["modes"][name]["ok"] else logging.WARNING,
                    "%s %s: online tau %.4f vs offline %.4f (%+.2f %%); %d/%d same output, %d of them identical steps",
                    entry["checkpoint"], name, on, offt, 100 * (on - offt) / offt, same_n, len(samples), ident_n)
        if drafter.take_nonfinite():  # an online tau of 1.0 "agreeing" with an offline 1.0 is no validation
            raise InputError(Path(drafter_dir) / "model.safetensors", None, "the drafter's states are not finite "
                             "(NaN or inf) in its forward pass: every draft is rejected", NONFINITE_FIX)
        for st in settings:
            if st.label not in [x["label"] for x in result["sampling_settings"]]:
                result["sampling_settings"].append({"label": st.label, "temperature": st.temperature,
                                                    "top_p": st.top_p, "top_k": st.top_k})
        entry["completion_sampling"] = ev.get("completion_sampling")
        entry["sampling"] = {st.label: _sampled_entry(target, drafter, embed, head, rows, stop_ids, ev, st, opts, dev)
                             for st in settings}
        for label, m in entry["sampling"].items():
            log.info("%s %s: online tau %s +- %s over %d seeds vs offline expected %s (diff %s, %s SE)",
                     entry["checkpoint"], label, _f(m["tau_online"]), _f(m["tau_online_se"]), opts.seeds,
                     _f(m["tau_offline"]), _f(m["diff"], "+.4f"), _f(m["diff_over_se"], "+.2f"))
        result["checkpoints"].append(entry)
    result["markdown"] = _markdown(result)
    result["provenance"] = stage_block(STAGE, opts, {"target": target_sha, **{
        str(e): (ev.get("provenance") or {}).get("inputs_sha256", {}).get("drafter_weights") for e, ev in zip(evals, loaded)}})
    result.update(write_json(out, result))
    records = online_records(result, loaded, rows, run)
    write_records(out_records or records_path(out), records, validation_jobs(records, result))
    return result


def _check_target(spec: TargetSpec, completions_path) -> str:
    """The target's weights sha256, verified through its fingerprint record (weights changed in place are refused:
    :func:`dflash_eval.target.spec.weights_sha256`), and compared with the sha256 of the weights that generated the
    completions (their meta; a server's completions name none).

    Raises:
        InputError: the weights changed in place, or are not those that generated the completions.
    """
    sha = spec.weights_sha256()
    meta = meta_path(completions_path)
    made = read_meta(meta, "completions").get("target_sha256") if meta.is_file() else None
    if made and made != sha:
        raise InputError(meta, "target_sha256", f"the completions were generated by a target with weights sha256 "
                         f"{made[:16]}..., the target given is {sha[:16]}...: online decoding would not follow them",
                         "validate against the target that made the run's completions (or remake them)")
    return sha


def _asked_settings(entries) -> list[SamplingSetting] | None:
    """``opts.sampling`` as settings (``None`` = every T > 0 setting of each evaluation; the schema refuses
    temperature 0 there: greedy is always validated, by the chain and DDTree modes)."""
    if entries is None:
        return None
    return [SamplingSetting(float(e["temperature"]), float(e.get("top_p", 1.0)), int(e.get("top_k", 0)))
            for e in entries]


def _settings_for(ev: dict, eval_path, asked) -> list[SamplingSetting]:
    """The T > 0 settings to run for one evaluation: ``asked``, or (``None``) each T > 0 setting it holds.

    Raises:
        InputError: an asked setting without an expected tau in the evaluation.
    """
    held = [SamplingSetting(float(e["temperature"]), float(e["top_p"]), int(e["top_k"]))
            for e in ev.get("sampling_settings", [])]
    settings = [st for st in held if not st.greedy] if asked is None else asked
    for st in settings:
        if st.label not in (ev.get("expected") or {}):
            raise InputError(eval_path, "expected", f"no expected tau at {st.label} (evaluated: "
                             f"{sorted(ev.get('expected') or {})})",
                             "add the setting to evaluate.sampling, or drop it from validate_online.sampling")
    return settings


def _mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error (sample sd / sqrt(n)) of ``xs``; ``None`` where undefined (no / one value)."""
    n = len(xs)
    if n == 0:
        return None, None
    m = sum(xs) / n
    if n < 2:
        return m, None
    return m, math.sqrt(_var(xs) / n)


def _var(xs: list[float]) -> float:
    """Sample variance (n - 1 in the denominator) of at least two values."""
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@torch.inference_mode()
def _expected_on_runs(target, drafter, embed, head, sequences: list[list[int]], prompt_len: int, max_new: int,
                      st: SamplingSetting, B: int) -> list[float | None]:
    """evaluate's expected tau (:mod:`dflash_eval.replay.expected`) given each online run's own trajectory.

    Each ``sequences[k]`` (prompt + the run's completion) goes through one target forward (the drafter's
    ``target_layer_ids`` states, the filtered p of every token) and the drafter's all-anchor pass, as
    evaluate does on a cached completion; ``None`` for a run without a verify step.
    """
    layers = list(drafter.cfg.target_layer_ids)
    samples, p_tokens, keep = [], [], []
    for k, seq in enumerate(sequences):
        if len(seq) - 1 - prompt_len < 1:
            continue
        ids = torch.tensor(seq, device=embed.device)
        out = target(input_ids=ids[None], output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[i + 1][0] for i in layers], dim=1).to(embed.dtype)  # [T, K, H]
        p = torch.ones(len(seq), dtype=torch.float32, device=embed.device)
        p[1:] = token_probs(out.logits[0, :-1], ids[1:], st.temperature, st.top_p, st.top_k)
        # on the host, as evaluate reads them from the cache; p on the compute device, as evaluate's
        samples.append(CacheSample(len(samples), str(k), ids.cpu(), prompt_len, hidden.cpu(),
                                   out.logits[0].argmax(-1).cpu(), "", max_new))
        p_tokens.append({st.label: p})
        keep.append(k)
    res: list[float | None] = [None] * len(sequences)
    if samples:
        drafts = list(iter_anchor_drafts(drafter, embed, head, samples, B, sampling=[st], p_tokens=p_tokens))
        exp = response_expectations([d.survival[st.label].cpu() for d in drafts], [d.prompt_len for d in drafts],
                                    [d.n_tokens for d in drafts], B)
        for k, e in zip(keep, exp):
            res[k] = e.tau
    return res


def _sampled_entry(target, drafter, embed, head, rows, stop_ids, ev: dict, st: SamplingSetting, opts, dev) -> dict:
    """One drafter and setting at temperature > 0: ``opts.seeds`` sampled chain runs per prompt vs the expected tau.

    Per sample (runs without a verify step, whose prefill token was a stop token, have ``None`` and are left
    out of the means):

    * ``taus``: each run's tau; ``runs``: how many have a verify step; ``tau_online`` / ``tau_online_se``:
      their mean and standard error (sd / sqrt(runs)).
    * ``tau_offline``: the evaluation's expected tau given the *cached* completion (``None`` when that had
      no verify step); ``diff = tau_online - tau_offline``, ``rel_diff = diff / tau_online``.
    * ``expected_taus``: the same expectation given each run's own trajectory (:func:`_expected_on_runs`);
      their variance estimates the variance of ``tau_offline`` over the trajectories the cached completion
      was one draw of, so ``diff_se = sqrt(tau_online_se^2 + var(expected_taus))`` is the SE of ``diff`` and
      ``diff_over_se = diff / diff_se``.
    * ``paired_diff``: mean over runs of ``tau - expected tau given that run's trajectory`` (0 in
      expectation: the estimator given the trajectory is unbiased, :mod:`dflash_eval.replay.sampling`), its
      ``paired_se`` and ``paired_over_se``.

    Macro over the samples with both sides (``n_compared``): the means of those fields, every SE as
    ``sqrt(sum se_i^2) / n`` (independent samples), ``within_goal`` (``|rel_diff| <= SAMPLED_GOAL``), and
    ``seconds`` (online runs and the expectations on their trajectories).
    """
    expected = {s["id"]: e for s, e in zip(ev["samples"], ev["expected"][st.label]["samples"])}
    B = int(ev.get("block_size") or drafter.cfg.block_size)
    samples, t0 = [], time.perf_counter()
    for i, r in enumerate(rows):
        taus, seqs = [], []
        for k in range(opts.seeds):
            g = torch.Generator(device=dev).manual_seed(opts.seed + i * opts.seeds + k)
            o = spec_generate(target, drafter, embed, head, r["prompt_ids"], r["max_new_tokens"], stop_ids,
                              B, None, sampling=st, generator=g)
            steps = o.acceptance_lengths
            taus.append(sum(steps) / len(steps) if steps else None)
            seqs.append(list(r["prompt_ids"]) + o.completion_ids)
        exp_runs = _expected_on_runs(target, drafter, embed, head, seqs, len(r["prompt_ids"]), r["max_new_tokens"],
                                     st, B)
        ok = [k for k, t in enumerate(taus) if t is not None]
        on, se = _mean_se([taus[k] for k in ok])
        exp_on, _ = _mean_se([exp_runs[k] for k in ok])
        _, paired_se = _mean_se([taus[k] - exp_runs[k] for k in ok])
        exp = expected[r["id"]]
        off = exp["tau"] if exp is not None else None
        diff = on - off if on is not None and off is not None else None
        diff_se = math.sqrt(se ** 2 + _var([exp_runs[k] for k in ok])) if se is not None else None
        paired = on - exp_on if on is not None else None
        samples.append({"id": r["id"], "runs": len(ok), "tau_online": on, "tau_online_se": se, "tau_offline": off,
                        "diff": diff, "diff_se": diff_se, "diff_over_se": _ratio(diff, diff_se),
                        "rel_diff": _ratio(diff, on), "tau_expected_online": exp_on, "paired_diff": paired,
                        "paired_se": paired_se, "paired_over_se": _ratio(paired, paired_se), "taus": taus,
                        "expected_taus": exp_runs})
    both = [s for s in samples if s["tau_online"] is not None and s["tau_offline"] is not None]
    n = len(both)

    def mean(key):
        return sum(s[key] for s in both) / n if n else None

    def pooled(key):
        vals = [s[key] for s in both]
        return math.sqrt(sum(x * x for x in vals)) / n if n and all(x is not None for x in vals) else None

    on, off, exp_on = mean("tau_online"), mean("tau_offline"), mean("tau_expected_online")
    diff = on - off if n else None
    paired = on - exp_on if n else None
    rel = _ratio(diff, on)
    return {"temperature": st.temperature, "top_p": st.top_p, "top_k": st.top_k, "seeds": opts.seeds,
            "n_compared": n, "tau_online": on, "tau_online_se": pooled("tau_online_se"), "tau_offline": off,
            "diff": diff, "diff_se": pooled("diff_se"), "diff_over_se": _ratio(diff, pooled("diff_se")),
            "rel_diff": rel, "within_goal": rel is not None and abs(rel) <= SAMPLED_GOAL,
            "tau_expected_online": exp_on, "paired_diff": paired, "paired_se": pooled("paired_se"),
            "paired_over_se": _ratio(paired, pooled("paired_se")),
            "seconds": round(time.perf_counter() - t0, 3), "samples": samples}


def _f(x, fmt: str = ".4f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f} %"


def _markdown_sampled(r: dict) -> list[str]:
    """The temperature > 0 part of the markdown (empty without sampled settings)."""
    rows = [(c, label, m) for c in r["checkpoints"] for label, m in c.get("sampling", {}).items()]
    if not rows:
        return []
    lines = ["", (f"**Speculative sampling (temperature > 0).** Per setting, each prompt is decoded {r['seeds']} "
                  "times (one seed each) by dflash==0.1.0's speculative sampler with the target in the loop (DFlash "
                  "chain): drafts sampled from the drafter's filtered q, verified against the target's filtered p "
                  "by rejection sampling (correction from max(p - q, 0), bonus token from p). Online, the context "
                  "is the target's own trajectory as sampled in that run. *tau offline* is evaluate's expected tau "
                  "given the *cached* completion: teacher-forced on that one trajectory, drawn at the completions' "
                  "setting (*trajectory*). Online and offline have the same mean over trajectories, not per "
                  "sample, so *SE* is the standard error of the difference: the online runs' SE and the spread "
                  "of the expected tau over trajectories, estimated from the expectation given each online run's "
                  "own trajectory (*E[tau] online traj.*). *paired*: online tau minus that expectation, run by "
                  "run (0 in expectation; the check of the estimator). Goal: the macro difference within 3 % of "
                  "the online tau."), "",
             ("| checkpoint | prompt set | setting | trajectory | samples | tau online (mean +- SE) | tau offline | "
              "diff | diff / SE | within 3 % | E[tau] online traj. | paired diff / SE |"),
             "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for c, label, m in rows:
        cs = c.get("completion_sampling") or {}
        traj = SamplingSetting(float(cs.get("temperature", 0)), float(cs.get("top_p", 1.0)),
                               int(cs.get("top_k", 0))).label if cs else "?"
        lines.append(f"| {c['checkpoint']} | {c['prompt_set']} | {label} | {traj} | {m['n_compared']} | "
                     f"{_f(m['tau_online'])} +- {_f(m['tau_online_se'])} | {_f(m['tau_offline'])} | "
                     f"{_pct(m['rel_diff'])} | {_f(m['diff_over_se'], '+.2f')} | "
                     f"{'yes' if m['within_goal'] else '**no**'} | {_f(m['tau_expected_online'])} | "
                     f"{_f(m['paired_over_se'], '+.2f')} |")
    lines += ["", "Per sample:", "",
              ("| checkpoint | setting | sample | runs | tau online | SE online | tau offline | diff | diff / SE | "
               "E[tau] online traj. | paired diff / SE |"),
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c, label, m in rows:
        for s in m["samples"]:
            lines.append(f"| {c['checkpoint']} | {label} | `{s['id']}` | {s['runs']} | {_f(s['tau_online'])} | "
                         f"{_f(s['tau_online_se'])} | {_f(s['tau_offline'])} | {_f(s['diff'], '+.4f')} | "
                         f"{_f(s['diff_over_se'], '+.2f')} | {_f(s['tau_expected_online'])} | "
                         f"{_f(s['paired_over_se'], '+.2f')} |")
    return lines


def _markdown(r: dict) -> str:
    lines = [(f"Greedy speculative decoding with the target in the loop on the first {r['n_samples']} prompts of "
             f"`{r['completions']}` ({r['device']}, {r['dtype']}), against the offline replay of the same samples. "
             "DDTree verifies its tree in one target forward with an ancestor-only mask. *same output*: the online "
             "completion equals the cached greedy completion; for those, the per-step acceptance lengths must be "
             "identical (*identical*). In bf16 the online trajectory may leave the cached completion at a near-tie; "
             "the macro tau difference is then the measure (goal within 2 %). *ok*: every same-output sample has "
             "identical steps."), "",
             ("| checkpoint | prompt set | mode | tau online | tau offline | diff | within 2 % | same output | "
              "identical steps | ok |"),
             "|---|---|---|---:|---:|---:|---|---:|---:|---|"]
    for c in r["checkpoints"]:
        for name, m in c["modes"].items():
            n = len(m["samples"])
            lines.append(f"| {c['checkpoint']} | {c['prompt_set']} | {name} | {m['tau_online']:.4f} | "
                         f"{m['tau_offline']:.4f} | {100 * m['rel_diff']:+.2f} % | "
                         f"{'yes' if abs(m['rel_diff']) <= 0.02 else '**no**'} | {m['n_same_output']}/{n} | "
                         f"{m['n_identical_steps']}/{m['n_same_output']} | {'yes' if m['ok'] else '**no**'} |")
    bad = [(c["checkpoint"], name, s) for c in r["checkpoints"] for name, m in c["modes"].items()
           for s in m["samples"] if s["same_output"] and not s["identical_steps"]]
    if bad:
        lines += ["", "Same output but different acceptance (first differing verify step):", ""]
        lines += [f"- `{c}` {name} `{s['id']}`: step {s['first_step_diff']}" for c, name, s in bad]
    return "\n".join(lines + _markdown_sampled(r))
