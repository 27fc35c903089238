"""FP8 storage on the demo: the SmolLM2 target's states of a few greedy / sampled completions of every demo prompt
set (humaneval, sharegpt, sharegpt-t1 drawn at T = 1), stored as FP8 and as bf16 (the same float32 forward
rounded), through the fp8_parity stage: the chain tau on each cache of the last demo drafter of each run (DFlash 1,
DFlash 2), the per-layer error, the bytes per token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_eval.data.prompts import build_prompt_set_with_meta, write_prompts
from dflash_eval.stages.completions import generate_completions
from dflash_eval.stages.fp8_parity import fp8_parity

REPO = Path(__file__).resolve().parents[2]
#: the last checkpoint of each demo run (DFlash 1, DFlash 2): the strongest drafters, the most drafts FP8 can flip
#: (all six: scripts/fp8_demo_tau.py)
DRAFTERS = [str(max((REPO / "demo" / "drafters").glob(f"{v}-smollm2-b8-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1])))
            for v in ("dflash", "dflash2")]
LAYERS = [1, 8, 15, 22, 27]  # config/config.yaml: the demo drafters' target layers
#: config/demo.yaml's prompt sets: (source, completion sampling)
SETS = {"humaneval": ("humaneval", {}), "sharegpt": ("sharegpt", {}),
        "sharegpt-t1": ("sharegpt", {"temperature": 1.0, "top_p": 0.95, "top_k": 20})}
N, MAX_NEW = 2, 64


@pytest.mark.slow
def test_demo_drafters_chain_tau_on_fp8_equals_bf16_within_001_on_every_demo_set(smollm2, tmp_path):
    assert [Path(d).name for d in DRAFTERS] == ["dflash-smollm2-b8-step2283", "dflash2-smollm2-b8-step2072"]
    for name, (source, sampling) in SETS.items():
        rows, _ = build_prompt_set_with_meta(source=source, tokenizer_dir=smollm2, n=N, seed=0, max_prompt_tokens=512)
        prompts = write_prompts(rows, tmp_path / f"{name}.prompts.jsonl")
        comp = generate_completions(smollm2, prompts, tmp_path / f"{name}.jsonl", device="cpu", batch_size=N,
                                    max_new_tokens=MAX_NEW, sampling={"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                                                      "seed": 0, **sampling})
        r = fp8_parity(smollm2, comp, LAYERS, tmp_path / f"{name}.parity.json", drafters=DRAFTERS, n_samples=N,
                       device="cpu", reference="bfloat16")
        assert r["reference"] == "bfloat16" and r["n_samples"] == N and [s["layer"] for s in r["layers"]] == LAYERS
        assert r["bytes_per_token"] == {"reference": 5 * 576 * 2 + 8, "fp8": 5 * 576 + 5 * 4 + 8}  # 1.98x smaller
        for s in r["layers"]:  # E4M3 rounding: under 5 % rel-L2 (about 0.5 % where massive activations dominate)
            assert 0.001 < s["rel_l2"] < 0.05 and s["cos_mean"] > 0.999, s
        assert r["argmax_agreement"] == 1.0  # one forward: the same target argmax in both caches
        for d in r["drafters"]:
            assert d["tau_reference"] > 1.1, d  # trained drafters accept drafts (random ones: 1.0): the test can fail
            # On 2 short samples one verify step more or less moves tau by ~0.015 (1 of ~40 steps, half the
            # weight): the resolution is a step. FP8 flips a draft here and there (2 steps of 85 at most on 4
            # humaneval samples of 128 tokens), so each sample's chain may differ by two steps; the 0.01 bound on
            # tau itself is measured at a larger scale (docs/measurements.md, "FP8 caches").
            assert all(abs(a - b) <= 2 for a, b in zip(d["steps_reference"], d["steps_fp8"])), (name, d)
            # tau follows: 2 steps of ~35 in both samples is ~0.08 (measured: -0.048 for step 3507 on sharegpt)
            assert abs(d["tau_diff"]) <= 0.08, (name, d)
        assert f"| {Path(DRAFTERS[-1]).name} |" in json.loads((tmp_path / f"{name}.parity.json").read_text())["markdown"]
        print(json.dumps({"set": name, "rel_l2": [round(s["rel_l2"], 5) for s in r["layers"]],
                          "tau": [(d["checkpoint"], round(d["tau_reference"], 4), round(d["tau_fp8"], 4))
                                  for d in r["drafters"]]}))
