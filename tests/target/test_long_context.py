"""A long-context prompt set through the whole workflow (prompts, completions, the HDF5 cache, the
replay): a prompt of more than 8192 tokens, its acceptance in the tau table's prompt-length bins."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from test_workflow import CI_PROFILE, make_tiny_workdir, smk

pytestmark = pytest.mark.slow

LONG_TOKENS = 8192 + 512  #: the largest context tested here (templated prompt tokens, tiny tokenizer)


def test_long_prompt_through_cache_and_replay(tmp_path):
    from transformers import AutoTokenizer

    wd = make_tiny_workdir(
        tmp_path / "wf",
        prompt_set={"n": 0, "max_prompt_tokens": 0},
        prompt_sets={"long": {"source": "file", "path": "prompts/long.jsonl"}},
        checkpoints={"glob": "ckpts/step100.pt", "demo": []},
        evaluate={"device": "cpu", "dtype": "float32", "batch_size": 2, "ddtree_budgets": [2, 4]},
        target_costs={"enabled": False})
    cfg_path = wd / "tiny_target" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["max_position_embeddings"] = 32768  # RoPE: the weights do not depend on it
    cfg_path.write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(wd / "tiny_target"))
    unit = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n"
    per_unit = len(tok(unit, add_special_tokens=False).input_ids)
    long_text = unit * (LONG_TOKENS // per_unit + 1)
    (wd / "prompts" / "long.jsonl").write_text(json.dumps({"id": "long", "prompt": long_text}) + "\n"
                                               + json.dumps({"id": "short", "prompt": "What is the capital of France?"})
                                               + "\n")
    smk(wd, "--workflow-profile", str(CI_PROFILE), "results/tiny/tau.csv")
    ev = json.loads((wd / "results/tiny/eval/step100/long.json").read_text())
    lens = {s["id"]: s["prompt_len"] for s in ev["samples"]}
    assert lens["long"] > LONG_TOKENS and lens["short"] < 128
    comps = {json.loads(x)["id"]: json.loads(x) for x in (wd / "results/tiny/completions/long.jsonl").read_text().splitlines()}
    assert len(comps["long"]["prompt_ids"]) == lens["long"]
    # random-init drafter: every verify step commits the bonus token only, over the whole completion
    for s in ev["samples"]:
        assert s["acceptance_lengths"] == [1] * (len(comps[s["id"]]["completion_ids"]) - 1)
    row = pd.read_csv(wd / "results/tiny/tau.csv").iloc[0]
    assert (row["n_prompt_8192_16384"], row["n_prompt_0_128"], row["tau_prompt_8192_16384"]) == (1, 1, 1.0)
