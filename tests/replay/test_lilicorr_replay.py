"""LiLiCorr in the replay: a tiny random DFlash backbone with a random LiLiCorr head on the tiny target (CPU float32).

* T = 0: the online loop (target in the loop, anchor row = the last accepted target row), the sequential chain
  replay and the all-anchor pass (every layout) commit the same tokens per verify step, on a DFlash 1 backbone and
  on a DFlash 2 backbone with its convs; the head's path is not the backbone's chain (tau_unary) and never beats
  the lattice oracle.
* T > 0: the all-anchor pass's expected survival under the argmax policy (the greedy walk given the trajectory)
  is the greedy chain, and under the reference at T -> 0 tends to it; per online verify step of the seeded sampler
  (the reference: the sampled walk, q on the candidates), its q of the accepted drafts and of the next token equals
  the offline pass's walk teacher-forced on the online trajectory.
* evaluate, the tau table and validate_online: variant ``lilicorr``, tau_unary / tau_oracle / recall / pick rate
  beside tau, no DDTree, the T > 0 rows' engine settings, the report's candidate table and note, the online chain
  reproducing evaluate per step.

The head's weights are N(0, 0.2^2): at N(0, 0.5^2) the random head amplifies the float32 difference between the
online loop's incremental target states and the cache's full forward past the T > 0 check's tolerance.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_workflow import PROMPTS_A, PROMPTS_B, TRAINED_DRAFTER  # noqa: E402
from tiny import make_tiny_target  # noqa: E402

from dflash_eval.cache.format import CacheSample  # noqa: E402
from dflash_eval.drafter.families import LILICORR  # noqa: E402
from dflash_eval.drafter.families.lilicorr import LiLiCorrConfig, export_config  # noqa: E402
from dflash_eval.drafter.lilicorr_drafter import LiLiCorrDrafter, save_lilicorr, without_selector  # noqa: E402
from dflash_eval.drafter.lilicorr_model import LiLiCorrHead  # noqa: E402
from dflash_eval.drafter.model import load_drafter  # noqa: E402
from dflash_eval.replay.anchors import LAYOUTS, chain_walk, iter_anchor_drafts  # noqa: E402
from dflash_eval.replay.chain import replay_batch  # noqa: E402
from dflash_eval.replay.expected import response_expectations  # noqa: E402
from dflash_eval.replay.online import spec_generate  # noqa: E402
from dflash_eval.replay.policies import DraftSetting  # noqa: E402
from dflash_eval.replay.sampling import SamplingSetting  # noqa: E402
from dflash_eval.replay.selector import walks  # noqa: E402

B = 4
GEOMETRY = {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 16, "lilicorr_num_layers": 1,
            "lilicorr_num_heads": 2, "lilicorr_mlp_ratio": 2.0, "lilicorr_factor_dim": 8,
            "lilicorr_vector_eps": 1e-4, "lilicorr_logit_scale": 8.0}
MAX_NEW = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target, the trained tiny DFlash 1 drafter (tests/fixtures/trained_drafter, block 4, layers 1-3) as
    the backbone of a random LiLiCorr head (saved and loaded: bf16 weights), the tiny workflow's prompts."""
    from transformers import AutoTokenizer

    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import load_embed_and_head

    d = tmp_path_factory.mktemp("lilicorr")
    target_dir = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            enable_thinking=False, return_dict=False)) for p in PROMPTS_A + PROMPTS_B]
    folder = _lilicorr(TRAINED_DRAFTER, d / "lilicorr")
    target, _, _ = load_target(target_dir, "cpu", "float32")
    embed, lm_head = (w.float() for w in load_embed_and_head(target_dir))
    drafter = load_drafter(folder)
    return {"dir": d, "target_dir": target_dir, "folder": folder, "target": target, "drafter": drafter,
            "embed": embed, "head": lm_head, "prompts": prompts, "layers": drafter.cfg.target_layer_ids}


