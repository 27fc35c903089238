"""Acceptance at temperature > 0: the sampling filter, the speculative sampler and expected acceptance.

What the reference does (``dflash==0.1.0``, ``dflash/model.py``, ``dflash_generate`` at ``temperature > 0``):

* **Filter** (``_sampling_probs``): logits / temperature in float32, then top-k (``torch.topk``), a
  softmax over what is left, then top-p (keep, in descending order, every token whose preceding mass is
  ``< top_p``, renormalise). :func:`filtered_probs` gives the same probabilities bit for bit (same
  order, same tie handling: ``torch.topk`` and ``torch.sort`` decide equal values); temperature 0 is
  the one-hot argmax (first index on ties), the reference's greedy branch.
* **Drafts**: DFlash 1 samples every block slot independently from the drafter's filtered
  distribution q_j (same setting as the target). DFlash 2's candidate selector samples its path slot
  by slot over the top-``selector_top_k`` candidates of the drafter's logits; its q lives on those
  candidates, at the temperature only (no top-p / top-k), and depends on the previous slot's pick
  (the anchor for slot 1) -- :func:`selector_transitions`.
* **Verify** (``_rejection_sample``; Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
  arXiv 2302.01318): accept draft j with probability ``min(1, p_j(y) / q_j(y))`` (``u * q < p``), stop
  at the first rejection and draw the correction from ``max(0, p - q)`` renormalised (p itself when
  that is all zero); when every draft is accepted the bonus token comes from p at the last verify
  position. :func:`rejection_sample` is this sampler, batched.

Expected acceptance offline, along a cached trajectory x (prompt + completion, the completion drawn
from the target at the evaluated setting). The step's cuts are those of :mod:`dflash_eval.replay.chain`:
``a <= limit = min(vs - 1, T - 1 - t)`` (``vs = min(B, max_length - t)``, the reference's shortened last
block) and the step commits ``min(a + 1, T - 1 - t)`` tokens (:func:`produced_probs`). Two estimators:

* **Given the trajectory (exact; what ``evaluate`` reports).** The sampler is lossless: the tokens it
  commits are distributed as the target's. So the online process is the same as "draw the committed
  sequence x from the target, then the step boundaries given x", and the second part has a closed form.
  A step at anchor t that accepts k drafts and commits ``x[t+1 .. t+k+1]`` has probability
  ``prod_{i <= k} min(q_i(x_{t+i}), p_i(x_{t+i})) * r_{k+1}``, where ``r = max(0, p - q)`` at the
  correction token ``x_{t+k+1}`` (p at the bonus token when ``k = J``). Every distribution here is
  conditioned on x itself, because the accepted drafts are x's tokens. Divided by the target's
  probability of those ``k + 1`` tokens, this is a Markov chain: slot i is accepted with
  ``beta_i = min(1, q_i(x_{t+i}) / p_i(x_{t+i}))`` (:func:`slot_beta`) until the first rejection, and
  ``P(a >= k) = prod_{i <= k} beta_i`` (the telescoping sum makes the steps' probabilities sum to 1).
  So ``E[tau | x]`` by the walk DP below is the online expectation given that the response is x, and
  its mean over drawn trajectories estimates the online tau with no bias. It also has less variance
  than the online runs, since the sampler's own randomness is averaged out
  (``tests/replay/test_sampling_online.py``). DFlash 2: ``q_i(x_{t+i})`` is the selector's probability of
  the token given the trajectory's previous token as predecessor (:func:`selector_path_probs`).
  Needed per slot: p and q of one token.
* **Teacher-forced ``1 - TV`` (SpecForge's probabilistic tau,** ``specforge/algorithms/common/
  dflash_family_model.py``, ``tau_probabilistic``, **walked).** ``alpha_j = sum_x min(p_j(x), q_j(x))``
  is the probability that slot j is accepted given slots < j were, averaged over what the draft
  commits, but with p_j conditioned on x's prefix whatever the step committed. For DFlash 1,
  ``P(a >= k) = prod_{j <= k} alpha_j`` (:func:`survival_independent`). For DFlash 2 the sum over the
  selector's paths is a product of ``[K, K]`` matrices ``M_j[c', c] = min(q_j(c | c'), p_j(c))``
  (:func:`survival_selector`). :func:`mc_accepted` checks both against a seeded Monte Carlo of the
  sampler. This estimator ignores that a rejection puts a residual token, one the drafter
  underweights, at the next anchor. It is optimistic wherever rejections are frequent: by up to 4
  standard errors on the bigram test, +6 % for a demo drafter at T = 1 (docs/design.md).

The walk of a response and its expected tau: :mod:`dflash_eval.replay.walk`. At temperature 0 every p and q is
one-hot, ``beta`` is 1 exactly where the drafter's argmax is the cached token, and the expectation is the
greedy walk of :func:`dflash_eval.replay.anchors.chain_walk`, exactly.

Probabilities are float32 (as the reference's); survival products, the walk DP and the Monte Carlo
means are float64 (:mod:`dflash_eval.replay.walk`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import sampling_label
from dflash_eval.replay.walk import MCEstimate, _estimate


# ----------------------------------------------------------------------------- settings and the filter

@dataclass(frozen=True)
class SamplingSetting:
    """One sampling setting: ``temperature`` (0 = greedy), ``top_p`` in (0, 1] (1 = off), ``top_k`` >= 0 (0 = off).

    The reference's meaning and order (``dflash/model.py`` ``_sampling_probs``): temperature, top-k, top-p.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        check_sampling(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def label(self) -> str:
        """Stable short name, e.g. ``T0`` or ``T1_p0.95_k20`` (:func:`dflash_eval.core.schema.sampling_label`)."""
        return sampling_label({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k})


