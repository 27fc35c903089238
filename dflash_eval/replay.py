"""Offline replay of greedy DFlash speculative decoding -> acceptance length (tau).

What online greedy DFlash does (z-lab/dflash ``dflash/model.py`` ``dflash_generate``; the DFlash
paper, arXiv 2602.06036), and what this module reproduces from the cache, per sample with prompt
length P, committed sequence ``x`` (prompt + greedy completion, length T) and
``max_length = P + max_new_tokens``:

* Prefill produces ``x[P]`` (not counted in tau). ``start = P`` is the index of
  the last committed token; the drafter's context is the target states of
  positions ``< start``.
* Verify step: block ``[x[start], MASK x (vs-1)]`` at positions
  ``start .. start+vs-1`` with ``vs = min(B, max_length - start)`` (the reference
  shortens the last block). Drafts ``d_j`` (j >= 1) are the greedy argmax of
  ``lm_head(drafter(block))[j]``; ``d_j`` predicts position ``start + j``.
* The target accepts the longest prefix with ``d_j == x[start + j]`` — with
  greedy verification the target's continuation *is* the greedy completion —
  giving ``a`` accepted drafts, then the bonus token: ``a + 1`` tokens per
  target forward. The step records ``produced = min(a + 1, T - 1 - start)``
  (cut at the stop token / ``max_new_tokens``, as ``dflash==0.1.0`` does).
* ``start += produced``; the context grows by the target states of the
  committed positions. Stop when ``start == T - 1``.

The drafter's output for a verify step depends only on its anchor ``t = start``: the
anchor token ``x[t]``, the context ``< t`` and the verify size ``vs(t)``. Two replays
follow from that:

* :func:`replay_batched` (the default of ``evaluate``) computes the block of **every**
  possible anchor ``t in [P, T-2]`` at once (:func:`iter_anchor_drafts`), as DFlash
  training does (one block per anchor, each seeing the context strictly before its
  anchor and its own block, blocks invisible to each other; SpecForge
  ``create_dflash_sdpa_mask``), then walks the chain: ``start = P``, ``a = acc[start]``,
  ``start += min(a + 1, T - 1 - start)``. It does more drafter work than the online
  loop (every anchor, not only the ~T/tau visited ones) but in large batches.
* :func:`replay_batch` is the sequential reference: one drafter call per verify step,
  samples side by side, exactly the online loop's data flow.

Both give the same per-step acceptance lists up to floating-point reduction order
(identical in float32 on the tests' drafters; in bf16 a draft whose top-2 logits are
within rounding can flip, :func:`explain_differences` names such near-ties).

tau (reference definition, ``dflash/benchmark.py`` ``_print_decode_summary``):
mean over responses of (mean over verify steps of ``produced``); the other conventions
are in :mod:`dflash_eval.metrics`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from .errors import InputError, atomic_path
from .metrics import aggregate, sample_tau
from .progress import Progress

log = logging.getLogger(__name__)

SLOT_CHUNK = 4  # sequential replay: LM-head slots evaluated per pass while drafts keep matching
#: batched replay, how one drafter call holds its anchors' blocks (see :func:`iter_anchor_drafts`):
#: ``rows`` = one row per anchor (per-row copies of the context K/V), ``packed`` = all blocks as
#: one sequence over shared context keys (no copies; attention also spans the other blocks' keys).
LAYOUTS = ("rows", "packed")
#: ``rows`` on both: on one H200 (bf16, ``python3 bench/replay.py``, 2026-12-01) rows took 51 ms/sample
#: against packed's 158 ms for a 2B target's 1k-token responses, and 2.7 vs 2.6-3.0 ms at 256 tokens.
DEFAULT_LAYOUT = {"cuda": "rows", "cpu": "rows"}
#: most query tokens (anchors x B) per drafter call, per layout and device type: enough to fill a
#: GPU, while ``rows``' K/V copies and ``packed``'s (chunk x chunk) attention stay a fraction of a call.
MAX_CHUNK_TOKENS = {("rows", "cuda"): 16384, ("rows", "cpu"): 4096, ("packed", "cuda"): 4096, ("packed", "cpu"): 1024}
MEMORY_FRACTION = {"cuda": 0.6, "cpu": 0.25}  # share of free memory the replay plans its temporaries for
REPLAY_MODES = ("batched", "sequential")


@dataclass
class SampleResult:
    """Per-sample replay result. ``acceptance_lengths[s]`` = tokens committed by verify step s (1..B)."""

    sample_id: str
    prompt_len: int
    n_tokens: int  # completion length, prefill token included
    acceptance_lengths: list[int] = field(default_factory=list)
    max_new_tokens: int | None = None

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sample_tau(self.acceptance_lengths)


def free_memory_bytes(device: str | torch.device) -> int:
    """Memory the replay may plan its temporaries for on ``device``, in bytes.

    CUDA: ``MEMORY_FRACTION['cuda']`` of the free device memory (``torch.cuda.mem_get_info``)
    plus what torch's caching allocator holds unused. CPU (and other devices):
    ``MEMORY_FRACTION['cpu']`` of ``MemAvailable`` from ``/proc/meminfo`` (Linux), else of
    the free physical pages (``os.sysconf``), else 2 GiB.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(MEMORY_FRACTION["cuda"] * (free + cached))
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    return int(MEMORY_FRACTION["cpu"] * avail)


