"""Expected acceptance from the all-anchor pass (:mod:`dflash_eval.replay.expected`) and its aggregate.

Exact cases: the target's token probabilities equal the dense filter at the cached tokens; at 0/1
acceptance probabilities the expected aggregate equals the greedy aggregate field for field.
"""

from __future__ import annotations

import pytest
import torch

from dflash_eval.replay.expected import response_expectations, target_token_probs
from dflash_eval.replay.metrics import aggregate, aggregate_expected
from dflash_eval.replay.anchors import chain_walk
from dflash_eval.replay.sampling import SamplingSetting, filtered_probs


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


@pytest.mark.parametrize("topk", [0, 32])
def test_anchor_pass_survival_equals_one_block_at_a_time(topk):
    """iter_anchor_drafts(sampling=...) from one batched pass == the drafter run on each anchor's block alone;
    with DDTree's top-32 in the same pass the top-20 setting's q comes from it (sampling.token_probs_topk)."""
    import copy

    from fixtures.drafters import HIDDEN, LAYER_IDS, VOCAB, randomize_, tiny_config

    from dflash_eval.replay.anchors import iter_anchor_drafts
    from dflash_eval.cache.format import CacheSample
    from dflash_eval.drafter.model import DFlashDrafter
    from dflash_eval.drafter.config import DrafterConfig
    from dflash_eval.replay.expected import chain_survival
    from dflash_eval.replay.chain import _single_block_logits

    B = 5
    drafter = randomize_(DFlashDrafter(DrafterConfig.from_dict(copy.deepcopy(tiny_config(block_size=B)))), 3).eval()
    g = torch.Generator().manual_seed(4)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=g), 0.05 * torch.randn(VOCAB, HIDDEN, generator=g)
    samples, p_tokens = [], []
    settings = [SamplingSetting(1.0, 0.95, 20), SamplingSetting(0.7), SamplingSetting(0.6, 0.9, 8)]
    for i, (P, T, M) in enumerate([(6, 30, 40), (4, 19, 15), (9, 11, 2)]):
        ids = torch.randint(0, VOCAB - 1, (T,), generator=g)
        samples.append(CacheSample(i, f"s{i}", ids, P, torch.randn(T, len(LAYER_IDS), HIDDEN, generator=g),
                                   ids.clone(), "length", M))
        p_tokens.append({s.label: torch.rand(T, generator=g) for s in settings})
    for layout in ("rows", "packed"):
        drafts = list(iter_anchor_drafts(drafter, embed, head, samples, B, layout=layout, sampling=settings,
                                         p_tokens=p_tokens, memory_bytes=1 << 22, topk=topk))
        for s, d, p in zip(samples, drafts, p_tokens):
            T = len(s.input_ids)
            for i, t in enumerate(range(s.prompt_len, T - 1)):
                lg = _single_block_logits(drafter, embed, head, s, t, B)[1:]  # [B-1, V]
                pos = torch.arange(t + 1, t + B).clamp(max=T - 1)
                for st in settings:
                    want = chain_survival(lg[None], s.input_ids[pos][None], p[st.label][pos][None], d.limit[i : i + 1],
                                          st)
                    assert torch.allclose(d.survival[st.label][i : i + 1], want, atol=1e-5), (layout, s.sample_id, t)
        assert all((drafts[0].survival[st.label][:, 1:] > 0).any() for st in settings)  # some acceptance


def test_expected_standard_error_is_over_the_expected_per_response_taus():
    """At T > 0 tau_se is the SE over the per-response E[tau_r]: 1.5, 2.5 -> sd sqrt(0.5), SE 0.5; bins alike."""
    from types import SimpleNamespace

    from dflash_eval.replay.metrics import aggregate_expected

    B = 3
    zero = {k: 0.0 for k in range(1, B + 1)}
    def resp(tau):
        return SimpleNamespace(tau=tau, tau_sglang=tau, histogram=zero, slot_accepted={1: 0.0, 2: 0.0},
                               slot_compared={1: 0.0, 2: 0.0}, bin_tokens=[0.0] * 8, bin_steps=[0.0] * 8, steps=1.0,
                               committed=1)
    s = aggregate_expected([resp(1.5), resp(2.5), None], B, prompt_lens=[10, 20, 30])
    assert s.tau == 2.0 and s.tau_se == pytest.approx(0.5, abs=1e-15)
    assert s.prompt_samples["0-128"] == 2 and s.prompt_se["0-128"] == pytest.approx(0.5, abs=1e-15)
