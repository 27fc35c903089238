"""Offline replay == the reference online loop per verify step, past a sliding window and past the trained length.

The reference is ``dflash==0.1.0``'s ``dflash_generate`` (its draft ``DynamicCache`` keeps only the last
``sliding_window - 1`` keys of a windowed layer and is cropped every step) driving the reference
``DFlashDraftModel`` / ``DFlash2DraftModel``; the target is :class:`test_parity.ScriptedTarget`, which
records every verify block it is given (the anchor position and ``[x[t], drafts...]``). Each case checks,
per sample and per verify step: the acceptance lengths of the sequential replay (``replay_batch``) and of
the all-anchor pass evaluate uses (``iter_anchor_drafts`` + ``chain_walk``, every layout), the drafts of
the all-anchor pass at the anchors the online loop visited (every slot of the block, accepted or not),
and the tokens each step committed.

Samples: two prompts (one longer than the window, one shorter) whose prompt + response is 3x-6x the
window, so that the window is crossed inside the response; random tiny drafters (hidden 64, block 8),
float32 on the CPU.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

import dflash.model as dflash_model
from transformers import Qwen3Config

from dflash_eval.cache.format import CacheSample
from dflash_eval.drafter.checkpoints import saved_codebook_names
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.replay.anchors import LAYOUTS, chain_walk, iter_anchor_drafts
from dflash_eval.replay.chain import replay_batch
from fixtures.drafters import (HIDDEN, LAYER_IDS, TARGET_LAYERS, VOCAB, randomize_, randomize_dflash2_, tiny_config,
                               tiny_config2)
from test_parity import ScriptedTarget

B = 8


def all_sliding(cfg: dict) -> dict:
    """``cfg`` with every layer ``sliding_attention`` (the public card's 'every draft layer is sliding')."""
    return dict(cfg, layer_types=["sliding_attention"] * cfg["num_hidden_layers"])


def trained_len(cfg: dict, max_len: int) -> dict:
    """``cfg`` recording a training length (``dflash_config.training.max_len``) and a matching RoPE length."""
    cfg = copy.deepcopy(cfg)
    cfg["dflash_config"]["training"] = {"max_len": max_len}
    cfg["max_position_embeddings"] = max_len
    return cfg


#: name -> (config, window or None, dflash 2?)
CASES = {
    # 2 sliding + 1 full (the '4 sliding + 1 full' layout, scaled down), window 8: samples 9x the window
    "sliding+full-w8": (tiny_config(sliding=True, layers=3, window=8, block_size=B), 8, False),
    # every layer sliding, window 8 and 16 (the window wider than the block: the cache keeps whole blocks)
    "all-sliding-w8": (all_sliding(tiny_config(sliding=True, layers=3, window=8, block_size=B)), 8, False),
    "all-sliding-w16": (all_sliding(tiny_config(sliding=True, layers=3, window=16, block_size=B)), 16, False),
    # a window smaller than the block: the block itself is cut by it
    "all-sliding-w5": (all_sliding(tiny_config(sliding=True, layers=3, window=5, block_size=B)), 5, False),
    # trained on 24 tokens, replayed on ~80: RoPE positions and the context past the trained length
    "trained-len-24": (trained_len(tiny_config(block_size=B), 24), None, False),
    "trained-len-24-sliding": (trained_len(tiny_config(sliding=True, layers=3, window=8, block_size=B), 24), 8, False),
    "trained-len-24-yarn": (dict(trained_len(tiny_config(block_size=B), 24), rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24}), None, False),
    # DFlash 2 (non-causal windowed layers, as the published DFlash 2 drafter)
    "dflash2-sliding+full-w8": (tiny_config2(sliding=True, layers=3, window=8, block_size=B), 8, True),
    "dflash2-all-sliding-w16": (all_sliding(tiny_config2(sliding=True, layers=3, window=16, block_size=B)), 16, True),
    "dflash2-trained-len-24": (trained_len(tiny_config2(sliding=True, layers=3, window=8, block_size=B), 24), 8, True),
}


