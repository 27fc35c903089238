"""The walk of verify steps along one cached response, and the expected tau of the reference's estimator.

tau per response as the reference estimator sees it (``dflash/benchmark.py``: mean over the response's
verify steps of the committed count, then the mean over responses). The steps of a response commit
``T - 1 - P`` tokens in all, so its tau is ``(T - 1 - P) / N``, with N its number of steps, a random
variable. :func:`walk_expectations` computes ``E[(T - 1 - P) / N]`` exactly by dynamic programming
over (position, steps): it tracks the distribution over anchors after s steps, each anchor t moving to
``t + d`` with ``P_t(produced = d)``, and the mass reaching ``T - 1`` at step s is ``P(N = s)``.
:func:`mc_walks` is the seeded Monte Carlo of the same walk.

Per anchor t the input is ``S[t, k] = P(a(t) >= k)`` (:mod:`dflash_eval.replay.sampling`: given the trajectory,
or teacher-forced); :func:`produced_probs` turns it into the step's committed-count distribution with the
cuts of :mod:`dflash_eval.replay.chain`. Probabilities and the DP are float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def produced_probs(survival: torch.Tensor, left: torch.Tensor, block_size: int) -> torch.Tensor:
    """``P(produced = d)``, ``d = 0..B``, of a step that commits ``min(a + 1, left)`` tokens.

    Args:
        survival: ``[n, J + 1]`` ``P(a >= k)`` with ``J <= B - 1`` (0 beyond the step's limit, ``<= left``).
        left: ``[n]`` int64 >= 1, tokens still to commit (``T - 1 - t``).
        block_size: B.

    Returns:
        ``[n, B + 1]`` float64 (column 0 is 0): ``P(a = d - 1)`` for ``d < left`` and ``P(a >= left - 1)`` at
        ``d = left``.
    """
    n, J1 = survival.shape
    S = torch.zeros((n, block_size + 1), dtype=torch.float64, device=survival.device)
    S[:, :J1] = survival.double().clamp(0.0, 1.0).cummin(-1).values  # rounding never makes P(a = k) < 0
    pa = S[:, :-1] - S[:, 1:]  # P(a = k), k = 0..B-1
    out = torch.zeros_like(S)
    d = torch.arange(1, block_size + 1, device=S.device)[None]
    out[:, 1:] = torch.where(d < left[:, None], pa, 0.0)
    last = left.clamp(max=block_size)
    out[torch.arange(n, device=S.device), last] = S.gather(1, (last - 1)[:, None])[:, 0]
    return out


# ----------------------------------------------------------------------------- the walk along a response

@dataclass
class WalkExpectation:
    """Expectations of one response's verify-step walk (:func:`walk_expectations`).

    Attributes:
        tau: ``E[(T - 1 - P) / N]``, the expected per-response tau of the reference estimator.
        tau_sglang: ``E[(T - P) / N]`` (the prefill token counted, :mod:`dflash_eval.replay.metrics`).
        steps: ``E[N]``, expected verify steps.
        steps_probs: ``[s_max + 1]`` float64, ``P(N = s)``.
        visit: ``[n]`` float64, P(anchor ``P + i`` starts a verify step).
        histogram: ``[B + 1]`` float64, expected steps committing d tokens (index d; 0 unused).
        residual_mass: probability still walking when the DP stopped (0 for the exact DP).
    """

    tau: float
    tau_sglang: float
    steps: float
    steps_probs: torch.Tensor
    visit: torch.Tensor
    histogram: torch.Tensor
    residual_mass: float = 0.0


def walk_expectations(produced: list[torch.Tensor], tol: float = 0.0) -> list[WalkExpectation]:
    """Expected tau of several responses by dynamic programming over (position, steps), side by side.

    The state after s steps is the distribution over anchors ``i = t - P`` (``n = T - 1 - P`` is the
    end); a step moves the mass at ``i`` to ``i + d`` with ``P_i(produced = d)``; the mass reaching ``n``
    at step s is ``P(N = s)``, so ``E[tau] = sum_s P(N = s) * n / s`` -- the reference's per-response
    mean of the committed counts, whose sum is always n.

    Args:
        produced: per response ``[n, B + 1]`` ``P(produced = d)`` per anchor (:func:`produced_probs`),
            ``n >= 1``; every row sums to 1 and never steps past the end.
        tol: stop when at most ``tol`` of each response's mass is still walking (0 = until all of it is
            absorbed, at most ``max n`` steps: exact). The neglected part of ``tau`` is at most ``tol * n``.

    Returns:
        one :class:`WalkExpectation` per response. ``O(steps * sum n * B)`` work in one
        ``scatter_add`` per step; with 0/1 probabilities (temperature 0) ``tau`` equals the greedy walk's
        ``sum / len`` exactly.

    Raises:
        ValueError: a response with ``n < 1`` (no verify step: the prefill token ended it).
    """
    if not produced:
        return []
    ns = [int(p.shape[0]) for p in produced]
    if min(ns) < 1:
        raise ValueError("a response without a verify step has no walk")
    B1 = produced[0].shape[1]
    dev = produced[0].device
    S, m = len(ns), max(ns)
    P = torch.zeros((S, m, B1), dtype=torch.float64, device=dev)
    for r, p in enumerate(produced):
        P[r, : ns[r]] = p.double()
    end = torch.tensor(ns, device=dev)
    rows = torch.arange(S, device=dev)
    step = torch.arange(1, B1, device=dev)[None]
    live = torch.zeros((S, m + B1), dtype=torch.float64, device=dev)  # B extra columns: steps past a window
    live[:, 0] = 1.0
    live_mask = torch.arange(m + B1, device=dev)[None] < end[:, None]
    visit = torch.zeros((S, m), dtype=torch.float64, device=dev)
    absorbed = [torch.zeros(S, dtype=torch.float64, device=dev)]
    lo, hi = 0, 1  # the mass still walking lies in columns [lo, hi)
    while float(live[:, lo:hi].sum(-1).max()) > tol:
        w = live[:, lo:hi]
        visit[:, lo:hi] += w
        idx = ((torch.arange(lo, hi, device=dev)[:, None] + step) - lo).reshape(1, -1).expand(S, -1)
        moved = torch.zeros((S, hi - lo + B1), dtype=torch.float64, device=dev)
        moved.scatter_add_(1, idx, (w[:, :, None] * P[:, lo:hi, 1:]).reshape(S, -1))
        live[:, lo:hi] = 0.0
        live[:, lo : hi + B1] += moved
        absorbed.append(live[rows, end])
        live *= live_mask
        nz = torch.nonzero(live[:, : m + 1].any(0)).flatten()
        if nz.numel() == 0:
            break
        lo, hi = int(nz[0]), int(nz[-1]) + 1
    pN = torch.stack(absorbed, dim=1).cpu()  # [S, steps + 1]
    s = torch.arange(pN.shape[1], dtype=torch.float64)
    hist = (visit[:, :, None] * P).sum(1).cpu()
    left = live[:, lo:hi].sum(-1).cpu()
    out = []
    for r, n in enumerate(ns):
        probs = pN[r]
        nz = torch.nonzero(probs > 0).flatten().tolist()
        out.append(WalkExpectation(
            tau=math.fsum(float(probs[k]) * (n / k) for k in nz),
            tau_sglang=math.fsum(float(probs[k]) * ((n + 1) / k) for k in nz),
            steps=float((probs * s).sum()), steps_probs=probs, visit=visit[r, :n].cpu(), histogram=hist[r],
            residual_mass=float(left[r])))
    return out


def walk_expectation(produced: torch.Tensor, tol: float = 0.0) -> WalkExpectation:
    """:func:`walk_expectations` of one response (``produced`` ``[n, B + 1]``)."""
    return walk_expectations([produced], tol)[0]


@dataclass(frozen=True)
class MCEstimate:
    """A seeded Monte Carlo mean with its standard error (``std / sqrt(draws)``, sample std)."""

    mean: float
    se: float
    draws: int


def _estimate(x: torch.Tensor) -> MCEstimate:
    x = x.double()
    se = float(x.std(unbiased=True) / math.sqrt(len(x))) if len(x) > 1 else math.nan
    return MCEstimate(float(x.mean()), se, len(x))


def mc_walks(produced: torch.Tensor, walks: int, seed: int = 0) -> tuple[MCEstimate, torch.Tensor]:
    """Seeded Monte Carlo of :func:`walk_expectation`: ``walks`` independent walks of one response.

    Args:
        produced: ``[n, B + 1]`` as in :func:`walk_expectation`. walks: number of walks. seed: RNG seed.

    Returns:
        ``(estimate of E[(T - 1 - P) / N], N per walk [walks] int64)``.
    """
    n = produced.shape[0]
    g = torch.Generator().manual_seed(seed)
    pos = torch.zeros(walks, dtype=torch.long)
    N = torch.zeros(walks, dtype=torch.long)
    P = produced.double().cpu()
    while True:
        live = torch.nonzero(pos < n).flatten()
        if live.numel() == 0:
            break
        d = torch.multinomial(P[pos[live]], 1, generator=g)[:, 0]
        pos[live] += d
        N[live] += 1
    return _estimate(n / N.double()), N
