"""DDTree: tree construction against the spec (B best prefixes, reference tie order), acceptance on
hand-built trees, nesting over budgets, per-budget trajectories, and spine vs bushy drafts."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from dflash_eval.replay.ddtree import accepted_depths, build_tree, chain_from_greedy, replay_with_trees, walk_budgets


def brute_force_order(lp, K, L):
    """Every prefix of the top-K lattice (rank paths) sorted by (-score, rank path): the spec's order."""
    paths = [p for d in range(1, L + 1) for p in itertools.product(range(K), repeat=d)]
    return sorted(paths, key=lambda p: (-sum(lp[i][r] for i, r in enumerate(p)), p))


def rank_paths(tree):
    paths = [()]
    for i in range(len(tree)):
        paths.append(paths[tree.parents[i + 1]] + (tree.ranks[i],))
    return paths[1:]


def test_hand_built_tree_with_ties():
    # depth 1: A=10, B=11 tied at -1; depth 2: C=20 (-1), D=21 (-2); depth 3: E=30 (-1), F=31 (-3)
    lp = [[-1.0, -1.0], [-1.0, -2.0], [-1.0, -3.0]]
    ids = [[10, 11], [20, 21], [30, 31]]
    tree = build_tree(lp, ids, budget=8)
    # scores -1: A, B; -2: AC, BC; -3 in rank-path order: ACE (0,0,0), AD (0,1), BCE (1,0,0), BD (1,1)
    assert rank_paths(tree) == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (0, 1), (1, 0, 0), (1, 1)]
    assert tree.tokens == [10, 11, 20, 20, 30, 21, 30, 21]
    assert tree.parents == [-1, 0, 0, 1, 2, 3, 1, 4, 2]
    assert tree.depths == [1, 1, 2, 2, 3, 2, 3, 2]
    # continuation B, D: BD is the 8th pop
    assert accepted_depths(lp, ids, [11, 21, 30], budgets=[1, 2, 7, 8]) == [0, 1, 1, 2]
    # continuation A, C, E: ACE is the 5th pop
    assert accepted_depths(lp, ids, [10, 20, 30], budgets=[1, 2, 3, 4, 5]) == [1, 1, 2, 2, 3]
    # a first token outside the tree accepts nothing; the depth limit caps acceptance
    assert accepted_depths(lp, ids, [12, 20, 30], budgets=[8]) == [0]
    assert accepted_depths(lp, ids, [10, 20, 30], budgets=[8], depth_limit=2) == [2]
    # the walk over the verified rows agrees (posterior of a node = the continuation token after it)
    posterior = [[10, 20, 30, 99][d] for d in [0] + tree.depths]
    assert tree.follow(posterior) == ([0, 1, 3, 5], 99)


def test_visibility_is_ancestor_or_self():
    lp = [[-1.0, -1.0], [-1.0, -2.0], [-1.0, -3.0]]
    tree = build_tree(lp, [[10, 11], [20, 21], [30, 31]], budget=5)
    vis = tree.visibility()
    for i in range(len(tree) + 1):
        anc, j = {i}, i
        while tree.parents[j] >= 0:
            j = tree.parents[j]
            anc.add(j)
        assert {int(c) for c in torch.nonzero(vis[i]).flatten()} == anc


@pytest.mark.parametrize("seed", range(6))
def test_pop_order_is_the_spec_order_with_ties(seed):
    # dyadic log-probs: every sum is exact, so ties are real ties and the order is checkable
    rng = random.Random(seed)
    K, L = 3, 4
    lp = [sorted((-rng.randint(0, 6) / 4 for _ in range(K)), reverse=True) for _ in range(L)]
    ids = [[100 * d + r for r in range(K)] for d in range(L)]
    want = brute_force_order(lp, K, L)
    for budget in (1, 5, 17, len(want)):
        assert rank_paths(build_tree(lp, ids, budget)) == want[:budget]


@pytest.mark.parametrize("seed", range(4))
def test_nested_in_budget_and_independent_of_k(seed):
    g = torch.Generator().manual_seed(seed)
    L, V = 7, 300
    logp_full = torch.log_softmax(torch.randn(L, V, generator=g) * 2.5, dim=-1)
    lp, ids = torch.topk(logp_full, 256, dim=-1)
    big = build_tree(lp, ids, 256)
    for b in (8, 16, 32, 64, 128):
        small = build_tree(lp, ids, b)
        assert (small.tokens, small.parents) == (big.tokens[:b], big.parents[: b + 1])
        # the reference keeps only K = B candidates per slot; same tree
        lk, ik = torch.topk(logp_full, b, dim=-1)
        assert build_tree(lk, ik, b).tokens == small.tokens
    # probabilities never increase along the pop order
    scores = []
    for i in range(len(big)):
        node, s = i + 1, 0.0
        while node:
            s += float(lp[big.depths[node - 1] - 1, big.ranks[node - 1]])
            node = big.parents[node]
        scores.append(s)
    assert all(a >= b - 1e-5 for a, b in zip(scores, scores[1:]))


