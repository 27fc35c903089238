"""Trainer: held-out split, mask token choice, reproducibility, CPU smoke run, loss against a hand computation."""

from __future__ import annotations

import json
import math
import types

import pytest
import torch

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.train import TrainConfig, block_loss, build_train_prompts, pick_mask_token, sample_anchors, train
from tiny import make_tiny_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    make_tiny_target(d / "target", num_layers=4, hidden=64, seed=0)
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(12):
        p = torch.randint(4, 300, (6 + i % 5,), generator=g).tolist()
        c = torch.randint(4, 300, (20 + 3 * i,), generator=g).tolist()
        rows.append({"id": f"s{i}", "prompt_ids": p, "completion_ids": c, "max_new_tokens": 64, "stop_reason": "length"})
    (d / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return d


@pytest.mark.slow
def test_sharegpt_split_holds_out_every_demo_prompt(tiny):
    from dflash_eval.data.prompts import build_prompt_set, read_prompts

    info = build_train_prompts(tiny / "target", tiny / "train_prompts.jsonl", holdout_n=64, limit=0)
    train_ids = {r["id"] for r in read_prompts(tiny / "train_prompts.jsonl")}
    # the demo's ShareGPT subsets (n <= holdout_n, seed 0, same length filter) are all held out
    for n in (16, 32, 64):
        demo = {r["id"] for r in build_prompt_set("sharegpt", tiny / "target", n=n, seed=0, max_prompt_tokens=1024)}
        assert demo <= set(info["holdout_ids"])
        assert not demo & train_ids
    human = {r["id"] for r in build_prompt_set("humaneval", tiny / "target", n=0, seed=0)}
    assert not human & train_ids
    assert info["n_train"] == len(train_ids) > 1000


def test_mask_token_is_an_unused_special_token():
    added = {i: types.SimpleNamespace(special=True) for i in range(6)}
    tok = types.SimpleNamespace(all_special_ids=[0, 1, 2], added_tokens_decoder=added, bos_token_id=1,
                                eos_token_id=2, pad_token_id=2, unk_token_id=None)
    assert pick_mask_token(tok, [[7, 8, 5], [9]]) == 4  # 5 occurs in the data, 0-2 are reserved/seen... 4 is free
    assert pick_mask_token(tok, [[3, 4, 5]]) == 0
    with pytest.raises(InputError, match="no unused special token"):
        pick_mask_token(tok, [[0, 3, 4, 5]])


def test_random_init_demo_drafter_uses_an_unused_special_mask_token(tiny, tmp_path):
    """Random-init demo drafters used vocab_size - 1, an ordinary BPE token, as the mask
    token; they now follow the trainer's rule (an existing special token, not bos/eos/pad/unk)."""
    from transformers import AutoTokenizer

    from dflash_eval.stages.demo_checkpoint import write_demo_checkpoint

    out = write_demo_checkpoint(tiny / "target", tmp_path / "d.pt", random_init=True, layer_ids=[1, 2], block_size=4)
    mask = torch.load(out, weights_only=True)["draft_config"]["dflash_config"]["mask_token_id"]
    tok = AutoTokenizer.from_pretrained(str(tiny / "target"))
    assert mask == pick_mask_token(tok) == tok.convert_tokens_to_ids("<|im_start|>")  # ids 0, 2, 3: bos/eos/pad
    assert mask != len(tok) - 1 and tok.added_tokens_decoder[mask].special
    ckpt = torch.load(out, weights_only=True)
    assert "optimizer" not in ckpt and ckpt["random_init"] is True  # a random-init drafter is written alone
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(ckpt["model"])  # with the target copies strip compares


def test_anchors_stay_in_the_completion():
    g = torch.Generator().manual_seed(0)
    a, ok = sample_anchors(torch.tensor([3, 5]), torch.tensor([10, 7]), 6, g, 10)
    for row, p, t in zip(range(2), (3, 5), (10, 7)):
        valid = a[row][ok[row]]
        assert valid.numel() == min(6, t - 1 - p)
        assert ((valid >= p) & (valid <= t - 2)).all()
        assert len(set(valid.tolist())) == valid.numel()  # without replacement


def test_block_loss_matches_hand_computation():
    """One block, B=4: CE over slots 1..3 of labels x[a+1..a+3], weights exp(-(k-1)/gamma)."""
    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig

    cfg = DrafterConfig.from_dict({"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 24, "vocab_size": 20,
                                   "dflash_config": {"target_layer_ids": [0], "mask_token_id": 19, "block_size": 4}})
    torch.manual_seed(0)
    d = DFlashDrafter(cfg)
    embed, head = torch.randn(20, 16), torch.randn(20, 16)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    hidden = torch.randn(1, 8, 16)
    anchors, valid = torch.tensor([[5]]), torch.tensor([[True]])  # labels 9, 10, then past the end
    loss, stats = block_loss(d, embed, head, hidden, ids, torch.tensor([8]), anchors, valid, 4, gamma=2.0)
    pos = torch.arange(8)[None]
    h = d(embed[torch.tensor([[8, 19, 19, 19]])], torch.tensor([[5, 6, 7, 8]]), d.context_kv(hidden, pos), pos,
          pos < 5)
    logp = torch.log_softmax(h[0, 1:] @ head.T, -1)
    ce = [-logp[0, 9], -logp[1, 10]]  # slot 3 (position 8) is past the sequence: unscored
    w = [1.0, math.exp(-1 / 2.0)]
    assert loss.item() == pytest.approx(float((w[0] * ce[0] + w[1] * ce[1]) / (w[0] + w[1])), rel=1e-5)


def test_cpu_smoke_run_is_reproducible(tiny):
    cfg = TrainConfig(block_size=8, num_layers=1, target_layer_ids=[0, 2], mask_token_id=383, seqs_per_step=4,
                      anchors=4, max_steps=6, save_steps=[2], seed=3, log_every=1)
    losses = []
    for run in ("a", "b"):
        saved = train(tiny / "target", tiny / "data.jsonl", tiny / run, cfg, device="cpu")
        assert [p.name for p in saved] == ["step2.pt", "step6.pt"]
        log = [json.loads(line) for line in (tiny / run / "train_log.jsonl").read_text().splitlines()]
        losses.append([r["loss"] for r in log])
    assert losses[0] == losses[1]  # same seed, same losses (first step included)
    assert math.isfinite(losses[0][0])
    ck = torch.load(tiny / "a" / "step6.pt", weights_only=True)
    assert ck["step"] == 6 and "optimizer" in ck and "embed_tokens.weight" in ck["model"]
    assert ck["draft_config"]["dflash_config"]["mask_token_id"] == 383


def test_trainer_and_replay_build_the_same_blocks_and_logits():
    """The trainer optimises what the replay measures: on a drafter with non-default ``input_embedding_scale``,
    ``output_multiplier`` and logit softcap, the trainer's per-anchor logits equal the replay's one-block logits
    (:func:`dflash_eval.replay.chain._single_block_logits`, the block built by ``make_block``) and a hand computation of
    the DFlash block (anchor + mask tokens embedded x scale; head x multiplier; tanh softcap). Dropping any of the
    three in the trainer or in the drafter's shared methods breaks one of the equalities."""
    from dflash_eval.cache.format import CacheSample
    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig
    from dflash_eval.replay.chain import _single_block_logits
    from dflash_eval.drafter.train import block_logits

    scale, mult, cap = 2.5, 0.7, 3.0
    cfg = DrafterConfig.from_dict({"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 24, "vocab_size": 20,
                                   "input_embedding_scale": scale, "output_multiplier": mult,
                                   "final_logit_softcapping": cap,
                                   "dflash_config": {"target_layer_ids": [0], "mask_token_id": 19, "block_size": 4}})
    torch.manual_seed(0)
    d = DFlashDrafter(cfg).eval()
    embed, head = torch.randn(20, 16), torch.randn(20, 16) * 4  # large logits: the softcap matters
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    hidden = torch.randn(1, 10, 16)
    anchors = torch.tensor([[3, 5]])
    with torch.no_grad():
        trainer, _, _ = block_logits(d, embed, head, hidden, ids, anchors, 4)
        sample = CacheSample(index=0, sample_id="s", input_ids=ids[0], prompt_len=2, hidden=hidden[0][:, None],
                             target_argmax=ids[0], stop_reason="length", max_new_tokens=64)
        pos = torch.arange(10)[None]
        for r, a in enumerate(anchors[0].tolist()):
            replay = _single_block_logits(d, embed, head, sample, a, 4)[1:]
            block = torch.cat([embed[ids[0, a]][None], embed[19][None].expand(3, -1)]) * scale  # [anchor, MASK x 3]
            h = d(block[None], torch.arange(a, a + 4)[None], d.context_kv(hidden, pos), pos, pos < a)[0, 1:]
            hand = torch.tanh(h @ head.T * mult / cap) * cap
            assert torch.allclose(trainer[r], hand, atol=1e-5), (a, (trainer[r] - hand).abs().max())
            assert torch.allclose(replay, hand, atol=1e-5), (a, (replay - hand).abs().max())
            assert hand.abs().max() > 0.9 * cap  # the cap is active: without it the values would differ


# --------------------------------------------------------------------------- DFlash 2
def tiny_dflash2_config(vocab: int = 5, hidden: int = 2, top_k: int = 2) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "head_dim": hidden, "intermediate_size": 4, "vocab_size": vocab,
            "dflash_config": {"target_layer_ids": [0], "mask_token_id": 0, "block_size": 3, "conv_kernel_size": 1,
                              "conv_group_size": 1, "selector_rank": 1, "selector_top_k": top_k}}


