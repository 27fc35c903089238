"""Online speculative decoding (target in the loop) on a tiny random target, CPU float32.

* The tree verify forward (4-D ancestor mask, position = start + depth) gives every node the target's
  prediction after exactly its ancestor path, and the compacted KV cache equals a fresh forward's.
* Chain and DDTree online decoding are lossless (= plain greedy decoding of the target).
* validate_online: online and offline acceptance are identical per step wherever the outputs agree.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_random_drafter, make_tiny_target  # noqa: E402

from dflash_eval.replay.ddtree import build_tree  # noqa: E402
from dflash_eval.replay.online import keep_kv_rows, spec_generate, tree_verify  # noqa: E402
from dflash_eval.core.errors import InputError  # noqa: E402
from dflash_eval.stages.validate_online import validate_online  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):

    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import load_embed_and_head

    d = tmp_path_factory.mktemp("online")
    target_dir = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    cfg, drafter = make_random_drafter(d / "drafter", target_dir, [1, 3], block_size=5)
    target, _, _ = load_target(target_dir, "cpu", "float32")
    embed, head = (w.float() for w in load_embed_and_head(target_dir))
    return {"dir": d, "target_dir": target_dir, "target": target, "drafter": drafter.eval(), "embed": embed,
            "head": head}


def _logits(target, ids):
    with torch.inference_mode():
        return target(input_ids=torch.tensor([ids])).logits[0]


def test_tree_verify_sees_exactly_the_ancestor_path(tiny):
    from transformers import DynamicCache

    target = tiny["target"]
    V = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, V, (11,), generator=g).tolist()
    lp, ids = torch.topk(torch.log_softmax(torch.randn(4, V, generator=g) * 4, -1), 12, dim=-1)
    tree = build_tree(lp, ids, budget=12)
    assert max(tree.depths) >= 2 and len(tree.children[0]) >= 2  # branches and depth
    cache = DynamicCache()
    with torch.inference_mode():
        target(input_ids=torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True)
        out = tree_verify(target, cache, start=len(prompt) - 1, root=prompt[-1], tree=tree)
    paths = [[]]
    for i in range(len(tree)):
        paths.append(paths[tree.parents[i + 1]] + [tree.tokens[i]])
    for i, path in enumerate(paths):
        torch.testing.assert_close(out.logits[0, i], _logits(target, prompt + path)[-1], atol=2e-4, rtol=1e-4)
    # keep the rows of one root path; the next forward on the compacted cache equals a fresh forward
    deep = max(range(1, len(tree) + 1), key=lambda i: tree.depths[i - 1])
    rows, node = [], deep
    while node:
        rows.append(node)
        node = tree.parents[node]
    rows = [0] + rows[::-1]
    keep_kv_rows(cache, len(prompt) - 1, torch.tensor(rows))
    nxt = 7
    committed = prompt + paths[deep]
    with torch.inference_mode():
        got = target(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[len(committed)]]),
                     past_key_values=cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(got, _logits(target, committed + [nxt])[-1], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [None, pytest.param(1, marks=pytest.mark.slow), 6,
                                    pytest.param(24, marks=pytest.mark.slow)])
def test_online_decoding_is_lossless(tiny, budget):
    """Greedy speculative decoding (chain or DDTree) commits exactly the target's own greedy output."""
    target = tiny["target"]
    prompt = [1, 40, 41, 42, 43, 44, 45, 2, 1, 50]
    with torch.inference_mode():
        ref = target.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                              pad_token_id=3)[0, len(prompt):].tolist()
    o = spec_generate(target, tiny["drafter"], tiny["embed"], tiny["head"], prompt, 30, stop_ids=[], budget=budget)
    assert o.completion_ids == ref
    assert sum(o.acceptance_lengths) == 29 and all(1 <= a <= 5 for a in o.acceptance_lengths)
    if budget == 1:
        assert max(o.acceptance_lengths) <= 2  # one drafted node: at most one draft + the bonus