class RecordingTarget(ScriptedTarget):
    """:class:`ScriptedTarget` that also records each verify block ``(anchor position, token ids)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.blocks: list[tuple[int, list[int]]] = []

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=False, logits_to_keep=0,
                output_hidden_states=False):
        if logits_to_keep != 1:
            self.blocks.append((int(position_ids[0, 0]), input_ids[0].tolist()))
        return super().forward(input_ids, position_ids, past_key_values, use_cache, logits_to_keep,
                               output_hidden_states)


def make_pair(cfg: dict, dflash2: bool, seed: int):
    """(reference draft model, our drafter) with the same random float32 weights; the reference's window checked."""
    ref_cls, fill = ((dflash_model.DFlash2DraftModel, randomize_dflash2_) if dflash2
                     else (dflash_model.DFlashDraftModel, randomize_))
    ref = fill(ref_cls(Qwen3Config(**copy.deepcopy(cfg))), seed).eval()
    ours = DFlashDrafter(DrafterConfig.from_dict(cfg))
    state = dict(ref.state_dict())
    if dflash2:
        saved_codebook_names(state, "ref")  # the reference's nn.Embedding codebooks carry .weight
    ours.load_state_dict(state, strict=True)
    assert [layer.self_attn.sliding_window for layer in ref.layers] == \
           [layer.self_attn.window for layer in ours.layers]
    return ref, ours.eval()


