"""Online speculative decoding with the target in the loop (chain and DDTree), to validate the offline replay.

:func:`spec_generate` decodes one prompt greedily the way a serving engine would: the target
verifies each step's drafts in one forward over its KV cache, and the drafter's context grows
from the hidden states of that verify forward (never from the HDF5 cache).

* **Chain** (z-lab ``dflash==0.1.0`` ``dflash_generate``): verify ``[root, d_1 .. d_{vs-1}]``
  causally at positions ``start .. start+vs-1``; accept the longest prefix of drafts equal to
  the target's argmax, then the bonus token.
* **DDTree** (``liranringel/ddtree`` ``ddtree_generate``): build the budget-B tree
  (:func:`dflash_eval.ddtree.build_tree`) from the step's top-B log-probs, verify
  ``[root, node_1 .. node_B]`` in **one** forward with position ids ``start + depth`` and a 4-D
  additive mask in which every row sees the committed past and, inside the tree, only its
  ancestors and itself; walk the verified tree (:meth:`DraftTree.follow`); keep the KV rows of
  the accepted path only (the reference's ``compact_dynamic_cache``).

Both use the conventions of the offline replay (shortened last block ``vs = min(B,
max_length - start)``, a step commits ``min(accepted + 1, max_length - start - 1)`` tokens, cut
after the first stop token), so in exact arithmetic the recorded acceptance lengths equal
:func:`dflash_eval.replay.replay_batch` (chain) and :func:`dflash_eval.ddtree.walk_budgets`
(DDTree) on the cached greedy completion, whenever the online output equals it.

Targets: full-attention decoder LMs (transformers ``DynamicCache`` with plain layers). Hybrid
(linear-attention) and sliding-window targets are refused: a tree verify there needs per-branch
recurrent state / window handling that a mask alone does not give.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ddtree import DraftTree, build_tree
from .errors import InputError


@dataclass
class OnlineResult:
    """``completion_ids``: generated ids (prefill token first, up to and including a stop token);
    ``acceptance_lengths``: tokens committed per verify step (accepted drafts + bonus, cut at the end)."""

    completion_ids: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    seconds: float = 0.0


def check_target_supported(model, where="target") -> None:
    """Raise :class:`InputError` unless every target layer is plain full attention.

    Reads ``config.layer_types`` (absent = all full attention) and ``config.sliding_window`` with
    ``use_sliding_window``.
    """
    cfg = model.config
    types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    windowed = getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True)
    if types != {"full_attention"} or windowed:
        raise InputError(where, "config.layer_types",
                         f"online validation supports full-attention targets only (layer types {sorted(types)}, "
                         f"sliding_window {getattr(cfg, 'sliding_window', None)})",
                         "disable validate_online for this target (the offline replay does not depend on it)")


def keep_kv_rows(cache, start: int, rows: torch.Tensor) -> None:
    """Keep cache positions ``< start`` plus the verify rows ``rows`` (indices after ``start``), in order."""
    from transformers.cache_utils import DynamicLayer

    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise InputError("target", "cache", f"unsupported KV cache layer {type(layer).__name__}",
                             "use a full-attention target for online validation")
        keep = torch.cat([torch.arange(start, device=layer.keys.device), start + rows.to(layer.keys.device)])
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def tree_verify(target, cache, start: int, root: int, tree: DraftTree):
    """One target forward over ``[root, node_1 .. node_n]`` with tree attention (reference ``compile_ddtree_tree``).

    Position ids ``start + depth`` (root: ``start``); 4-D additive mask ``[1, 1, n+1, start+n+1]`` in the
    target's dtype: 0 on the committed past (the ``start`` cached positions) and, inside the tree, on a
    row's ancestors and itself; ``finfo(dtype).min`` elsewhere. The cache grows by ``n + 1`` rows (verify
    order); :func:`keep_kv_rows` then keeps the accepted path's rows.

    Returns:
        the HF model output (``logits`` ``[1, n+1, V]``, ``hidden_states``): row ``i`` is the target's
        prediction after node ``i``'s ancestor path.
    """
    dev = target.device
    verify = [root] + tree.tokens
    n = len(verify)
    pos = start + torch.tensor([0] + tree.depths, device=dev)
    mask = torch.zeros(1, 1, n, start + n, dtype=target.dtype, device=dev)
    mask[0, 0, :, start:] = torch.where(tree.visibility().to(dev), 0.0, torch.finfo(target.dtype).min)
    return target(input_ids=torch.tensor([verify], device=dev), position_ids=pos[None], attention_mask=mask,
                  past_key_values=cache, use_cache=True, output_hidden_states=True)


def _tap(hidden_states, layer_ids) -> torch.Tensor:
    """``cat(hidden_states[i + 1] for i in layer_ids)`` -> ``[1, L, K*H]`` (HF convention, as the cache)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.inference_mode()
