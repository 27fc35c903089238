"""Expected acceptance from the all-anchor pass (:mod:`dflash_eval.expected`) and its aggregate.

Exact cases: at 0/1 acceptance probabilities the expected aggregate equals the greedy aggregate field
for field; DDTree's survival under one-hot target p equals the greedy tree walk's accepted depth, and
under a spread p equals brute-force path sums and a seeded Monte Carlo of the reference's sampled
tree walk (``follow_verified_tree`` with sampled posteriors).
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_eval.ddtree import accepted_depths, build_tree
from dflash_eval.expected import response_expectations, target_slot_probs, tree_survival
from dflash_eval.metrics import aggregate, aggregate_expected
from dflash_eval.replay import chain_walk


def test_target_slot_probs_indexing():
    win = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)  # window rows = positions a0+1 .. a0+7
    v = target_slot_probs(win, rows=4, slots=3)
    assert v.shape == (4, 3, 2)
    for r in range(4):
        for j in range(3):
            assert torch.equal(v[r, j], win[r + j])


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
    got = aggregate_expected(exp + [None], B).as_dict()
    want = aggregate(greedy + [[]], B).as_dict()
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-12, nan_ok=True), key


def _tree_inputs(g, n, J, K, V):
    logits = torch.randn(n, J, V, generator=g) * 2
    logp, ids = torch.topk(logits.log_softmax(-1), K, dim=-1)
    return logp, ids


def test_tree_survival_one_hot_p_is_the_greedy_tree_walk():
    g = torch.Generator().manual_seed(1)
    n, J, K, V = 12, 4, 8, 10
    logp, ids = _tree_inputs(g, n, J, K, V)
    cont = ids[:, :, 0].clone()  # continuation = mostly the drafter's favourites, sometimes another token
    flip = torch.rand(n, J, generator=g) < 0.3
    cont[flip] = ids[:, :, 1][flip]
    cont[torch.rand(n, J, generator=g) < 0.1] = V + 1  # not in any top-K
    p_top = (ids == cont[..., None]).double()
    vs = torch.full((n,), J + 1)
    limit = torch.full((n,), J)
    budgets = [1, 3, 8, 40]
    S = tree_survival(logp, p_top, vs, limit, budgets)
    for t in range(n):
        depths = accepted_depths(logp[t], ids[t], cont[t].tolist(), budgets)
        for b, d in zip(budgets, depths):
            assert S[b][t].tolist() == [1.0] * (d + 1) + [0.0] * (J - d), (t, b)


def test_tree_survival_under_sampling_brute_force_and_reference_walk():
    g = torch.Generator().manual_seed(2)
    J, K, V = 3, 4, 6
    logp, ids = _tree_inputs(g, 1, J, K, V)
    p = torch.softmax(torch.randn(J, V, generator=g), -1)  # target p at depths 1..J (teacher forced)
    p_top = p.gather(-1, ids[0])[None].double()
    budgets = [2, 5, 12]
    S = tree_survival(logp, p_top, torch.tensor([J + 1]), torch.tensor([J]), budgets)
    for b in budgets:
        tree = build_tree(logp[0], ids[0], b)
        want = [1.0] + [0.0] * J
        for i in range(1, len(tree) + 1):  # reach probability of node i = product of p along its path
            w, node = 1.0, i
            while node:
                w *= float(p[tree.depths[node - 1] - 1, tree.tokens[node - 1]])
                node = tree.parents[node]
            want[tree.depths[i - 1]] += w
        assert S[b][0].tolist() == pytest.approx(want, rel=1e-12)
        # the reference's sampled walk: sample the target's token at each node, follow the child holding it
        draws = 20000
        tok = torch.multinomial(p, draws, replacement=True, generator=g).T.tolist()  # [draws, J]
        depth = []
        for row in tok:
            node, d = 0, 0
            while d < J and row[d] in tree.children[node]:
                node = tree.children[node][row[d]]
                d += 1
            depth.append(d)
        depth = torch.tensor(depth, dtype=torch.float64)
        se = float(depth.std() / math.sqrt(draws))
        exact = float(S[b][0, 1:].sum())
        assert abs(float(depth.mean()) - exact) <= 3 * se, (b, float(depth.mean()), exact, se)
    assert float(S[12][0, 1:].sum()) > float(S[2][0, 1:].sum())  # a bigger tree accepts more
