"""Offline expected tau vs the online speculative sampler, on a bigram target where both are cheap to simulate.

The target is a random bigram model (p(x_m | x_{m-1})), the drafter a fixed noisy function of the anchor
token (DFlash 1: independent slots; DFlash 2: each slot also conditioned on the previous drafted token, as
the candidate selector). Online: seeded runs of the reference's loop (drafts sampled from q, verified by
:func:`dflash_eval.replay.sampling.rejection_sample`, which draws what ``dflash.model._rejection_sample``
draws; the target's p of a slot conditioned on the drafted tokens before it). Offline: trajectories drawn
from the target (as the completions stage draws them), then per trajectory the exact expectation of the
response's tau given the trajectory (per slot ``beta = min(1, q(x)/p(x))`` at the trajectory's token,
the walk DP). Checked: offline == online within 3 standard errors; the teacher-forced ``1 - TV``
expectation (SpecForge's probabilistic tau) is printed beside it.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_eval.replay.sampling import filtered_probs, rejection_sample, slot_alpha, slot_beta, survival_independent
from dflash_eval.replay.walk import produced_probs, walk_expectations

V, B, P, M = 6, 4, 1, 12  # vocabulary, block size, prompt length, max_new_tokens
MAX_LEN = P + M
SETTINGS = [(1.0, 1.0, 0), (0.8, 0.9, 4)]


def _model(seed: int, setting):
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # bigram target logits
    tp = filtered_probs(logp, *setting)  # tp[prev] = target p of the next token
    steps = [torch.softmax(logp, -1)]
    for _ in range(B - 2):
        steps.append(steps[-1] @ torch.softmax(logp, -1))  # j-step marginals from the anchor token
    # DFlash 1: slot j's logits from the anchor token only; DFlash 2: also from the previous drafted token
    d1 = torch.stack([s.log() * 0.8 + 0.6 * torch.randn(V, V, generator=g) for s in steps])  # [J, anchor, V]
    d2 = d1[:, :, None, :] + 1.2 * torch.randn(B - 1, V, V, V, generator=g) * 0.5 + 0.8 * logp[None, None]
    return tp, filtered_probs(d1, *setting), filtered_probs(d2, *setting)  # q1 [J, a, V]; q2 [J, a, prev, V]


def _online(tp, q1, q2, variant: str, runs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    taus = []
    for _ in range(runs):
        x = [0, int(torch.multinomial(tp[0], 1, generator=g))]
        start, steps = P, []
        while start + 1 < MAX_LEN:
            J = min(B, MAX_LEN - start) - 1
            anchor, ys, rows = x[start], [], []
            for j in range(J):
                row = q1[j, anchor] if variant == "dflash1" else q2[j, anchor, ys[-1] if ys else anchor]
                rows.append(row)
                ys.append(int(torch.multinomial(row, 1, generator=g)))
            tprobs = torch.stack([tp[anchor]] + [tp[y] for y in ys])  # p conditioned on the drafted tokens
            a, z = rejection_sample(torch.tensor([ys]), tprobs[None], torch.stack(rows)[None], generator=g)
            new = ys[: int(a)] + [int(z)]
            produced = min(int(a) + 1, MAX_LEN - start - 1)
            x += new[:produced]
            start += produced
            steps.append(produced)
        taus.append(sum(steps) / len(steps))
    return torch.tensor(taus, dtype=torch.float64)


def _offline(tp, q1, q2, variant: str, runs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per drawn trajectory: E[tau | trajectory] (exact) and the teacher-forced 1 - TV expectation."""
    g = torch.Generator().manual_seed(seed)
    post, tv = [], []
    t = torch.arange(P, MAX_LEN - 1)
    vs = torch.clamp(MAX_LEN - t, max=B)
    limit = torch.minimum(vs - 1, MAX_LEN - 1 - t)
    left = MAX_LEN - 1 - t
    for _ in range(runs):
        x = [0]
        while len(x) < MAX_LEN:
            x.append(int(torch.multinomial(tp[x[-1]], 1, generator=g)))
        x = torch.tensor(x)
        pos = (t[:, None] + torch.arange(1, B)[None]).clamp(max=MAX_LEN - 1)  # position of slot j of anchor t
        tok, prev = x[pos], x[pos - 1]
        p_tok = tp[prev, tok]
        if variant == "dflash1":
            q_rows = q1[torch.arange(B - 1)[None], x[t][:, None]]  # [n, J, V]
        else:
            q_rows = q2[torch.arange(B - 1)[None], x[t][:, None], prev]  # predecessor = the trajectory's token
        beta = slot_beta(p_tok, q_rows.gather(-1, tok[..., None])[..., 0])
        post.append(produced_probs(survival_independent(beta, limit), left, B))
        tv.append(produced_probs(survival_independent(slot_alpha(tp[prev], q_rows), limit), left, B))
    return (torch.tensor([w.tau for w in walk_expectations(post)]),
            torch.tensor([w.tau for w in walk_expectations(tv)]))


