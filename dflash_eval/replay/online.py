"""Online speculative decoding with the target in the loop (chain and DDTree), to validate the offline replay.

:func:`spec_generate` decodes one prompt the way a serving engine would, greedily or with the
speculative sampler: the target verifies each step's drafts in one forward over its KV cache, and
the drafter's context grows from the hidden states of that verify forward (never from the HDF5
cache), so the context is the target's own online trajectory.

* **Chain** (z-lab ``dflash==0.1.0`` ``dflash_generate``): verify ``[root, d_1 .. d_{vs-1}]``
  causally at positions ``start .. start+vs-1``; accept the longest prefix of drafts equal to
  the target's argmax, then the bonus token.
* **DDTree** (``liranringel/ddtree`` ``ddtree_generate``): build the budget-B tree
  (:func:`dflash_eval.replay.ddtree.build_tree`) from the step's top-B log-probs, verify
  ``[root, node_1 .. node_B]`` in **one** forward with position ids ``start + depth`` and a 4-D
  additive mask in which every row sees the committed past and, inside the tree, only its
  ancestors and itself; walk the verified tree (:meth:`DraftTree.follow`); keep the KV rows of
  the accepted path only (the reference's ``compact_dynamic_cache``).
* **Chain at temperature > 0** (``sampling``: the same ``dflash_generate`` with ``temperature``,
  ``top_p``, ``top_k``): the prefill token is sampled from the target's filtered p; each step samples
  every draft slot independently from the drafter's filtered q (:func:`dflash_eval.replay.sampling.filtered_probs`,
  the reference's ``_sampling_probs``), verifies with the target's filtered p by rejection sampling
  (:func:`dflash_eval.replay.sampling.rejection_sample`, the reference's ``_rejection_sample``: accept draft j
  while ``u_j * q_j < p_j``, then the correction from ``max(p - q, 0)`` renormalised, or the bonus token
  from p after all drafts). The random numbers are drawn in the reference's order and shapes (prefill
  ``multinomial([1, V])``; per step ``multinomial([vs-1, V])`` for the drafts, ``rand([1, vs-1])``,
  ``multinomial([1, V])``), so one ``torch.Generator`` seeded with s draws what the reference draws
  after ``torch.manual_seed(s)`` on the same device. DFlash 2: the candidate selector samples the
  path slot by slot (``multinomial([1, K])`` per slot, the reference's ``CandidateSelector.select``)
  and q is its distribution on the slot's candidates (zero elsewhere), as ``_rejection_sample`` with
  ``draft_indices``.

Both use the conventions of the offline replay (shortened last block ``vs = min(B,
max_length - start)``, a step commits ``min(accepted + 1, max_length - start - 1)`` tokens, cut
after the first stop token), so in exact arithmetic the recorded acceptance lengths equal
:func:`dflash_eval.replay.chain.replay_batch` (chain) and :func:`dflash_eval.replay.ddtree.walk_budgets`
(DDTree) on the cached greedy completion, whenever the online output equals it.

Targets: full-attention decoder LMs (transformers ``DynamicCache`` with plain layers). Hybrid
(linear-attention) and sliding-window targets are refused: a tree verify there needs per-branch
recurrent state / window handling that a mask alone does not give.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.replay.ddtree import DraftTree, build_tree
from dflash_eval.replay.sampling import SamplingSetting, filtered_probs, rejection_sample


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


def _dynamic_layers(cache) -> list:
    """The cache's layers, each a plain transformers ``DynamicLayer`` (keys/values tensors that can be cut).

    Raises:
        InputError: another kind of layer (sliding-window, linear-attention, quantized caches).
    """
    from transformers.cache_utils import DynamicLayer  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise InputError("target", "cache", f"unsupported KV cache layer {type(layer).__name__}",
                             "use a full-attention target for online validation")
    return cache.layers


def keep_kv_rows(cache, start: int, rows: torch.Tensor) -> None:
    """Keep cache positions ``< start`` plus the verify rows ``rows`` (indices after ``start``), in order."""
    for layer in _dynamic_layers(cache):
        keep = torch.cat([torch.arange(start, device=layer.keys.device), start + rows.to(layer.keys.device)])
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def crop_kv(cache, length: int) -> None:
    """Keep the first ``length`` cache positions: :func:`keep_kv_rows` when the kept verify rows are a prefix
    ``0 .. n-1``, as views instead of a gathered copy of every layer's keys/values each step (same values)."""
    for layer in _dynamic_layers(cache):
        layer.keys = layer.keys[..., :length, :]
        layer.values = layer.values[..., :length, :]


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