# ----------------------------------------------------------------------------- sequential reference

def _context_bytes_per_token(cfg, elem: int) -> int:
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


@torch.inference_mode()
def replay_batch(
    drafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    samples: list,
    block_size: int | None = None,
) -> list[list[int]]:
    """Sequential reference replay: one drafter call per verify step, several samples side by side.

    Args:
        drafter: :class:`~dflash_eval.drafter.DFlashDrafter` on the compute device/dtype.
        embed_weight: target ``embed_tokens`` ``[V, H]`` (compute device/dtype).
        head_weight: target ``lm_head`` ``[V, H]`` (compute device/dtype).
        samples: :class:`~dflash_eval.cache.CacheSample` list; ``hidden`` holds exactly the
            drafter's ``target_layer_ids`` in order, ``[T, K, H]``. All are replayed in one
            batch: the caller bounds memory (about ``len(samples) * max T`` context tokens of
            :func:`_context_bytes_per_token`, twice).
        block_size: B (default: the drafter's).

    Returns:
        per sample, the list of tokens committed per verify step (``min(a+1, tokens left)``).
    """
    cfg = drafter.cfg
    B = int(block_size or cfg.block_size)
    dev = embed_weight.device
    dt = embed_weight.dtype
    S = len(samples)
    T = torch.tensor([len(s.input_ids) for s in samples], device=dev)
    P = torch.tensor([s.prompt_len for s in samples], device=dev)
    max_len = P + torch.tensor([s.max_new_tokens for s in samples], device=dev)
    Tmax = int(T.max())
    ids = torch.full((S, Tmax + B), -1, dtype=torch.long, device=dev)  # -1 pads never match a draft
    hidden = torch.zeros((S, Tmax, len(cfg.target_layer_ids) * cfg.hidden_size), dtype=dt, device=dev)
    for r, s in enumerate(samples):
        ids[r, : len(s.input_ids)] = s.input_ids.to(dev)
        hidden[r, : len(s.input_ids)] = s.hidden.reshape(len(s.input_ids), -1).to(device=dev, dtype=dt)
    positions = torch.arange(Tmax, device=dev)
    ctx_kv = drafter.context_kv(hidden, positions[None].expand(S, -1))
    del hidden

    start = P.clone()
    records: list[list[int]] = [[] for _ in range(S)]
    slot = torch.arange(B, device=dev)
    mask_id = cfg.mask_token_id
    while True:
        rows = torch.nonzero(start < T - 1).flatten()
        if rows.numel() == 0:
            break
        st = start[rows]
        tc = int(st.max())
        kv = [(k[rows, :, :tc], v[rows, :, :tc]) for k, v in ctx_kv]
        ctx_valid = positions[None, :tc] < st[:, None]
        vs = torch.clamp(max_len[rows] - st, max=B)
        block_valid = slot[None] < vs[:, None]
        block_ids = torch.full((len(rows), B), mask_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = ids[rows, st]
        emb = embed_weight[block_ids]
        if cfg.input_embedding_scale != 1.0:
            emb = emb * cfg.input_embedding_scale
        block_pos = st[:, None] + slot[None]
        h = drafter(emb, block_pos, kv, positions[None, :tc].expand(len(rows), -1), ctx_valid, block_valid)
        # verify: longest prefix of drafts equal to the committed continuation
        left = T[rows] - 1 - st  # tokens still to commit
        limit = torch.minimum(vs - 1, left)  # comparable draft slots
        want = ids[rows[:, None], block_pos]  # x[start + j]
        acc = torch.zeros(len(rows), dtype=torch.long, device=dev)
        alive = torch.ones(len(rows), dtype=torch.bool, device=dev)
        if getattr(drafter, "candidate_selector", None) is not None:  # DFlash 2: the selector's path over the block's slots
            draft = drafter.propose(h[:, 1:], block_ids[:, 0], head_weight).path
            acc = ((draft == want[:, 1:]) & (slot[None, 1:] <= limit[:, None])).long().cumprod(-1).sum(-1)
            alive[:] = False
        for j0 in range(1, B, SLOT_CHUNK):
            j1 = min(j0 + SLOT_CHUNK, B)
            sel = torch.nonzero(alive & (limit >= j0)).flatten()
            if sel.numel() == 0:
                break
            draft = drafter.logits(h[sel, j0:j1], head_weight).argmax(-1)
            ok = (draft == want[sel, j0:j1]) & (slot[None, j0:j1] <= limit[sel, None])
            run = ok.long().cumprod(-1)
            acc[sel] += run.sum(-1)
            alive[:] = False
            alive[sel] = run[:, -1].bool()
        produced = torch.minimum(acc + 1, left)
        start[rows] = st + produced
        for r, p in zip(rows.tolist(), produced.tolist()):
            records[r].append(p)
    return records


# ----------------------------------------------------------------------------- all-anchor pass

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
                 layout: str):
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
        slots = B - 1 if (full or topk) else 1
        row = vocab * (elem + (4 * 3 if topk else 0)) * slots
        self.head_rows = max(1, mem // 2 // max(row, 1))  # rows per LM-head pass
        # context tokens per group: context states + K/V, and the per-anchor outputs kept for the group
        out = (B - 1) * (8 + 12 * topk) + 32
        self.ctx_tokens = max(1, mem // 4 // (_context_bytes_per_token(cfg, elem) + out))

    def add_keys(self, keys: int, piece_keys: int) -> int:
        """Context keys of a call after adding a piece: the largest piece's (``rows``) or their sum (``packed``)."""
        return max(keys, piece_keys) if self.layout == "rows" else keys + piece_keys

    def cost(self, rows: int, keys: int) -> int:
        """Peak temporary bytes of one drafter call on ``rows`` anchors and ``keys`` context keys."""
        q = rows * self.B
        if self.layout == "rows":  # every row: keys + its own block
            return q * (keys + self.B) * self.pair + rows * (keys + self.B) * self.row_key + q * self.token
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
) -> Iterator[AnchorDrafts]:
    """All-anchor drafts of several samples, yielded per sample in input order.

    Samples are taken in groups whose context (stored states, fused states and every draft
    layer's context K/V, :func:`_context_bytes_per_token`) and outputs (``greedy``, top-K) fit a
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

    with heads ``nh``, KV heads ``nkv``, head dim ``hd``, element size ``elem``,
    ``p = 11 + elem + 8*nh`` (+8 for causal/windowed layers: masks, the additive mask, scores
    and probabilities of a non-fused kernel), ``r = 2*elem*hd*(2*nkv + nh)`` (K/V gathered,
    concatenated, repeated for GQA) and ``t = elem*(8H + 3I + (nh + 2nkv)*hd) + 64``
    (activations); kept below half of ``memory_bytes``, with ``Q <= MAX_CHUNK_TOKENS``.
    The LM head runs on at most ``memory_bytes / 2 / (V * (elem [+ 12 with topk]) * slots)``
    rows at once, where ``slots`` is 1 (lazy greedy) or B-1 (``full`` / ``topk``); no
    ``[anchors, B, V]`` logits are ever held.

    Args:
        drafter: :class:`~dflash_eval.drafter.DFlashDrafter` on the compute device/dtype.
        embed_weight: target ``embed_tokens`` ``[V, H]`` (compute device/dtype).
        head_weight: target ``lm_head`` ``[V, H]`` (compute device/dtype).
        samples: :class:`~dflash_eval.cache.CacheSample` list (``hidden`` ``[T, K, H]`` = the
            drafter's ``target_layer_ids`` in order).
        block_size: B (default: the drafter's).
        topk: K > 0 also returns the top-K full-vocabulary log-probabilities per slot.
        full: compute the greedy draft of every slot (not only those the chain needs).
        memory_bytes: plan for this many bytes of temporaries (default :func:`free_memory_bytes`).
        max_group_samples: > 0 caps the samples per group.
        layout: ``'rows'`` or ``'packed'`` (default: :data:`DEFAULT_LAYOUT` for the device type);
            both give the same drafts up to reduction order.
        stats: if given, accumulates ``query_tokens``, ``attn_pairs`` (query-key pairs
            computed, per layer), ``context_tokens``, ``head_rows`` (LM-head rows) and
            ``calls`` (drafter calls), for FLOP accounting.

    Yields:
        one :class:`AnchorDrafts` per sample.
    """
    cfg = drafter.cfg
    if getattr(drafter, "candidate_selector", None) is not None:
        raise InputError(None, "evaluate.replay", "the all-anchor replay of DFlash 2 drafters is not built yet",
                         "evaluate DFlash 2 drafters with replay: sequential")
    B = int(block_size or cfg.block_size)
    dev, dt = embed_weight.device, embed_weight.dtype
    elem = torch.finfo(dt).bits // 8
    V = head_weight.shape[0]
    K = min(int(topk), V)
    mem = int(memory_bytes or free_memory_bytes(dev))
    layout = layout or DEFAULT_LAYOUT.get(dev.type, "rows")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} not in {LAYOUTS}")
    plan = _Plan(cfg, B, elem, V, mem, dev, K, full, layout)
    if stats is not None:
        for key in ("query_tokens", "attn_pairs", "context_tokens", "head_rows", "calls"):
            stats.setdefault(key, 0)
    lengths = [len(s.input_ids) for s in samples]
    for group in length_groups(lengths, plan.ctx_tokens, max_group_samples):
        yield from _group_drafts(drafter, embed_weight, head_weight, [samples[i] for i in group], B, K,
                                 full or K > 0, plan, stats)