def _se(x: torch.Tensor) -> float:
    return float(x.std() / math.sqrt(len(x)))


@pytest.mark.slow  # 10-20 s on 2 cores
def test_expected_tau_given_the_trajectory_equals_the_online_sampler():
    for variant in ("dflash1", "dflash2"):
        for k, setting in enumerate(SETTINGS):
            tp, q1, q2 = _model(k, setting)
            on = _online(tp, q1, q2, variant, 2500, seed=100 + k)
            post, tv = _offline(tp, q1, q2, variant, 2500, seed=200 + k)
            se = math.hypot(_se(on), _se(post))
            print(f"{variant} T={setting[0]} top_p={setting[1]} top_k={setting[2]}: online {float(on.mean()):.4f} "
                  f"+- {_se(on):.4f}; offline given the trajectory {float(post.mean()):.4f} +- {_se(post):.4f} "
                  f"(diff {float(post.mean() - on.mean()):+.4f}, {float(post.mean() - on.mean()) / se:+.1f} SE); "
                  f"teacher-forced 1 - TV {float(tv.mean()):.4f}")
            assert abs(float(post.mean() - on.mean())) <= 3 * se
            assert _se(post) < _se(on)  # conditioning on the trajectory removes the sampler's own noise


def test_ddtree_under_sampling_is_the_tree_walk_on_the_sampled_trajectory():
    """liranringel/ddtree at T > 0: a tree from the drafter's log-probabilities, the target's token sampled at
    every node, the walk follows the child holding it. Given the committed tokens the accepted depth is
    determined, so the greedy tree walk on sampled trajectories (:func:`dflash_eval.replay.ddtree.walk_budgets`)
    has the online mean tau."""
    from dflash_eval.replay.ddtree import build_tree, walk_budgets

    setting = (1.0, 1.0, 0)
    tp, q1, _ = _model(5, setting)
    budget, runs = 5, 2500
    lp_all = q1.clamp_min(1e-30).log()  # [J, anchor, V]: the drafter's log-probabilities per slot
    g = torch.Generator().manual_seed(300)
    on = []
    for _ in range(runs):
        x = [0, int(torch.multinomial(tp[0], 1, generator=g))]
        start, steps = P, []
        while start + 1 < MAX_LEN:
            J = min(B, MAX_LEN - start) - 1
            lp, ids = torch.topk(lp_all[:J, x[start]], budget, dim=-1)
            tree = build_tree(lp, ids, budget, J)
            node, new = 0, []
            while True:  # sample the target's token at the node (p given the node's path: its last token)
                last = x[start] if node == 0 else tree.tokens[node - 1]
                z = int(torch.multinomial(tp[last], 1, generator=g))
                new.append(z)
                if z not in tree.children[node]:
                    break
                node = tree.children[node][z]
            produced = min(len(new), MAX_LEN - start - 1)
            x += new[:produced]
            start += produced
            steps.append(produced)
        on.append(sum(steps) / len(steps))
    on = torch.tensor(on, dtype=torch.float64)
    off = []
    for _ in range(runs):
        x = [0]
        while len(x) < MAX_LEN:
            x.append(int(torch.multinomial(tp[x[-1]], 1, generator=g)))
        lp, ids = torch.topk(lp_all[:, x[P:-1]].transpose(0, 1), budget, dim=-1)  # [n, J, K] per anchor
        steps = walk_budgets(lp, ids, x, P, M, B, [budget])[budget]
        off.append(sum(steps) / len(steps))
    off = torch.tensor(off, dtype=torch.float64)
    se = math.hypot(_se(on), _se(off))
    print(f"DDTree-{budget} at T=1: online {float(on.mean()):.4f} +- {_se(on):.4f}; tree walk on sampled "
          f"trajectories {float(off.mean()):.4f} +- {_se(off):.4f} ({float(off.mean() - on.mean()) / se:+.1f} SE)")
    assert abs(float(off.mean() - on.mean())) <= 3 * se
    assert float(on.mean()) > 1.2  # trees were accepted