def _lilicorr(backbone_dir, out: Path) -> Path:
    """A random LiLiCorr head (N(0, 0.2^2) weights, seed 1) on the backbone of ``backbone_dir`` (its candidate
    selector dropped, DFlash 2's convs kept), saved in the engines' layout (bf16) to ``out``."""
    backbone = load_drafter(backbone_dir)
    geometry = LiLiCorrConfig.from_dict({"dflash_config": GEOMETRY}, model_hidden=64)
    torch.manual_seed(1)
    head = LiLiCorrHead(geometry, 64, B, 1e-6)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model = LiLiCorrDrafter(without_selector(backbone), head, geometry, export_config(backbone.cfg.raw, geometry))
    return save_lilicorr(model, out)


def _sample(target, layers, ids: list[int], P: int, index: int, max_new: int) -> CacheSample:
    """The cache's sample of a completion: the target's states at ``layers`` over prompt + completion."""
    full = torch.tensor(ids)
    with torch.inference_mode():
        o = target(input_ids=full[None], output_hidden_states=True)
    hidden = torch.stack([o.hidden_states[k + 1][0] for k in layers], dim=1)
    return CacheSample(index, f"s{index}", full, P, hidden, o.logits[0].argmax(-1), "length", max_new)


@pytest.fixture(scope="module")
def greedy(tiny):
    """Per prompt: the online loop's result and the cache sample of its completion (no stop token)."""
    out = []
    for i, prompt in enumerate(tiny["prompts"]):
        o = spec_generate(tiny["target"], tiny["drafter"], tiny["embed"], tiny["head"], prompt, MAX_NEW, stop_ids=[])
        out.append((o, _sample(tiny["target"], tiny["layers"], prompt + o.completion_ids, len(prompt), i, MAX_NEW)))
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
            ref = tiny["target"].generate(s.input_ids[None, : s.prompt_len], max_new_tokens=MAX_NEW,
                                          do_sample=False, eos_token_id=None, pad_token_id=3)[0, s.prompt_len:].tolist()
        assert online.completion_ids == ref and sum(online.acceptance_lengths) == MAX_NEW - 1
        assert online.acceptance_lengths == seq == chain_walk(dr.accepted.tolist(), dr.prompt_len, dr.n_tokens)
    for layout in LAYOUTS:  # every layout of the all-anchor pass gives the same walk
        other = list(iter_anchor_drafts(d, embed, head, samples, B, layout=layout))
        assert all(torch.equal(a.accepted, b.accepted) and torch.equal(a.greedy, b.greedy)
                   for a, b in zip(drafts, other)), layout
    w = [walks(dr.accepted.tolist(), dr.oracle.tolist(), dr.unary_accepted.tolist(), dr.limit.tolist(),
               dr.in_candidates.tolist(), dr.prompt_len, dr.n_tokens) for dr in drafts]
    # the head matters (its path is not the backbone's chain at some anchor) and never beats the lattice oracle
    assert any(bool((dr.accepted != dr.unary_accepted).any()) for dr in drafts)
    assert all(bool((dr.accepted <= dr.oracle).all()) for dr in drafts)
    assert [len(x.chain) for x in w] == [len(o.acceptance_lengths) for o, _ in greedy]
    steps = [a for o, _ in greedy for a in o.acceptance_lengths]
    print(f"\nLiLiCorr online == offline on {len(steps)} verify steps; tau {len(steps) and sum(steps) / len(steps):.3f}")
    assert max(steps) > 1  # drafts were accepted: the comparison is not 1 == 1


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