@pytest.mark.slow
def test_validate_online_equals_offline_on_tiny_pipeline(tiny):
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.evaluate import evaluate

    d = tiny["dir"]
    prompts = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p} for i, p in
               enumerate([[1, 40, 41, 42, 2, 1, 50], [1, 60, 61, 2, 1, 50, 51, 52], [1, 70, 2, 1, 50]])]
    (d / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    generate_completions(tiny["target_dir"], d / "prompts.jsonl", d / "c.jsonl", max_new_tokens=24, batch_size=3,
                         device="cpu", dtype="float32")
    extract_hidden_states(tiny["target_dir"], d / "c.jsonl", d / "c.h5", layer_ids=[1, 3], device="cpu",
                          dtype="float32")
    evaluate(d / "drafter", d / "c.h5", tiny["target_dir"], d / "ev.json", device="cpu", dtype="float32",
             ddtree_budgets=[4, 32])
    r = validate_online(tiny["target_dir"], d / "c.jsonl", [d / "drafter"], [d / "ev.json"], d / "vo.json",
                        n_samples=3, ddtree_budget=32, device="cpu", dtype="float32")
    modes = r["checkpoints"][0]["modes"]
    assert set(modes) == {"chain", "ddtree_32"}
    for m in modes.values():
        assert m["n_same_output"] == m["n_identical_steps"] == 3 and m["ok"]
        assert m["tau_online"] == m["tau_offline"] and m["rel_diff"] == 0
        for s in m["samples"]:
            assert s["online"] == s["offline"] and s["first_step_diff"] is None
    assert max(a for s in modes["ddtree_32"]["samples"] for a in s["online"]) > 1  # the tree accepted drafts
    saved = json.loads((d / "vo.json").read_text())
    assert saved["title"] and "| ddtree_32 |" in saved["markdown"]
    assert saved["provenance"]["stage"] == "validate_online" and saved["provenance"]["settings"]["validate_online"]
    # the fingerprint verifies the target's weights and names the completions' target
    from dflash_eval.stages.target_fingerprint import write_fingerprint

    fp = write_fingerprint(tiny["target_dir"], d / "fp.json")
    r2 = validate_online(tiny["target_dir"], d / "c.jsonl", [d / "drafter"], [d / "ev.json"], d / "vo3.json",
                         n_samples=1, device="cpu", dtype="float32", target_fingerprint=fp)
    assert r2["target_sha256"] == json.loads(fp.read_text())["sha256"] and r2["checkpoints"][0]["modes"]["chain"]["ok"]
    changed = d / "changed_target"
    shutil.copytree(tiny["target_dir"], changed, copy_function=shutil.copy2)
    w = changed / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-64] ^= 0x40
    w.write_bytes(bytes(data))
    fp3 = write_fingerprint(changed, d / "fp3.json")  # fingerprinted after the change: not the completions' target
    generate_completions(tiny["target_dir"], d / "prompts.jsonl", d / "c2.jsonl", max_new_tokens=24, batch_size=3,
                         device="cpu", dtype="float32", target_fingerprint=fp)  # as the workflow: meta names the target
    assert json.loads((d / "c2.meta.json").read_text())["target_sha256"] == r2["target_sha256"]
    with pytest.raises(InputError, match="target_sha256: the completions were generated by a target with weights"):
        validate_online(changed, d / "c2.jsonl", [d / "drafter"], [d / "ev.json"], d / "vo5.json", n_samples=1,
                        device="cpu", dtype="float32", target_fingerprint=fp3)
    # another target outside the workflow (no fingerprint): no sample has the same output, so nothing is validated
    other = make_tiny_target(d / "other_target", arch="llama", num_layers=4, hidden=64, seed=1)
    r3 = validate_online(other, d / "c.jsonl", [d / "drafter"], [d / "ev.json"], d / "vo6.json", n_samples=2,
                         device="cpu", dtype="float32")
    chain = r3["checkpoints"][0]["modes"]["chain"]
    assert chain["n_same_output"] == 0 and not chain["ok"]
