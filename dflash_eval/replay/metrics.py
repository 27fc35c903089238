"""Acceptance metrics: per-sample acceptance lengths -> tau and its companions (pure, torch-free).

Every number in ``tau.csv`` is computed here, from the per-sample lists the replay
records: ``acceptance[s][k]`` = tokens committed by verify step ``k`` of response ``s``
(accepted drafts ``a`` + the bonus token, so ``1 <= a + 1 <= block_size``; the last
step of a response can be cut shorter by the stop token / ``max_new_tokens``).

Three tau conventions, side by side (they differ only in what is counted and how
responses are weighted; none is "the" right one, but only the first is comparable
with the DFlash paper's tables):

* ``tau`` (macro) -- the reference benchmark's acceptance length: per response the mean
  over its verify steps of ``a + 1``, then the mean over responses; the prefill token is
  not counted (z-lab/dflash ``dflash/benchmark.py``, ``_print_decode_summary``:
  ``np.mean([np.mean(r) ...])``).
* ``tau_tokens_per_step`` (micro) -- committed tokens / verify steps pooled over all
  responses: long responses weigh more. It is vLLM's ``1 + accepted / drafts`` pooled
  metric (vllm-project/vllm PR #17908) restricted to one (checkpoint, prompt set).
* ``tau_sglang`` -- per response ``completion tokens / verify steps`` where the completion
  tokens **include the prefill token** (so it exceeds the response's ``tau`` by
  ``1 / steps``), then the mean over responses: SGLang's per-request
  ``meta_info["spec_accept_length"] = completion_tokens / spec_verify_ct``
  (sgl-project/sglang ``python/sglang/srt/managers/tokenizer_manager.py``,
  ``_calculate_spec_decoding_metrics``), averaged over requests as the z-lab benchmark's
  server mode does.

Companions:

* ``histogram[k]`` -- verify steps that committed exactly ``k`` tokens, ``k = 1..B``.
* ``slot_acceptance[k]`` -- per-slot conditional acceptance
  ``P(draft slot k accepted | slots 1..k-1 accepted)``, ``k = 1..B-1``, pooled over all
  verify steps (the per-position acceptance that vLLM reports as
  ``num_accepted_tokens_per_pos / num_drafts``, made conditional). A step that committed
  ``n`` tokens accepted slots ``1..n-1``; slot ``n`` counts as a rejection only when it was
  actually compared and refused: ``n <= B - 1`` and ``n < left``, with ``left = n_tokens - 1
  - pos`` the tokens still to commit and ``pos`` the step's anchor index in the completion.
  Otherwise the block was full (``n = B``) or the response ended inside it, and slot ``n``
  is censored (neither accepted nor rejected). The shortened last block at
  ``max_new_tokens`` needs no special case: its verify size is at least ``left + 1``.
* ``position_tau[bin]`` -- tokens per verify step (micro) over the steps whose anchor lies
  in that bin of completion positions (``pos``, 0 = the prefill token); bins
  :data:`POSITION_BINS`. Shows whether acceptance decays along long responses.
* ``prompt_tau[bin]`` -- ``tau`` (macro, as above) over the responses whose prompt length
  (templated prompt tokens) lies in that bin of :data:`PROMPT_BINS`, with ``prompt_samples[bin]``
  responses; shows whether acceptance falls with the context length. Empty (NaN / 0) when the
  prompt lengths are not given. The bins are by prompt length at request start with power-of-two
  edges, as vllm-project/speculators PR #1107 (``scripts/evaluate/rebin.py``) bins its results.
* ``tau_se`` / ``prompt_se[bin]`` -- the standard error of ``tau`` (of ``prompt_tau[bin]``) over
  prompts: the sample standard deviation (``n - 1`` in the denominator) of the per-response taus
  divided by ``sqrt(n)``; NaN for ``n < 2``. It assumes the prompts are i.i.d. draws from the set's
  population and takes each response's tau as one observation (the verify steps of a response are
  not independent, so they are not counted separately). At T > 0 it is the same over the
  per-response expected taus ``E[tau_r]``: the spread over prompts, not the sampling noise of the
  speculative sampler, which the expectation removes.

DFlash 2 drafters also get :func:`selector_stats` (top-K recall per slot, the oracle accepted
length of a perfect selector on the same candidates, the selector's pick rate).

Responses with no verify step (the prefill token ended them: an eos right away, or
``max_new_tokens == 1``) have no tau; they are counted in ``n_skipped`` and left out of
every mean.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Sequence

#: completion-position bin edges for :attr:`AcceptanceStats.position_tau` (last bin open-ended)
POSITION_BINS = (0, 64, 128, 256, 512, 1024, 2048, 4096)
#: prompt-length bin edges (templated prompt tokens) for :attr:`AcceptanceStats.prompt_tau` (last open-ended)
PROMPT_BINS = (0, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def position_bin_labels(edges: Sequence[int] = POSITION_BINS) -> list[str]:
    """Bin labels ``"0-64", "64-128", ..., "4096-inf"`` in order (also the suffix of the tau.csv columns);
    ``edges``: :data:`POSITION_BINS` (default) or :data:`PROMPT_BINS`."""
    edges = list(edges) + [None]
    return [f"{lo}-{hi if hi is not None else 'inf'}" for lo, hi in zip(edges[:-1], edges[1:])]


def ulp_at(x: float, eps: float) -> float:
    """The unit in the last place at ``|x|`` of a float format whose machine epsilon is ``eps``:
    ``eps * 2**floor(log2 |x|)`` (``eps`` at 0). Units: those of ``x`` (logits here). bfloat16: ``eps = 2**-7``
    (``torch.finfo(torch.bfloat16).eps``), so ``ulp_at(16.0, 2**-7) == 0.125``. The replay's flipped-decision
    check and the engine's near-tie check both measure logit gaps in these units."""
    return eps * 2.0 ** math.floor(math.log2(abs(x))) if x else eps