def _probs(logits: torch.Tensor, st: SamplingSetting) -> torch.Tensor:
    """The reference's ``_sampling_probs`` of ``logits [n, V]`` at ``st`` -> ``[n, V]`` float32."""
    return filtered_probs(logits, st.temperature, st.top_p, st.top_k)


def _tap(hidden_states, layer_ids) -> torch.Tensor:
    """``cat(hidden_states[i + 1] for i in layer_ids)`` -> ``[1, L, K*H]`` (HF convention, as the cache)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@torch.inference_mode()
def spec_generate(target, drafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, prompt_ids: list[int],
                  max_new_tokens: int, stop_ids: list[int], block_size: int | None = None,
                  budget: int | None = None, sampling: SamplingSetting | None = None,
                  generator: torch.Generator | None = None) -> OnlineResult:
    """Speculative decoding of one prompt with the target in the loop (greedy, or the speculative sampler).

    Args:
        target: HF causal LM (full attention; :func:`check_target_supported`), on the compute device.
        drafter: :class:`~dflash_eval.drafter.model.DFlashDrafter` on the same device/dtype.
        embed_weight, head_weight: the target's ``embed_tokens`` / ``lm_head`` weights ``[V, H]``.
        prompt_ids: prompt token ids (chat-templated), length P >= 1.
        max_new_tokens: generation limit (the prefill token included, as in the completions).
        stop_ids: stop token ids (the target's eos ids).
        block_size: B (default: the drafter's).
        budget: ``None`` = DFlash chain; an int = DDTree with that node budget.
        sampling: ``None`` or temperature 0 = greedy. Temperature > 0 = dflash==0.1.0's speculative
            sampler (module docstring), the chain only (DFlash 1: drafts sampled from the filtered q;
            DFlash 2: the candidate selector's sampled path, q on its candidates).
        generator: the RNG of the sampler, on the compute device (``None`` = torch's global one, as the
            reference); unused when greedy.

    Returns:
        :class:`OnlineResult`.

    Raises:
        InputError: DDTree with a DFlash 2 drafter; temperature > 0 with DDTree (the offline side,
            ``evaluate``, has no expected tau there either).
    """
    from transformers import DynamicCache  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    t0 = time.perf_counter()
    cfg = drafter.cfg
    if budget is not None and not drafter.family.ddtree_applicable:
        label = drafter.family.label
        raise InputError(None, "budget", f"DDTree is not defined for {label} drafters (the serving engines draft "
                         "one selector path)", f"validate {label} drafters in chain mode")
    sampled = sampling is not None and not sampling.greedy
    if sampled and budget is not None:
        raise InputError(None, "sampling", f"{sampling.label}: online speculative sampling is built for the chain "
                         "only (evaluate's DDTree columns at temperature > 0 are the greedy tree walk on the sampled "
                         "cache, dflash_eval.replay.expected)", "validate DDTree at temperature 0")
    selector = drafter.family.selects_candidates  # DFlash 2: the candidate selector's walk (drafter.select)
    B = int(block_size or cfg.block_size)
    dev = embed_weight.device
    P = len(prompt_ids)
    max_len = P + int(max_new_tokens)
    stops = {int(s) for s in stop_ids}
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=dev)
    out = target(input_ids=ids, position_ids=torch.arange(P, device=dev)[None], past_key_values=cache,
                 use_cache=True, output_hidden_states=True, logits_to_keep=1)
    if sampled:  # the reference's sample(): multinomial over the [1, V] filtered p of the prefill's last row
        first = torch.multinomial(_probs(out.logits[0, -1:], sampling), 1, generator=generator)[0, 0]
    else:
        first = out.logits[0, -1].argmax()
    seq = list(prompt_ids) + [int(first)]
    taps = _tap(out.hidden_states, cfg.target_layer_ids).to(embed_weight.dtype)
    ctx_kv = drafter.context_kv(taps, torch.arange(P, device=dev)[None])
    # a walk reading the last accepted target row (family.walk_reads_context, LiLiCorr's anchor row)
    reads_row = drafter.family.walk_reads_context
    last_row = taps[:, -1]  # [1, K*H]: the row at start - 1
    res = OnlineResult()
    start = P
    stopped = seq[P] in stops
    while start + 1 < max_len and not stopped:
        vs = min(B, max_len - start)
        emb = drafter.make_block(torch.tensor([seq[start]], device=dev), embed_weight, vs)
        ctx_pos = torch.arange(start, device=dev)[None]
        h = drafter(emb, torch.arange(start, start + vs, device=dev)[None], ctx_kv, ctx_pos,
                    torch.ones(1, start, dtype=torch.bool, device=dev))
        logits = drafter.logits(h[0, 1:], head_weight).float()  # [vs-1, V]
        walk = {"context": drafter.walk_context(embed_weight, last_row, torch.ones(1, dtype=torch.bool, device=dev))
                } if reads_row else {}
        if sampled:
            if selector:  # DFlash 2: the selector samples its path; q lives on its candidates (reference select)
                sel = drafter.select(h[:, 1:], logits[None], torch.tensor([seq[start]], device=dev),
                                     temperature=sampling.temperature, generator=generator, **walk)
                drafts = sel.path[0]
                q = torch.zeros_like(logits).scatter_(-1, sel.candidates[0], sel.probs[0])  # [vs-1, V]
            else:
                q = _probs(logits, sampling)  # [vs-1, V]
                drafts = torch.multinomial(q, 1, generator=generator)[:, 0]
            verify = [seq[start]] + drafts.tolist()
            out = target(input_ids=torch.tensor([verify], device=dev),
                         position_ids=torch.arange(start, start + vs, device=dev)[None], past_key_values=cache,
                         use_cache=True, output_hidden_states=True)
            a, z = rejection_sample(drafts[None], _probs(out.logits[0], sampling)[None], q[None], generator=generator)
            accepted, bonus = list(range(int(a) + 1)), int(z)
        elif budget is None:
            if selector:  # DFlash 2: the selector's path (reference propose), on this step's logits
                drafts = drafter.select(h[:, 1:], logits[None], torch.tensor([seq[start]], device=dev),
                                        **walk).path[0].tolist()
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
        if accepted[:produced] == list(range(produced)):  # a prefix of the verify rows (always for the chain)
            crop_kv(cache, start + produced)
            hid = _tap(out.hidden_states, cfg.target_layer_ids)[:, :produced].to(embed_weight.dtype)
        else:
            rows = torch.tensor(accepted[:produced], device=dev)
            keep_kv_rows(cache, start, rows)
            hid = _tap(out.hidden_states, cfg.target_layer_ids)[:, rows].to(embed_weight.dtype)
        new_kv = drafter.context_kv(hid, torch.arange(start, start + produced, device=dev)[None])
        last_row = hid[:, -1]
        ctx_kv = [(torch.cat([k0, k1], dim=2), torch.cat([v0, v1], dim=2)) for (k0, v0), (k1, v1) in zip(ctx_kv, new_kv)]
        res.acceptance_lengths.append(produced)
        start += produced
    res.completion_ids = seq[P:]
    res.seconds = time.perf_counter() - t0
    return res