def hand_selector():
    """vocab 5, hidden 2, rank 1, top-2; h = (1, 0), (2, 0) -> projections 1, 2."""
    from dflash_eval.drafter.model import CandidateSelector, DrafterConfig

    sel = CandidateSelector(DrafterConfig.from_dict(tiny_dflash2_config()))
    with torch.no_grad():
        sel.hidden_projection.weight[:] = torch.tensor([[1.0, 0.0]])
        sel.predecessor_codebook[:] = torch.tensor([[-1.0], [1.0], [0.0], [1.0], [0.5]])
        sel.successor_codebook[:] = torch.tensor([[0.0], [1.0], [0.5], [0.0], [2.0]])
    return sel


def test_selector_loss_matches_hand_computation():
    """Anchor 3, labels (1, 4). Slot 1 after 3 (gate 1): candidates 0, 1 scored 3 + 0, 2.5 + 1; the label is
    candidate 1. Slot 2 after the label 1 (gate 2): candidates 2, 3, the label 4 missing, so it replaces 3 in the
    loss: scored 2 + 2 x 0.5 = 3 and -3 + 2 x 2 = 1, class 1. Metrics on the strict candidates: recall 1/2; the
    teacher-forced pick at slot 2 is 2 (3 vs 1.8 for 3): accuracy 1/2; the self-conditioned path (1, 2) accepts 1
    draft, as does the oracle (slot 2's label is no candidate)."""
    from dflash_eval.drafter.train import selector_loss

    sel = hand_selector()
    hidden = torch.tensor([[[1.0, 0.0], [2.0, 0.0]]], requires_grad=True)
    logits = torch.tensor([[[3.0, 2.5, 0.0, -1.0, -2.0], [0.0, 1.0, 2.0, 1.8, -3.0]]], requires_grad=True)
    weights = torch.tensor([[1.0, 0.5]])
    loss, stats = selector_loss(sel, hidden, logits, torch.tensor([3]), torch.tensor([[1, 4]]), weights)
    ce1, ce2 = math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(2.0))
    assert loss.item() == pytest.approx((ce1 + 0.5 * ce2) / 1.5, rel=1e-6)
    assert stats == {"selector_loss": pytest.approx(loss.item()), "candidate_recall_at_k": 0.5, "selector_acc": 0.5,
                     "tau_proxy": 2.0, "tau_proxy_oracle": 2.0}
    loss.backward()
    # the selector loss reaches the codebooks, the projection and the backbone (its states and logits)
    assert sel.predecessor_codebook.grad[[3, 1]].abs().min() > 0 and sel.predecessor_codebook.grad[[0, 2, 4]].eq(0).all()
    assert sel.successor_codebook.grad[[0, 1, 2, 4]].abs().min() > 0 and sel.successor_codebook.grad[3].eq(0).all()
    assert hidden.grad[..., 0].abs().min() > 0 and logits.grad[0, 1, [2, 4]].abs().min() > 0
    # an unscored slot (weight 0) drops out of the loss and the rates
    loss1, stats1 = selector_loss(sel, hidden, logits, torch.tensor([3]), torch.tensor([[1, 4]]), torch.tensor([[1.0, 0.0]]))
    assert loss1.item() == pytest.approx(ce1, rel=1e-6)
    assert (stats1["candidate_recall_at_k"], stats1["selector_acc"], stats1["tau_proxy"]) == (1.0, 1.0, 2.0)


