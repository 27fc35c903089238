"""Stage ``validate_online`` (rule ``validate_online``): true speculative decoding of a few prompts vs the offline replay.

The online loop (target in the loop: chain and DDTree) is :func:`dflash_eval.online.spec_generate`;
this stage runs it on the first ``n_samples`` prompts of one prompt set for every selected drafter
and compares per sample with that drafter's evaluate JSON. Options: config section
``validate_online`` (:mod:`dflash_eval.options`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .. import options as options_mod
from ..completions_file import read_completions
from ..drafter import load_drafter
from ..errors import InputError, atomic_path
from ..generation import stop_token_ids
from ..metrics import aggregate
from ..online import check_target_supported, spec_generate
from ..runtime import dtype_name, resolve_device, resolve_dtype
from ..target import load_target
from ..target_spec import TargetSpec, load_embed_and_head

log = logging.getLogger(__name__)

STAGE = "validate_online"


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder (full-attention targets only)")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first n_samples "
                                                        "prompts are decoded")
    p.add_argument("--drafter", nargs="+", required=True, help="stripped drafter folders")
    p.add_argument("--evals", nargs="+", required=True,
                   help="evaluate JSONs of those drafters on this prompt set, in the order of --drafter")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the per-sample "
                                                "comparison")


def main(args, opts) -> None:
    validate_online(args.target, args.completions, args.drafter, args.evals, args.out, opts)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing entry (``None`` if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def validate_online(target_dir, completions_path, drafters: list[str], evals: list[str], out, opts=None,
                    **overrides) -> dict:
    """Online speculative decoding of the first ``n_samples`` prompts vs the offline replay of the same samples.

    Per drafter (paired with its evaluate JSON on the same prompt set) and per mode (``chain``, and
    ``ddtree_<budget>`` when ``budget > 0``): run :func:`spec_generate` on each prompt and compare with the
    cached greedy completion and the offline per-step acceptance lengths. Where the online output equals
    the cached completion, the per-step acceptance lengths should be identical (exactly so in float32);
    in bf16 the online trajectory can leave the cached completion at a near-tie, so the summary is the
    macro tau difference over all compared samples, ``(online - offline) / offline`` (goal |.| <= 2 %).

    Args:
        target_dir: HF target folder (full attention only, :func:`check_target_supported`).
        completions_path: completions JSONL of the prompt set the evaluations used.
        drafters: stripped drafter folders, in the order of ``evals``.
        evals: evaluate JSONs (per-sample ``acceptance_lengths``; ``acceptance_lengths_ddtree`` when
            ``budget > 0``), one per drafter.
        out: JSON path. Keys: ``title`` and ``markdown`` (for ``report --extra``), ``budget``, ``device``,
            ``dtype``, ``checkpoints``: per drafter and mode ``tau_online``, ``tau_offline``, ``rel_diff``,
            ``n_same_output``, ``n_identical_steps``, ``ok`` (every same-output sample has identical steps),
            ``seconds`` and ``samples`` (``id``, ``same_output``, ``identical_steps``, ``first_step_diff``,
            ``first_token_diff``, ``online``, ``offline``).
        opts: the stage's options (config section ``validate_online``): ``n_samples`` (prompts to decode,
            the first of the completions file, >= 1), ``ddtree_budget`` (DDTree node budget to validate,
            one of the evaluation's ``ddtree_budgets``; 0 or null = chain only; the workflow passes the
            smallest of ``evaluate.ddtree_budgets`` by default), ``device``, ``dtype`` (``auto``:
            cuda/bf16 if available, else cpu/float32).
        **overrides: option values, when ``opts`` is not given.

    Raises:
        InputError: ``n_samples < 1``, drafters/evals of different lengths, an evaluation without the budget
            or without one of the samples, or an unsupported (hybrid / sliding-window) target.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    n_samples, budget = opts.n_samples, opts.ddtree_budget or 0
    if len(drafters) != len(evals):
        raise InputError(None, "--drafter/--evals", f"{len(drafters)} drafters but {len(evals)} evaluations",
                         "pass one evaluate JSON per drafter, in the same order")
    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    spec = TargetSpec.read(target_dir)
    target, tok, _ = load_target(spec, dev, dt)
    check_target_supported(target, str(Path(target_dir) / "config.json"))
    stop_ids, _ = stop_token_ids(target_dir, tok)  # the ids the completions stage stopped on
    embed, head = (w.to(device=dev, dtype=dt) for w in load_embed_and_head(spec))
    rows = read_completions(Path(completions_path))[:n_samples]
    modes = [("chain", None)] + ([(f"ddtree_{budget}", budget)] if budget else [])
    result: dict = {"title": "Online speculative decoding vs offline replay", "budget": budget or None,
                    "device": str(dev), "dtype": dtype_name(dt), "n_samples": len(rows),
                    "completions": str(completions_path), "checkpoints": []}
    for drafter_dir, eval_path in zip(drafters, evals):
        ev = json.loads(Path(eval_path).read_text())
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
                                    "n_same_output": same_n, "n_identical_steps": ident_n, "ok": same_n == ident_n,
                                    "seconds": round(t_mode, 3), "samples": samples}
            log.info("%s %s: online tau %.4f vs offline %.4f (%+.2f %%); %d/%d same output, %d of them identical steps",
                     entry["checkpoint"], name, on, offt, 100 * (on - offt) / offt, same_n, len(samples), ident_n)
        result["checkpoints"].append(entry)
    result["markdown"] = _markdown(result)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _markdown(r: dict) -> str:
    lines = [f"Greedy speculative decoding with the target in the loop on the first {r['n_samples']} prompts of "
             f"`{r['completions']}` ({r['device']}, {r['dtype']}), against the offline replay of the same samples. "
             "DDTree verifies its tree in one target forward with an ancestor-only mask. *same output*: the online "
             "completion equals the cached greedy completion; for those, the per-step acceptance lengths must be "
             "identical (*identical*). In bf16 the online trajectory may leave the cached completion at a near-tie; "
             "the macro tau difference is then the measure (goal within 2 %). *ok*: every same-output sample has "
             "identical steps.", "",
             "| checkpoint | prompt set | mode | tau online | tau offline | diff | within 2 % | same output | "
             "identical steps | ok |",
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
    return "\n".join(lines)