def check_sampling(temperature: float, top_p: float, top_k: int, where: str | None = None,
                   field: str = "sampling") -> None:
    """Raise :class:`InputError` (naming ``where`` / ``field``) unless the reference accepts the setting.

    The reference's ``_validate_sampling``: ``temperature >= 0``, ``0 < top_p <= 1``, ``top_k >= 0``
    (an integer); NaN and infinities are refused too.
    """
    ok = (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0
          and isinstance(top_p, (int, float)) and math.isfinite(top_p) and 0 < top_p <= 1
          and isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0)
    if not ok:
        raise InputError(where, field, f"temperature {temperature!r}, top_p {top_p!r}, top_k {top_k!r} is not a "
                         "sampling setting", "use temperature >= 0, top_p in (0, 1] (1 = off) and an integer "
                         "top_k >= 0 (0 = off)")


def filtered_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The distribution the reference samples from: ``[..., V]`` logits -> ``[..., V]`` float32 probabilities.

    ``temperature == 0``: one-hot at ``argmax`` (the first index among equal maxima). Otherwise, in
    float32: divide by the temperature; with ``0 < top_k < V`` keep the ``top_k`` largest
    (``torch.topk``: which of equal values at the cut survive is its choice, as in the reference);
    softmax; with ``top_p < 1`` sort descending (``torch.sort``) and keep each token whose preceding
    cumulative mass is ``< top_p`` (so at least the first), renormalise over the kept ones. Equal to
    ``dflash.model._sampling_probs`` bit for bit (``tests/replay/test_sampling.py``).

    Raises:
        InputError: a setting the reference refuses (:func:`check_sampling`).
    """
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    probs, kept = _filtered(logits, temperature, top_p, top_k)
    if kept is None:
        return probs
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, kept, probs)


def filtered_support(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                     top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`filtered_probs` without the scatter: ``(probs [..., k], ids [..., k])`` when ``0 < top_k < V``
    (the same values, ``torch.topk`` order), else ``(probs [..., V], None)``. ``temperature > 0``."""
    check_sampling(temperature, top_p, top_k)
    if temperature == 0:
        raise ValueError("filtered_support needs temperature > 0 (temperature 0 is the one-hot argmax)")
    return _filtered(logits, temperature, top_p, top_k)


def token_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, top_p: float = 1.0,
                top_k: int = 0) -> torch.Tensor:
    """:func:`filtered_probs` at given tokens: ``logits [..., V]``, ``tokens [...]`` int64 -> ``[...]`` float32.

    The same values as ``filtered_probs(...).gather(-1, tokens[..., None])`` without the dense scatter
    (0 for a token the filter drops; temperature 0: 1 where the token is the argmax).
    """
    if temperature == 0:
        check_sampling(temperature, top_p, top_k)
        return (logits.argmax(-1) == tokens).float()
    probs, kept = filtered_support(logits, temperature, top_p, top_k)
    if kept is None:
        return probs.gather(-1, tokens[..., None])[..., 0]
    return torch.where(kept == tokens[..., None], probs, 0.0).sum(-1)