def test_teacher_forced_scores_equal_the_selector_walk():
    """The trainer's all-slots scores equal the selector's slot-by-slot walk given the same predecessors."""
    from dflash_eval.drafter.model import CandidateSelector, DrafterConfig

    torch.manual_seed(0)
    sel = CandidateSelector(DrafterConfig.from_dict(tiny_dflash2_config(vocab=40, hidden=8, top_k=5)))
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_()
    hidden, logits = torch.randn(3, 4, 8), torch.randn(3, 4, 40)
    anchors, tokens = torch.randint(0, 40, (3,)), torch.randint(0, 40, (3, 4))
    walk = sel(hidden, logits, anchors, predecessors=tokens)  # slot j scored after tokens[:, j-1], the anchor first
    prev = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
    assert torch.allclose(sel.teacher_forced_scores(hidden, logits, prev, walk.candidates), walk.scores, atol=1e-5)
    assert not torch.allclose(sel.teacher_forced_scores(hidden, logits, tokens, walk.candidates), walk.scores, atol=1e-2)


def test_identity_convs_make_dflash2_its_dflash1_backbone():
    """A DFlash 2 drafter with :func:`identity_convs_` (the trainer's init) drafts the states of the DFlash 1 drafter
    with the same backbone weights; random convs do not."""
    from dflash_eval.drafter.demo import identity_convs_
    from dflash_eval.drafter.model import DFlashDrafter, DrafterConfig
    from fixtures.drafters import randomize_, tiny_config, tiny_config2

    d2 = randomize_(DFlashDrafter(DrafterConfig.from_dict(tiny_config2())), seed=0).eval()
    d1 = DFlashDrafter(DrafterConfig.from_dict(tiny_config())).eval()
    d1.load_state_dict({k: v for k, v in d2.state_dict().items() if "conv" not in k and "selector" not in k})
    gen = torch.Generator().manual_seed(1)
    ctx, emb = torch.randn(1, 12, 3 * 64, generator=gen), torch.randn(1, 8, 64, generator=gen)
    pos = torch.arange(12)[None]

    def states(d):
        with torch.no_grad():
            return d(emb, torch.arange(12, 20)[None], d.context_kv(ctx, pos), pos, pos < 12)

    assert (states(d2) - states(d1)).abs().max() > 1e-2
    identity_convs_(d2)
    assert torch.allclose(states(d2), states(d1), atol=1e-5)