def _group_drafts(drafter, embed, head, samples, B, K, full, plan, stats):
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
    del hidden
    if stats is not None:
        stats["context_tokens"] += off[-1]
    T_t = torch.tensor(T, device=dev)
    off_t = torch.tensor(off[:-1], device=dev)
    max_len_t = torch.tensor([p + s.max_new_tokens for p, s in zip(P, samples)], device=dev)

    out = []
    for i, s in enumerate(samples):
        anchors = torch.arange(P[i], P[i] + n[i], device=dev)
        vs = torch.clamp(max_len_t[i] - anchors, max=B)
        out.append(dict(
            anchors=anchors, verify_size=vs, limit=torch.minimum(vs - 1, T[i] - 1 - anchors),
            accepted=torch.zeros(n[i], dtype=torch.long, device=dev),
            greedy=torch.full((n[i], B - 1), -1, dtype=torch.long, device=dev),
            topk_logp=torch.empty((n[i], B - 1, K), dtype=torch.float32, device=dev) if K else None,
            topk_ids=torch.empty((n[i], B - 1, K), dtype=torch.long, device=dev) if K else None,
        ))
    spans = [(i, P[i], P[i] + n[i]) for i in range(len(samples)) if n[i] > 0]
    slot = torch.arange(B, device=dev)
    for pieces in _plan_chunks(plan, spans):
        owner = torch.cat([torch.full((a1 - a0,), i, dtype=torch.long, device=dev) for i, a0, a1 in pieces])
        anchors = torch.cat([torch.arange(a0, a1, device=dev) for _, a0, a1 in pieces])
        base = off_t[owner]  # flat offset of each row's sample
        vs = torch.clamp(max_len_t[owner] - anchors, max=B)
        if plan.layout == "packed":
            h, n_keys = _packed_forward(drafter, embed, ids, pos, ctx_kv, off, pieces, owner, anchors, base, vs, B)
            pairs = len(anchors) * B * (n_keys + len(anchors) * B)
        else:
            h, n_keys = _rows_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B)
            pairs = len(anchors) * B * (n_keys + B)
        # verification targets x[t + j] (-1 past the sample) and comparable slots
        Tr = T_t[owner]
        limit = torch.minimum(vs - 1, Tr - 1 - anchors)
        tgt = anchors[:, None] + slot[None]
        want = torch.where(tgt < Tr[:, None], ids[(base[:, None] + tgt).clamp(max=off[-1] - 1)], -1)
        greedy, logp, topi = _lm_head(drafter, head, h, want, limit, B, K, full, plan, stats)
        match = (greedy == want[:, 1:]) & (slot[None, 1:] <= limit[:, None])
        acc = match.long().cumprod(-1).sum(-1)
        r0 = 0
        for i, a0, a1 in pieces:
            rows = slice(a0 - P[i], a1 - P[i])
            out[i]["accepted"][rows] = acc[r0 : r0 + a1 - a0]
            out[i]["greedy"][rows] = greedy[r0 : r0 + a1 - a0]
            if K:
                out[i]["topk_logp"][rows] = logp[r0 : r0 + a1 - a0]
                out[i]["topk_ids"][rows] = topi[r0 : r0 + a1 - a0]
            r0 += a1 - a0
        if stats is not None:
            stats["query_tokens"] += len(anchors) * B
            stats["attn_pairs"] += pairs
            stats["calls"] += 1
    for i, s in enumerate(samples):
        yield AnchorDrafts(sample_id=s.sample_id, prompt_len=P[i], n_tokens=T[i], block_size=B, **out[i])


