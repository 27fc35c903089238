"""Expected acceptance from the all-anchor pass (:mod:`dflash_eval.expected`) and its aggregate.

Exact cases: the target's token probabilities equal the dense filter at the cached tokens; at 0/1
acceptance probabilities the expected aggregate equals the greedy aggregate field for field.
"""

from __future__ import annotations

import pytest
import torch

from dflash_eval.expected import response_expectations, target_token_probs
from dflash_eval.metrics import aggregate, aggregate_expected
from dflash_eval.anchors import chain_walk
from dflash_eval.sampling import SamplingSetting, filtered_probs


def test_target_token_probs_are_the_filter_at_the_cached_tokens():
    g = torch.Generator().manual_seed(3)
    T, H, V = 9, 6, 11
    final = torch.randn(T, H, generator=g)
    head = torch.randn(V, H, generator=g) * 2
    ids = torch.randint(0, V, (T,), generator=g)
    settings = [SamplingSetting(), SamplingSetting(1.0, 0.9, 4)]
    got = target_token_probs(final, head, ids, settings)
    logits = final @ head.T
    for s in settings:
        want = filtered_probs(logits[:-1], s.temperature, s.top_p, s.top_k).gather(-1, ids[1:, None])[:, 0]
        assert torch.equal(got[s.label][1:], want) and got[s.label][0] == 1


def test_zero_one_expectation_equals_the_greedy_aggregate():
    """Survival 1 up to a(t) and 0 after: every expected field equals the greedy one."""
    g = torch.Generator().manual_seed(0)
    B = 5
    survivals, Ps, Ts, greedy = [], [], [], []
    for P, T, M in [(3, 40, 37), (5, 9, 4), (2, 200, 300), (4, 6, 2)]:  # M = max_new_tokens
        n = T - 1 - P
        t = torch.arange(P, T - 1)
        vs = torch.clamp(P + M - t, max=B)
        limit = torch.minimum(vs - 1, T - 1 - t)
        a = torch.minimum(torch.randint(0, B, (n,), generator=g), limit)
        S = (torch.arange(B)[None] <= a[:, None]).double()
        survivals.append(S)
        Ps.append(P)
        Ts.append(T)
        greedy.append(chain_walk(a.tolist(), P, T))
    exp = response_expectations(survivals, Ps, Ts, B)
    got = aggregate_expected(exp + [None], B, Ps + [3]).as_dict()
    want = aggregate(greedy + [[]], B, Ps + [3]).as_dict()
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12, nan_ok=True), key