def test_evaluate_and_tau_table_show_the_backbone_and_oracle_beside_lilicorr(tiny, greedy):
    import json

    from dflash_eval.report.tau_table import summary_frame
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states

    d = tiny["dir"]
    rows = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p}
            for i, p in enumerate(tiny["prompts"])]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    generate_completions(tiny["target_dir"], d / "prompts.jsonl", d / "c.jsonl", max_new_tokens=MAX_NEW,
                         batch_size=len(rows), device="cpu", dtype="float32")
    extract_hidden_states(tiny["target_dir"], d / "c.jsonl", d / "c.h5", layer_ids=tiny["layers"], device="cpu",
                          dtype="float32", final_hidden=True)
    ev = evaluate(tiny["folder"], d / "c.h5", tiny["target_dir"], d / "ev.json", device="cpu", dtype="float32",
                  ddtree_budgets=[4], sampling=[{"temperature": 0.0}, {"temperature": 1.0}], cross_temperature=True,
                  checkpoint_name="lili", prompt_set="set")
    assert ev["variant"] == "lilicorr"
    by_id = {s["id"]: s for s in ev["samples"]}
    for i, (online, _) in enumerate(greedy):  # evaluate's chain is the online loop's, step by step
        assert by_id[f"p{i}"]["acceptance_lengths"] == online.acceptance_lengths
    tau = ev["tau"]
    assert ev["tau_unary"] != tau and ev["tau_oracle"] >= tau  # the head changes the chain; the oracle bounds it
    frame = summary_frame([str(d / "ev.json")])
    t0 = frame[frame["sampling"] == "T0"].iloc[0]
    assert t0["variant"] == "lilicorr" and t0["tau"] == pytest.approx(tau)
    assert t0["tau_unary"] == pytest.approx(ev["tau_unary"]) and t0["tau_oracle"] == pytest.approx(ev["tau_oracle"])
    assert 0 <= t0["sel_pick_rate"] <= 1 and 0 <= t0["topk_recall_slot_1"] <= 1
    assert not t0["ddtree_applicable"] and math.isnan(t0.get("tau_ddtree_4", math.nan))
    # beside a DFlash 2 checkpoint (the same candidate-walk columns): each column once, both rows kept
    (d / "ev2").mkdir(exist_ok=True)
    (d / "ev2" / "ev.json").write_text(json.dumps({**ev, "variant": "dflash2", "checkpoint": "d2"}))
    both = summary_frame([str(d / "ev.json"), str(d / "ev2" / "ev.json")])
    assert not both.columns.duplicated().any() and set(both["variant"]) == {"lilicorr", "dflash2"}
    t1 = frame[frame["sampling"] != "T0"]
    assert sorted(t1["draft"]) == ["argmax", "reference"]
    engines = dict(zip(t1["draft"], t1["engine"]))
    assert "SGLANG_ENABLE_LILICORR_SAMPLING=1" in engines["reference"] and "unset" in engines["argmax"]
    assert all(1.0 <= x <= 5.0 for x in t1["tau"])
    # the report's candidate section holds the LiLiCorr row (backbone and oracle beside it) and its note
    from dflash_eval.report.tables import SELECTOR_NOTE, selector_table

    sel = selector_table(frame).iloc[0]
    assert (sel["checkpoint"], sel["tau"], sel["tau_unary"]) == ("lili", t0["tau"], t0["tau_unary"])
    assert "LiLiCorr drafters (variant `lilicorr`)" in SELECTOR_NOTE
    # the validate_online stage: the online loop reproduces evaluate's per-step acceptance (float32, chain)
    from dflash_eval.stages.validate_online import validate_online

    r = validate_online(tiny["target_dir"], d / "c.jsonl", [tiny["folder"]], [d / "ev.json"], d / "vo.json",
                        n_samples=3, ddtree_budget=0, device="cpu", dtype="float32", sampling=[])
    chain = r["checkpoints"][0]["modes"]["chain"]
    assert chain["n_same_output"] == chain["n_identical_steps"] == 3 and chain["rel_diff"] == 0



