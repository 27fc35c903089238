"""Acceptance metrics: per-sample acceptance lengths -> tau and its companions (pure, torch-free).

Every number in ``tau.csv`` is computed here, from the per-sample lists the replay
records: ``acceptance[s][k]`` = tokens committed by verify step ``k`` of response ``s``
(accepted drafts ``a`` + the bonus token, so ``1 <= a + 1 <= block_size``; the last
step of a response can be cut shorter by the stop token / ``max_new_tokens``).

Conventions (the prefill token, produced by the target before the first verify step,
is never counted):

* ``tau`` (macro) -- the reference benchmark's acceptance length: per response the mean
  over its verify steps of ``a + 1``, then the mean over responses
  (z-lab/dflash ``benchmark.py``, ``_print_decode_summary``: ``np.mean([np.mean(r) ...])``).
* ``tau_tokens_per_step`` (micro) -- committed tokens / verify steps pooled over all
  responses: long responses weigh more.
* ``histogram[k]`` -- verify steps that committed exactly ``k`` tokens, ``k = 1..B``.

Responses with no verify step (the prefill token ended them: an eos right away, or
``max_new_tokens == 1``) have no tau; they are counted in ``n_skipped`` and left out of
every mean.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class AcceptanceStats:
    """Aggregate of one (checkpoint, prompt set) replay; see the module docstring for each convention."""

    tau: float  #: macro: mean over responses of the per-response mean of a+1 (NaN when n_samples == 0)
    tau_tokens_per_step: float  #: micro: committed tokens / verify steps (NaN when no step)
    n_samples: int  #: responses with at least one verify step
    n_skipped: int  #: responses with no verify step
    verify_steps: int  #: total verify steps (= target forwards after prefill)
    committed_tokens: int  #: total tokens committed by verify steps
    histogram: dict[int, int]  #: k -> verify steps that committed k tokens, k = 1..block_size

    def as_dict(self) -> dict:
        """JSON-ready dict (histogram keys as strings ``"1".."B"``)."""
        d = asdict(self)
        d["histogram"] = {str(k): v for k, v in self.histogram.items()}
        return d


def sample_tau(lengths: Sequence[int]) -> float:
    """Mean tokens per verify step of one response (NaN for a response without a verify step)."""
    return sum(lengths) / len(lengths) if len(lengths) else math.nan


def aggregate(acceptance: Sequence[Sequence[int]], block_size: int) -> AcceptanceStats:
    """Aggregate per-response acceptance lengths.

    Args:
        acceptance: one list per response; entry ``k`` = tokens committed by verify step ``k``
            (``a + 1``, an int in ``1..block_size``).
        block_size: B, the largest possible entry (size of the histogram).

    Returns:
        :class:`AcceptanceStats`.

    Raises:
        ValueError: an entry outside ``1..block_size`` (a replay bug, never user input).
    """
    hist = {k: 0 for k in range(1, block_size + 1)}
    per_response = []
    steps = tokens = skipped = 0
    for lengths in acceptance:
        if not len(lengths):
            skipped += 1
            continue
        for n in lengths:
            if n not in hist:
                raise ValueError(f"acceptance length {n} outside 1..{block_size}")
            hist[n] += 1
        per_response.append(sample_tau(lengths))
        steps += len(lengths)
        tokens += sum(lengths)
    return AcceptanceStats(
        tau=sum(per_response) / len(per_response) if per_response else math.nan,
        tau_tokens_per_step=tokens / steps if steps else math.nan,
        n_samples=len(per_response),
        n_skipped=skipped,
        verify_steps=steps,
        committed_tokens=tokens,
        histogram=hist,
    )


@dataclass(frozen=True)
class AgreementStats:
    """Target argmax agreement of the replayed samples (the cache's per-sample ``argmax_agreement``:
    the fraction of a completion's tokens equal to the target's teacher-forced greedy token)."""

    min: float  #: lowest per-sample agreement (NaN when no sample records one)
    mean: float  #: mean over samples (macro, like tau; NaN when no sample records one)
    n_unknown: int  #: samples without a recorded agreement


def agreement(values: Sequence[float | None]) -> AgreementStats:
    """Aggregate per-sample argmax agreements (``None`` = not recorded)."""
    known = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    return AgreementStats(min=min(known) if known else math.nan,
                          mean=sum(known) / len(known) if known else math.nan,
                          n_unknown=len(values) - len(known))
