"""Draft policies at T > 0: each policy's closed form given the trajectory vs a seeded Monte Carlo of the engine.

A bigram target (p(x_m | x_{m-1})) and a drafter that is a fixed noisy function of the anchor token (DFlash 1:
independent slots; DFlash 2: a selector whose scores also depend on the previous pick). Online, seeded runs of
each engine's loop as its source writes it:

* ``reference`` (dflash==0.1.0 ``dflash_generate``): DFlash 1 drafts from the drafter's filtered q, DFlash 2 the
  selector's sampled path at the temperature; :func:`~dflash_eval.replay.sampling.rejection_sample`.
* ``argmax`` (vLLM ``draft_sample_method="greedy"``): the drafter's argmax (DFlash 2: the selector's argmax path,
  each slot after the previous pick); :func:`~dflash_eval.replay.policies.vllm_rejection_sample` with one-hot q.
* ``probabilistic`` (vLLM ``"probabilistic"``, DFlash 1): drafts from ``softmax(logits / T)`` without top-p /
  top-k, that q in vLLM's ratio test against the filtered p.

Offline: trajectories drawn from the target, then per trajectory the policy's exact expectation
(:func:`~dflash_eval.replay.expected.chain_survival` / :func:`~dflash_eval.replay.expected.selector_survival`, the
walk DP). Checked: offline == online within 3 standard errors, and the argmax policy equals the greedy walk on the
trajectory exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from dflash_eval.replay.anchors import chain_walk
from dflash_eval.replay.expected import chain_survival, response_expectations, selector_survival
from dflash_eval.replay.metrics import aggregate
from dflash_eval.drafter.families import DFLASH, DFLASH2, DRAFT_POLICIES
from dflash_eval.replay.policies import ARGMAX, PROBABILISTIC, REFERENCE, vllm_rejection_sample
from dflash_eval.replay.sampling import SamplingSetting, filtered_probs, rejection_sample

V, B, P, M = 6, 4, 1, 12  # vocabulary, block size, prompt length, max_new_tokens
MAX_LEN = P + M
J = B - 1
FILTERED = SamplingSetting(0.8, 0.9, 4)
PLAIN = SamplingSetting(1.0)


def _model(seed: int):
    """Target logits ``[prev, V]``; DFlash 1 drafter logits ``[J, anchor, V]``; DFlash 2 selector scores
    ``[J, anchor, prev pick, V]`` (every token a candidate)."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    steps = [torch.softmax(logp, -1)]
    for _ in range(J - 1):
        steps.append(steps[-1] @ torch.softmax(logp, -1))
    d1 = torch.stack([s.log() * 0.8 + 0.6 * torch.randn(V, V, generator=g) for s in steps])
    d2 = d1[:, :, None, :] + 0.6 * torch.randn(J, V, V, V, generator=g) + 0.8 * logp[None, None]
    return logp, d1, d2


def _draft(row_logits, setting, policy, variant, g):
    """One slot's draft and its q row ``[V]`` (None = one-hot, vLLM greedy) as the engine draws it."""
    if policy == ARGMAX:
        return int(row_logits.argmax()), None
    if policy == PROBABILISTIC:  # vLLM: softmax(logits / T), top-p / top-k ignored for the drafts
        q = torch.softmax(row_logits / setting.temperature, -1)
    elif variant == "dflash2":  # the reference's selector: the temperature only
        q = filtered_probs(row_logits, setting.temperature)
    else:
        q = filtered_probs(row_logits, setting.temperature, setting.top_p, setting.top_k)
    return int(torch.multinomial(q, 1, generator=g)), q


def _online(model, setting, variant, policy, runs, seed):
    logp, d1, d2 = model
    tp = filtered_probs(logp, setting.temperature, setting.top_p, setting.top_k)
    g = torch.Generator().manual_seed(seed)
    taus = []
    for _ in range(runs):
        x = [0, int(torch.multinomial(tp[0], 1, generator=g))]
        start, steps = P, []
        while start + 1 < MAX_LEN:
            n_slots = min(B, MAX_LEN - start) - 1
            anchor, ys, qs = x[start], [], []
            for j in range(n_slots):
                row = d1[j, anchor] if variant == "dflash1" else d2[j, anchor, ys[-1] if ys else anchor]
                y, q = _draft(row, setting, policy, variant, g)
                ys.append(y)
                qs.append(q)
            tprobs = torch.stack([tp[anchor]] + [tp[y] for y in ys])[None]
            if policy == REFERENCE:
                a, z = rejection_sample(torch.tensor([ys]), tprobs, torch.stack(qs)[None], generator=g)
            else:
                a, z = vllm_rejection_sample(torch.tensor([ys]), tprobs,
                                             None if policy == ARGMAX else torch.stack(qs)[None], generator=g)
            new = ys[: int(a)] + [int(z)]
            produced = min(int(a) + 1, MAX_LEN - start - 1)
            x += new[:produced]
            start += produced
            steps.append(produced)
        taus.append(sum(steps) / len(steps))
    return torch.tensor(taus, dtype=torch.float64)


def _trajectory_inputs(model, setting, x):
    """Per anchor t = P .. MAX_LEN - 2: slot tokens, predecessors, target p of the tokens, limit, left."""
    logp = model[0]
    tp = filtered_probs(logp, setting.temperature, setting.top_p, setting.top_k)
    t = torch.arange(P, MAX_LEN - 1)
    vs = torch.clamp(MAX_LEN - t, max=B)
    limit = torch.minimum(vs - 1, MAX_LEN - 1 - t)
    pos = (t[:, None] + torch.arange(1, B)[None]).clamp(max=MAX_LEN - 1)
    tok, prev = x[pos], x[pos - 1]
    return t, tok, prev, tp[prev, tok], limit


