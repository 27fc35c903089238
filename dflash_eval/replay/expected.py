"""Expected acceptance at T > 0 along cached responses, from the drafter's all-anchor pass.

The all-anchor pass (:func:`dflash_eval.replay.anchors.iter_anchor_drafts`) drafts the block of every anchor
``t`` of a response once; this module turns those drafts and the target's probabilities of the cached
tokens into the expected acceptance of each sampling setting, given the trajectory (the estimator and
why it is exact: :mod:`dflash_eval.replay.sampling`):

* :func:`target_token_probs`: ``p(x_m | x_<m)`` under each setting for every position of a response,
  from the LM head of the cache's final normed hidden states (position ``m`` is predicted at ``m - 1``).
* :func:`chain_survival` (DFlash 1: drafts sampled independently from the drafter's filtered q) and
  :func:`selector_survival` (DFlash 2: the candidate selector's path): ``S[t, k] = P(a(t) >= k | x)``.
* :func:`response_expectations`: the walk over each response (:func:`dflash_eval.replay.walk.walk_expectations`)
  and the expected per-slot and per-position counts that :func:`dflash_eval.replay.metrics.aggregate_expected`
  pools exactly as :func:`dflash_eval.replay.metrics.aggregate` pools the greedy counts.

Greedy drafts, sampled target. DDTree under sampling (``liranringel/ddtree`` ``ddtree.py``:
``ddtree_generate`` builds the tree from the drafter's log-probabilities, which do not depend on the
temperature, then ``posterior = sample(target logits, temperature)`` at every verified node, and
``follow_verified_tree`` moves to the child holding the sampled token while there is one) commits exactly
the target's sampled tokens, so given the trajectory the accepted depth is determined: the deepest root
path equal to a prefix of x. That is the greedy tree walk of :mod:`dflash_eval.replay.ddtree` run on the sampled
cache, exact for any setting. The same holds for the argmax chain verified against sampled target
tokens (z-lab/dflash's ``dflash_generate`` on GitHub; SGLang's DFlash worker): the greedy chain walk on
the sampled cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_eval.replay.metrics import POSITION_BINS
from dflash_eval.replay.policies import ARGMAX, PROBABILISTIC, REFERENCE, draft_token_probs
from dflash_eval.replay.sampling import (SamplingSetting, candidate_token_probs, slot_beta, survival_independent,
                                         token_probs)
from dflash_eval.replay.walk import WalkExpectation, produced_probs, walk_expectations

#: logits rows per LM-head call in :func:`target_token_probs` (bounds the ``[rows, V]`` temporaries)
TARGET_ROWS = 1024


def target_token_probs(final_hidden: torch.Tensor, head_weight: torch.Tensor, input_ids: torch.Tensor,
                       settings: Sequence[SamplingSetting], logits_fn=None) -> dict[str, torch.Tensor]:
    """The target's filtered probability of each cached token: ``{setting label: [T] float32}``.

    Args:
        final_hidden: ``[T, H]`` the target's final normed hidden state per position (compute device/dtype).
        head_weight: ``[V, H]`` the target's LM head.
        input_ids: ``[T]`` int64, prompt + completion.
        settings: the settings (temperature 0 included: 1 where the token is the target's argmax).
        logits_fn: ``hidden [n, H] -> logits [n, V]`` (default ``hidden @ head_weight.T``; a target with
            logit soft-capping or scaling passes its own).

    Returns:
        per label, entry ``m >= 1`` = ``p(x_m | x_<m)`` from the logits at ``m - 1``; entry 0 = 1.
    """
    T = len(input_ids)
    ids = input_ids.to(final_hidden.device)
    out = {s.label: torch.ones(T, dtype=torch.float32, device=final_hidden.device) for s in settings}
    for r0 in range(0, T - 1, TARGET_ROWS):
        r1 = min(r0 + TARGET_ROWS, T - 1)
        h = final_hidden[r0:r1]
        logits = logits_fn(h) if logits_fn is not None else h @ head_weight.T
        for s in settings:
            out[s.label][r0 + 1 : r1 + 1] = token_probs(logits, ids[r0 + 1 : r1 + 1], s.temperature, s.top_p, s.top_k)
    return out


def chain_survival(draft_logits: torch.Tensor, tokens: torch.Tensor, p_tokens: torch.Tensor, limit: torch.Tensor,
                   setting: SamplingSetting, q_tokens: torch.Tensor | None = None,
                   policy: str = REFERENCE) -> torch.Tensor:
    """DFlash 1's ``P(a >= k | x)`` ``[r, J + 1]`` float64 for ``r`` anchors under a draft policy.

    Slot i is accepted given the trajectory with ``beta_i = min(1, q_i(x_{t+i}) / p_i(x_{t+i}))``
    (:mod:`dflash_eval.replay.sampling`), q the policy's (:func:`dflash_eval.replay.policies.draft_token_probs`).
    :data:`~dflash_eval.replay.policies.ARGMAX` (vLLM ``greedy``): q is one-hot at the draft and vLLM's correction
    excludes the draft token, so a slot is accepted exactly when the trajectory's token is the drafter's argmax,
    ``beta`` in {0, 1}: the greedy chain walk on the trajectory.

    Args:
        draft_logits: ``[r, J, V]`` the drafter's logits per anchor and slot (compute dtype).
        tokens: ``[r, J]`` int64, the cached token each slot drafts (``x[t + j]``; any id past the response).
        p_tokens: ``[r, J]`` the target's probability of those tokens (:func:`target_token_probs`).
        limit: ``[r]`` int64 verifiable slots per anchor (``min(vs - 1, T - 1 - t)``).
        setting: the sampling setting (the reference's q is the drafter's distribution filtered with it).
        q_tokens: ``[r, J]`` q of those tokens under ``policy`` when the caller has it already
            (:func:`dflash_eval.replay.sampling.token_probs_topk`); ``draft_logits`` is then not read.
        policy: :data:`~dflash_eval.replay.policies.DRAFT_POLICIES` entry.
    """
    q = q_tokens if q_tokens is not None else draft_token_probs(draft_logits, tokens, setting, policy)
    return survival_independent(slot_beta(p_tokens, q), limit)


def selector_survival(scores: torch.Tensor, candidates: torch.Tensor, tokens: torch.Tensor, p_tokens: torch.Tensor,
                      limit: torch.Tensor, setting: SamplingSetting, policy: str = REFERENCE) -> torch.Tensor:
    """DFlash 2's ``P(a >= k | x)`` ``[r, J + 1]`` float64 for ``r`` anchors under a draft policy.

    Given the trajectory, slot j's predecessor is the cached token before it (the anchor token for
    slot 1): every accepted draft is x's token, so the selector's distribution at slot j is the one it
    has after x's prefix (:mod:`dflash_eval.replay.sampling`, "Given the trajectory"). The selector samples at
    the setting's temperature only, no top-p / top-k (the reference's ``CandidateSelector.select``), and
    its q lives on the slot's candidates (``_rejection_sample`` with ``draft_indices``).

    Args:
        scores: ``[r, J, K]`` float32, the selector's scores teacher-forced on the cached tokens
            (:meth:`dflash_eval.drafter.model.CandidateSelector.forward` with ``predecessors=tokens``).
        candidates: ``[r, J, K]`` int64, the slots' candidates.
        tokens, p_tokens, limit: as for :func:`chain_survival`.
        setting: the sampling setting (temperature > 0).
        policy: :data:`~dflash_eval.replay.policies.REFERENCE` (the sampled path; also vLLM 0.32.0's
            ``probabilistic`` walk) or :data:`~dflash_eval.replay.policies.ARGMAX` (vLLM's ``greedy`` walk,
            ``vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py`` ``_selector_walk_kernel`` at temperature 0:
            each slot the argmax given the previous pick; given the trajectory q is one-hot at the argmax after
            x's previous token, the greedy selector chain on the trajectory).

    Raises:
        ValueError: ``probabilistic`` (vLLM's DFlash 2 walk is the reference's) or an unknown policy.
    """
    if policy not in (REFERENCE, ARGMAX):
        raise ValueError(f"draft policy {policy!r} does not apply to DFlash 2 (reference or argmax; vLLM's "
                         f"{PROBABILISTIC} DFlash 2 walk is the reference's)")
    q = candidate_token_probs(scores, candidates, tokens, setting.temperature if policy == REFERENCE else 0.0)
    return survival_independent(slot_beta(p_tokens, q), limit)


@dataclass
class ResponseExpectation:
    """One response's expectations given its trajectory (:func:`response_expectations`); counts are expected
    values (floats), pooled by :func:`dflash_eval.replay.metrics.aggregate_expected`.

    Attributes:
        tau, tau_sglang, steps: ``E[(T - 1 - P) / N]``, ``E[(T - P) / N]``, ``E[N]``.
        committed: ``T - 1 - P``, the tokens the verify steps commit (not random).
        histogram: ``[B + 1]`` expected steps committing d tokens (index d; 0 unused).
        slot_accepted, slot_compared: ``[B]`` (index k = slot k, 0 unused) expected verify steps in which
            slot k was accepted / compared, with :func:`dflash_eval.replay.metrics.aggregate`'s censoring.
        bin_tokens, bin_steps: expected committed tokens and steps per
            :data:`~dflash_eval.replay.metrics.POSITION_BINS` bin of the anchor's completion position.
        walk: the full :class:`~dflash_eval.replay.walk.WalkExpectation` (not serialised).
    """

    tau: float
    tau_sglang: float
    steps: float
    committed: int
    histogram: list[float]
    slot_accepted: list[float]
    slot_compared: list[float]
    bin_tokens: list[float]
    bin_steps: list[float]
    walk: WalkExpectation | None = None

    SERIALISED = ("tau", "tau_sglang", "steps", "committed", "histogram", "slot_accepted", "slot_compared",
                  "bin_tokens", "bin_steps")

    def as_dict(self) -> dict:
        """JSON-ready fields (the evaluate output's per-sample entry of a sampling setting)."""
        return {k: getattr(self, k) for k in self.SERIALISED}

    @classmethod
    def from_dict(cls, d: dict) -> "ResponseExpectation":
        return cls(**{k: d[k] for k in cls.SERIALISED})


def response_expectations(survivals: list[torch.Tensor], prompt_lens: Sequence[int], n_tokens: Sequence[int],
                          block_size: int, tol: float = 0.0) -> list[ResponseExpectation]:
    """Expected walk and counts of several responses from their per-anchor ``P(a >= k)``.

    Args:
        survivals: per response ``[n, J + 1]`` (``n = T - 1 - P >= 1`` anchors ``t = P + i``, J <= B - 1).
        prompt_lens, n_tokens: P and T per response.
        block_size: B.
        tol: passed to :func:`dflash_eval.replay.walk.walk_expectations` (0 = exact).

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
            tau=w.tau, tau_sglang=w.tau_sglang, steps=w.steps, committed=len(left), histogram=w.histogram.tolist(),
            slot_accepted=[0.0] + acc[1:B].tolist(), slot_compared=[0.0] + comp[1:B].tolist(),
            bin_tokens=torch.zeros(nb, dtype=torch.float64).index_add_(0, bins, v * mean_produced).tolist(),
            bin_steps=torch.zeros(nb, dtype=torch.float64).index_add_(0, bins, v).tolist(), walk=w))
    return out
