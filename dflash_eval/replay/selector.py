"""DFlash 2 chains and selector diagnostics from one all-anchor pass (per sample, torch-free).

The all-anchor pass (:func:`dflash_eval.replay.anchors.iter_anchor_drafts`) drafts every anchor ``t`` of a
cached response once. For a DFlash 2 drafter it keeps, per anchor: ``accepted`` (the prefix of the
selector's path that matches the committed tokens), ``oracle`` (the prefix whose target tokens are
all among the slots' top-K candidates: what a perfect selector could accept from the same
candidates), ``unary_accepted`` (the prefix of the per-slot argmax, DFlash 1's draft from the same
logits) and ``in_candidates`` per slot. Each gives a chain (:func:`dflash_eval.replay.anchors.chain_walk`):

* the selector's chain: the checkpoint's tau, what the serving engines decode (vLLM PR #52816,
  SGLang PR #35371 walk one selector path per step);
* the oracle chain: ``tau_oracle``, the tau a perfect selector would reach on its own trajectory;
* the unary chain: ``tau_unary``, the tau of the same logits without the selector.

The selector's own verify steps also feed :func:`dflash_eval.replay.metrics.selector_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_eval.replay.anchors import chain_walk
from dflash_eval.replay.metrics import SelectorStep


@dataclass
class Dflash2Walks:
    """Per sample: the three chains (tokens committed per verify step) and the selector chain's steps."""

    chain: list[int]
    oracle: list[int]
    unary: list[int]
    steps: list[SelectorStep] = field(default_factory=list)


def walks(accepted: list[int], oracle: list[int], unary: list[int], limit: list[int],
          in_candidates: list[list[bool]], prompt_len: int, n_tokens: int) -> Dflash2Walks:
    """The chains and the selector's verify steps of one sample from its per-anchor values.

    Args:
        accepted, oracle, unary, limit: per anchor ``t = P .. T-2`` (lists of ints).
        in_candidates: per anchor, per slot ``1..B-1``: the slot's target token is a candidate.
        prompt_len: P. n_tokens: T.

    Returns:
        :class:`Dflash2Walks`.
    """
    chain = chain_walk(accepted, prompt_len, n_tokens)
    steps, start = [], prompt_len
    for produced in chain:
        i = start - prompt_len
        steps.append(SelectorStep(accepted[i], oracle[i], limit[i], tuple(in_candidates[i][: limit[i]])))
        start += produced
    return Dflash2Walks(chain, chain_walk(oracle, prompt_len, n_tokens), chain_walk(unary, prompt_len, n_tokens),
                        steps)