def token_probs_topk(top_logp: torch.Tensor, top_ids: torch.Tensor, tokens: torch.Tensor, temperature: float,
                     top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """:func:`token_probs` from the ``K`` largest log-probabilities the DDTree pass already holds, ``0 < top_k <= K``.

    Args:
        top_logp: ``[..., K]`` float32 ``log_softmax(logits)`` of the K most probable tokens, descending
            (``torch.topk`` order, as :func:`dflash_eval.replay.anchors.iter_anchor_drafts` returns them).
        top_ids: ``[..., K]`` int64 their token ids; tokens: ``[...]`` int64.

    Returns ``[...]`` float32: the setting's filtered probability of each token (0 outside its support). The
    reference's filter (temperature, then top-k, then top-p) only reads the ``top_k`` largest logits, and
    ``log_softmax`` shifts every logit of a row by one constant, which neither the ranking nor a softmax sees;
    so this equals :func:`token_probs` up to float32 rounding (and, as the reference itself, ``torch.topk``'s
    choice among values tied at the cut). It saves a second full-vocabulary ``topk`` per setting and slot.

    Raises:
        ValueError: temperature 0, or ``top_k`` outside ``1..K``.
    """
    check_sampling(temperature, top_p, top_k)
    if temperature == 0 or not 0 < top_k <= top_logp.shape[-1]:
        raise ValueError(f"token_probs_topk needs temperature > 0 and 0 < top_k <= K (got temperature "
                         f"{temperature}, top_k {top_k}, K {top_logp.shape[-1]})")
    probs = torch.softmax(top_logp[..., :top_k].float() / temperature, dim=-1)  # descending already
    if top_p < 1.0:
        before = probs.cumsum(dim=-1) - probs  # mass of the better-ranked tokens
        probs = probs.masked_fill(~(before < top_p), 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.where(top_ids[..., :top_k] == tokens[..., None], probs, 0.0).sum(-1)


def _filtered(logits, temperature, top_p, top_k):
    scaled = logits.float() / temperature
    kept = None
    if 0 < top_k < scaled.shape[-1]:
        scaled, kept = torch.topk(scaled, top_k, dim=-1)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        before = ranked.cumsum(dim=-1) - ranked  # mass of the better-ranked tokens
        ranked = ranked.masked_fill(~(before < top_p), 0.0)
        probs = torch.empty_like(probs).scatter_(-1, order, ranked)  # order is a permutation
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, kept


def hf_logits_processor(setting: SamplingSetting):
    """A logits processor (called as transformers' ``LogitsProcessor``) that makes ``generate(do_sample=True)`` draw
    from :func:`filtered_probs`.

    It returns ``log(filtered_probs(scores))`` (``-inf`` outside the kept tokens), whose softmax is the
    reference's filtered distribution; generate's own temperature / top-k / top-p warpers must be off
    (``temperature=1.0, top_k=0, top_p=1.0``). transformers' warpers differ from the reference at ties
    (``TopKLogitsWarper`` keeps every logit equal to the k-th) and at the top-p boundary
    (``TopPLogitsWarper`` drops the tokens whose cumulative mass from the bottom is ``<= 1 - top_p``).

    Raises:
        ValueError: a greedy setting (temperature 0 is ``do_sample=False``).
    """
    if setting.greedy:
        raise ValueError("temperature 0 is greedy decoding (do_sample=False), not a sampling filter")

    class ReferenceFilter:  # generate() calls each processor as processor(input_ids, scores), like DecodeSteps
        def __call__(self, input_ids, scores):
            return filtered_probs(scores, setting.temperature, setting.top_p, setting.top_k).log().to(scores.dtype)

    return ReferenceFilter()


def generation_sampling(sampling: dict | None) -> tuple[dict, list]:
    """``generation.sampling`` -> ``(the setting with defaults filled, transformers logits processors)``; no
    processor at temperature 0 (greedy). The processor draws from dflash==0.1.0's filter
    (:func:`hf_logits_processor`).

    Raises:
        InputError: a setting the reference refuses.
    """
    s = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0, **(sampling or {})}
    s = {"temperature": float(s["temperature"]), "top_p": float(s["top_p"]), "top_k": int(s["top_k"]),
         "seed": int(s["seed"])}
    if s["temperature"] == 0:
        return s, []
    return s, [hf_logits_processor(SamplingSetting(s["temperature"], s["top_p"], s["top_k"]))]



# ----------------------------------------------------------------------------- the speculative sampler

def _draft_mass(draft_probs: torch.Tensor, tokens: torch.Tensor, draft_indices: torch.Tensor | None) -> torch.Tensor:
    """q of ``tokens`` ``[...]`` under ``draft_probs`` (``[..., V]``, or ``[..., K]`` over ``draft_indices``)."""
    if draft_indices is None:
        return draft_probs.gather(-1, tokens[..., None])[..., 0]
    return torch.where(draft_indices == tokens[..., None], draft_probs, 0.0).sum(-1)


def rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                     draft_indices: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one verify step per row (the reference's ``_rejection_sample``, batched).

    Args:
        draft_tokens: ``[n, J]`` int64, the drafted tokens of slots 1..J.
        target_probs: ``[n, J + 1, V]`` float32, the target's filtered distribution at the J drafted
            positions and the one after them (the bonus position).
        draft_probs: ``[n, J, V]`` float32 (DFlash 1: the drafter's filtered distribution per slot), or
            ``[n, J, K]`` over ``draft_indices`` (DFlash 2: the selector's distribution on its candidates).
        draft_indices: ``[n, J, K]`` int64 candidate token ids, or None.
        generator: torch RNG (None = the global one; then one row draws exactly what the reference draws).

    Returns:
        ``(accepted [n] int64 in 0..J, next_token [n] int64)``: the accepted drafts, then the correction
        token (from ``max(0, p - q)`` renormalised at the first rejected slot, p where that is all zero)
        or, when all J were accepted, the bonus token from ``target_probs[:, J]``.
    """
    n, J = draft_tokens.shape
    p = target_probs[:, :J].gather(-1, draft_tokens[..., None])[..., 0]
    q = _draft_mass(draft_probs, draft_tokens, draft_indices)
    u = torch.rand(q.shape, generator=generator, dtype=q.dtype, device=q.device)
    accepted = (u * q < p).long().cumprod(-1).sum(-1)
    rows = torch.arange(n, device=draft_tokens.device)
    final = target_probs[rows, accepted].clone()  # [n, V]: the bonus distribution where all were accepted
    rejected = torch.nonzero(accepted < J).flatten()
    if rejected.numel():
        a = accepted[rejected]
        residual = final[rejected]
        if draft_indices is None:
            residual = residual - draft_probs[rejected, a]
        else:
            residual = residual.scatter_add(-1, draft_indices[rejected, a], -draft_probs[rejected, a])
        residual = residual.clamp_min(0)
        total = residual.sum(-1, keepdim=True)
        residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(residual.dtype).tiny),
                               final[rejected])
        final[rejected] = residual
    return accepted, torch.multinomial(final, 1, generator=generator)[:, 0]


# ----------------------------------------------------------------------------- DFlash 2's selector

def selector_transitions(unary: torch.Tensor, candidates: torch.Tensor, hidden_proj: torch.Tensor,
                         anchor_ids: torch.Tensor, predecessor_codebook: torch.Tensor,
                         successor_codebook: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The DFlash 2 candidate selector's distributions for every predecessor (``dflash.model.CandidateSelector``).

    The reference scores slot j's candidates ``c`` given the previous slot's pick ``prev`` (the anchor
    token for slot 1) as ``unary[c] + <predecessor_codebook[prev] * hidden_proj[j], successor_codebook[c]>``
    and samples ``softmax(score / temperature)`` (argmax at temperature 0) along one path. Here the
    scores are computed for every possible ``prev`` among slot j-1's candidates, which is what the
    expectation over paths needs (:func:`survival_selector`).

    Args:
        unary: ``[n, J, K]`` the drafter's logits at the candidates. candidates: ``[n, J, K]`` int64 token
            ids (the reference: ``torch.topk(logits, selector_top_k, sorted=False)``).
        hidden_proj: ``[n, J, R]`` the selector's ``hidden_projection`` of the slots' drafter states.
        anchor_ids: ``[n]`` int64. predecessor_codebook, successor_codebook: ``[V, R]``.
        temperature: >= 0 (the selector applies no top-p / top-k).

    Returns:
        ``(first [n, K], trans [n, J - 1, K, K])`` float32: slot 1's distribution given the anchor, and
        ``trans[:, j - 1, c', c]`` = P(slot j + 1 picks candidate c | slot j picked candidate c').
    """
    succ = successor_codebook[candidates]  # [n, J, K, R]
    s0 = unary[:, 0] + torch.einsum("nr,nkr->nk", predecessor_codebook[anchor_ids] * hidden_proj[:, 0], succ[:, 0])
    pred = predecessor_codebook[candidates[:, :-1]] * hidden_proj[:, 1:, None, :]  # [n, J-1, K', R]
    s = unary[:, 1:, None, :] + torch.einsum("njpr,njkr->njpk", pred, succ[:, 1:])
    return filtered_probs(s0, temperature), filtered_probs(s, temperature)


def selector_path_probs(unary: torch.Tensor, candidates: torch.Tensor, hidden_proj: torch.Tensor,
                        prev_ids: torch.Tensor, tokens: torch.Tensor, predecessor_codebook: torch.Tensor,
                        successor_codebook: torch.Tensor, temperature: float) -> torch.Tensor:
    """The DFlash 2 selector's probability of ``tokens`` given the predecessors ``prev_ids``, slot by slot.

    For the estimator given the trajectory (module docstring): slot j's predecessor is the trajectory's
    token before it (the anchor token for slot 1), so one path is scored, not the whole lattice
    (:func:`selector_transitions`, same scores).

    Args:
        unary, candidates, hidden_proj: ``[n, J, K]``, ``[n, J, K]``, ``[n, J, R]`` as for :func:`selector_transitions`.
        prev_ids, tokens: ``[n, J]`` int64, the predecessor and the token of every slot.
        predecessor_codebook, successor_codebook: ``[V, R]``. temperature: >= 0.

    Returns:
        ``[n, J]`` float32: ``softmax(score / temperature)`` at the token's candidate (argmax indicator at
        temperature 0), 0 where the token is not among the slot's candidates.
    """
    scores = unary + torch.einsum("njr,njkr->njk", predecessor_codebook[prev_ids] * hidden_proj,
                                  successor_codebook[candidates])
    return candidate_token_probs(scores, candidates, tokens, temperature)


def candidate_token_probs(scores: torch.Tensor, candidates: torch.Tensor, tokens: torch.Tensor,
                          temperature: float) -> torch.Tensor:
    """The selector's probability of ``tokens`` ``[..., J]`` from its ``scores`` of the ``candidates`` ``[..., J, K]``.

    Returns:
        ``[..., J]`` float32: ``softmax(score / temperature)`` at the token's candidate (argmax indicator at
        temperature 0), 0 where the token is not among the slot's candidates (the reference's
        ``_rejection_sample``: ``(draft_probs * (draft_indices == token)).sum(-1)``).
    """
    return torch.where(candidates == tokens[..., None], filtered_probs(scores, temperature), 0.0).sum(-1)


# ----------------------------------------------------------------------------- expected acceptance of a step

def slot_alpha(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``alpha = sum_x min(p(x), q(x))`` over the last axis (= 1 - total variation), float32."""
    return torch.minimum(p.float(), q.float()).sum(-1)


def slot_beta(p_token: torch.Tensor, q_token: torch.Tensor) -> torch.Tensor:
    """``beta = min(1, q(x) / p(x))`` at the committed token x: P(slot accepted | the step committed x there).

    Args:
        p_token: ``[...]`` the target's filtered probability of the trajectory's token at the slot's position.
        q_token: ``[...]`` the drafter's probability of that token at that slot (DFlash 2: given the
            trajectory's previous token as the selector's predecessor).

    Returns:
        float64 ``[...]``; 1 where ``q >= p`` (so also where ``p = 0 < q``) and 0 where ``q = 0``. A token with
        ``p = 0`` cannot be committed by the sampler at this setting (see :func:`trajectory_support`).
    """
    p, q = p_token.double(), q_token.double()
    return torch.where(q >= p, (q > 0).double(), q / p.clamp_min(torch.finfo(torch.float64).tiny))


def _limit_mask(limit: torch.Tensor, J: int) -> torch.Tensor:
    return torch.arange(1, J + 1, device=limit.device)[None] <= limit[:, None]


def survival_independent(alpha: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """``S[:, k] = P(a >= k)`` for independent slots (DFlash 1), ``k = 0..J``.

    Args:
        alpha: ``[n, J]`` per-slot acceptance ``sum_x min(p_j, q_j)`` (:func:`slot_alpha`).
        limit: ``[n]`` int64, the slots that can be accepted (``min(vs - 1, T - 1 - t)``); later slots
            count as rejected.

    Returns:
        ``[n, J + 1]`` float64 with ``S[:, 0] = 1`` and ``S[:, k] = prod_{j <= k} alpha_j`` for
        ``k <= limit``, 0 beyond; ``E[a] = S[:, 1:].sum(-1)``.
    """
    a = alpha.double() * _limit_mask(limit, alpha.shape[1])
    return torch.cat([torch.ones_like(a[:, :1]), a.cumprod(-1)], dim=1)


def survival_selector(first: torch.Tensor, trans: torch.Tensor, p_cand: torch.Tensor,
                      limit: torch.Tensor) -> torch.Tensor:
    """``S[:, k] = P(a >= k)`` for DFlash 2's sequential selector path, exactly (no Monte Carlo needed).

    Accepting slots 1..k along a path ``c_1..c_k`` has probability ``prod_j q_j(c_j | c_{j-1}) *
    min(1, p_j(c_j) / q_j(c_j | c_{j-1})) = prod_j min(q_j(c_j | c_{j-1}), p_j(c_j))``; summed over
    paths it is a forward pass ``v_1 = min(first, p_1)``, ``v_j = v_{j-1} @ min(trans_j, p_j)``,
    ``P(a >= k) = sum(v_k)`` (teacher forcing: p_j does not depend on the accepted tokens).

    Args:
        first: ``[n, K]``, trans: ``[n, J - 1, K, K]`` from :func:`selector_transitions`.
        p_cand: ``[n, J, K]`` the target's filtered probability of each slot's candidates.
        limit: ``[n]`` int64 as in :func:`survival_independent`.

    Returns:
        ``[n, J + 1]`` float64, as :func:`survival_independent`.
    """
    n, J, _ = p_cand.shape
    p = p_cand.double()
    v = torch.minimum(first.double(), p[:, 0])
    out = [torch.ones(n, dtype=torch.float64, device=p.device), v.sum(-1)]
    for j in range(1, J):
        v = torch.einsum("np,npk->nk", v, torch.minimum(trans[:, j - 1].double(), p[:, j, None, :]))
        out.append(v.sum(-1))
    return torch.stack(out, dim=1) * torch.cat([torch.ones_like(limit[:, None], dtype=torch.bool),
                                                 _limit_mask(limit, J)], dim=1)


def mc_accepted(target_probs: torch.Tensor, draws: int, seed: int = 0, draft_probs: torch.Tensor | None = None,
                candidates: torch.Tensor | None = None, first: torch.Tensor | None = None,
                trans: torch.Tensor | None = None) -> tuple[MCEstimate, torch.Tensor]:
    """Seeded Monte Carlo of one verify step under :func:`rejection_sample` (accepted drafts per draw).

    Drafts are drawn as the reference draws them, then verified by the sampler:

    * DFlash 1 (``draft_probs [J, V]``): every slot independently from ``draft_probs[j]``;
    * DFlash 2 (``candidates [J, K]``, ``first [K]``, ``trans [J - 1, K, K]``,
      :func:`selector_transitions`): slot 1 from ``first``, slot j + 1 from ``trans[j - 1, c_j]``; q of each
      slot is the row it was drawn from, on ``candidates``.

    Args:
        target_probs: ``[J + 1, V]`` float32 p per drafted position and the bonus position.
        draws: number of verify steps simulated. seed: RNG seed.

    Returns:
        ``(estimate of E[a], accepted per draw [draws] int64)``.

    Raises:
        ValueError: neither or both draft descriptions given.
    """
    g = torch.Generator(device=target_probs.device).manual_seed(seed)
    J = target_probs.shape[0] - 1
    tp = target_probs[None].expand(draws, -1, -1)
    if (draft_probs is None) == (candidates is None):
        raise ValueError("give draft_probs (DFlash 1) or candidates, first and trans (DFlash 2)")
    if draft_probs is not None:
        tokens = torch.multinomial(draft_probs, draws, replacement=True, generator=g).T  # [draws, J]
        acc, _ = rejection_sample(tokens, tp, draft_probs[None].expand(draws, -1, -1), generator=g)
        return _estimate(acc), acc
    rows, picks = [first[None].expand(draws, -1)], []
    for j in range(J):
        picks.append(torch.multinomial(rows[-1], 1, generator=g)[:, 0])
        if j + 1 < J:
            rows.append(trans[j][picks[-1]])
    idx = torch.stack(picks, dim=1)  # [draws, J] candidate indices
    cand = candidates[None].expand(draws, -1, -1)
    tokens = cand.gather(-1, idx[..., None])[..., 0]
    acc, _ = rejection_sample(tokens, tp, torch.stack(rows, dim=1), cand, generator=g)
    return _estimate(acc), acc

