"""Sampling filter, speculative sampler and expected acceptance (:mod:`dflash_eval.replay.sampling`).

Checked against the reference implementation (``dflash==0.1.0``, ``dflash.model``): the filter bit for
bit, the rejection sampler draw for draw, the closed forms (DFlash 1's independent slots, DFlash 2's
selector lattice) against seeded Monte Carlo runs of the reference's own ``_rejection_sample`` within
3 standard errors, the walk DP against brute-force enumeration, and the temperature-0 limit against
the greedy walk.
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch

import dflash.model as ref  # the reference: a missing one must fail, never skip
from dflash_eval.core.errors import InputError
from dflash_eval.replay.metrics import sample_tau
from dflash_eval.replay.anchors import chain_walk
from dflash_eval.replay.sampling import (SamplingSetting, check_sampling, filtered_probs, filtered_support, mc_accepted,
                                  rejection_sample, selector_path_probs, selector_transitions, slot_alpha, slot_beta,
                                  survival_independent, survival_selector, token_probs)
from dflash_eval.replay.walk import mc_walks, produced_probs, walk_expectation, walk_expectations

SETTINGS = [(1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.95, 20), (1.0, 0.95, 0), (1.3, 1.0, 5), (0.6, 0.5, 3),
            (1.0, 0.3, 0), (2.0, 0.999, 1), (1.0, 1.0, 64), (1.0, 0.9, 1000)]


# ----------------------------------------------------------------------------- the filter

@pytest.mark.parametrize("T,top_p,top_k", SETTINGS)
def test_filtered_probs_equals_reference_bitwise(T, top_p, top_k):
    g = torch.Generator().manual_seed(1)
    random = torch.randn(3, 5, 64, generator=g) * 3
    tied = torch.randint(0, 4, (3, 5, 64), generator=g).float()  # many equal logits at every cut
    for logits in (random, tied, random.to(torch.bfloat16)):
        ours = filtered_probs(logits, T, top_p, top_k)
        theirs = ref._sampling_probs(logits, T, top_p, top_k)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, theirs), (T, top_p, top_k, (ours - theirs).abs().max())


def test_filtered_probs_greedy_is_one_hot_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    p = filtered_probs(logits, 0.0)
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert torch.equal(p.argmax(-1), ref.sample(logits, 0.0))


def test_filtered_probs_hand_values():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.2, 0.1]))
    assert torch.allclose(filtered_probs(logits, 1.0, top_k=2), torch.tensor([0.5 / 0.7, 0.2 / 0.7, 0, 0]))
    # top-p 0.6: 0.5 kept (mass before 0), one 0.2 kept (mass before 0.5 < 0.6), the rest dropped
    p = filtered_probs(logits, 1.0, top_p=0.6)
    assert sorted(p.tolist(), reverse=True) == pytest.approx([0.5 / 0.7, 0.2 / 0.7, 0, 0])
    assert p[0] == pytest.approx(0.5 / 0.7) and p[3] == 0


@pytest.mark.parametrize("bad", [(-0.1, 1.0, 0), (1.0, 0.0, 0), (1.0, 1.5, 0), (1.0, 1.0, -1), (math.nan, 1.0, 0),
                                 (1.0, 1.0, 2.5)])
def test_invalid_settings_refused_as_the_reference_refuses(bad):
    with pytest.raises(InputError, match="sampling.*temperature >= 0"):
        check_sampling(*bad, where="config.yaml", field="evaluate.sampling[1]")
    with pytest.raises(InputError):
        SamplingSetting(*bad)
    if not (isinstance(bad[2], float) or math.isnan(bad[0])):
        with pytest.raises(ValueError):
            ref._validate_sampling(*bad)


def test_setting_labels():
    assert SamplingSetting().label == "T0" and SamplingSetting().greedy
    assert SamplingSetting(1.0, 0.95, 20).label == "T1_p0.95_k20"
    assert SamplingSetting(0.7).label == "T0.7"


# ----------------------------------------------------------------------------- the sampler

def _step(g, J, V, K=None):
    """Random target/draft distributions of one verify step (sparse, as after top-k/top-p)."""
    base = torch.randn(1, J + 1, V, generator=g) * 2
    tp = filtered_probs(base, 1.0, 0.9, 0)
    noisy = base[:, :J] + 0.7 * torch.randn(1, J, V, generator=g)  # a drafter close to the target
    if K is None:
        dp = filtered_probs(noisy, 1.0, 0.9, 0)
        return tp, dp, torch.multinomial(dp[0], 1, generator=g).T, None
    unary, cand = torch.topk(noisy, K, dim=-1)
    dp = torch.softmax(unary, -1)
    idx = torch.multinomial(dp[0], 1, generator=g).T
    return tp, dp, cand.gather(-1, idx[..., None])[..., 0], cand


@pytest.mark.parametrize("K", [None, 3])
def test_rejection_sample_draws_what_the_reference_draws(K):
    g = torch.Generator().manual_seed(2)
    outcomes = set()
    for seed in range(300):
        tp, dp, tokens, cand = _step(g, 4, 12, K)
        torch.manual_seed(seed)
        a_ref, tok_ref = ref._rejection_sample(tokens, tp, dp, cand)
        torch.manual_seed(seed)
        a, tok = rejection_sample(tokens, tp, dp, cand)
        assert (int(a[0]), int(tok[0])) == (a_ref, int(tok_ref)), seed
        outcomes.add(a_ref)
    assert outcomes == {0, 1, 2, 3, 4}  # every branch (each rejection slot and the bonus) was exercised


def test_committed_token_is_distributed_as_the_target():
    """Speculative sampling is lossless: the first committed token (draft or correction) follows p."""
    V, J, n = 6, 3, 60000
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.2, 0.2, 0.3])
    tp = p.expand(J + 1, V)
    g = torch.Generator().manual_seed(3)
    tokens = torch.multinomial(q.expand(J, V), n, replacement=True, generator=g).T
    acc, nxt = rejection_sample(tokens, tp[None].expand(n, -1, -1), q.expand(n, J, V), generator=g)
    first = torch.where(acc > 0, tokens[:, 0], nxt)
    freq = torch.bincount(first, minlength=V).double() / n
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 3 * se + 1e-12).all(), (freq, p)


# ----------------------------------------------------------------------------- expected accepted length

def _dists_with_alpha(alphas, V=5):
    """p_j, q_j over V tokens with sum_x min(p_j, q_j) = alphas[j] exactly (p and q share mass alpha)."""
    ps, qs = [], []
    for a in alphas:
        p = torch.zeros(V, dtype=torch.float64)
        q = torch.zeros(V, dtype=torch.float64)
        p[0], q[0] = a * 0.6, a * 0.6
        p[1], q[1] = a * 0.4, a * 0.4
        p[2], q[3] = 1 - a, 1 - a  # disjoint rest
        ps.append(p)
        qs.append(q)
    return torch.stack(ps).float(), torch.stack(qs).float()


def test_closed_form_equals_reference_rejection_sampler_dflash1():
    alphas = [0.8, 0.5, 0.9, 0.3]
    p, q = _dists_with_alpha(alphas)
    tp = torch.cat([p, p[:1]])  # + the bonus position
    alpha = slot_alpha(p, q)[None]
    assert alpha[0].tolist() == pytest.approx(alphas)
    S = survival_independent(alpha, torch.tensor([4]))
    exact = float(S[0, 1:].sum())
    assert exact == pytest.approx(0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.9 + 0.8 * 0.5 * 0.9 * 0.3)
    # seeded Monte Carlo of the reference's own sampler: drafts drawn from q, verified by _rejection_sample
    torch.manual_seed(0)
    draws = 4000
    acc = torch.tensor([ref._rejection_sample(torch.multinomial(q, 1).T, tp[None], q[None])[0] for _ in range(draws)],
                       dtype=torch.float64)
    se = float(acc.std() / math.sqrt(draws))
    print(f"DFlash 1: closed form {exact:.4f}, reference sampler {float(acc.mean()):.4f} +- {se:.4f}")
    assert abs(float(acc.mean()) - exact) <= 3 * se
    pa = (S[0, :-1] - S[0, 1:]).tolist() + [float(S[0, -1])]  # P(a = k), k = 0..4
    for k in range(5):
        f = float((acc == k).double().mean())
        assert abs(f - pa[k]) <= 3 * math.sqrt(pa[k] * (1 - pa[k]) / draws), (k, f, pa[k])
    # and this module's Monte Carlo of the same step
    est, _ = mc_accepted(tp, 20000, seed=1, draft_probs=q)
    assert abs(est.mean - exact) <= 3 * est.se


def _random_selector(g, J, K, V):
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(J)])
    bias = torch.zeros(K)
    bias[0] = 2.0  # candidate 0 preferred: deep acceptances happen when p agrees
    first = torch.softmax(torch.randn(K, generator=g) * 1.5 + bias, -1)
    trans = torch.softmax(torch.randn(J - 1, K, K, generator=g) * 1.5 + bias, -1)
    tp = filtered_probs(torch.randn(J + 1, V, generator=g) * 1.5, 1.0)
    return cand, first, trans, tp


def test_selector_closed_form_equals_reference_rejection_sampler_dflash2():
    g = torch.Generator().manual_seed(4)
    J, K, V = 4, 3, 8
    cand, first, trans, tp = _random_selector(g, J, K, V)
    # make the candidates likely under p so that deep acceptances happen
    tp = 0.3 * tp + 0.7 * torch.zeros(J + 1, V).scatter_(-1, torch.cat([cand, cand[:1]])[:, :1], 1.0)
    p_cand = tp[:J].gather(-1, cand)
    S = survival_selector(first[None], trans[None], p_cand[None], torch.tensor([J]))
    exact = float(S[0, 1:].sum())
    # brute force over every path of candidate indices: sum of prod min(q, p)
    brute = 0.0
    for k in range(1, J + 1):
        for path in itertools.product(range(K), repeat=k):
            w, prev = 1.0, None
            for j, c in enumerate(path):
                qj = float(first[c]) if j == 0 else float(trans[j - 1, prev, c])
                w *= min(qj, float(p_cand[j, c]))
                prev = c
            brute += w
    assert exact == pytest.approx(brute, rel=1e-12)
    # the reference's sampler on paths drawn as the reference's selector draws them
    torch.manual_seed(5)
    draws, acc = 4000, []
    for _ in range(draws):
        rows, picks = [first], []
        for j in range(J):
            picks.append(int(torch.multinomial(rows[-1], 1)))
            if j + 1 < J:
                rows.append(trans[j][picks[-1]])
        tokens = torch.tensor([[int(cand[j, c]) for j, c in enumerate(picks)]])
        acc.append(ref._rejection_sample(tokens, tp[None], torch.stack(rows)[None], cand[None])[0])
    acc = torch.tensor(acc, dtype=torch.float64)
    se = float(acc.std() / math.sqrt(draws))
    print(f"DFlash 2: closed form {exact:.4f}, reference sampler {float(acc.mean()):.4f} +- {se:.4f}")
    assert abs(float(acc.mean()) - exact) <= 3 * se
    est, _ = mc_accepted(tp, 20000, seed=6, candidates=cand, first=first, trans=trans)
    assert abs(est.mean - exact) <= 3 * est.se


def test_selector_transitions_match_the_reference_selector():
    torch.manual_seed(7)
    V, H, R, K, J, n = 40, 16, 6, 5, 6, 3
    cfg = types.SimpleNamespace(dflash_config={"selector_rank": R, "selector_top_k": K}, vocab_size=V, hidden_size=H)
    sel = ref.CandidateSelector(cfg)
    for p in sel.parameters():
        torch.nn.init.normal_(p, std=1.0)
    hidden = torch.randn(n, J, H)
    logits = torch.randn(n, J, V) * 2
    anchor = torch.randint(0, V, (n,))
    with torch.no_grad():
        path, cand, _ = sel.select(hidden, logits, anchor, 0.0)
        unary, cand2 = torch.topk(logits, K, dim=-1, sorted=False)
        assert torch.equal(cand, cand2)
        first, trans = selector_transitions(unary, cand, sel.hidden_projection(hidden), anchor,
                                            sel.predecessor_codebook.weight, sel.successor_codebook.weight, 0.0)
        c = first.argmax(-1)
        ours = [cand[:, 0].gather(-1, c[:, None])[:, 0]]
        for j in range(1, J):
            c = trans[torch.arange(n), j - 1, c].argmax(-1)
            ours.append(cand[:, j].gather(-1, c[:, None])[:, 0])
        assert torch.equal(torch.stack(ours, 1), path)
        # at a temperature: the reference's per-slot q along its sampled path = our rows at that path
        torch.manual_seed(8)
        path, cand, q = sel.select(hidden, logits, anchor, 0.8)
        first, trans = selector_transitions(unary, cand, sel.hidden_projection(hidden), anchor,
                                            sel.predecessor_codebook.weight, sel.successor_codebook.weight, 0.8)
        idx = (cand == path[..., None]).long().argmax(-1)  # candidate index of each pick
        rows = [first] + [trans[torch.arange(n), j - 1, idx[:, j - 1]] for j in range(1, J)]
        assert torch.allclose(torch.stack(rows, 1), q, atol=1e-6, rtol=1e-5)


def test_survival_and_produced_cuts_hand_values():
    alpha = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    limit = torch.tensor([3, 1, 2])
    S = survival_independent(alpha, limit)
    assert S.tolist() == [[1, 0.5, 0.25, 0.125], [1, 0.5, 0, 0], [1, 1, 1, 0]]
    left = torch.tensor([10, 1, 2])  # row 2: the response ends inside the block
    P = produced_probs(S, left, 4)
    assert P[0].tolist() == [0, 0.5, 0.25, 0.125, 0.125]  # a = 0..3 -> 1..4 tokens
    assert P[1].tolist() == [0, 1, 0, 0, 0]  # one token left: the step commits it whatever a is
    assert P[2].tolist() == [0, 0, 1, 0, 0]  # min(a + 1, 2) with a = 2
    assert P.sum(-1).tolist() == [1, 1, 1]


# ----------------------------------------------------------------------------- the walk

def _random_produced(g, n, B):
    """Valid ``[n, B + 1]`` step distributions (limit = min(B - 1, left), random alphas)."""
    alpha = torch.rand(n, B - 1, generator=g) ** 0.5
    t = torch.arange(n)
    left = n - t
    limit = torch.clamp(left, max=B - 1)
    return produced_probs(survival_independent(alpha, limit), left, B)


def _enumerate(P, n):
    """Brute force over every walk: E[n/N], E[(n+1)/N], E[N], visit probabilities and histogram."""
    out = dict(tau=0.0, sg=0.0, steps=0.0, visit=[0.0] * n, hist=[0.0] * P.shape[1])

    def rec(i, w, N, path):
        if i == n:
            out["tau"] += w * n / N
            out["sg"] += w * (n + 1) / N
            out["steps"] += w * N
            for a, d in path:
                out["visit"][a] += w
                out["hist"][d] += w
            return
        for d in range(1, P.shape[1]):
            if P[i, d] > 0:
                rec(i + d, w * float(P[i, d]), N + 1, path + [(i, d)])

    rec(0, 1.0, 0, [])
    return out


def test_walk_dp_equals_brute_force_enumeration():
    g = torch.Generator().manual_seed(9)
    cases = [(1, 3), (2, 2), (5, 3), (7, 4), (9, 3)]
    Ps = [_random_produced(g, n, B) for n, B in cases]
    together = walk_expectations([p for p, (_, B) in zip(Ps, cases) if B == 3])
    alone = [walk_expectation(p) for p in Ps]
    for (n, B), P, w in zip(cases, Ps, alone):
        bf = _enumerate(P, n)
        assert w.residual_mass == 0
        assert w.tau == pytest.approx(bf["tau"], rel=1e-12, abs=1e-14)
        assert w.tau_sglang == pytest.approx(bf["sg"], rel=1e-12)
        assert w.steps == pytest.approx(bf["steps"], rel=1e-12)
        assert w.visit.tolist() == pytest.approx(bf["visit"], rel=1e-12, abs=1e-15)
        assert w.histogram.tolist() == pytest.approx(bf["hist"], rel=1e-12, abs=1e-15)
        assert float(w.steps_probs.sum()) == pytest.approx(1.0, rel=1e-12)
    # several responses of different lengths side by side = one at a time
    b3 = [w for w, (_, B) in zip(alone, cases) if B == 3]
    assert [x.tau for x in together] == pytest.approx([x.tau for x in b3], rel=1e-13)


def test_walk_monte_carlo_agrees_with_dp():
    g = torch.Generator().manual_seed(10)
    P = _random_produced(g, 60, 6)
    w = walk_expectation(P)
    est, N = mc_walks(P, 4000, seed=11)
    print(f"walk: DP {w.tau:.4f}, Monte Carlo {est.mean:.4f} +- {est.se:.4f}; "
          f"E[N] {w.steps:.3f} vs {N.double().mean():.3f}")
    assert abs(est.mean - w.tau) <= 3 * est.se
    assert w.tau != pytest.approx(60 / w.steps, rel=1e-4)  # E[n/N] is not n/E[N] (Jensen): the DP is needed


def test_temperature_zero_limit_is_the_greedy_walk():
    """One response, block 5, drafts and target logits at every anchor/slot: at T = 0 the expectation is the
    greedy chain walk exactly; at a tiny temperature it converges to it."""
    g = torch.Generator().manual_seed(12)
    B, V, P_len, T_len = 5, 11, 4, 40
    n = T_len - 1 - P_len
    target_logits = torch.randn(T_len, V, generator=g) * 4  # row m: the target's logits for position m
    x = target_logits.argmax(-1)  # the cached greedy trajectory
    drafter_logits = torch.randn(n, B - 1, V, generator=g) * 4
    # make the drafter right most of the time: slot j of anchor t predicts x[t + j]
    t = torch.arange(P_len, P_len + n)
    pos = (t[:, None] + torch.arange(1, B)[None]).clamp(max=T_len - 1)
    right = torch.rand(n, B - 1, generator=g) < 0.75
    drafter_logits += 12 * right[..., None] * torch.nn.functional.one_hot(x[pos], V)
    left = T_len - 1 - t
    limit = torch.clamp(left, max=B - 1)
    valid = torch.arange(1, B)[None] <= limit[:, None]
    accepted = ((drafter_logits.argmax(-1) == x[pos]) & valid).long().cumprod(-1).sum(-1)
    greedy = sample_tau(chain_walk(accepted.tolist(), P_len, T_len))

    def expected(T, given_trajectory):
        if given_trajectory:
            tok = x[pos]
            beta = slot_beta(token_probs(target_logits[pos], tok, T), token_probs(drafter_logits, tok, T))
            S = survival_independent(beta, limit)
        else:  # teacher-forced 1 - TV
            S = survival_independent(slot_alpha(filtered_probs(target_logits[pos], T),
                                                filtered_probs(drafter_logits, T)), limit)
        return walk_expectation(produced_probs(S, left, B)).tau

    for given in (True, False):
        assert expected(0.0, given) == greedy  # exactly
        assert expected(1e-3, given) == pytest.approx(greedy, abs=1e-9)
        assert abs(expected(1.0, given) - greedy) > 1e-3  # and the temperature matters
    # given the trajectory, T = 0 is the greedy replay on the cached tokens even where they are not the
    # target's argmax (p = 0 there): accepted exactly where the drafter's argmax is the cached token
    x[P_len + 5] = (x[P_len + 5] + 1) % V
    accepted = ((drafter_logits.argmax(-1) == x[pos]) & valid).long().cumprod(-1).sum(-1)
    assert expected(0.0, True) == sample_tau(chain_walk(accepted.tolist(), P_len, T_len))


def test_filtered_support_is_filtered_probs_without_the_scatter():
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(4, 3, 50, generator=g) * 2
    for T, top_p, top_k in [(1.0, 0.95, 20), (0.7, 1.0, 5), (1.0, 0.9, 0)]:
        vals, ids = filtered_support(logits, T, top_p, top_k)
        dense = filtered_probs(logits, T, top_p, top_k)
        if top_k:
            assert vals.shape == (4, 3, top_k)
            assert torch.equal(torch.zeros_like(dense).scatter_(-1, ids, vals), dense)
        else:
            assert ids is None and torch.equal(vals, dense)
    with pytest.raises(ValueError):
        filtered_support(logits, 0.0)


def test_token_probs_equal_the_dense_filter_at_the_tokens():
    g = torch.Generator().manual_seed(14)
    for logits in (torch.randn(5, 4, 40, generator=g) * 2, torch.randint(0, 3, (5, 4, 40), generator=g).float()):
        tokens = torch.randint(0, 40, (5, 4), generator=g)
        tokens[:, 0] = logits[:, 0].argmax(-1)  # some kept for sure
        for setting in [(0.0, 1.0, 0), (1.0, 0.95, 20), (0.7, 1.0, 3), (1.0, 0.8, 0)]:
            dense = filtered_probs(logits, *setting).gather(-1, tokens[..., None])[..., 0]
            assert torch.equal(token_probs(logits, tokens, *setting), dense), setting


def test_slot_beta_hand_values():
    p = torch.tensor([0.5, 0.2, 0.0, 0.0, 0.3])
    q = torch.tensor([0.25, 0.4, 0.1, 0.0, 0.3])
    assert slot_beta(p, q).tolist() == [0.5, 1.0, 1.0, 0.0, 1.0]


def test_selector_path_probs_are_the_transition_rows_on_the_path():
    torch.manual_seed(15)
    V, H, R, K, J, n = 30, 12, 5, 4, 5, 3
    cfg = types.SimpleNamespace(dflash_config={"selector_rank": R, "selector_top_k": K}, vocab_size=V, hidden_size=H)
    sel = ref.CandidateSelector(cfg)
    for prm in sel.parameters():
        torch.nn.init.normal_(prm, std=1.0)
    hidden, logits, anchor = torch.randn(n, J, H), torch.randn(n, J, V) * 2, torch.randint(0, V, (n,))
    with torch.no_grad():
        unary, cand = torch.topk(logits, K, dim=-1, sorted=False)
        hp = sel.hidden_projection(hidden)
        cb = (sel.predecessor_codebook.weight, sel.successor_codebook.weight)
        first, trans = selector_transitions(unary, cand, hp, anchor, *cb, 0.9)
        idx = torch.randint(0, K, (n, J))  # a path of candidates
        tokens = cand.gather(-1, idx[..., None])[..., 0]
        tokens[0, 2] = V - 1 if V - 1 not in cand[0, 2] else tokens[0, 2]  # one token off the candidates
        prev = torch.cat([anchor[:, None], tokens[:, :-1]], dim=1)
        got = selector_path_probs(unary, cand, hp, prev, tokens, *cb, 0.9)
        want = torch.stack([first[torch.arange(n), idx[:, 0]]]
                           + [trans[torch.arange(n), j - 1, idx[:, j - 1], idx[:, j]] for j in range(1, J)], 1)
        off = ~(cand == tokens[..., None]).any(-1)
        assert off[0, 2]
        want[off] = 0.0
        keep = torch.ones_like(off)
        keep[0, 3] = False  # its predecessor is the off-candidate token: not a row of the lattice
        assert torch.allclose(got[keep], want[keep], atol=1e-6, rtol=1e-5)
        assert got[0, 3] > 0


def test_hf_logits_processor_samples_the_reference_filter(tmp_path):
    """transformers' generate with the processor draws from the reference's filtered distribution, seeded."""
    from tiny import make_tiny_target
    from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

    from dflash_eval.replay.sampling import hf_logits_processor

    model = AutoModelForCausalLM.from_pretrained(make_tiny_target(tmp_path / "m"), dtype=torch.float32).eval()
    setting = SamplingSetting(1.0, 0.9, 5)
    cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=12,
                           eos_token_id=None, pad_token_id=3)
    ids = torch.tensor([[5, 9, 14, 7]])

    def run(seed):
        torch.manual_seed(seed)
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg,
                              logits_processor=LogitsProcessorList([hf_logits_processor(setting)]),
                              output_scores=True, output_logits=True, return_dict_in_generate=True)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.sequences, b.sequences) and not torch.equal(a.sequences, c.sequences)
    for raw, used in zip(a.logits, a.scores):  # per step: the raw logits and what the sampler drew from
        assert torch.allclose(torch.softmax(used, -1), filtered_probs(raw, 1.0, 0.9, 5), atol=1e-6)
    with pytest.raises(ValueError):
        hf_logits_processor(SamplingSetting())


def test_token_probs_from_the_top_k_equal_the_full_filter():
    """q of a top-k setting from the DDTree pass's top-K log-probs == the filter over the whole vocabulary."""
    from dflash_eval.replay.sampling import token_probs_topk

    g = torch.Generator().manual_seed(11)
    logits = 3 * torch.randn(6, 5, 257, generator=g)
    top_logp, top_ids = torch.topk(logits.log_softmax(-1), 40, dim=-1)
    rank = torch.randint(0, 4, (6, 5, 1), generator=g)
    tokens = torch.where(torch.rand(6, 5, generator=g) < 0.7, top_ids.gather(-1, rank)[..., 0],
                         torch.randint(0, 257, (6, 5), generator=g))
    for setting in [(1.0, 0.95, 20), (0.6, 1.0, 40), (1.3, 0.5, 7), (0.8, 0.9, 1)]:
        want = token_probs(logits, tokens, *setting)
        got = token_probs_topk(top_logp, top_ids, tokens, *setting)
        assert torch.allclose(got, want, atol=1e-6), setting
        assert (want > 0).any(), setting
    with pytest.raises(ValueError, match="0 < top_k <= K"):
        token_probs_topk(top_logp, top_ids, tokens, 1.0, 1.0, 41)