def test_cpu_smoke_run_dflash2(tiny):
    """``--variant dflash2``: the checkpoint holds a DFlash 2 drafter (config fields, conv and selector tensors) and
    every step's log line has the selector metrics, rates in [0, 1] and the proxies ordered unary/selector <= oracle."""
    cfg = TrainConfig(block_size=4, num_layers=1, target_layer_ids=[0, 2], mask_token_id=383, seqs_per_step=4,
                      anchors=4, max_steps=3, seed=3, log_every=1, variant="dflash2", conv_group_size=16,
                      selector_rank=4, selector_top_k=8)
    saved = train(tiny / "target", tiny / "data.jsonl", tiny / "d2", cfg, device="cpu")
    ck = torch.load(saved[-1], weights_only=True)
    dc = ck["draft_config"]["dflash_config"]
    assert ck["draft_config"]["architectures"] == ["DFlash2DraftModel"]
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (2, 16, 4, 8)
    assert ck["model"]["candidate_selector.predecessor_codebook"].shape == (384, 4)
    assert ck["model"]["layers.0.mlp_conv.base_kernel"].shape == (2, 2, 64)
    log = [json.loads(line) for line in (tiny / "d2" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3]
    for r in log:
        assert 0 <= r["candidate_recall_at_k"] <= 1 and 0 <= r["selector_acc"] <= 1
        assert max(r["tau_proxy"], r["tau_proxy_unary"]) <= r["tau_proxy_oracle"] + 1e-9
        assert r["loss"] == pytest.approx(r["unary_loss"] + r["selector_loss"], rel=1e-5)


@pytest.mark.parametrize("flags, problem", [
    (["--selector-rank", "0"], "must be >= 1"),
    (["--conv-group-size", "24"], "24 does not divide hidden_size 64"),
])
def test_dflash2_flags_refused(tiny, tmp_path, flags, problem):
    import argparse

    from dflash_eval.drafter import train as train_mod

    p = argparse.ArgumentParser()
    train_mod.add_arguments(p)
    args = p.parse_args(["--target", str(tiny / "target"), "--data", str(tiny / "data.jsonl"), "--out-dir",
                         str(tmp_path), "--variant", "dflash2", "--device", "cpu", "--max-steps", "1", *flags])
    with pytest.raises(InputError) as exc:
        train_mod.main(args, None)
    assert problem in exc.value.problem
