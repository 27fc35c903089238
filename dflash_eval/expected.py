"""Expected acceptance at T > 0 along cached responses, from the drafter's all-anchor pass.

The all-anchor pass (:func:`dflash_eval.anchors.iter_anchor_drafts`) drafts the block of every anchor
``t`` of a response once; this module turns those drafts, and the target's distribution along the
cached trajectory, into the expected acceptance of every sampling setting
(:mod:`dflash_eval.sampling` states the sampler, the closed forms and the teacher-forcing
approximation):

* :func:`target_slot_probs`: the target's filtered p for every (anchor, slot) of a run of consecutive
  anchors, from one window of target probabilities (slot j of anchor t is position ``t + j``, whose
  logits are the LM head of the final normed hidden state at ``t + j - 1``): no copy per slot.
* :func:`chain_survival` (DFlash 1: independent slots, drafts sampled from the drafter's filtered q),
  :func:`selector_survival` (DFlash 2: the candidate selector's path) and :func:`tree_survival`
  (DDTree, below): ``S[t, k] = P(a(t) >= k)`` per anchor.
* :func:`response_expectation`: the walk over a response (:func:`dflash_eval.sampling.walk_expectations`)
  plus the expected per-slot and per-position counts that :func:`dflash_eval.metrics.aggregate_expected`
  pools exactly like :func:`dflash_eval.metrics.aggregate` pools the greedy counts.

DDTree under sampling (``liranringel/ddtree`` ``ddtree.py``: ``ddtree_generate`` builds the tree from
the drafter's log-probabilities, which do not depend on the temperature, then ``posterior =
sample(target logits, temperature)`` at every verified node and ``follow_verified_tree`` moves to the
child holding the sampled token while there is one). The walk reaches node u with probability
``prod_i p_{t+i}(u_i)`` along its path (siblings are distinct tokens, so the nodes of one depth are
disjoint events), hence ``P(a >= k) = sum over depth-k nodes of prod p``; with teacher forcing p at depth
i is the trajectory's p at ``t + i``. The reference's sampler has no top-p / top-k; a setting's filters
are applied to the target's p here as for the chain (at ``top_p = 1, top_k = 0`` it is the reference's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .metrics import POSITION_BINS
from .sampling import (SamplingSetting, WalkExpectation, filtered_probs, produced_probs, selector_transitions,
                       slot_alpha, survival_independent, survival_selector, walk_expectations)


def target_slot_probs(window_probs: torch.Tensor, rows: int, slots: int) -> torch.Tensor:
    """``[rows, slots, V]`` view of ``window_probs`` ``[rows + slots - 1, V]``: row r, slot j -> window row ``r + j``.

    With the window = p of positions ``a0 + 1 .. a1 + slots - 1`` (a run of anchors ``a0 .. a1 - 1``),
    entry ``[r, j - 1]`` is p at position ``a0 + r + j``, the one slot j of anchor ``a0 + r`` drafts.
    """
    return window_probs.unfold(0, slots, 1).transpose(1, 2)[:rows]


def chain_survival(draft_logits: torch.Tensor, p_slots: torch.Tensor, limit: torch.Tensor,
                   setting: SamplingSetting) -> torch.Tensor:
    """DFlash 1's ``P(a >= k)`` ``[r, J + 1]`` float64 from the drafter's logits ``[r, J, V]`` and the target's p.

    Args:
        draft_logits: the drafter's logits per anchor and slot (compute dtype).
        p_slots: ``[r, J, V]`` float32 target p per slot (:func:`target_slot_probs`).
        limit: ``[r]`` int64 verifiable slots per anchor (``min(vs - 1, T - 1 - t)``).
        setting: a non-greedy setting; q = :func:`~dflash_eval.sampling.filtered_probs` of the logits under it.
    """
    q = filtered_probs(draft_logits, setting.temperature, setting.top_p, setting.top_k)
    return survival_independent(slot_alpha(p_slots, q), limit)


def selector_survival(unary: torch.Tensor, candidates: torch.Tensor, hidden_proj: torch.Tensor,
                      anchor_ids: torch.Tensor, predecessor_codebook: torch.Tensor, successor_codebook: torch.Tensor,
                      p_slots: torch.Tensor, limit: torch.Tensor, setting: SamplingSetting) -> torch.Tensor:
    """DFlash 2's ``P(a >= k)`` ``[r, J + 1]`` float64: the selector's paths summed exactly.

    The selector samples at the setting's temperature only (the reference's ``CandidateSelector.select``);
    the target's p is filtered with the whole setting. Arguments as for
    :func:`dflash_eval.sampling.selector_transitions` (``[r, J, K]`` / ``[r, J, R]`` / ``[r]``) plus ``p_slots``
    and ``limit`` as for :func:`chain_survival`.
    """
    first, trans = selector_transitions(unary, candidates, hidden_proj, anchor_ids, predecessor_codebook,
                                        successor_codebook, setting.temperature)
    return survival_selector(first, trans, p_slots.gather(-1, candidates), limit)


def tree_survival(topk_logp: torch.Tensor, p_topk: torch.Tensor, verify_size: torch.Tensor, limit: torch.Tensor,
                  budgets: Sequence[int]) -> dict[int, torch.Tensor]:
    """DDTree's ``P(a >= k)`` per budget under target sampling (module docstring), one heap run per anchor.

    Args:
        topk_logp: ``[n, J, K]`` the drafter's top-K full-vocabulary log-softmax per slot, descending
            (:attr:`dflash_eval.anchors.AnchorDrafts.topk_logp`), ``K >= max(budgets)``.
        p_topk: ``[n, J, K]`` the target's filtered p of those tokens at each slot's position.
        verify_size: ``[n]`` vs per anchor (the tree's depth limit is ``vs - 1``, as the greedy walk's).
        limit: ``[n]`` verifiable depth per anchor; deeper nodes count as rejected.
        budgets: node budgets (>= 1).

    Returns:
        ``{budget: [n, J + 1] float64}``; the budget-b tree is the first b pops (trees are nested).
    """
    from .ddtree import _heap_pops

    n, J, _ = topk_logp.shape
    bmax = max(budgets)
    out = {b: torch.zeros((n, J + 1), dtype=torch.float64) for b in budgets}
    lp_all = topk_logp.float().cpu().tolist()
    p_all = p_topk.double().cpu().tolist()
    vs, lim = verify_size.tolist(), limit.tolist()
    order = sorted(budgets)
    for t in range(n):
        depth_limit = vs[t] - 1
        w = [1.0]  # reach probability per node, root first
        acc = [0.0] * (J + 1)
        k = 0
        for pops, (parent, depth, rank) in enumerate(_heap_pops(lp_all[t][:depth_limit], bmax, depth_limit), 1):
            w.append(w[parent] * p_all[t][depth - 1][rank])
            if depth <= lim[t]:
                acc[depth] += w[-1]
            while k < len(order) and order[k] == pops:
                out[order[k]][t] = torch.tensor(acc, dtype=torch.float64)
                k += 1
        for b in order[k:]:  # a lattice smaller than the budget
            out[b][t] = torch.tensor(acc, dtype=torch.float64)
    for S in out.values():
        S[:, 0] = 1.0
    return out


@dataclass
class ResponseExpectation:
    """One response's expectations (:func:`response_expectation`); counts are expected values (floats).

    ``walk``: :class:`~dflash_eval.sampling.WalkExpectation`; ``slot_accepted`` / ``slot_compared``:
    ``[B]`` (index k = slot k, 0 unused) expected verify steps in which slot k was accepted / compared,
    with :func:`dflash_eval.metrics.aggregate`'s censoring; ``bin_tokens`` / ``bin_steps``: expected
    committed tokens and steps per :data:`~dflash_eval.metrics.POSITION_BINS` bin of the anchor's
    completion position.
    """

    walk: WalkExpectation
    slot_accepted: list[float]
    slot_compared: list[float]
    bin_tokens: list[float]
    bin_steps: list[float]


def response_expectations(survivals: list[torch.Tensor], prompt_lens: Sequence[int], n_tokens: Sequence[int],
                          block_size: int, tol: float = 0.0) -> list[ResponseExpectation]:
    """Expected walk and counts of several responses from their per-anchor ``P(a >= k)``.

    Args:
        survivals: per response ``[n, J + 1]`` (``n = T - 1 - P >= 1`` anchors ``t = P + i``, J <= B - 1).
        prompt_lens, n_tokens: P and T per response.
        block_size: B.
        tol: passed to :func:`dflash_eval.sampling.walk_expectations` (0 = exact).

    Returns:
        one :class:`ResponseExpectation` per response. Slot k of anchor t is accepted when ``a >= k`` and
        ``k + 1 <= left`` and compared when ``a >= k - 1`` and ``k < left`` (``left = T - 1 - t``), as the
        greedy counts; the position bins use the anchor's completion index ``t - P``.
    """
    B = block_size
    produced, lefts = [], []
    for S, P, T in zip(survivals, prompt_lens, n_tokens):
        left = torch.arange(T - 1 - P, 0, -1, device=S.device)
        lefts.append(left)
        produced.append(produced_probs(S, left, B))
    walks = walk_expectations(produced, tol)
    edges = torch.tensor(list(POSITION_BINS[1:]), dtype=torch.long)
    out = []
    for S, left, pr, w in zip(survivals, lefts, produced, walks):
        Sx = torch.zeros((S.shape[0], B + 1), dtype=torch.float64)
        Sx[:, : S.shape[1]] = S.double().cpu()
        left, v, pr = left.cpu(), w.visit, pr.cpu()
        k = torch.arange(B + 1)[None]
        ok = k < left[:, None]
        acc = (v[:, None] * Sx * ok).sum(0)
        comp = (v[:, None] * torch.roll(Sx, 1, dims=1) * (ok & (k <= B - 1))).sum(0)
        bins = torch.bucketize(torch.arange(len(left)), edges, right=True)
        mean_produced = (pr * torch.arange(B + 1, dtype=torch.float64)[None]).sum(1)
        nb = len(POSITION_BINS)
        out.append(ResponseExpectation(
            walk=w, slot_accepted=[0.0] + acc[1:B].tolist(), slot_compared=[0.0] + comp[1:B].tolist(),
            bin_tokens=torch.zeros(nb, dtype=torch.float64).index_add_(0, bins, v * mean_produced).tolist(),
            bin_steps=torch.zeros(nb, dtype=torch.float64).index_add_(0, bins, v).tolist()))
    return out
