"""The real default target (SmolLM2-135M-Instruct GGUF) and the trained demo drafters, on CPU in float32.

* Offline replay == online greedy DFlash: the reference package's own loop (``dflash.model.dflash_generate``,
  z-lab DFlash 0.1.0, KV caches and verify forwards of the target) commits the same tokens and records the
  same per-step acceptance as our completions -> cache -> replay pipeline.
* Our own online loop (chain, and DDTree verified with tree attention) equals the offline replay per step.
* The same for the demo's DFlash 2 drafter: strict load into the reference ``DFlash2DraftModel``, whose online loop
  equals the offline replay of the candidate selector's path per step wherever the outputs agree.
* The demo drafters' tau grows with training, in both runs (DFlash 1 and DFlash 2): tau(final) > tau(middle) >
  tau(early) >= 1 on both prompt sets.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DRAFTERS = REPO / "demo" / "drafters"
#: the checkpoints of the two demo runs (demo/drafters/PROVENANCE.md): DFlash 1 and DFlash 2
RUNS = {"dflash": (172, 870, 2283), "dflash2": (177, 806, 2072)}
STEPS = RUNS["dflash"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(smollm2, tmp_path_factory):
    d = tmp_path_factory.mktemp("smol")
    (d / "target").symlink_to(smollm2, target_is_directory=True)  # converted once per session (tests/conftest.py)
    return d


def _pipeline(smol, source, n, max_new_tokens, name):
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.data.prompts import build_prompt_set, write_prompts

    target = smol / "target"
    write_prompts(build_prompt_set(source, target, n=n, seed=0, max_prompt_tokens=400), smol / f"{name}.prompts.jsonl")
    generate_completions(target, smol / f"{name}.prompts.jsonl", smol / f"{name}.jsonl", max_new_tokens=max_new_tokens,
                         batch_size=n, device="cpu", dtype="float32")
    extract_hidden_states(target, smol / f"{name}.jsonl", smol / f"{name}.h5", layer_ids=[1, 8, 15, 22, 27],
                          device="cpu", dtype="float32")
    return smol / f"{name}.h5"


@pytest.fixture(scope="module")
def online_cache(smol):
    return _pipeline(smol, "humaneval", 2, 48, "online")


def test_offline_replay_equals_reference_online_loop(smol, online_cache, monkeypatch):
    import dflash.model as ref

    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.target.model import load_target

    cache = online_cache
    drafter_dir = DRAFTERS / f"dflash-smollm2-b8-step{STEPS[-1]}"
    ours = evaluate(drafter_dir, cache, smol / "target", smol / "online_eval.json", device="cpu", dtype="float32")

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with cuda.synchronize
    target, _, _ = load_target(smol / "target", device="cpu", dtype="float32")
    draft = ref.DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32).eval()
    with CacheReader(cache) as rd:
        for i, sample in enumerate(ours["samples"]):
            s = rd.sample(i)
            ids = s.input_ids[: s.prompt_len][None]
            out = ref.dflash_generate(draft, target, ids, max_new_tokens=48, stop_token_ids=[2], return_stats=True)
            assert out.output_ids[0, s.prompt_len:].tolist() == s.input_ids[s.prompt_len:].tolist()  # lossless
            assert sample["acceptance_lengths"] == out.acceptance_lengths
    assert any(a > 1 for s in ours["samples"] for a in s["acceptance_lengths"])  # drafts were accepted


def test_offline_replay_of_the_dflash2_demo_drafter_equals_reference_online_loop(smol, online_cache, monkeypatch):
    import dflash.model as ref

    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.target.model import load_target

    drafter_dir = DRAFTERS / f"dflash2-smollm2-b8-step{RUNS['dflash2'][-1]}"
    ours = evaluate(drafter_dir, online_cache, smol / "target", smol / "online_eval2.json", device="cpu",
                    dtype="float32")
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    target, _, _ = load_target(smol / "target", device="cpu", dtype="float32")
    draft, info = ref.DFlash2DraftModel.from_pretrained(str(drafter_dir), dtype=torch.float32,
                                                       output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}  # strict: no missing / unexpected / mismatched keys
    draft = draft.eval()
    agreed = 0
    with CacheReader(online_cache) as rd:
        for i, sample in enumerate(ours["samples"]):
            s = rd.sample(i)
            with torch.no_grad():
                out = ref.dflash_generate(draft, target, s.input_ids[: s.prompt_len][None], max_new_tokens=48,
                                          stop_token_ids=[2], return_stats=True)
            if out.output_ids[0, s.prompt_len:].tolist() == s.input_ids[s.prompt_len:].tolist():  # outputs agree
                agreed += 1
                assert sample["acceptance_lengths"] == out.acceptance_lengths, sample["id"]
    print(f"outputs agreed on {agreed} of {len(ours['samples'])} samples")
    assert agreed >= 1
    assert any(a > 2 for s in ours["samples"] for a in s["acceptance_lengths"])  # the selector's drafts accepted


def test_validate_online_chain_and_ddtree_equal_offline(smol, online_cache):
    """Our online loop with the target in the loop (chain, and DDTree-16 verified in one tree-attention forward)
    commits the cached completion and the exact per-step acceptance of the offline replay (float32)."""
    from dflash_eval.stages.validate_online import validate_online
    from dflash_eval.stages.evaluate import evaluate

    drafter_dir = DRAFTERS / f"dflash-smollm2-b8-step{STEPS[-1]}"
    evaluate(drafter_dir, online_cache, smol / "target", smol / "online_dd.json", device="cpu", dtype="float32",
             ddtree_budgets=[16, 64])
    r = validate_online(smol / "target", smol / "online.jsonl", [drafter_dir], [smol / "online_dd.json"],
                        smol / "validate_online.json", n_samples=2, ddtree_budget=16, device="cpu", dtype="float32")
    modes = r["checkpoints"][0]["modes"]
    for name in ("chain", "ddtree_16"):
        m = modes[name]
        assert m["n_same_output"] == m["n_identical_steps"] == 2, (name, m["samples"])
        assert m["tau_online"] == m["tau_offline"]
    tree = [a for s in modes["ddtree_16"]["samples"] for a in s["online"]]
    chain = [a for s in modes["chain"]["samples"] for a in s["online"]]
    assert max(tree) > 2 and len(tree) < len(chain)  # the tree accepted deeper than one draft, in fewer steps


def test_demo_drafters_improve_with_training(smol):
    from dflash_eval.stages.evaluate import evaluate

    for source in ("humaneval", "sharegpt"):
        cache = _pipeline(smol, source, 6, 96, f"order-{source}")
        for variant, steps in RUNS.items():
            taus = [evaluate(DRAFTERS / f"{variant}-smollm2-b8-step{s}", cache, smol / "target",
                             smol / f"{source}-{variant}-{s}.json", device="cpu", dtype="float32",
                             ddtree_budgets=[])["tau"] for s in steps]  # the chain's tau only (the trees: above)
            assert taus[2] > taus[1] > taus[0] >= 1.0, (source, variant, taus)


def test_batched_replay_equals_sequential_on_demo_drafters(smol):
    """All-anchor replay == sequential replay, per step, for every demo drafter on the real target, float32.

    Both prompt sets, responses cut at max_new_tokens (so the shortened last blocks are
    exercised), both layouts of the batched pass. (bf16: tests/replay/test_parity.py and bench/replay.py,
    where every difference must be a near-tie named by explain_differences.)
    """
    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.drafter.model import load_drafter
    from dflash_eval.replay.anchors import LAYOUTS, replay_batched
    from dflash_eval.replay.chain import replay
    from dflash_eval.target.spec import load_embed_and_head

    embed, head = load_embed_and_head(smol / "target")
    embed, head = embed.float(), head.float()
    caches = [_pipeline(smol, source, 4, 64, f"batched-{source}") for source in ("humaneval", "sharegpt")]
    samples = []
    for c in caches:
        with CacheReader(c) as rd:
            samples += [rd.sample(i) for i in range(len(rd))]
    assert any(len(s.input_ids) - s.prompt_len == 64 for s in samples)  # length-limited responses
    for step in STEPS:
        drafter = load_drafter(DRAFTERS / f"dflash-smollm2-b8-step{step}", dtype=torch.float32)
        seq = replay(drafter, embed, head, samples, mode="sequential")
        assert any(n > 1 for rec in seq for n in rec)
        for layout in LAYOUTS:
            assert replay_batched(drafter, embed, head, samples, layout=layout) == seq, (step, layout)
