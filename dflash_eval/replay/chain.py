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
  ``lm_head(drafter(block))[j]`` (DFlash 2: the candidate selector's path over those logits,
  :meth:`~dflash_eval.drafter.model.DFlashDrafter.propose` at temperature 0, the reference
  ``DFlash2DraftModel.propose``); ``d_j`` predicts position ``start + j``.
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

* :func:`dflash_eval.replay.anchors.replay_batched` (the default of ``evaluate``) computes the block
  of **every** possible anchor ``t in [P, T-2]`` at once
  (:func:`dflash_eval.replay.anchors.iter_anchor_drafts`), as DFlash
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
are in :mod:`dflash_eval.replay.metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_eval.core.runtime import free_memory_bytes
from dflash_eval.replay.anchors import block_forward, context_bytes_per_token, replay_batched
from dflash_eval.replay.metrics import sample_tau, ulp_at

SLOT_CHUNK = 4  # sequential replay: LM-head slots evaluated per pass while drafts keep matching
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
        drafter: :class:`~dflash_eval.drafter.model.DFlashDrafter` on the compute device/dtype.
        embed_weight: target ``embed_tokens`` ``[V, H]`` (compute device/dtype).
        head_weight: target ``lm_head`` ``[V, H]`` (compute device/dtype).
        samples: :class:`~dflash_eval.cache.format.CacheSample` list; ``hidden`` holds exactly the
            drafter's ``target_layer_ids`` in order, ``[T, K, H]``. All are replayed in one
            batch: the caller bounds memory (about ``len(samples) * max T`` context tokens of
            :func:`dflash_eval.replay.anchors.context_bytes_per_token`, twice).
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
    walk_rows = hidden if drafter.family.walk_reads_context else None  # the target row before each anchor
    del hidden

    start = P.clone()
    records: list[list[int]] = [[] for _ in range(S)]
    slot = torch.arange(B, device=dev)
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
        emb = drafter.make_block(ids[rows, st], embed_weight, B)
        block_pos = st[:, None] + slot[None]
        h = drafter(emb, block_pos, kv, positions[None, :tc].expand(len(rows), -1), ctx_valid, block_valid)
        # verify: longest prefix of drafts equal to the committed continuation
        left = T[rows] - 1 - st  # tokens still to commit
        limit = torch.minimum(vs - 1, left)  # comparable draft slots
        want = ids[rows[:, None], block_pos]  # x[start + j]
        acc = torch.zeros(len(rows), dtype=torch.long, device=dev)
        alive = torch.ones(len(rows), dtype=torch.bool, device=dev)
        if drafter.family.selects_candidates:  # DFlash 2: the selector's path over the block's slots
            walk = {} if walk_rows is None else {"context": drafter.walk_context(
                embed_weight, walk_rows[rows, (st - 1).clamp_min(0)], st > 0)}
            draft = drafter.propose(h[:, 1:], ids[rows, st], head_weight, **walk).path
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
    tokens = max(1, mem // 3 // context_bytes_per_token(drafter.cfg, torch.finfo(dt).bits // 8))
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
    h = block_forward(drafter, embed, ids[a], a, kv, anchor, vs, B)[0]
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
        ulp = ulp_at(top1, eps)
        other = lg.clone()
        other[target] = -float("inf")
        out.append({"sample_id": s.sample_id, "anchor": anchor, "step": k, "slot": j, "n_first": f[k],
                    "n_second": g[k], "target_token": target, "top1": int(top.indices[0]),
                    "top2": int(top.indices[1]), "top1_logit": top1, "gap": gap, "gap_ulps": gap / ulp,
                    "target_margin": float(lg[target] - other.max())})
    return out