@pytest.mark.parametrize("seed", range(4))
def test_accepted_depths_equal_tree_walk(seed):
    """The one-heap early-exit answer for all budgets == building each budget's tree and walking it."""
    g = torch.Generator().manual_seed(seed)
    L, V = 7, 40
    budgets = [1, 2, 3, 8, 16, 32, 64]
    for trial in range(20):
        logits = torch.randn(L, V, generator=g) * 3
        lp, ids = torch.topk(torch.log_softmax(logits, -1), V, dim=-1)  # K = V < max budget
        # continuation: mostly the drafter's top-1/2 tokens so paths go deep
        cont = [int(ids[d, int(torch.randint(0, 3, (1,), generator=g))]) for d in range(L)]
        got = accepted_depths(lp, ids, cont, budgets)
        for b, d in zip(budgets, got):
            tree = build_tree(lp, ids, b)
            posterior = [(cont + [0])[dep] for dep in [0] + tree.depths]
            assert len(tree.follow(posterior)[0]) - 1 == d, (trial, b)


# --------------------------------------------------------------------------- walks over a response


def synthetic_drafts(x, P, B, K, top1_lp, top2_lp, wrong_at=()):
    """Per anchor: slot j's top-1 = the true token x[t+j] (except anchors in ``wrong_at``), top-2 another."""
    n = len(x) - 1 - P
    rest = math.log((1 - math.exp(top1_lp) - math.exp(top2_lp)) / (K - 2))
    lp = torch.full((n, B - 1, K), rest)
    lp[..., 0], lp[..., 1] = top1_lp, top2_lp
    ids = torch.zeros(n, B - 1, K, dtype=torch.long)
    for i in range(n):
        t = P + i
        for j in range(B - 1):
            true = x[t + 1 + j] if t + 1 + j < len(x) else 0
            first = (true + 1) % 50 if t in wrong_at else true
            others = [v for v in range(50) if v != first][: K - 1]
            ids[i, j] = torch.tensor([first] + others)
    return lp, ids


def reference_walk(lp, ids, x, P, max_new, B, budget):
    """Independent per-budget walk: build the tree at each root, verify with the target's greedy tokens."""
    T, t, out = len(x), P, []
    while t < T - 1:
        limit = min(B, P + max_new - t) - 1
        tree = build_tree(lp[t - P], ids[t - P], budget, limit)
        posterior = [(x + [0] * B)[t + 1 + dep] for dep in [0] + tree.depths]
        produced = min(len(tree.follow(posterior)[0]), T - 1 - t)
        out.append(produced)
        t += produced
    return out


def seq(n):
    return [(7 * i + 3) % 50 for i in range(n)]


def test_spine_drafts_tree_equals_chain_from_budget_l():
    # confident drafter, always right: the greedy spine pops first (0.9^7 > 0.05), so DDTree-B accepts
    # min(B, L) per step and equals the chain once B >= L = B-1
    B, P = 8, 5
    x = seq(5 + 40)
    lp, ids = synthetic_drafts(x, P, B, K=16, top1_lp=math.log(0.9), top2_lp=math.log(0.05))
    chain = chain_from_greedy(ids[..., 0], x, P, 100, B)
    walks = walk_budgets(lp, ids, x, P, 100, B, [2, 4, 7, 16])
    assert chain == [8] * 4 + [7]
    assert walks[7] == walks[16] == chain
    assert walks[2] == [3] * 13 and walks[4] == [5] * 7 + [4]


def test_bushy_drafts_accept_less_than_chain_at_small_budget():
    # unsure drafter (top-1 0.5, top-2 0.45), always right at top-1: the depth-1 runner-up (0.45) beats the
    # depth-2 spine (0.25), so DDTree-2 accepts 1 draft per step while the chain accepts 7 (the reference does
    # the same: no spine guarantee); larger budgets recover the spine
    B, P = 8, 5
    x = seq(5 + 40)
    lp, ids = synthetic_drafts(x, P, B, K=16, top1_lp=math.log(0.5), top2_lp=math.log(0.45))
    chain = chain_from_greedy(ids[..., 0], x, P, 100, B)
    walks = walk_budgets(lp, ids, x, P, 100, B, [2, 3, 16, 64])
    assert chain == [8] * 4 + [7]
    assert walks[2] == [2] * 19 + [1]
    assert walks[3] == [3] * 13  # third node: the spine's depth-2 child (0.25 > 0.004 of a depth-1 rank 3)
    for b in (2, 3, 16, 64):
        assert walks[b] == reference_walk(lp, ids, x, P, 100, B, b)
    assert sum(walks[64]) / len(walks[64]) > sum(walks[16]) / len(walks[16]) > 2