def online_and_samples(ref, prompt_lens, max_new, seed):
    """Run ``dflash_generate`` per prompt; returns the cache samples, acceptance lengths and recorded blocks."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randn(TARGET_LAYERS + 1, max(prompt_lens) + max_new + 1, HIDDEN, generator=gen)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    samples, lengths, blocks = [], [], []
    for i, prompt_len in enumerate(prompt_lens):
        target = RecordingTarget(table, embed, head, accept=lambda s: (s * 2654435761 % 2**32 >> 16) % B)
        prompt = torch.randint(0, VOCAB - 1, (1, prompt_len), generator=gen)
        res = dflash_model.dflash_generate(ref, target, prompt, max_new, stop_token_ids=None, return_stats=True)
        ids = res.output_ids[0]
        hidden = table[[j + 1 for j in LAYER_IDS], : len(ids)].transpose(0, 1)  # [T, K, H]
        samples.append(CacheSample(i, f"s{i}", ids, prompt_len, hidden, ids.clone(), "length", max_new))
        lengths.append(res.acceptance_lengths)
        blocks.append(target.blocks)
    return samples, lengths, blocks, embed, head


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_replay_equals_online_per_step_past_window_and_trained_length(case, monkeypatch):
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU run
    cfg, window, dflash2 = CASES[case]
    ref, ours = make_pair(cfg, dflash2, seed=7)
    prompt_lens, max_new = (11, 4), 70
    samples, want, blocks, embed, head = online_and_samples(ref, prompt_lens, max_new, seed=8)
    span = window or cfg["dflash_config"]["training"]["max_len"]
    for s, acc in zip(samples, want):
        assert len(s.input_ids) >= 3 * span  # prompt + response: at least 3 windows / trained lengths
        assert len(set(acc)) >= 4 and sum(acc) == len(s.input_ids) - s.prompt_len - 1  # varied, whole response
    assert any(s.prompt_len < span for s in samples)  # the window / trained length crossed inside the response
    # the sequential replay (reference order) and the all-anchor pass evaluate runs, every layout
    assert replay_batch(ours, embed, head, samples) == want
    for layout in LAYOUTS:
        drafts = list(iter_anchor_drafts(ours, embed, head, samples, full=True, layout=layout))
        assert [chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens) for d in drafts] == want, layout
        for s, d, acc, steps in zip(samples, drafts, want, blocks):
            assert len(steps) == len(acc)
            start = s.prompt_len
            for (pos, block), produced in zip(steps, acc):
                assert pos == start  # the online loop visited exactly the replay's anchors
                vs = len(block)
                # every drafted slot, accepted or not, is the reference's draft
                assert d.greedy[start - s.prompt_len, : vs - 1].tolist() == block[1:], (layout, start)
                # the tokens this step committed: the block's accepted drafts, then the target's token
                committed = s.input_ids[start + 1: start + produced + 1].tolist()
                assert committed[:-1] == block[1:produced] and len(committed) == produced
                start += produced
            assert start == len(s.input_ids) - 1
    if window is not None:  # the test can fail: the same drafter without its windows drafts otherwise
        windows = [layer.self_attn.window for layer in ours.layers]
        for layer in ours.layers:
            layer.self_attn.window = None
        assert replay_batch(ours, embed, head, samples) != want
        for layer, w in zip(ours.layers, windows):
            layer.self_attn.window = w


#: RoPE whose frequencies change with the sequence length, fixed up to 24 tokens
LENGTH_ROPE = {
    "dynamic": {"max_position_embeddings": 24, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    "longrope": {"max_position_embeddings": 96, "rope_scaling": {
        "rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
        "original_max_position_embeddings": 24}},
}


@pytest.mark.parametrize("kind", sorted(LENGTH_ROPE))
@torch.no_grad()
def test_length_dependent_rope_equal_within_its_length_refused_past_it(kind, monkeypatch):
    """``dynamic`` / ``longrope`` RoPE: the replay equals the online loop while every position stays within the
    fixed length (24 tokens); past it the online loop's per-step frequencies give other drafts, and
    :func:`check_rope_length` (called by evaluate with the longest sample + B - 2) refuses, naming the field."""
    from dflash_eval.core.errors import InputError
    from dflash_eval.drafter.rope import check_rope_length, rope_fixed_length

    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU run
    cfg = {**tiny_config(block_size=B), **LENGTH_ROPE[kind]}
    ref, ours = make_pair(cfg, False, seed=7)
    assert rope_fixed_length(ours.cfg) == 24
    # within: T <= 4 + 13 = 17 tokens, positions up to T + B - 3 = 22 < 24 (a fresh reference module)
    samples, want, _, embed, head = online_and_samples(ref, (4,), 13, seed=8)
    assert len(samples[0].input_ids) == 17 and len(want[0]) >= 3
    assert replay_batch(ours, embed, head, samples) == want
    assert [chain_walk(d.accepted.tolist(), d.prompt_len, d.n_tokens)
            for d in iter_anchor_drafts(ours, embed, head, samples)] == want
    check_rope_length(ours.cfg, 17 + B - 2, "config.json")  # 23 <= 24: accepted
    # past it: ~82 tokens
    ref, ours = make_pair(cfg, False, seed=7)
    samples, want, _, embed, head = online_and_samples(ref, (11, 4), 70, seed=8)
    assert replay_batch(ours, embed, head, samples) != want
    longest = max(len(s.input_ids) for s in samples) + B - 2
    with pytest.raises(InputError) as err:
        check_rope_length(ours.cfg, longest, "config.json")
    assert err.value.field == "rope_scaling.rope_type" and f"past 24 tokens and the replay needs {longest}" in str(err.value)
    with pytest.raises(InputError):
        check_rope_length(ours.cfg, 25, "config.json")
    assert rope_fixed_length(DrafterConfig.from_dict(CASES["trained-len-24-yarn"][0])) is None  # yarn: fixed
    assert rope_fixed_length(DrafterConfig.from_dict(tiny_config())) is None


def test_evaluate_refuses_dynamic_rope_past_its_length(tmp_path):
    """The evaluate stage runs :func:`check_rope_length` on the longest sample: a ``dynamic`` RoPE drafter with
    ``max_position_embeddings`` below the longest sample + B - 2 is refused naming ``rope_scaling.rope_type``; the
    same drafter with room for every position is evaluated."""
    import json

    from dflash_eval.core.errors import InputError
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from tiny import make_tiny_pipeline

    p = make_tiny_pipeline(tmp_path / "p", [1, 2], block_size=4, max_new_tokens=12)
    d, target_dir = p["dir"], p["target_dir"]
    extract_hidden_states(target_dir, d / "c.jsonl", d / "c.h5", layer_ids=[1, 2], device="cpu", dtype="float32")
    longest = max(len(json.loads(line)["prompt_ids"]) + len(json.loads(line)["completion_ids"])
                  for line in open(d / "c.jsonl"))
    cfg_path = d / "drafter" / "config.json"
    cfg = json.loads(cfg_path.read_text())

    def run(max_pos: int):
        cfg_path.write_text(json.dumps({**cfg, "max_position_embeddings": max_pos,
                                        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
        return evaluate(d / "drafter", d / "c.h5", target_dir, d / f"e{max_pos}.json", device="cpu", dtype="float32")

    with pytest.raises(InputError) as err:
        run(longest + 4 - 3)
    assert err.value.field == "rope_scaling.rope_type" and str(cfg_path) == err.value.file
    assert f"past {longest + 1} tokens and the replay needs {longest + 2}" in err.value.problem
    assert run(longest + 4 - 2)["n_samples"] == 3