@dataclass(frozen=True)
class AcceptanceStats:
    """Aggregate of one (checkpoint, prompt set) replay; see the module docstring for each convention."""

    tau: float  #: macro: mean over responses of the per-response mean of a+1 (NaN when n_samples == 0)
    tau_tokens_per_step: float  #: micro: committed tokens / verify steps (NaN when no step)
    tau_sglang: float  #: mean over responses of (completion tokens incl. the prefill token) / verify steps
    n_samples: int  #: responses with at least one verify step
    n_skipped: int  #: responses with no verify step
    verify_steps: int  #: total verify steps (= target forwards after prefill)
    committed_tokens: int  #: total tokens committed by verify steps
    histogram: dict[int, int]  #: k -> verify steps that committed k tokens, k = 1..block_size
    slot_acceptance: dict[int, float]  #: k -> P(slot k accepted | slots < k accepted), k = 1..B-1 (NaN: never compared)
    slot_compared: dict[int, int]  #: k -> verify steps in which slot k was compared (the denominator above)
    position_tau: dict[str, float]  #: position bin label -> tokens per verify step of steps anchored there (NaN: none)
    position_steps: dict[str, int]  #: position bin label -> verify steps anchored in that bin
    prompt_tau: dict[str, float]  #: prompt-length bin label -> tau of the responses in it (NaN: none)
    prompt_samples: dict[str, int]  #: prompt-length bin label -> responses (with a verify step) in it
    tau_se: float  #: standard error of ``tau`` over prompts (:func:`standard_error`; NaN for n < 2)
    prompt_se: dict[str, float]  #: prompt-length bin label -> standard error of ``prompt_tau[bin]`` (NaN: n < 2)

    def as_dict(self) -> dict:
        """JSON-ready dict (integer keys as strings; NaN as None)."""
        d = asdict(self)
        for key in ("histogram", "slot_acceptance", "slot_compared"):
            d[key] = {str(k): v for k, v in d[key].items()}
        return _nan_to_none(d)


def _nan_to_none(x):
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _nan_to_none(v) for k, v in x.items()}
    return x