def test_online_sampler_equals_offline_survival_per_step(tiny, monkeypatch):
    """T > 0, the reference policy (the sampled walk): each online verify step's q of its accepted drafts, and of
    the token that followed them, is the offline pass's walk teacher-forced on the online trajectory. With the
    target's p set to 1 at every cached token, the offline survival is ``S[t, k] = prod_{j <= k} q_j(x_j)``, so per
    step ``S[t, a] = prod q_online(accepted drafts)`` and ``S[t, a + 1] = S[t, a] * q_online(x_{t+a+1})``."""
    import dflash_eval.replay.online as online_mod

    setting = SamplingSetting(0.1)  # the tiny target is nearly flat at T = 1: low T, so that drafts are accepted
    steps: list[tuple] = []
    real = online_mod.rejection_sample

    def recording(drafts, target_probs, draft_probs, generator=None):
        a, z = real(drafts, target_probs, draft_probs, generator=generator)
        steps.append((drafts[0].clone(), draft_probs[0].clone(), int(a)))
        return a, z

    monkeypatch.setattr(online_mod, "rejection_sample", recording)
    d, embed, head = tiny["drafter"], tiny["embed"], tiny["head"]
    checked, accepted = 0, 0
    for i, prompt in enumerate(tiny["prompts"][:4]):
        steps.clear()
        o = spec_generate(tiny["target"], d, embed, head, prompt, MAX_NEW, stop_ids=[], sampling=setting,
                          generator=torch.Generator().manual_seed(10 + i))
        s = _sample(tiny["target"], tiny["layers"], prompt + o.completion_ids, len(prompt), i, MAX_NEW)
        st = DraftSetting(setting, "reference")
        dr = next(iter_anchor_drafts(d, embed, head, [s], B, sampling=[st],
                                     p_tokens=[{setting.label: torch.ones(len(s.input_ids))}]))
        S, x, start = dr.survival[st.label], s.input_ids.tolist(), len(prompt)
        assert len(steps) == len(o.acceptance_lengths)
        for (drafts, q, a), produced in zip(steps, o.acceptance_lengths):
            t = start - len(prompt)
            assert drafts[:a].tolist() == x[start + 1: start + 1 + a]
            q_acc = torch.tensor([float(q[j, x[start + 1 + j]]) for j in range(a)]).prod()
            torch.testing.assert_close(S[t, a].float(), q_acc, atol=1e-5, rtol=1e-4)
            if a < len(drafts) and start + a + 1 < len(x):  # the token after the accepted drafts
                torch.testing.assert_close(S[t, a + 1].float(), q_acc * q[a, x[start + a + 1]], atol=1e-5, rtol=1e-4)
            checked, accepted = checked + 1, accepted + a
            start += produced
    print(f"\nLiLiCorr at {setting.label}: {checked} online verify steps, {accepted} drafts accepted, q == offline")
    assert checked >= 20 and accepted >= 5


def test_dflash2_backbone_with_convs_online_equals_offline(tiny, tmp_path):
    """The trained tiny DFlash 2 drafter (tests/fixtures/trained_drafter2: grouped convs, its selector dropped) as
    the backbone: the online loop and the all-anchor pass commit the same tokens per verify step at T = 0."""
    d = load_drafter(_lilicorr(TRAINED_DRAFTER.parents[1] / "trained_drafter2" / "step35", tmp_path / "lili2"))
    assert d.backbone.layers[0].attention_conv is not None and d.backbone.candidate_selector is None
    embed, head, n = tiny["embed"], tiny["head"], 0
    for i, prompt in enumerate(tiny["prompts"][:4]):
        o = spec_generate(tiny["target"], d, embed, head, prompt, MAX_NEW, stop_ids=[])
        s = _sample(tiny["target"], d.cfg.target_layer_ids, prompt + o.completion_ids, len(prompt), i, MAX_NEW)
        dr = next(iter_anchor_drafts(d, embed, head, [s], B))
        assert o.acceptance_lengths == chain_walk(dr.accepted.tolist(), dr.prompt_len, dr.n_tokens)
        n += sum(a > 1 for a in o.acceptance_lengths)
    assert n > 0  # drafts were accepted