def spec_generate(target, drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, prompt_ids: list[int],
                  max_new_tokens: int, stop_ids: list[int], block_size: int | None = None,
                  budget: int | None = None) -> OnlineResult:
    """Greedy speculative decoding of one prompt with the target in the loop.

    Args:
        target: HF causal LM (full attention; :func:`check_target_supported`), on the compute device.
        drafter: :class:`~dflash_eval.drafter.DFlashDrafter` on the same device/dtype.
        embed_weight, head_weight: the target's ``embed_tokens`` / ``lm_head`` weights ``[V, H]``.
        prompt_ids: prompt token ids (chat-templated), length P >= 1.
        max_new_tokens: generation limit (the prefill token included, as in the completions).
        stop_ids: stop token ids (the target's eos ids).
        block_size: B (default: the drafter's).
        budget: ``None`` = DFlash chain; an int = DDTree with that node budget.

    Returns:
        :class:`OnlineResult`.
    """
    import time

    from transformers import DynamicCache

    t0 = time.perf_counter()
    cfg = drafter.cfg
    if budget is not None and getattr(drafter, "candidate_selector", None) is not None:
        raise InputError(None, "budget", "DDTree is not defined for DFlash 2 drafters (the serving engines draft "
                         "one selector path)", "validate DFlash 2 drafters in chain mode")
    B = int(block_size or cfg.block_size)
    dev = embed_weight.device
    P = len(prompt_ids)
    max_len = P + int(max_new_tokens)
    stops = {int(s) for s in stop_ids}
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=dev)
    out = target(input_ids=ids, position_ids=torch.arange(P, device=dev)[None], past_key_values=cache,
                 use_cache=True, output_hidden_states=True, logits_to_keep=1)
    seq = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    ctx_kv = drafter.context_kv(_tap(out.hidden_states, cfg.target_layer_ids).to(embed_weight.dtype),
                                torch.arange(P, device=dev)[None])
    res = OnlineResult()
    start = P
    stopped = seq[P] in stops
    while start + 1 < max_len and not stopped:
        vs = min(B, max_len - start)
        block = torch.tensor([[seq[start]] + [cfg.mask_token_id] * (vs - 1)], device=dev)
        emb = embed_weight[block]
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        ctx_pos = torch.arange(start, device=dev)[None]
        h = drafter(emb, torch.arange(start, start + vs, device=dev)[None], ctx_kv, ctx_pos,
                    torch.ones(1, start, dtype=torch.bool, device=dev))
        logits = drafter.logits(h[0, 1:], head_weight).float()  # [vs-1, V]
        if budget is None:
            if getattr(drafter, "candidate_selector", None) is not None:  # DFlash 2: the selector's path (reference propose)
                drafts = drafter.propose(h[:, 1:], block[:, 0], head_weight).path[0].tolist()
            else:
                drafts = logits.argmax(-1).tolist()
            verify = [seq[start]] + drafts
            vpos = torch.arange(start, start + vs, device=dev)
            out = target(input_ids=torch.tensor([verify], device=dev), position_ids=vpos[None], past_key_values=cache,
                         use_cache=True, output_hidden_states=True)
            post = out.logits[0].argmax(-1).tolist()
            a = 0
            while a < vs - 1 and verify[a + 1] == post[a]:
                a += 1
            accepted, bonus = list(range(a + 1)), post[a]
        else:
            lp, tk = torch.topk(torch.log_softmax(logits, dim=-1), min(budget, logits.shape[-1]), dim=-1)
            tree = build_tree(lp.cpu(), tk.cpu(), budget, vs - 1)
            verify = [seq[start]] + tree.tokens
            out = tree_verify(target, cache, start, seq[start], tree)
            accepted, bonus = tree.follow(out.logits[0].argmax(-1).tolist())
        new = [verify[i] for i in accepted[1:]] + [bonus]  # tokens at start+1 .. start+len(accepted)
        produced = min(len(accepted), max_len - start - 1)
        for k, tok in enumerate(new[:produced]):
            if tok in stops:
                produced, stopped = k + 1, True
                break
        seq += new[:produced]
        rows = torch.tensor(accepted[:produced], device=dev)
        keep_kv_rows(cache, start, rows)
        hid = _tap(out.hidden_states, cfg.target_layer_ids)[:, rows].to(embed_weight.dtype)
        new_kv = drafter.context_kv(hid, torch.arange(start, start + produced, device=dev)[None])
        ctx_kv = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)) for (k0, v0), (k1, v1) in zip(ctx_kv, new_kv)]
        res.acceptance_lengths.append(produced)
        start += produced
    res.completion_ids = seq[P:]
    res.seconds = time.perf_counter() - t0
    return res


def _first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing entry (``None`` if equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def validate_online(target_dir, completions_path, drafters: list[str], evals: list[str], out, n_samples: int = 4,
                    budget: int = 0, device: str = "auto", dtype: str = "auto") -> dict:
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
        n_samples: prompts to decode (the first of the completions file), >= 1.
        budget: DDTree node budget to validate (one of the evaluation's ``ddtree_budgets``); 0 = chain only.
        device, dtype: compute device and dtype (``auto``: cuda/bf16 if available, else cpu/float32).

    Raises:
        InputError: ``n_samples < 1``, drafters/evals of different lengths, an evaluation without the budget
            or without one of the samples, or an unsupported (hybrid / sliding-window) target.
    """
    import json
    import logging
    from pathlib import Path

    from .completions import read_completions, stop_token_ids
    from .drafter import load_drafter
    from .errors import atomic_path
    from .metrics import aggregate
    from .runtime import dtype_name, resolve_device, resolve_dtype
    from .target import TargetSpec, load_embed_and_head, load_target

    log = logging.getLogger(__name__)
    if n_samples < 1:
        raise InputError("config", "validate_online.n_samples", f"{n_samples} < 1", "decode at least one prompt")
    if len(drafters) != len(evals):
        raise InputError(None, "--drafter/--evals", f"{len(drafters)} drafters but {len(evals)} evaluations",
                         "pass one evaluate JSON per drafter, in the same order")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
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
