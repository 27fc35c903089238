"""The batched all-anchor pass: the drafter's block for every possible verify-step start at once.

The drafter's output for a verify step depends only on its anchor ``t`` (the index of the last
committed token): the anchor token ``x[t]``, the context ``< t`` and the verify size ``vs(t)``
(:mod:`dflash_eval.replay.chain` states the online loop this reproduces). :func:`iter_anchor_drafts`
therefore drafts the block of **every** anchor ``t in [P, T-2]`` of a cached response in large
drafter calls, as DFlash training does (one block per anchor, each seeing the context strictly
before its anchor and its own block, blocks invisible to each other; SpecForge
``create_dflash_sdpa_mask``), and :func:`chain_walk` then walks the greedy chain over the
per-anchor accepted drafts. It does more drafter work than the online loop (every anchor, not
only the ~T/tau visited ones) but in large batches. The chain (:func:`replay_batched`), every
DDTree budget (:mod:`dflash_eval.replay.ddtree`) and every sampling setting read the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from dflash_eval.core.runtime import free_memory_bytes
from dflash_eval.replay.expected import chain_survival, selector_survival
from dflash_eval.replay.layouts import block_forward, groups_forward, packed_forward, rows_forward
from dflash_eval.replay.policies import REFERENCE, DraftSetting
from dflash_eval.replay.sampling import token_probs_topk

__all__ = ["block_forward"]  # re-exported: replay.py and ddtree read it here

#: batched replay, how one drafter call holds its anchors' blocks (see :func:`iter_anchor_drafts`):
#: ``rows`` = one row per anchor (per-row copies of the context K/V), ``packed`` = all blocks as
#: one sequence over shared context keys (no copies; attention also spans the other blocks' keys),
#: ``groups`` = one row per :data:`GROUP_QUERIES` // B consecutive anchors (one context copy per
#: group instead of per anchor; each query also scores its group's other blocks' keys, masked).
LAYOUTS = ("rows", "packed", "groups")
#: ``groups`` layout: query tokens per row (anchors per row = max(1, this // B)). On one H200 (bf16,
#: ``python3 bench/replay.py --case real --groups-sweep ...``, 2026-12-03) the 5-layer hidden-4096 B=16
#: drafter took 102.6 ms/sample at 128 queries per row and 16384 per call, 88.6 at 512 and 32768 (the
#: context K/V copied once per 32 anchors instead of 8; 2 % more executed FLOPs), 87.5-91.9 beyond
#: (docs/measurements.md)
GROUP_QUERIES = 512
#: ``groups`` on CUDA: on one H200 (bf16, ``python3 bench/replay.py --case real``, 2026-12-02) a 5-layer
#: hidden-4096 drafter's replay took 101.6 ms/sample in ``groups`` against 321.2 in ``rows`` and 348.3 in
#: ``packed`` (38 % vs 12 % of the measured GEMM rate), same tau (docs/measurements.md). ``rows`` on the CPU,
#: where the demo's small drafters run (its pinned float32 figures were measured with it).
DEFAULT_LAYOUT = {"cuda": "groups", "cpu": "rows"}
#: most query tokens (anchors x B) per drafter call, per layout and device type: enough to fill a
#: GPU, while ``rows``' K/V copies and ``packed``'s (chunk x chunk) attention stay a fraction of a call.
MAX_CHUNK_TOKENS = {("rows", "cuda"): 16384, ("rows", "cpu"): 4096, ("packed", "cuda"): 4096, ("packed", "cpu"): 1024,
                    ("groups", "cuda"): 32768, ("groups", "cpu"): 4096}


def context_bytes_per_token(cfg, elem: int) -> int:
    """Device bytes one context token costs: stored states, fused state, per-layer context K/V, ids."""
    k = len(cfg.target_layer_ids)
    kv = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
    return elem * (k * cfg.hidden_size + 2 * cfg.hidden_size + kv) + 32


def length_groups(lengths: list[int], tokens: int, max_samples: int = 0) -> list[list[int]]:
    """Consecutive index groups whose summed ``lengths`` stay within ``tokens`` (at least one index per group).

    ``max_samples > 0`` also caps the indices per group.
    """
    groups, cur, total = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (total + n > tokens or (max_samples and len(cur) >= max_samples)):
            groups.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += n
    if cur:
        groups.append(cur)
    return groups



@dataclass
class AnchorDrafts:
    """The drafter's block for every possible verify-step start of one sample.

    Row ``i`` is anchor ``t = anchors[i] = P + i``, the index of the last committed token,
    for every ``t in [P, T-2]`` (``n = T - 1 - P`` rows; 0 when the prefill token ended the
    response). Column ``j - 1`` is block slot ``j = 1..B-1``, which drafts position ``t + j``.
    Tensors are on the compute device.

    Attributes:
        sample_id: the cache sample id.
        prompt_len: P. n_tokens: T (prompt + completion). block_size: B.
        anchors: ``[n]`` int64, ``P .. T-2``.
        verify_size: ``[n]`` int64, ``vs = min(B, max_length - t)``: slots ``>= vs`` are masked
            out of the block (the reference shortens the last block), which changes the drafts.
        limit: ``[n]`` int64, ``min(vs - 1, T - 1 - t)``: draft slots that can be verified.
        accepted: ``[n]`` int64, ``a(t)``: the longest prefix of slots ``1..limit`` whose greedy
            draft equals ``x[t + j]`` (the chain's accepted drafts at that anchor).
        greedy: ``[n, B-1]`` int64, the argmax draft per slot (``torch.argmax`` of the logits in
            the compute dtype, as the online loop). With ``full=False`` only the slots the chain
            needs are computed (slot ``j`` where slots ``< j`` matched and ``j <= limit``); the
            rest hold -1. With ``full=True`` or ``topk > 0`` every slot of every anchor is set.
        topk_logp: ``[n, B-1, K]`` float32 or None: the K largest full-vocabulary
            ``log_softmax`` values per slot (of the logits cast to float32), descending.
        topk_ids: ``[n, B-1, K]`` int64 or None: their token ids (``torch.topk`` order).
        survival: ``{setting label: [n, B] float64}`` or None: ``P(a(t) >= k | x)``, ``k = 0..B-1``, of DFlash 1's
            sampled drafts under each sampling setting given the cached trajectory
            (:func:`dflash_eval.replay.expected.chain_survival`; 0 beyond ``limit``).
        oracle: DFlash 2 only (else None), ``[n]`` int64: the longest prefix of slots ``1..limit``
            whose target token ``x[t + j]`` is among the slot's ``selector_top_k`` candidates (what a
            perfect selector could accept from the same candidates; ``accepted <= oracle``).
        unary_accepted: DFlash 2 only, ``[n]`` int64: the accepted prefix of the per-slot argmax of
            the same logits (DFlash 1's draft rule, the selector switched off).
        in_candidates: DFlash 2 only, ``[n, B-1]`` bool: slot ``j``'s target token is a candidate
            (False past ``limit``).

    For DFlash 2 ``greedy`` is the candidate selector's path (:meth:`DFlashDrafter.propose` at
    temperature 0, slot by slot, batched over the anchors) and ``accepted`` its accepted prefix:
    every slot of every anchor is computed.
    """

    sample_id: str
    prompt_len: int
    n_tokens: int
    block_size: int
    anchors: torch.Tensor
    verify_size: torch.Tensor
    limit: torch.Tensor
    accepted: torch.Tensor
    greedy: torch.Tensor
    topk_logp: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    survival: dict | None = None
    oracle: torch.Tensor | None = None
    unary_accepted: torch.Tensor | None = None
    in_candidates: torch.Tensor | None = None


def chain_walk(accepted: list[int], prompt_len: int, n_tokens: int) -> list[int]:
    """Per-step committed tokens of the greedy chain from per-anchor accepted drafts.

    Args:
        accepted: ``a(t)`` for ``t = P .. T-2`` (:attr:`AnchorDrafts.accepted` as a list).
        prompt_len: P. n_tokens: T.

    Returns:
        ``[min(a + 1, T - 1 - start), ...]`` walking ``start = P, P + produced, ...`` to ``T - 1``.
    """
    out, start, last = [], prompt_len, n_tokens - 1
    while start < last:
        produced = min(accepted[start - prompt_len] + 1, last - start)
        out.append(produced)
        start += produced
    return out


class _Plan:
    """Sizes of one all-anchor pass (bytes per element ``elem``; see :func:`iter_anchor_drafts`)."""

    def __init__(self, cfg, B: int, elem: int, vocab: int, mem: int, device: torch.device, topk: int, full: bool,
                 layout: str, sampling: int = 0):
        self.B = B
        self.mem = mem
        self.layout = layout
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H, I = cfg.hidden_size, cfg.intermediate_size
        positional = any(lt == "sliding_attention" for lt in cfg.layer_types) or bool(cfg.is_causal)
        # per (query, key) pair: bool masks (input, concatenation, per-layer-kind copy), the additive
        # float mask SDPA builds, positions' distance (int64) when a layer is causal/windowed, and the
        # scores + probabilities of a non-fused attention kernel (float32), for every head.
        self.pair = 3 + elem + (8 if positional else 0) + nh * 8
        # per (row, key) in ``rows`` / per key in ``packed``: the context + block K/V gathered
        # (multi-sample chunks), concatenated, and repeated to every query head (GQA), one layer at a time.
        self.row_key = elem * 2 * hd * (2 * nkv + nh)
        # per query token: hidden states, q/k/v, attention output, MLP (gate, up, product).
        self.token = elem * (8 * H + 3 * I + (nh + 2 * nkv) * hd) + 64
        self.max_tokens = MAX_CHUNK_TOKENS[layout, "cuda" if device.type == "cuda" else "cpu"]
        self.g = max(1, GROUP_QUERIES // B) if layout == "groups" else 1  # anchors per row
        slots = B - 1 if (full or topk) else 1
        # + top-K (float32 log-softmax, int64 ids); + one sampling setting at a time: the logits in float32,
        # their softmax, and a top-p sort (float32 values, int64 order)
        row = vocab * (elem + (4 * 3 if topk else 0) + (4 * 5 if sampling else 0)) * slots
        self.head_rows = max(1, mem // 2 // max(row, 1))  # rows per LM-head pass
        # context tokens per group: context states + K/V, and the per-anchor outputs kept for the group
        out = (B - 1) * (8 + 12 * topk) + 32 + 8 * B * sampling
        self.ctx_tokens = max(1, mem // 4 // (context_bytes_per_token(cfg, elem) + out))

    def add_keys(self, keys: int, piece_keys: int) -> int:
        """Context keys of a call after adding a piece: the largest piece's (``rows``) or their sum (``packed``)."""
        return keys + piece_keys if self.layout == "packed" else max(keys, piece_keys)

    def cost(self, rows: int, keys: int) -> int:
        """Peak temporary bytes of one drafter call on ``rows`` anchors and ``keys`` context keys."""
        q = rows * self.B
        if self.layout in ("rows", "groups"):  # every row: keys + its own g blocks (g = 1 for rows)
            n_rows = -(-rows // self.g) + (self.g > 1)  # groups: a piece's last row is padded (estimate)
            own = self.g * self.B
            q = n_rows * own
            return q * (keys + own) * self.pair + n_rows * (keys + own) * self.row_key + q * self.token
        return q * (keys + q) * self.pair + (keys + q) * self.row_key + q * self.token  # one sequence

    def fits(self, rows: int, keys: int) -> bool:
        return rows * self.B <= self.max_tokens and self.cost(rows, keys) <= self.mem // 2


def _plan_chunks(plan: _Plan, spans: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split per-sample anchor ranges ``(sample, a0, a1)`` into drafter calls within ``plan``'s limits.

    A chunk holds consecutive anchors of one or more samples; a piece ``(s, a0, a1)`` needs its
    sample's context positions ``< a1 - 1`` (keys at or after a row's own anchor are masked).
    """
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    rows = keys = 0
    for s, a0, a1 in spans:
        while a0 < a1:
            lo, hi = 0, a1 - a0  # largest r with fits(rows + r, max(keys, a0 + r - 1))
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if plan.fits(rows + mid, plan.add_keys(keys, a0 + mid - 1)):
                    lo = mid
                else:
                    hi = mid - 1
            r = lo
            if r == 0:
                if cur:
                    chunks.append(cur)
                    cur, rows, keys = [], 0, 0
                    continue
                r = 1  # a single anchor always runs (even past the planned memory)
            cur.append((s, a0, a0 + r))
            rows += r
            keys = plan.add_keys(keys, a0 + r - 1)
            a0 += r
            if a0 < a1:  # the sample continues in the next chunk
                chunks.append(cur)
                cur, rows, keys = [], 0, 0
    if cur:
        chunks.append(cur)
    return chunks


@torch.inference_mode()
def iter_anchor_drafts(
    drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    samples: list,
    block_size: int | None = None,
    topk: int = 0,
    full: bool = False,
    memory_bytes: int | None = None,
    max_group_samples: int = 0,
    layout: str | None = None,
    stats: dict | None = None,
    sampling: Sequence = (),
    p_tokens: Sequence[dict] | None = None,
) -> Iterator[AnchorDrafts]:
    """All-anchor drafts of several samples, yielded per sample in input order.

    Samples are taken in groups whose context (stored states, fused states and every draft
    layer's context K/V, :func:`context_bytes_per_token`) and outputs (``greedy``, top-K) fit a
    quarter of ``memory_bytes``; a group's context K/V is computed once for all its tokens
    (positions restart per sample). The group's anchors are then drafted in chunks of ``C``
    consecutive anchors (of one or more samples), one drafter call each; every anchor ``t``
    gets its block ``[x[t], MASK x (B-1)]`` seeing its own sample's context ``< t`` and its own
    slots ``< vs(t)``, never another block: the DFlash training mask (SpecForge
    ``create_dflash_sdpa_mask``), with the context K/V computed once and shared. Two layouts
    (``layout``, default :data:`DEFAULT_LAYOUT` per device type):

    * ``rows``: ``C`` rows of ``B`` queries, keys ``[context [0, Kc) | own block]`` per row
      (``Kc`` = the chunk's largest anchor), the context K/V copied per row. Bytes per call,
      with ``Q = C*B`` queries: ``Q*(Kc+B)*p + C*(Kc+B)*r + Q*t``;
    * ``packed``: one sequence of ``Q`` queries over ``[the chunk's samples' contexts (Kc keys
      in all) | all C blocks]`` with a per-query mask: no copies, but every query also scores
      the ``Q`` block keys. Bytes per call: ``Q*(Kc+Q)*p + (Kc+Q)*r + Q*t``;
    * ``groups``: ``ceil(C/g)`` rows of ``g = GROUP_QUERIES // B`` consecutive anchors of one sample
      (``g*B`` queries, per-query masks as ``packed``) over ``[context [0, Kc) | the row's g blocks]``:
      one context copy per row of ``g`` anchors; a piece's last row is padded with its last anchor
      (computed, dropped; counted in ``stats['pad_query_tokens']``). Bytes per call as ``rows`` with
      ``ceil(C/g) + 1`` rows of ``g*B`` queries and ``g*B`` own keys;

    with heads ``nh``, KV heads ``nkv``, head dim ``hd``, element size ``elem``,
    ``p = 11 + elem + 8*nh`` (+8 for causal/windowed layers: masks, the additive mask, scores
    and probabilities of a non-fused kernel), ``r = 2*elem*hd*(2*nkv + nh)`` (K/V gathered,
    concatenated, repeated for GQA) and ``t = elem*(8H + 3I + (nh + 2nkv)*hd) + 64``
    (activations); kept below half of ``memory_bytes``, with ``Q <= MAX_CHUNK_TOKENS``.
    The LM head runs on at most ``memory_bytes / 2 / (V * (elem [+ 12 with topk]) * slots)``
    rows at once, where ``slots`` is 1 (lazy greedy) or B-1 (``full`` / ``topk``); no
    ``[anchors, B, V]`` logits are ever held.

    Args:
        drafter: :class:`~dflash_eval.drafter.model.DFlashDrafter` on the compute device/dtype.
        embed_weight: target ``embed_tokens`` ``[V, H]`` (compute device/dtype).
        head_weight: target ``lm_head`` ``[V, H]`` (compute device/dtype).
        samples: :class:`~dflash_eval.cache.format.CacheSample` list (``hidden`` ``[T, K, H]`` = the
            drafter's ``target_layer_ids`` in order).
        block_size: B (default: the drafter's).
        topk: K > 0 also returns the top-K full-vocabulary log-probabilities per slot.
        full: compute the greedy draft of every slot (not only those the chain needs).
        memory_bytes: plan for this many bytes of temporaries (default :func:`free_memory_bytes`).
        max_group_samples: > 0 caps the samples per group.
        layout: ``'rows'``, ``'packed'`` or ``'groups'`` (default: :data:`DEFAULT_LAYOUT` for the device
            type); all give the same drafts up to reduction order.
        stats: if given, accumulates ``query_tokens`` (anchors x B), ``pad_query_tokens`` (the
            ``groups`` layout's padding queries, also computed), ``attn_pairs`` (query-key pairs
            computed, per layer), ``context_tokens``, ``head_rows`` (LM-head rows) and
            ``calls`` (drafter calls), for FLOP accounting.
        sampling: :class:`~dflash_eval.replay.sampling.SamplingSetting` (the reference's drafts) or
            :class:`~dflash_eval.replay.policies.DraftSetting` (a setting and a draft policy) list with
            temperature > 0: every slot's logits (``full``) also give each entry's :attr:`AnchorDrafts.survival`
            (keyed by its ``label``), from the same pass.
        p_tokens: with ``sampling``, per sample ``{setting label: [T]}`` the target's probability of each cached
            token under the setting (:func:`dflash_eval.replay.expected.target_token_probs`).

    Yields:
        one :class:`AnchorDrafts` per sample.
    """
    cfg = drafter.cfg
    B = int(block_size or cfg.block_size)
    dev, dt = embed_weight.device, embed_weight.dtype
    elem = torch.finfo(dt).bits // 8
    V = head_weight.shape[0]
    K = min(int(topk), V)
    mem = int(memory_bytes or free_memory_bytes(dev))
    layout = layout or DEFAULT_LAYOUT.get(dev.type, "rows")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    sampling = list(sampling)
    if sampling and (p_tokens is None or len(p_tokens) != len(samples)):
        raise ValueError("sampling settings need the target's token probabilities of every sample (p_tokens)")
    # a candidate walk (drafter.family.selects_candidates) / every setting walks every slot
    full = full or drafter.family.selects_candidates or bool(sampling)
    plan = _Plan(cfg, B, elem, V, mem, dev, K, full, layout, len(sampling))
    if stats is not None:
        for key in ("query_tokens", "pad_query_tokens", "attn_pairs", "context_tokens", "head_rows", "calls"):
            stats.setdefault(key, 0)
    lengths = [len(s.input_ids) for s in samples]
    for group in length_groups(lengths, plan.ctx_tokens, max_group_samples):
        yield from _group_drafts(drafter, embed_weight, head_weight, [samples[i] for i in group], B, K,
                                 full or K > 0 or bool(sampling), plan, stats, sampling,
                                 [p_tokens[i] for i in group] if sampling else None)


def _group_drafts(drafter, embed, head, samples, B, K, full, plan, stats, sampling=(), p_tokens=None):
    dev, dt = embed.device, embed.dtype
    T = [len(s.input_ids) for s in samples]
    P = [s.prompt_len for s in samples]
    n = [max(t - 1 - p, 0) for t, p in zip(T, P)]
    off = [0]
    for t in T:
        off.append(off[-1] + t)
    ids = torch.cat([s.input_ids for s in samples]).to(dev)
    pos = torch.cat([torch.arange(t) for t in T]).to(dev)
    hidden = torch.cat([s.hidden.reshape(len(s.input_ids), -1) for s in samples]).to(device=dev, dtype=dt)
    ctx_kv = drafter.context_kv(hidden[None], pos[None])  # per layer [1, n_kv, sum T, hd]
    # a walk reading the target row before each anchor (family.walk_reads_context) keeps the flat rows
    walk_rows = hidden if drafter.family.walk_reads_context else None
    del hidden
    if stats is not None:
        stats["context_tokens"] += off[-1]
    T_t = torch.tensor(T, device=dev)
    off_t = torch.tensor(off[:-1], device=dev)
    max_len_t = torch.tensor([p + s.max_new_tokens for p, s in zip(P, samples)], device=dev)

    sel2 = drafter.family.selects_candidates  # the candidate walk and its diagnostics
    out = []
    for i, s in enumerate(samples):
        anchors = torch.arange(P[i], P[i] + n[i], device=dev)
        vs = torch.clamp(max_len_t[i] - anchors, max=B)
        extra = {} if not sel2 else dict(
            oracle=torch.zeros(n[i], dtype=torch.long, device=dev),
            unary_accepted=torch.zeros(n[i], dtype=torch.long, device=dev),
            in_candidates=torch.zeros((n[i], B - 1), dtype=torch.bool, device=dev))
        out.append(dict(**extra,
            anchors=anchors, verify_size=vs, limit=torch.minimum(vs - 1, T[i] - 1 - anchors),
            accepted=torch.zeros(n[i], dtype=torch.long, device=dev),
            greedy=torch.full((n[i], B - 1), -1, dtype=torch.long, device=dev),
            topk_logp=torch.empty((n[i], B - 1, K), dtype=torch.float32, device=dev) if K else None,
            topk_ids=torch.empty((n[i], B - 1, K), dtype=torch.long, device=dev) if K else None,
            survival={st.label: torch.zeros((n[i], B), dtype=torch.float64, device=dev) for st in sampling} or None,
        ))
    p_flat = {_split(st)[0].label: torch.cat([p[_split(st)[0].label].to(dev) for p in p_tokens]) for st in sampling}
    spans = [(i, P[i], P[i] + n[i]) for i in range(len(samples)) if n[i] > 0]
    slot = torch.arange(B, device=dev)
    for pieces in _plan_chunks(plan, spans):
        owner = torch.cat([torch.full((a1 - a0,), i, dtype=torch.long, device=dev) for i, a0, a1 in pieces])
        anchors = torch.cat([torch.arange(a0, a1, device=dev) for _, a0, a1 in pieces])
        base = off_t[owner]  # flat offset of each row's sample
        vs = torch.clamp(max_len_t[owner] - anchors, max=B)
        pad = 0
        if plan.layout == "packed":
            h, n_keys = packed_forward(drafter, embed, ids, pos, ctx_kv, off, pieces, owner, anchors, base, vs, B)
            pairs = len(anchors) * B * (n_keys + len(anchors) * B)
        elif plan.layout == "groups":
            h, n_keys, n_rows = groups_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B,
                                                plan.g)
            pad = (n_rows * plan.g - len(anchors)) * B
            pairs = n_rows * plan.g * B * (n_keys + plan.g * B)
        else:
            h, n_keys = rows_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B)
            pairs = len(anchors) * B * (n_keys + B)
        # verification targets x[t + j] (-1 past the sample) and comparable slots
        Tr = T_t[owner]
        limit = torch.minimum(vs - 1, Tr - 1 - anchors)
        tgt = anchors[:, None] + slot[None]
        want = torch.where(tgt < Tr[:, None], ids[(base[:, None] + tgt).clamp(max=off[-1] - 1)], -1)
        flat = (base[:, None] + tgt[:, 1:]).clamp(max=off[-1] - 1)  # p of slot j's cached token (masked past limit)
        p_rows = [(st, p_flat[_split(st)[0].label][flat]) for st in sampling]
        comparable = slot[None, 1:] <= limit[:, None]
        surv = {}
        if sel2:
            ctx = None if walk_rows is None else drafter.walk_context(
                embed, walk_rows[(base + anchors - 1).clamp_min(0)], anchors > 0)
            greedy, logp, topi, unary, hit, surv = _selector_head(drafter, head, h, ids[base + anchors], want, limit, K,
                                                                  plan, stats, p_rows, ctx)
            hit &= comparable
            per_slot = {"oracle": hit.long().cumprod(-1).sum(-1),
                        "unary_accepted": ((unary == want[:, 1:]) & comparable).long().cumprod(-1).sum(-1),
                        "in_candidates": hit}
        else:
            greedy, logp, topi, surv = _lm_head(drafter, head, h, want, limit, B, K, full, plan, stats, p_rows)
            per_slot = {}
        match = (greedy == want[:, 1:]) & comparable
        acc = match.long().cumprod(-1).sum(-1)
        r0 = 0
        for i, a0, a1 in pieces:
            rows = slice(a0 - P[i], a1 - P[i])
            for key, val in per_slot.items():
                out[i][key][rows] = val[r0 : r0 + a1 - a0]
            out[i]["accepted"][rows] = acc[r0 : r0 + a1 - a0]
            out[i]["greedy"][rows] = greedy[r0 : r0 + a1 - a0]
            if K:
                out[i]["topk_logp"][rows] = logp[r0 : r0 + a1 - a0]
                out[i]["topk_ids"][rows] = topi[r0 : r0 + a1 - a0]
            for label, S in surv.items():
                out[i]["survival"][label][rows] = S[r0 : r0 + a1 - a0]
            r0 += a1 - a0
        if stats is not None:
            stats["query_tokens"] += len(anchors) * B
            stats["pad_query_tokens"] += pad
            stats["attn_pairs"] += pairs
            stats["calls"] += 1
    for i, s in enumerate(samples):
        yield AnchorDrafts(sample_id=s.sample_id, prompt_len=P[i], n_tokens=T[i], block_size=B, **out[i])


def _selector_head(drafter, head, h, anchor_ids, want, limit, K, plan, stats, p_rows=(), ctx=None):
    """A candidate walk (DFlash 2's selector, LiLiCorr's head with ``ctx``, the drafter's ``walk_context`` of the
    anchors): the walk's path ``[C, B-1]`` over every slot (its loop runs over the slots, batched
    over the anchors, :meth:`DFlashDrafter.propose`), top-K log-probs/ids (with K), the per-slot
    argmax ``[C, B-1]``, whether each slot's target token is a candidate ``[C, B-1]`` bool, and per
    sampling setting of ``p_rows`` ``P(a >= k | x)`` ``[C, B]``: the selector teacher-forced on the cached
    tokens (each slot scored after the cached token before it, :func:`dflash_eval.replay.expected.selector_survival`)."""
    C, B = h.shape[0], h.shape[1]
    dev = h.device
    surv = {st.label: torch.empty((C, B), dtype=torch.float64, device=dev) for st, _ in p_rows}
    path = torch.empty((C, B - 1), dtype=torch.long, device=dev)
    unary = torch.empty_like(path)
    hit = torch.empty((C, B - 1), dtype=torch.bool, device=dev)
    logp = torch.empty((C, B - 1, K), dtype=torch.float32, device=dev) if K else None
    topi = torch.empty((C, B - 1, K), dtype=torch.long, device=dev) if K else None
    step = plan.head_rows
    for r0 in range(0, C, step):
        r = slice(r0, r0 + step)
        lg = drafter.logits(h[r, 1:], head)  # [n, B-1, V]
        walk = {} if ctx is None else {"context": ctx.rows(r)}
        sel = drafter.select(h[r, 1:], lg, anchor_ids[r], **walk)
        path[r], unary[r] = sel.path, lg.argmax(-1)
        hit[r] = (sel.candidates == want[r, 1:, None]).any(-1)
        if K:
            logp[r], topi[r] = torch.topk(lg.float().log_softmax(-1), K, dim=-1)
        if p_rows:  # slot j's cached token x[t + j] (-1 past the sample: masked by limit)
            tok = want[r, 1:].clamp_min(0)
            forced = drafter.select(h[r, 1:], lg, anchor_ids[r], predecessors=tok, **walk)
            for st, p in p_rows:
                setting, policy = _split(st)
                surv[st.label][r] = selector_survival(forced.scores, forced.candidates, tok, p[r], limit[r], setting,
                                                      policy)
        del lg
    if stats is not None:
        stats["head_rows"] += C * (B - 1)
    return path, logp, topi, unary, hit, surv


def _split(st):
    """``(SamplingSetting, draft policy)`` of a :class:`~dflash_eval.replay.sampling.SamplingSetting` (the reference's
    drafts) or a :class:`~dflash_eval.replay.policies.DraftSetting`."""
    return (st.setting, st.policy) if isinstance(st, DraftSetting) else (st, REFERENCE)


def _lm_head(drafter, head, h, want, limit, B, K, full, plan, stats, p_rows=()):
    """Greedy drafts ``[C, B-1]`` (-1 = not computed), with K top-K log-probs/ids ``[C, B-1, K]``, and per
    sampling setting of ``p_rows`` (``(setting, [C, B-1] p of each slot's cached token)``) ``P(a >= k | x)``
    ``[C, B]``."""
    C = h.shape[0]
    dev = h.device
    greedy = torch.full((C, B - 1), -1, dtype=torch.long, device=dev)
    logp = topi = None
    surv = {st.label: torch.empty((C, B), dtype=torch.float64, device=dev) for st, _ in p_rows}
    step = plan.head_rows
    if full:
        if K:
            logp = torch.empty((C, B - 1, K), dtype=torch.float32, device=dev)
            topi = torch.empty((C, B - 1, K), dtype=torch.long, device=dev)
        for r0 in range(0, C, step):
            lg = drafter.logits(h[r0 : r0 + step, 1:], head)  # [n, B-1, V]
            greedy[r0 : r0 + step] = lg.argmax(-1)
            if K:
                v, i = torch.topk(lg.float().log_softmax(-1), K, dim=-1)
                logp[r0 : r0 + step], topi[r0 : r0 + step] = v, i
            for st, p in p_rows:  # slot j's cached token x[t + j] (-1 past the sample: masked by limit)
                tok = want[r0 : r0 + step, 1:].clamp_min(0)
                q = None
                setting, policy = _split(st)
                if policy == REFERENCE and K and 0 < setting.top_k <= K:  # q from the top-K just computed
                    q = token_probs_topk(v, i, tok, setting.temperature, setting.top_p, setting.top_k)
                elif policy == "argmax":  # one-hot q at the argmax drafts just computed
                    q = (greedy[r0 : r0 + step] == tok).float()
                surv[st.label][r0 : r0 + step] = chain_survival(lg, tok, p[r0 : r0 + step], limit[r0 : r0 + step],
                                                                setting, q_tokens=q, policy=policy)
            del lg
        if stats is not None:
            stats["head_rows"] += C * (B - 1)
        return greedy, logp, topi, surv
    alive = limit >= 1
    for j in range(1, B):
        sel = torch.nonzero(alive & (limit >= j)).flatten()
        if sel.numel() == 0:
            break
        draft = torch.cat([drafter.logits(h[sel[r0 : r0 + step], j], head).argmax(-1)
                           for r0 in range(0, len(sel), step)])
        greedy[sel, j - 1] = draft
        alive = torch.zeros_like(alive)
        alive[sel] = draft == want[sel, j]
        if stats is not None:
            stats["head_rows"] += len(sel)
    return greedy, logp, topi, surv


def anchor_drafts(
    drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    sample,
    block_size: int | None = None,
    topk: int = 0,
    full: bool = False,
    memory_bytes: int | None = None,
    layout: str | None = None,
) -> AnchorDrafts:
    """:class:`AnchorDrafts` of one sample (see :func:`iter_anchor_drafts` for arguments and memory)."""
    return next(iter_anchor_drafts(drafter, embed_weight, head_weight, [sample], block_size, topk, full, memory_bytes,
                                   layout=layout))


def replay_batched(
    drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    samples: list,
    block_size: int | None = None,
    memory_bytes: int | None = None,
    max_group_samples: int = 0,
    layout: str | None = None,
    stats: dict | None = None,
) -> list[list[int]]:
    """All-anchor replay: per sample, the tokens committed per verify step (same contract as :func:`replay_batch`).

    Memory is bounded as in :func:`iter_anchor_drafts` (``memory_bytes`` default: the
    device's free memory, :func:`free_memory_bytes`).
    """
    return [chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens)
            for d in iter_anchor_drafts(drafter, embed_weight, head_weight, samples, block_size,
                                        memory_bytes=memory_bytes, max_group_samples=max_group_samples,
                                        layout=layout, stats=stats)]


