"""LiLiCorr as a registered family: loaded and stripped through the family, and its candidate walk (``select``) as
the replay calls it, against the walks of :mod:`dflash_eval.drafter.lilicorr_drafter` and a hand-computed lattice."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_lilicorr import random_model

from dflash_eval.drafter.families import LILICORR, Selection, WalkContext, family_of_config
from dflash_eval.drafter.lilicorr_drafter import (
    LiLiCorrDrafter,
    anchor_rows,
    rerank_block,
    save_lilicorr,
    trajectory_probs,
)
from dflash_eval.drafter.model import load_drafter
from dflash_eval.stages.strip_drafter import strip_checkpoint


def _context(model, n=3, seed=1, valid=(True, True, False)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 3, 32, generator=g)  # [N, S = block 4 - 1, H]
    embed, head = torch.randn(50, 32, generator=g), torch.randn(50, 32, generator=g)
    target = torch.randn(n, 2 * 32, generator=g)  # the two target layers' row before each anchor
    ctx = WalkContext(embed, target, torch.tensor(valid))
    return hidden, head, embed, target, ctx


def test_load_drafter_and_strip_route_through_the_family(tmp_path):
    model = random_model()
    folder = save_lilicorr(model, tmp_path / "saved")
    assert family_of_config(json.loads((folder / "config.json").read_text())) is LILICORR
    back = load_drafter(folder)
    assert isinstance(back, LiLiCorrDrafter) and back.family is LILICORR and not back.training
    assert back.cfg.block_size == 4 and back.geometry == model.geometry
    out = strip_checkpoint(folder, tmp_path / "stripped")  # strip_drafter sends it to strip_lilicorr
    keys = set(load_file(str(out / "model.safetensors")))
    assert "lilicorr.out_head.weight" in keys and "fc.weight" in keys
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LiLiCorrDraftModel"]
    assert isinstance(load_drafter(out), LiLiCorrDrafter)


def test_select_is_the_reranked_path_of_rerank_block():
    model = random_model().eval()
    hidden, head, embed, target, ctx = _context(model)
    sel = model.propose(hidden, torch.zeros(3, dtype=torch.long), head, context=ctx)
    starts = torch.tensor([1, 1, 0])  # rows 0, 1 have a row before the anchor; row 2 none
    anchor, valid = anchor_rows(model.backbone, target[:, None], starts, torch.arange(3))
    ref = rerank_block(model, hidden, head, embed, anchor, valid)
    assert isinstance(sel, Selection) and sel.probs is None
    assert torch.equal(sel.path, ref.path) and torch.equal(sel.candidates, ref.candidates)
    assert torch.equal(sel.scores[:, 0], ref.start)
    with pytest.raises(ValueError, match="WalkContext"):
        model.propose(hidden, torch.zeros(3, dtype=torch.long), head)


def test_teacher_forced_scores_give_the_trajectory_probs():
    model = random_model(seed=2).eval()
    hidden, head, embed, target, ctx = _context(model, seed=3)
    logits = model.logits(hidden, head)
    cand = logits.topk(4, dim=-1).indices
    tokens = torch.stack([cand[:, 0, 1], cand[:, 1, 2], cand[:, 2, 0]], 1)  # a trajectory through the lattice
    tokens[2, 1] = 49 if 49 not in cand[2, 1] else 48  # row 2: slot 2 misses, slot 3 is unreachable
    forced = model.select(hidden, logits, tokens[:, 0], predecessors=tokens, context=ctx)
    ref = rerank_block(model, hidden, head, embed, *anchor_rows(model.backbone, target[:, None],
                                                               torch.tensor([1, 1, 0])))
    for T in (0.0, 0.7):
        want = trajectory_probs(ref.start, ref.pair, ref.candidates, tokens, T)
        got = torch.where(forced.candidates == tokens[..., None],
                          torch.softmax(forced.scores / T, -1) if T else
                          torch.nn.functional.one_hot(forced.scores.argmax(-1), 4).float(), 0.0).sum(-1)
        found = (forced.candidates == tokens[..., None]).any(-1)
        torch.testing.assert_close(got * torch.cat([torch.ones(3, 1, dtype=torch.bool), found[:, :-1]], 1), want)
    assert float(want[2, 1]) == 0.0 and float(want[2, 2]) == 0.0


def test_sampled_walk_hand_computed():
    """One slot, two candidates: the row [log 3, 0] at T = 1 gives q = (3/4, 1/4); the inverse CDF picks rank 0
    for u < 3/4 (torch.rand of seed 0 draws 0.4963) and rank 1 for u >= 3/4 (seed 5 draws 0.8303)."""
    model = random_model(lilicorr_candidate_topk=2)
    model.head.log_factors = lambda s, p: (torch.tensor([[math.log(3.0), 0.0]]), torch.zeros(1, 2, 2, 2))
    model.head.forward = lambda *a: (None, None)
    hidden = torch.zeros(1, 3, 32)
    logits = torch.zeros(1, 3, 50)
    logits[..., 7], logits[..., 9] = 2.0, 1.0  # candidates (7, 9) at every slot
    ctx = WalkContext(torch.zeros(50, 32), torch.zeros(1, 64), torch.tensor([True]))
    for seed, pick in ((0, 7), (5, 9)):
        sel = model.select(hidden, logits, None, 1.0, generator=torch.Generator().manual_seed(seed), context=ctx)
        assert int(sel.path[0, 0]) == pick
        torch.testing.assert_close(sel.probs[0, 0], torch.tensor([0.75, 0.25]))
        torch.testing.assert_close(sel.probs[0, 1], torch.tensor([0.5, 0.5]))  # flat pair rows


def test_train_lilicorr_writes_the_resolved_head_width(tmp_path):
    """``--hidden-size 0`` (the backbone's width, read as such by vLLM / SGLang) is written as the width: 64 for the
    trained tiny backbone; a LiLiCorr folder saved with 0 is continued with the width too."""
    from test_workflow import TRAINED_DRAFTER

    from dflash_eval.drafter.train_lilicorr import LiLiCorrTrainConfig, initial_model

    model = initial_model(LiLiCorrTrainConfig(candidate_topk=4, hidden_size=0, num_heads=2, factor_dim=8,
                                              init_from=str(TRAINED_DRAFTER)))
    assert model.geometry.hidden_size == 64 and model.head.hidden == 64
    zero = random_model(lilicorr_hidden_size=0)  # a 32-wide backbone saved with lilicorr_hidden_size 0
    folder = save_lilicorr(zero, tmp_path / "zero")
    assert json.loads((folder / "config.json").read_text())["dflash_config"]["lilicorr_hidden_size"] == 0
    assert initial_model(LiLiCorrTrainConfig(init_from=str(folder))).geometry.hidden_size == 32