def sample_tau(lengths: Sequence[int]) -> float:
    """Mean tokens per verify step of one response (NaN for a response without a verify step)."""
    return sum(lengths) / len(lengths) if len(lengths) else math.nan


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of ``values`` (one tau per response): sample sd (``n - 1``) / sqrt(n).

    Returns NaN for fewer than 2 values. Assumes the values are i.i.d. (prompts drawn independently from one
    population); see the module docstring.
    """
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else math.nan


def _bin_index(pos: int, edges: Sequence[int] = POSITION_BINS) -> int:
    i = 0
    while i + 1 < len(edges) and pos >= edges[i + 1]:
        i += 1
    return i


def aggregate(acceptance: Sequence[Sequence[int]], block_size: int,
              prompt_lens: Sequence[int] | None = None) -> AcceptanceStats:
    """Aggregate per-response acceptance lengths.

    Args:
        acceptance: one list per response; entry ``k`` = tokens committed by verify step ``k``
            (``a + 1``, an int in ``1..block_size``). Every completion token after the prefill
            token is committed by exactly one step, so a response has ``1 + sum(lengths)``
            completion tokens.
        block_size: B, the largest possible entry (size of the histogram).
        prompt_lens: each response's prompt length in tokens (for ``prompt_tau``); None = unknown.

    Returns:
        :class:`AcceptanceStats`.

    Raises:
        ValueError: an entry outside ``1..block_size`` (a replay bug, never user input).
    """
    B = block_size
    hist = {k: 0 for k in range(1, B + 1)}
    accepted = [0] * B  # index k = slot k (0 unused)
    compared = [0] * B
    labels = position_bin_labels()
    bin_tokens = [0] * len(labels)
    bin_steps = [0] * len(labels)
    per_response, per_response_sglang = [], []
    prompt_labels = position_bin_labels(PROMPT_BINS)
    prompt_taus: list[list[float]] = [[] for _ in prompt_labels]
    if prompt_lens is not None and len(prompt_lens) != len(acceptance):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(acceptance)} responses")
    steps = tokens = skipped = 0
    for r, lengths in enumerate(acceptance):
        if not len(lengths):
            skipped += 1
            continue
        if prompt_lens is not None:
            prompt_taus[_bin_index(int(prompt_lens[r]), PROMPT_BINS)].append(sample_tau(lengths))
        n_tokens = 1 + sum(lengths)
        pos = 0  # completion index of the step's anchor (0 = the prefill token)
        for n in lengths:
            if n not in hist:
                raise ValueError(f"acceptance length {n} outside 1..{B}")
            hist[n] += 1
            b = _bin_index(pos)
            bin_tokens[b] += n
            bin_steps[b] += 1
            for k in range(1, n):
                accepted[k] += 1
                compared[k] += 1
            if n <= B - 1 and n < n_tokens - 1 - pos:
                compared[n] += 1  # slot n was compared and refused
            pos += n
        per_response.append(sample_tau(lengths))
        per_response_sglang.append(n_tokens / len(lengths))
        steps += len(lengths)
        tokens += sum(lengths)
    return AcceptanceStats(
        tau=sum(per_response) / len(per_response) if per_response else math.nan,
        tau_tokens_per_step=tokens / steps if steps else math.nan,
        tau_sglang=sum(per_response_sglang) / len(per_response_sglang) if per_response_sglang else math.nan,
        n_samples=len(per_response),
        n_skipped=skipped,
        verify_steps=steps,
        committed_tokens=tokens,
        histogram=hist,
        **_rate_fields(B, accepted, compared, labels, bin_tokens, bin_steps, prompt_labels, prompt_taus, per_response),
    )


def _rate_fields(B, accepted, compared, labels, bin_tokens, bin_steps, prompt_labels, prompt_taus,
                 per_response) -> dict:
    """The per-slot, per-position and per-prompt-length fields of :class:`AcceptanceStats` from their sums, the
    per-bin lists of per-response taus and every response's tau (for the standard errors); shared by
    :func:`aggregate` and :func:`aggregate_expected`; NaN where nothing was counted."""
    return dict(
        slot_acceptance={k: accepted[k] / compared[k] if compared[k] else math.nan for k in range(1, B)},
        slot_compared={k: compared[k] for k in range(1, B)},
        position_tau={lab: bin_tokens[i] / bin_steps[i] if bin_steps[i] else math.nan for i, lab in enumerate(labels)},
        position_steps={lab: bin_steps[i] for i, lab in enumerate(labels)},
        prompt_tau={lab: sum(prompt_taus[i]) / len(prompt_taus[i]) if prompt_taus[i] else math.nan
                    for i, lab in enumerate(prompt_labels)},
        prompt_samples={lab: len(prompt_taus[i]) for i, lab in enumerate(prompt_labels)},
        tau_se=standard_error(per_response),
        prompt_se={lab: standard_error(prompt_taus[i]) for i, lab in enumerate(prompt_labels)},
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


def aggregate_expected(responses: Sequence, block_size: int, prompt_lens: Sequence[int] | None = None) -> AcceptanceStats:
    """Aggregate expected acceptance at T > 0 (:func:`dflash_eval.replay.expected.response_expectations`).

    The same fields and pooling as :func:`aggregate`, every count an expected value (float):
    ``tau`` is the mean over responses of ``E[tau_r]`` (exact: the expectation of the reference's
    macro estimator on these trajectories); ``tau_sglang`` likewise; ``tau_tokens_per_step``,
    ``slot_acceptance`` and ``position_tau`` are ratios of pooled expectations (``sum n_r / sum E[N_r]``
    etc.), not expectations of the pooled ratios, which differ by a term of order ``1 / sum E[N_r]``.

    Args:
        responses: one :class:`~dflash_eval.replay.expected.ResponseExpectation` per response, ``None`` for a
            response without a verify step.
        block_size: B.
        prompt_lens: each response's prompt length in tokens (for ``prompt_tau``); None = unknown.
    """
    B = block_size
    prompt_labels = position_bin_labels(PROMPT_BINS)
    prompt_taus: list[list[float]] = [[] for _ in prompt_labels]
    if prompt_lens is not None:
        if len(prompt_lens) != len(responses):
            raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(responses)} responses")
        for r, n in zip(responses, prompt_lens):
            if r is not None:
                prompt_taus[_bin_index(int(n), PROMPT_BINS)].append(r.tau)
    live = [r for r in responses if r is not None]
    labels = position_bin_labels()
    hist = {k: 0.0 for k in range(1, B + 1)}
    acc, comp = [0.0] * B, [0.0] * B
    bin_tokens, bin_steps = [0.0] * len(labels), [0.0] * len(labels)
    steps = 0.0
    tokens = 0
    for r in live:
        for k in range(1, B + 1):
            hist[k] += float(r.histogram[k])
        for k in range(1, B):
            acc[k] += r.slot_accepted[k]
            comp[k] += r.slot_compared[k]
        for i in range(len(labels)):
            bin_tokens[i] += r.bin_tokens[i]
            bin_steps[i] += r.bin_steps[i]
        steps += r.steps
        tokens += r.committed
    return AcceptanceStats(
        tau=sum(r.tau for r in live) / len(live) if live else math.nan,
        tau_tokens_per_step=tokens / steps if steps else math.nan,
        tau_sglang=sum(r.tau_sglang for r in live) / len(live) if live else math.nan,
        n_samples=len(live),
        n_skipped=len(responses) - len(live),
        verify_steps=steps,
        committed_tokens=tokens,
        histogram=hist,
        **_rate_fields(B, acc, comp, labels, bin_tokens, bin_steps, prompt_labels, prompt_taus, [r.tau for r in live]),
    )


@dataclass(frozen=True)
class SelectorStep:
    """One DFlash 2 verify step as the selector diagnostics need it (:func:`selector_stats`).

    ``accepted``: drafts of the selector's path accepted (``a``); ``oracle``: the longest prefix
    of slots ``1..limit`` whose target token is among the slot's candidates (what a perfect
    selector could have accepted from the same candidates, so ``accepted <= oracle``); ``limit``:
    the slots that could be verified; ``in_candidates[j-1]``: slot ``j``'s target token is among
    its candidates, ``j = 1..limit``.
    """

    accepted: int
    oracle: int
    limit: int
    in_candidates: tuple[bool, ...]


@dataclass(frozen=True)
class SelectorStats:
    """DFlash 2 candidate-selector diagnostics of one (checkpoint, prompt set), over the verify steps of
    the selector's own chain; they say whether the candidates or the selector hold tau back.

    * ``topk_recall[j]`` -- P(slot j's target token is among its top-K candidates), over the steps
      whose slot ``j`` could be verified (``recall_compared[j]`` of them), unconditional on the
      earlier slots (the candidates do not depend on the selector's picks).
    * ``oracle_accepted`` / ``accepted`` -- mean accepted drafts per step of a perfect selector
      choosing from the same candidates, and of the checkpoint's selector.
    * ``pick_rate[j]`` -- P(the selector picks slot j's target token | it picked the target tokens
      of slots < j, and slot j's target token is among the candidates): the selector's own error,
      with the candidates' misses taken out; ``pick_compared[j]`` such slots. ``pick_rate_all``
      pools every slot: ``sum a / sum min(a + 1, oracle)``.
    * ``oracle_path_rate`` -- the share of steps in which the selector accepted the whole oracle
      prefix (``a == oracle``).

    Per-slot dicts have keys ``1..B-1``; NaN where nothing was compared. The tau a perfect selector
    would reach on its own trajectory is ``tau_oracle`` (an :func:`aggregate` of the oracle chain).
    """

    steps: int
    accepted: float
    oracle_accepted: float
    pick_rate_all: float
    oracle_path_rate: float
    topk_recall: dict[int, float]
    recall_compared: dict[int, int]
    pick_rate: dict[int, float]
    pick_compared: dict[int, int]

    def as_dict(self) -> dict:
        """JSON-ready dict (integer keys as strings; NaN as None)."""
        d = asdict(self)
        for key in ("topk_recall", "recall_compared", "pick_rate", "pick_compared"):
            d[key] = {str(k): v for k, v in d[key].items()}
        return _nan_to_none(d)


def selector_stats(steps: Sequence[SelectorStep], block_size: int) -> SelectorStats:
    """Aggregate DFlash 2 selector diagnostics over verify steps (:class:`SelectorStats`).

    Raises:
        ValueError: a step with ``accepted > oracle``, ``oracle > limit``, an ``in_candidates`` of
            another length than ``limit``, or an ``oracle`` that is not its leading run of True
            (a replay bug, never user input).
    """
    B = block_size
    recall_hit, recall_n = [0] * B, [0] * B
    pick_hit, pick_n = [0] * B, [0] * B
    acc = orc = opportunities = full = 0
    for s in steps:
        lead = next((i for i, hit in enumerate(s.in_candidates) if not hit), len(s.in_candidates))
        if not (0 <= s.accepted <= s.oracle <= s.limit < B and len(s.in_candidates) == s.limit and lead == s.oracle):
            raise ValueError(f"inconsistent selector step {s}")
        for j, hit in enumerate(s.in_candidates, start=1):
            recall_n[j] += 1
            recall_hit[j] += hit
        for j in range(1, min(s.accepted + 1, s.oracle) + 1):  # slots where the oracle path was open to the pick
            pick_n[j] += 1
            pick_hit[j] += j <= s.accepted
        acc += s.accepted
        orc += s.oracle
        opportunities += min(s.accepted + 1, s.oracle)
        full += s.accepted == s.oracle
    n = len(steps)
    return SelectorStats(
        steps=n,
        accepted=acc / n if n else math.nan,
        oracle_accepted=orc / n if n else math.nan,
        pick_rate_all=acc / opportunities if opportunities else math.nan,
        oracle_path_rate=full / n if n else math.nan,
        topk_recall={j: recall_hit[j] / recall_n[j] if recall_n[j] else math.nan for j in range(1, B)},
        recall_compared={j: recall_n[j] for j in range(1, B)},
        pick_rate={j: pick_hit[j] / pick_n[j] if pick_n[j] else math.nan for j in range(1, B)},
        pick_compared={j: pick_n[j] for j in range(1, B)},
    )
