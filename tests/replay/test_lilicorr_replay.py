"""LiLiCorr in the replay: a tiny random DFlash backbone with a random LiLiCorr head on the tiny target (CPU float32).

* T = 0: the online loop (target in the loop, anchor row = the last accepted target row), the sequential chain
  replay and the all-anchor pass commit the same tokens per verify step; the head's path is not the backbone's
  chain (tau_unary) and never beats the lattice oracle.
* T > 0: the all-anchor pass's expected survival under the reference (the sampled walk teacher-forced on the
  trajectory) tends to the greedy walk's chain as T -> 0 (argmax policy: equal at any T), and the online sampler
  runs seeded, reproducibly.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_random_drafter, make_tiny_target  # noqa: E402

from dflash_eval.cache.format import CacheSample  # noqa: E402
from dflash_eval.drafter.families import LILICORR  # noqa: E402
from dflash_eval.drafter.families.lilicorr import LiLiCorrConfig, export_config  # noqa: E402
from dflash_eval.drafter.lilicorr_drafter import LiLiCorrDrafter, save_lilicorr, without_selector  # noqa: E402
from dflash_eval.drafter.lilicorr_model import LiLiCorrHead  # noqa: E402
from dflash_eval.drafter.model import load_drafter  # noqa: E402
from dflash_eval.replay.anchors import chain_walk, iter_anchor_drafts  # noqa: E402
from dflash_eval.replay.chain import replay_batch  # noqa: E402
from dflash_eval.replay.expected import response_expectations  # noqa: E402
from dflash_eval.replay.online import spec_generate  # noqa: E402
from dflash_eval.replay.policies import DraftSetting  # noqa: E402
from dflash_eval.replay.sampling import SamplingSetting  # noqa: E402
from dflash_eval.replay.selector import walks  # noqa: E402

LAYERS, B = [1, 3], 5
GEOMETRY = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16, "lilicorr_num_layers": 1,
            "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
            "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}
PROMPTS = [[1, 40, 41, 42, 2, 1, 50], [1, 60, 61, 2, 1, 50, 51, 52], [1, 70, 2, 1, 50]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import load_embed_and_head

    d = tmp_path_factory.mktemp("lilicorr")
    target_dir = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    cfg, backbone = make_random_drafter(d / "backbone", target_dir, LAYERS, block_size=B)
    geometry = LiLiCorrConfig.from_dict({"dflash_config": GEOMETRY}, model_hidden=64)
    torch.manual_seed(1)
    head = LiLiCorrHead(geometry, 64, B, 1e-6)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    model = LiLiCorrDrafter(without_selector(backbone), head, geometry, export_config(cfg, geometry))
    folder = save_lilicorr(model, d / "lilicorr")  # bf16 on disk; everything below uses the loaded drafter
    target, _, _ = load_target(target_dir, "cpu", "float32")
    embed, lm_head = (w.float() for w in load_embed_and_head(target_dir))
    return {"target": target, "drafter": load_drafter(folder), "embed": embed, "head": lm_head}


def _sample(target, ids: list[int], P: int, index: int, max_new: int) -> CacheSample:
    """The cache's sample of a completion: the target's states at LAYERS over prompt + completion."""
    full = torch.tensor(ids)
    with torch.inference_mode():
        o = target(input_ids=full[None], output_hidden_states=True)
    hidden = torch.stack([o.hidden_states[k + 1][0] for k in LAYERS], dim=1)
    return CacheSample(index, f"s{index}", full, P, hidden, o.logits[0].argmax(-1), "length", max_new)


@pytest.fixture(scope="module")
def greedy(tiny):
    """Per prompt: the online loop's result and the cache sample of its completion (max_new_tokens 20)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        o = spec_generate(tiny["target"], tiny["drafter"], tiny["embed"], tiny["head"], prompt, 20, stop_ids=[])
        out.append((o, _sample(tiny["target"], prompt + o.completion_ids, len(prompt), i, 20)))
    return out


def test_loaded_drafter_is_lilicorr(tiny):
    d = tiny["drafter"]
    assert d.family is LILICORR and d.family.selects_candidates and d.family.walk_reads_context


def test_online_equals_offline_per_step_at_temperature_zero(tiny, greedy):
    d, embed, head = tiny["drafter"], tiny["embed"], tiny["head"]
    samples = [s for _, s in greedy]
    sequential = replay_batch(d, embed, head, samples, B)
    drafts = list(iter_anchor_drafts(d, embed, head, samples, B))
    for (online, s), seq, dr in zip(greedy, sequential, drafts):
        with torch.inference_mode():  # lossless: the online completion is the target's greedy decoding
            ref = tiny["target"].generate(s.input_ids[None, : s.prompt_len], max_new_tokens=20, do_sample=False,
                                          eos_token_id=None, pad_token_id=3)[0, s.prompt_len:].tolist()
        assert online.completion_ids == ref and sum(online.acceptance_lengths) == 20 - 1
        assert online.acceptance_lengths == seq == chain_walk(dr.accepted.tolist(), dr.prompt_len, dr.n_tokens)
    w = [walks(dr.accepted.tolist(), dr.oracle.tolist(), dr.unary_accepted.tolist(), dr.limit.tolist(),
               dr.in_candidates.tolist(), dr.prompt_len, dr.n_tokens) for dr in drafts]
    # the head matters (its path is not the backbone's chain at some anchor) and never beats the lattice oracle
    assert any(bool((dr.accepted != dr.unary_accepted).any()) for dr in drafts)
    assert all(bool((dr.accepted <= dr.oracle).all()) for dr in drafts)
    assert [len(x.chain) for x in w] == [len(o.acceptance_lengths) for o, _ in greedy]


def test_expected_survival_argmax_is_the_greedy_walk_and_reference_tends_to_it(tiny, greedy):
    d, embed, head = tiny["drafter"], tiny["embed"], tiny["head"]
    samples = [s for _, s in greedy]
    ones = [{"T1": torch.ones(len(s.input_ids))} for s in samples]  # p = 1 at every cached token
    settings = [DraftSetting(SamplingSetting(1.0), "argmax"), DraftSetting(SamplingSetting(1e-4), "reference")]
    # p_tokens are keyed by the setting's label; both settings' p are 1 at the cached tokens
    p_tokens = [{st.setting.label: p["T1"] for st in settings} for p in ones]
    drafts = list(iter_anchor_drafts(d, embed, head, samples, B, sampling=settings, p_tokens=p_tokens))
    greedy_tau = [sum(o.acceptance_lengths) / len(o.acceptance_lengths) for o, _ in greedy]
    for st in settings:
        exp = response_expectations([dr.survival[st.label] for dr in drafts], [dr.prompt_len for dr in drafts],
                                    [dr.n_tokens for dr in drafts], B)
        # with p = 1, beta = min(1, q / p) = q: the argmax policy accepts exactly the greedy walk's drafts
        assert [e.tau for e in exp] == pytest.approx(greedy_tau, abs=1e-6)