def _survival(model, setting, variant, policy, x):
    _, d1, d2 = model
    t, tok, prev, p_tok, limit = _trajectory_inputs(model, setting, x)
    slots = torch.arange(J)[None]
    if variant == "dflash1":
        return chain_survival(d1[slots, x[t][:, None]], tok, p_tok, limit, setting, policy=policy)
    scores = d2[slots, x[t][:, None], prev]  # the selector after the trajectory's previous token
    cand = torch.arange(V).expand(scores.shape)
    return selector_survival(scores, cand, tok, p_tok, limit, setting, policy)


def _offline(model, setting, variant, policy, runs, seed):
    tp = filtered_probs(model[0], setting.temperature, setting.top_p, setting.top_k)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(runs):
        x = [0]
        while len(x) < MAX_LEN:
            x.append(int(torch.multinomial(tp[x[-1]], 1, generator=g)))
        x = torch.tensor(x)
        out.append(response_expectations([_survival(model, setting, variant, policy, x)], [P], [MAX_LEN], B)[0].tau)
    return torch.tensor(out, dtype=torch.float64)


def _se(x):
    return float(x.std() / math.sqrt(len(x)))


CASES = [(v, s, pol) for v in ("dflash1", "dflash2") for s in (PLAIN, FILTERED)
         for pol in (DFLASH2 if v == "dflash2" else DFLASH).draft_policies(s)]


@pytest.mark.slow
@pytest.mark.parametrize("variant,setting,policy", CASES, ids=lambda c: getattr(c, "label", c))
def test_policy_closed_form_equals_the_engine_monte_carlo(variant, setting, policy):
    model = _model(3)
    on = _online(model, setting, variant, policy, 500, seed=11)
    off = _offline(model, setting, variant, policy, 500, seed=12)
    se = math.hypot(_se(on), _se(off))
    print(f"{variant} {setting.label} {policy}: online {float(on.mean()):.4f} +- {_se(on):.4f}; offline "
          f"{float(off.mean()):.4f} +- {_se(off):.4f} ({float(off.mean() - on.mean()) / se:+.1f} SE)")
    assert abs(float(off.mean() - on.mean())) <= 3 * se
    assert float(on.mean()) > 1.05  # drafts were accepted


def test_policies_differ_where_the_engines_do():
    """The three policies are distinct expectations on the same trajectories (else the axis would be empty)."""
    model = _model(3)
    taus = {pol: float(_offline(model, FILTERED, "dflash1", pol, 200, seed=5).mean())
            for pol in (REFERENCE, ARGMAX, PROBABILISTIC)}
    assert len({round(v, 6) for v in taus.values()}) == 3, taus


@pytest.mark.parametrize("variant", ["dflash1", "dflash2"])
@pytest.mark.parametrize("setting", [PLAIN, FILTERED], ids=lambda s: s.label)
def test_argmax_policy_is_the_greedy_walk_on_the_trajectory(variant, setting):
    """One-hot q and vLLM's correction without the draft token: a slot is accepted iff the trajectory's token is
    the draft's argmax, so the expectation is the greedy chain walk on the trajectory, exactly."""
    model = _model(7)
    _, d1, d2 = model
    g = torch.Generator().manual_seed(1)
    tp = filtered_probs(model[0], setting.temperature, setting.top_p, setting.top_k)
    for _ in range(20):
        x = [0]
        while len(x) < MAX_LEN:
            x.append(int(torch.multinomial(tp[x[-1]], 1, generator=g)))
        x = torch.tensor(x)
        t, tok, prev, _, limit = _trajectory_inputs(model, setting, x)
        slots = torch.arange(J)[None]
        if variant == "dflash1":
            greedy = d1[slots, x[t][:, None]].argmax(-1)
        else:  # the selector's argmax after each slot's trajectory predecessor (= its own pick while accepted)
            greedy = d2[slots, x[t][:, None], prev].argmax(-1)
        ok = (greedy == tok) & (torch.arange(1, B)[None] <= limit[:, None])
        chain = chain_walk(ok.long().cumprod(-1).sum(-1).tolist(), P, MAX_LEN)
        want = aggregate([chain], B).tau
        got = response_expectations([_survival(model, setting, variant, ARGMAX, x)], [P], [MAX_LEN], B)[0].tau
        assert got == pytest.approx(want, abs=1e-12)


def test_engine_settings_name_vllm_draft_sample_method():
    assert DRAFT_POLICIES == (REFERENCE, ARGMAX, PROBABILISTIC)  # the families name the policies without torch
    assert DFLASH.draft_policies(PLAIN) == [REFERENCE, ARGMAX]
    assert DFLASH.draft_policies(FILTERED) == [REFERENCE, ARGMAX, PROBABILISTIC]
    assert DFLASH2.draft_policies(FILTERED) == [REFERENCE, ARGMAX]
    assert DFLASH.vllm_draft_sample_method(PLAIN, REFERENCE) == "probabilistic"
    assert DFLASH.vllm_draft_sample_method(FILTERED, REFERENCE) is None  # vLLM drops q's filters
    assert DFLASH.vllm_draft_sample_method(FILTERED, ARGMAX) == "greedy"
    assert DFLASH2.vllm_draft_sample_method(FILTERED, REFERENCE) == "probabilistic"
    assert "vLLM draft_sample_method=greedy (the default)" in DFLASH.engine_settings(PLAIN, ARGMAX)
    with pytest.raises(ValueError):
        selector_survival(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2, dtype=torch.long), torch.zeros(1, 1,
                          dtype=torch.long), torch.ones(1, 1), torch.ones(1, dtype=torch.long), PLAIN, PROBABILISTIC)