def _rows_forward(drafter, embed, ids, ctx_kv, off, pieces, anchors, base, vs, B: int):
    """``rows`` layout: drafter states ``[C, B, H]``, one row per anchor over its sample's first ``Kc`` keys
    (``Kc`` = the chunk's largest anchor); returns ``(h, Kc)``."""
    dev = embed.device
    Kc = max(a1 - 1 for _, _, a1 in pieces)
    if len(pieces) == 1:  # one sample: its context, shared by every row (no copy until the drafter's cat)
        i = pieces[0][0]
        kv = [(k[:, :, off[i] : off[i] + Kc].expand(len(anchors), -1, -1, -1),
               v[:, :, off[i] : off[i] + Kc].expand(len(anchors), -1, -1, -1)) for k, v in ctx_kv]
    else:  # several samples: each row gathers its own sample's first Kc keys (the tail is masked)
        idx = (base[:, None] + torch.arange(Kc, device=dev)[None]).clamp(max=off[-1] - 1)
        kv = [(k[0][:, idx].transpose(0, 1), v[0][:, idx].transpose(0, 1)) for k, v in ctx_kv]
    return _block_forward(drafter, embed, ids[base + anchors], anchors, kv, Kc, vs, B), Kc


def _packed_forward(drafter, embed, ids, pos, ctx_kv, off, pieces, owner, anchors, base, vs, B: int):
    """``packed`` layout: drafter states ``[C, B, H]`` from one sequence of ``C*B`` queries over the keys
    ``[each piece's sample context < its largest anchor | all blocks]``; returns ``(h, context keys)``."""
    cfg = drafter.cfg
    dev = embed.device
    C = len(anchors)
    if len(pieces) == 1:
        i, _, a1 = pieces[0]
        key_idx = slice(off[i], off[i] + a1 - 1)
        key_owner = torch.full((a1 - 1,), i, dtype=torch.long, device=dev)
    else:
        key_idx = torch.cat([torch.arange(off[i], off[i] + a1 - 1, device=dev) for i, _, a1 in pieces])
        key_owner = torch.cat([torch.full((a1 - 1,), i, dtype=torch.long, device=dev) for i, _, a1 in pieces])
    key_pos = pos[key_idx]
    kv = [(k[:, :, key_idx], v[:, :, key_idx]) for k, v in ctx_kv]
    slot = torch.arange(B, device=dev)
    block_ids = torch.full((C, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[base + anchors]
    emb = embed[block_ids].reshape(1, C * B, -1)
    if cfg.input_embedding_scale != 1.0:
        emb = emb * cfg.input_embedding_scale
    ctx_valid = (key_owner[None, :] == owner[:, None]) & (key_pos[None, :] < anchors[:, None])  # [C, Kc]
    row = torch.arange(C * B, device=dev) // B
    block_valid = (row[:, None] == row[None, :]) & (slot.repeat(C)[None, :] < vs[row][:, None])  # [C*B, C*B]
    h = drafter(emb, (anchors[:, None] + slot[None]).reshape(1, C * B), kv, key_pos[None],
                ctx_valid.repeat_interleave(B, dim=0)[None], block_valid[None])
    return h.view(C, B, -1), len(key_pos)


def _block_forward(drafter, embed, anchor_ids, anchors, kv, Kc: int, vs, B: int):
    """Drafter states ``[C, B, H]`` of the blocks at ``anchors`` ``[C]`` (anchor tokens ``anchor_ids``,
    verify sizes ``vs``), over per-row context K/V ``[C, n_kv, Kc, hd]`` of positions ``0..Kc-1``."""
    cfg = drafter.cfg
    dev = embed.device
    C = len(anchors)
    slot = torch.arange(B, device=dev)
    block_ids = torch.full((C, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_ids[:, 0] = anchor_ids
    emb = embed[block_ids]
    if cfg.input_embedding_scale != 1.0:
        emb = emb * cfg.input_embedding_scale
    ctx_pos = torch.arange(Kc, device=dev)[None].expand(C, -1)
    return drafter(emb, anchors[:, None] + slot[None], kv, ctx_pos, ctx_pos < anchors[:, None], slot[None] < vs[:, None])


def _lm_head(drafter, head, h, want, limit, B, K, full, plan, stats):
    """Greedy drafts ``[C, B-1]`` (-1 = not computed) and, with K, top-K log-probs/ids ``[C, B-1, K]``."""
    C = h.shape[0]
    dev = h.device
    greedy = torch.full((C, B - 1), -1, dtype=torch.long, device=dev)
    logp = topi = None
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
            del lg
        if stats is not None:
            stats["head_rows"] += C * (B - 1)
        return greedy, logp, topi
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
    return greedy, logp, topi


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


def replay(drafter, embed_weight, head_weight, samples, block_size=None, mode: str = "batched",
           memory_bytes: int | None = None, batch_size: int = 0) -> list[list[int]]:
    """Replay ``samples`` with the all-anchor (``'batched'``) or the sequential reference replay.

    ``batch_size`` > 0 caps the samples handled together (``0``: as many as fit
    ``memory_bytes``, default :func:`free_memory_bytes`). Returns per-sample acceptance lists.

    Raises:
        ValueError: an unknown ``mode``.
    """
    if mode == "batched":
        return replay_batched(drafter, embed_weight, head_weight, samples, block_size, memory_bytes, batch_size)
    if mode != "sequential":
        raise ValueError(f"replay mode {mode!r} not in {REPLAY_MODES}")
    dt = embed_weight.dtype
    mem = int(memory_bytes or free_memory_bytes(embed_weight.device))
    tokens = max(1, mem // 3 // _context_bytes_per_token(drafter.cfg, torch.finfo(dt).bits // 8))
    recs: list[list[int]] = []
    lengths = [len(s.input_ids) for s in samples]
    groups, cur = [], []
    for i in range(len(samples)):  # samples are padded to the longest of their group
        if cur and ((len(cur) + 1) * max(lengths[j] for j in cur + [i]) > tokens or (batch_size and len(cur) >= batch_size)):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    for g in groups:
        recs += replay_batch(drafter, embed_weight, head_weight, [samples[i] for i in g], block_size)
    return recs


# ----------------------------------------------------------------------------- bf16 differences

@torch.inference_mode()
def _single_block_logits(drafter, embed, head, sample, anchor: int, B: int) -> torch.Tensor:
    """Logits ``[B, V]`` (float32 copy of the compute-dtype logits) of one anchor's block alone:
    context ``[0, anchor)`` + the block with its verify size (a one-row drafter call)."""
    dev, dt = embed.device, embed.dtype
    T = len(sample.input_ids)
    ids = sample.input_ids.to(dev)
    hidden = sample.hidden.reshape(T, -1).to(device=dev, dtype=dt)[None]
    pos = torch.arange(T, device=dev)
    kv = [(k[:, :, :anchor], v[:, :, :anchor]) for k, v in drafter.context_kv(hidden, pos[None])]
    a = torch.tensor([anchor], device=dev)
    vs = torch.clamp(sample.prompt_len + sample.max_new_tokens - a, max=B)
    h = _block_forward(drafter, embed, ids[a], a, kv, anchor, vs, B)[0]
    return drafter.logits(h, head).float()


def explain_differences(drafter, embed_weight, head_weight, samples, first: list[list[int]],
                        second: list[list[int]], block_size: int | None = None) -> list[dict]:
    """Name the draft decision behind each sample's first diverging verify step of two replays.

    For every sample whose acceptance lists differ, the first differing step (anchor ``t``)
    is decided at slot ``j = min(n_first, n_second)``: one replay accepted the draft for
    ``t + j``, the other did not. That block's logits are recomputed alone
    (:func:`_single_block_logits`) and reported with their top-2 gap, so a flip can be
    checked to be a near-tie (a gap of a few units in the last place of the compute dtype at
    the logit's magnitude, which the other replay's batching can round either way), not a bug.

    Returns:
        one dict per differing sample: ``sample_id``, ``anchor``, ``step``, ``slot``,
        ``n_first``, ``n_second``, ``target_token`` (``x[t + j]``), ``top1``, ``top2`` (token
        ids), ``top1_logit``, ``gap`` (top-1 minus top-2 logit), ``gap_ulps`` (the gap in
        units in the last place of the compute dtype at ``top1_logit``), ``target_margin``
        (target logit minus the best other logit); or ``sample_id``, ``step``, ``note`` when
        the lists differ only in length.
    """
    B = int(block_size or drafter.cfg.block_size)
    eps = torch.finfo(embed_weight.dtype).eps
    out = []
    for s, f, g in zip(samples, first, second):
        if f == g:
            continue
        k = next((i for i, (x, y) in enumerate(zip(f, g)) if x != y), min(len(f), len(g)))
        if k >= min(len(f), len(g)):
            out.append({"sample_id": s.sample_id, "step": k, "note": "lists differ in length only"})
            continue
        anchor = s.prompt_len + sum(f[:k])
        j = min(f[k], g[k])
        target = int(s.input_ids[anchor + j])
        lg = _single_block_logits(drafter, embed_weight, head_weight, s, anchor, B)[j]
        top = torch.topk(lg, 2)
        top1, gap = float(top.values[0]), float(top.values[0] - top.values[1])
        ulp = eps * 2.0 ** math.floor(math.log2(abs(top1))) if top1 else eps
        other = lg.clone()
        other[target] = -float("inf")
        out.append({"sample_id": s.sample_id, "anchor": anchor, "step": k, "slot": j, "n_first": f[k],
                    "n_second": g[k], "target_token": target, "top1": int(top.indices[0]),
                    "top2": int(top.indices[1]), "top1_logit": top1, "gap": gap, "gap_ulps": gap / ulp,
                    "target_margin": float(lg[target] - other.max())})
    return out


# ----------------------------------------------------------------------------- evaluate stage

def evaluate(
    drafter_dir,
    cache_path,
    target_dir,
    out,
    block_size: int | None = None,
    max_samples: int = 0,
    batch_size: int = 0,
    device: str = "auto",
    dtype: str = "auto",
    allow_backend_mismatch: bool = False,
    training_backend: str = "unknown",
    checkpoint_name: str | None = None,
    prompt_set: str | None = None,
    replay_mode: str = "batched",
    ddtree_budgets: tuple[int, ...] | list[int] = (),
    allow_foreign_cache: bool = False,
    agreement_warn: float = 0.99,
    agreement_min: float = 0.9,
    allow_low_agreement: bool = False,
    target_fingerprint: str | Path | None = None,
) -> dict:
    """Replay one drafter over one cache and write per-sample acceptance as JSON.

    Args:
        batch_size: samples handled together (0 = as many as fit the device's free memory,
            :func:`free_memory_bytes`).
        replay_mode: ``'batched'`` (all-anchor, :func:`replay_batched`) or ``'sequential'``
            (the reference, :func:`replay_batch`); both give the same acceptance lists.
        ddtree_budgets: DDTree node budgets (:mod:`dflash_eval.ddtree`); with ``'batched'`` the
            chain and every budget come from one all-anchor pass keeping the top-``max(budgets)``
            log-probs per slot (:func:`dflash_eval.ddtree.replay_with_trees`); with
            ``'sequential'`` the chain is replayed step by step and the trees from that pass.

    Output JSON keys: ``checkpoint`` (``checkpoint_name``, default the drafter folder name),
    ``prompt_set`` (``prompt_set``, default the cache file stem),
    ``block_size``, ``replay``, ``samples`` (``id``, ``prompt_len``, ``n_tokens``,
    ``max_new_tokens``, ``steps``, ``tau``, ``acceptance_lengths``, ``argmax_agreement``), and the
    :class:`~dflash_eval.metrics.AcceptanceStats` fields: ``tau`` (macro),
    ``tau_tokens_per_step`` (micro), ``tau_sglang`` (prefill token counted),
    ``histogram`` (verify steps per committed count 1..B), ``slot_acceptance`` /
    ``slot_compared`` (per-slot conditional acceptance), ``position_tau`` /
    ``position_steps`` (by completion position), ``n_samples`` (samples with >= 1 verify
    step), ``n_skipped`` (no verify step: the prefill token ended the response); provenance;
    ``argmax_agreement`` (min/mean of the samples' target agreement and the thresholds,
    :func:`~dflash_eval.compat.check_agreement`; each sample also carries its own) and
    ``target_check`` (the target's and the cache's weight fingerprints,
    :func:`~dflash_eval.compat.check_cache_target`; ``target_fingerprint`` is the
    ``target-fingerprint`` record, so the weights are not hashed again by every evaluate job).
    With ``ddtree_budgets``: ``ddtree_budgets``, ``ddtree_elapsed_s``, per sample
    ``acceptance_lengths_ddtree`` (``{"<B>": [...]}``) and ``ddtree`` (``{"<B>": aggregate}``).

    Raises:
        InputError: drafter/cache/target mismatch (layer ids not cached, hidden size, vocab,
            mask token, kernel backend); a cache of another target (unless ``allow_foreign_cache``);
            completions that are not the target's greedy output (mean agreement below
            ``agreement_min``, unless ``allow_low_agreement``); ``max_samples < 0``, a block size
            of 1, nothing to replay (no sample with a verify step), an unknown replay mode, or a
            DDTree budget < 1.
    """
    from .compat import check_agreement, check_cache_target

    if max_samples < 0:
        raise InputError(None, "--max-samples", f"must be >= 0 (0 = all), got {max_samples}", "pass 0 or a sample count")
    if block_size is not None and block_size < 2:
        raise InputError(None, "--block-size", f"must be >= 2 (or 0 = the drafter's), got {block_size}",
                         "a block holds the last committed token and at least one mask")
    from .cache import CacheReader
    from .compat import check_compat
    from .ddtree import replay_with_trees
    from .drafter import load_drafter
    from .runtime import dtype_name, resolve_device, resolve_dtype
    from .target import TargetSpec, load_embed_and_head

    if replay_mode not in REPLAY_MODES:
        raise InputError(None, "evaluate.replay", f"unknown replay mode {replay_mode!r}", f"use one of {REPLAY_MODES}")
    budgets = sorted({int(b) for b in ddtree_budgets})
    if budgets and budgets[0] < 1:
        raise InputError(None, "evaluate.ddtree_budgets", f"{budgets} has a budget < 1",
                         "give node budgets >= 1 (drafted nodes per verify step), or [] for no DDTree")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    drafter_dir = Path(drafter_dir)
    drafter = load_drafter(drafter_dir, device=dev, dtype=dt)
    cfg = drafter.cfg
    reader = CacheReader(cache_path)
    a = reader.attrs
    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    embed, head = load_embed_and_head(spec)
    check_compat(cfg, drafter_dir / "config.json", target=spec, embed_rows=embed.shape[0], cache_attrs=a,
                 cache_path=cache_path)
    target_check = check_cache_target(spec, a, cache_path, allow_foreign_cache)
    if target_check["allowed_mismatch"]:
        log.warning("%s: extracted from another target (sha256 %s, given %s); evaluated anyway (--allow-foreign-cache)",
                    cache_path, target_check["cache_target_sha256"], target_check["target_sha256"])
    cache_backend = json.loads(a.get("linear_attn_kernel", "{}") or "{}").get("backend", "none")
    if (training_backend not in ("unknown", cache_backend) and cache_backend != "none"
            and not allow_backend_mismatch):
        raise InputError(cache_path, "linear_attn_kernel",
                         f"cache made with the '{cache_backend}' kernel but the drafter was trained on "
                         f"'{training_backend}' states (fla and torch states differ by ~1-3 % per layer)",
                         "re-extract with target.linear_attn_backend matching training, or pass --allow-backend-mismatch")
    embed = embed.to(device=dev, dtype=dt)
    head = head.to(device=dev, dtype=dt)

    n = len(reader) if not max_samples else min(max_samples, len(reader))
    if n == 0:
        raise InputError(cache_path, "n_samples", "the cache holds no sample", "re-run the prompts/completions stages")
    agreement, agreement_warnings = check_agreement([reader.argmax_agreement(i) for i in range(n)],
                                                    reader.sample_ids[:n], cache_path, agreement_warn, agreement_min,
                                                    allow_low_agreement)
    for line in agreement_warnings:
        log.warning("%s", line)
    lengths = [reader.length(i) for i in range(n)]
    order = sorted(range(n), key=lambda i: -lengths[i])  # similar lengths side by side
    mem = free_memory_bytes(dev)
    # samples read from the cache at a time: what one batched group / sequential batch holds
    per_token = _context_bytes_per_token(cfg, torch.finfo(dt).bits // 8)
    read_tokens = max(1, mem // 4 // per_token)
    results: dict[int, SampleResult] = {}
    trees: dict[int, dict[int, list[int]]] = {}
    tree_s = 0.0
    t0 = time.perf_counter()
    n_comp = sum(lengths[i] - int(reader.sample_attrs(i)["prompt_len"]) for i in range(n))  # completion tokens
    bar = Progress(n_comp, "replay", logger=log)
    for group in length_groups([lengths[i] for i in order], read_tokens, batch_size):
        idx = [order[g] for g in group]
        samples = [reader.sample(i, cfg.target_layer_ids) for i in idx]
        if budgets:
            # one all-anchor pass with the top-max(budgets) log-probs: chain + every budget's tree
            t1 = time.perf_counter()
            both = replay_with_trees(drafter, embed, head, samples, budgets, block_size, mem, batch_size)
            tree_s += time.perf_counter() - t1
            for s, (_, tr) in zip(samples, both):
                trees[s.index] = tr
        if budgets and replay_mode == "batched":
            recs = [chain for chain, _ in both]
        else:
            recs = replay(drafter, embed, head, samples, block_size, replay_mode, mem, batch_size)
        for s, rec in zip(samples, recs):
            results[s.index] = SampleResult(s.sample_id, s.prompt_len, len(s.input_ids) - s.prompt_len, rec,
                                            s.max_new_tokens)
        bar.update(sum(len(s.input_ids) - s.prompt_len for s in samples))
        log.debug("replayed %d/%d samples", len(results), n)
    bar.close()
    elapsed = time.perf_counter() - t0
    B = int(block_size or cfg.block_size)
    per = [results[i] for i in range(n)]
    stats = aggregate([r.acceptance_lengths for r in per], B)
    if stats.n_samples == 0:
        raise InputError(cache_path, "samples", f"none of the {n} samples has a verify step (every response ended "
                         "at its first token), so tau is undefined", "check the completions (max_new_tokens, stop "
                         "tokens) of this prompt set")
    strip_info = {}
    if (drafter_dir / "strip_info.json").exists():
        strip_info = json.loads((drafter_dir / "strip_info.json").read_text())
    result = {
        "checkpoint": checkpoint_name or drafter_dir.name,
        "prompt_set": prompt_set or Path(cache_path).stem,
        "block_size": B,
        **stats.as_dict(),
        "step": strip_info.get("step"),
        "random_init": bool(strip_info.get("random_init", False)),
        "device": str(dev),
        "dtype": dtype_name(dt),
        "replay": replay_mode,
        "cache": {"path": str(cache_path), "dtype": a.get("dtype"), "target_sha256": a.get("target_sha256"),
                  "linear_attn_kernel": a.get("linear_attn_kernel")},
        "argmax_agreement": agreement,
        "target_check": target_check,
        "elapsed_s": round(elapsed, 3),
        "samples": [
            {"id": r.sample_id, "prompt_len": r.prompt_len, "n_tokens": r.n_tokens, "max_new_tokens": r.max_new_tokens,
             "steps": r.steps, "tau": r.tau if r.steps else None, "acceptance_lengths": r.acceptance_lengths,
             "argmax_agreement": reader.argmax_agreement(i)}
            for i, r in enumerate(per)
        ],
    }
    if budgets:
        result["ddtree_budgets"] = budgets
        # the shared all-anchor pass + the tree walks (batched: the chain's time too); included in elapsed_s
        result["ddtree_elapsed_s"] = round(tree_s, 3)
        result["ddtree"] = {str(b): aggregate([trees[i][b] for i in range(n)], B).as_dict() for b in budgets}
        for i, row in enumerate(result["samples"]):
            row["acceptance_lengths_ddtree"] = {str(b): trees[i][b] for b in budgets}
        log.info("DDTree tau by node budget: %s", {b: round(result["ddtree"][str(b)]["tau"], 3) for b in budgets})
    reader.close()
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    log.info("evaluate %s on %s: tau %.4f over %d samples (%d verify steps, %.1f s, %.0f tok/s, %s %s, %s replay)",
             result["checkpoint"], result["prompt_set"], stats.tau, stats.n_samples, stats.verify_steps, elapsed,
             n_comp / max(elapsed, 1e-9), dev, result["dtype"], replay_mode)
    return result