def test_each_budget_walks_its_own_anchors():
    # drafts are wrong at some anchors: budgets that commit different lengths reach different anchors
    B, P = 6, 3
    x = seq(3 + 60)
    wrong = set(range(P, len(x), 4))
    lp, ids = synthetic_drafts(x, P, B, K=8, top1_lp=math.log(0.6), top2_lp=math.log(0.3), wrong_at=wrong)
    budgets = [1, 2, 4, 8, 32]
    walks = walk_budgets(lp, ids, x, P, 200, B, budgets)
    for b in budgets:
        assert walks[b] == reference_walk(lp, ids, x, P, 200, B, b), b
        assert sum(walks[b]) == len(x) - 1 - P
    assert len({tuple(w) for w in walks.values()}) >= 3  # the trajectories really differ


def test_length_capped_response_shortens_the_last_blocks():
    # max_new_tokens = 12 -> max_length = P + 12; T = P + 12: the last roots have depth limit max_length - t - 1
    B, P = 8, 4
    x = seq(P + 12)
    lp, ids = synthetic_drafts(x, P, B, K=8, top1_lp=math.log(0.9), top2_lp=math.log(0.05))
    walks = walk_budgets(lp, ids, x, P, 12, B, [64])
    assert walks[64] == [8, 3] == chain_from_greedy(ids[..., 0], x, P, 12, B)


# --------------------------------------------------------------------------- the drafts producer


@pytest.mark.parametrize("layout", ["rows", "packed", "groups"])
@pytest.mark.parametrize("memory_bytes", [1, 10**9])
def test_batched_drafts_give_the_sequential_chain_and_the_trees(layout, memory_bytes):
    """One all-anchor pass with top-K (replay_with_trees): its chain == replay_batch on the replay's hand-built
    cases (whatever the chunking), and its trees == the spec walk on the same per-anchor top-K."""
    from test_replay import OracleDrafter, sample, seq_of

    from dflash_eval.replay.anchors import anchor_drafts
    from dflash_eval.replay.chain import replay_batch

    eye = torch.eye(50)
    cases = [(seq_of(15), 5, 2, 4, 1000), (seq_of(16), 5, 2, 4, 1000), (seq_of(26), 5, 99, 8, 1000),
             (seq_of(12), 5, 99, 4, 7), (seq_of(20), 5, lambda s: {5: 1, 7: 3, 11: 0}.get(s, 2), 4, 1000),
             (seq_of(6), 5, 2, 4, 1000)]  # the prefill token ended the response: no step
    samples = [sample(x, p, max_new) for x, p, _, _, max_new in cases]
    for (x, p, k, B, max_new), s in zip(cases, samples):
        want = replay_batch(OracleDrafter([x], k, B), eye, eye, [s])[0]
        [(chain, trees)] = replay_with_trees(OracleDrafter([x], k, B), eye, eye, [s], [1, 3], B,
                                             memory_bytes=memory_bytes, layout=layout)
        assert chain == want
        d = anchor_drafts(OracleDrafter([x], k, B), eye, eye, s, B, topk=3, memory_bytes=memory_bytes, layout=layout)
        assert d.topk_logp.shape == (max(len(x) - 1 - p, 0), B - 1, 3)
        assert torch.all(d.topk_logp[..., :-1] >= d.topk_logp[..., 1:])
        assert torch.equal(d.topk_ids[..., 0], d.greedy)
        assert chain_from_greedy(d.greedy, x, p, max_new, B) == want
        assert trees == {b: reference_walk(d.topk_logp.tolist(), d.topk_ids.tolist(), x, p, max_new, B, b)
                         for b in (1, 3)}
        # the oracle's top-1 is the continuation for k slots: one drafted node accepts 1 per step where k >= 1
        assert all(1 <= a <= 2 for a in trees[1]) and sum(trees[1]) == sum(want)
    with pytest.raises(ValueError, match="at least one budget"):
        replay_with_trees(OracleDrafter([cases[0][0]], 2, 4), eye, eye, samples[:1], [], 4)
