"""Greedy completions: equal to a hand-written argmax loop, batching-invariant, correct stops."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_eval.completions import SOURCES, TransformersSource, cut_at_eos, generate_completions
from dflash_eval.errors import InputError
from dflash_eval.prompts import build_prompt_set, write_prompts
from dflash_eval.target import load_target
from tiny import make_tiny_target

PROMPTS = ["hi", "What is the capital of France? Paris.", "def add(a, b):\n    return a + b",
           "The quick brown fox jumps over the lazy dog. " * 3, "Summarize the text."]
MAX_NEW = 12


def reference_greedy(model, prompt_ids, eos_ids, max_new_tokens):
    """Argmax of a full (uncached, unpadded) forward, one token at a time."""
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            t = int(torch.argmax(logits))
            out.append(t)
            ids.append(t)
            if t in eos_ids:
                return out, "eos"
    return out, "length"


def _read(path):
    return [json.loads(line) for line in open(path, encoding="utf-8")]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"compl-{request.param}")
    target = make_tiny_target(root / "target", arch=request.param, seed=3)
    txt = root / "p.txt"
    txt.write_text("\n".join(p.replace("\n", " ") for p in PROMPTS) + "\n")
    prompts = write_prompts(build_prompt_set("file", target, n=0, seed=0, path=txt), root / "prompts.jsonl")
    model, tok, _ = load_target(target, device="cpu", dtype="float32")
    rows = [json.loads(line) for line in open(prompts)]
    assert len({len(r["prompt_ids"]) for r in rows}) == len(rows)  # lengths differ: batches really pad
    ref = {r["id"]: reference_greedy(model, r["prompt_ids"], {2}, MAX_NEW) for r in rows}
    return root, target, prompts, rows, ref, model, tok


def test_matches_reference_loop_batched_and_single(setup):
    root, target, prompts, rows, ref, _, tok = setup
    outs = {}
    for bs in (1, 2, 16):
        out = generate_completions(target, prompts, root / f"c{bs}.jsonl", max_new_tokens=MAX_NEW, batch_size=bs,
                                   device="cpu", dtype="float32")
        got = _read(out)
        assert [g["id"] for g in got] == [r["id"] for r in rows]  # prompts' order, not length order
        for g, r in zip(got, rows):
            assert set(g) == {"id", "prompt_ids", "completion_ids", "text", "stop_reason", "max_new_tokens"}
            assert g["prompt_ids"] == r["prompt_ids"]
            assert (g["completion_ids"], g["stop_reason"]) == ref[r["id"]], (bs, r["id"])
            assert g["max_new_tokens"] == MAX_NEW
            assert g["text"] == tok.decode(g["completion_ids"], skip_special_tokens=False)
        outs[bs] = [g["completion_ids"] for g in got]
    assert outs[1] == outs[2] == outs[16]


def test_eos_stops_and_padding_is_stripped(setup, tmp_path):
    """Make a token the model emits mid-completion an eos: completions end right after it."""
    root, target, prompts, rows, ref, _, _ = setup
    comp = ref[rows[1]["id"]][0]
    j = next(k for k in range(2, MAX_NEW) if comp[k] not in comp[:k])
    stop_tok = comp[j]
    t2 = tmp_path / "target"
    shutil.copytree(target, t2)
    gen = json.loads((t2 / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, stop_tok]
    gen["repetition_penalty"] = 1.5  # must not leak into greedy decoding
    gen["no_repeat_ngram_size"] = 2
    (t2 / "generation_config.json").write_text(json.dumps(gen))
    got = _read(generate_completions(t2, prompts, tmp_path / "c.jsonl", max_new_tokens=MAX_NEW, batch_size=16,
                                     device="cpu", dtype="float32"))
    stops = {2, stop_tok}
    n_eos = 0
    for g, r in zip(got, rows):
        full, _ = ref[r["id"]]
        cut = next((k for k, t in enumerate(full) if t in stops), None)
        if cut is None:
            assert (g["completion_ids"], g["stop_reason"]) == (full, "length")
        else:
            n_eos += 1
            assert (g["completion_ids"], g["stop_reason"]) == (full[:cut + 1], "eos")
    assert got[1]["completion_ids"] == comp[:j + 1] and got[1]["stop_reason"] == "eos"
    # one batch held rows that stopped early (then padded, padding stripped) and rows that ran to the limit
    assert 1 <= n_eos < len(rows)


def test_cut_at_eos():
    assert cut_at_eos([5, 2, 3, 3], [2], 4) == ([5, 2], "eos")
    assert cut_at_eos([5, 6, 7, 2], [2, 7], 4) == ([5, 6, 7], "eos")
    assert cut_at_eos([5, 6, 7], [2], 3) == ([5, 6, 7], "length")
    assert cut_at_eos([5, 6, 7, 2], [2], 3) == ([5, 6, 7], "length")
    with pytest.raises(RuntimeError):
        cut_at_eos([5, 6], [2], 3)


def test_source_registry_and_pad_fallback(setup):
    _, _, _, rows, ref, model, tok = setup
    assert SOURCES["transformers"] is TransformersSource
    src = TransformersSource(model, tok, max_new_tokens=MAX_NEW)
    assert src.eos_ids == [2] and src.pad_id == tok.pad_token_id == 3
    tok_nopad = type(tok).from_pretrained(tok.name_or_path)
    tok_nopad.pad_token = None
    src = TransformersSource(model, tok_nopad, max_new_tokens=MAX_NEW)
    assert src.pad_id == 2  # falls back to the first eos id
    got = src.generate([rows[0]["prompt_ids"], rows[3]["prompt_ids"]])
    assert got == [ref[rows[0]["id"]], ref[rows[3]["id"]]]


def test_errors_leave_no_output(setup, tmp_path):
    root, target, prompts, rows, _, _, _ = setup
    out = tmp_path / "c.jsonl"
    with pytest.raises(InputError, match="unknown completion source"):
        generate_completions(target, prompts, out, source="vllm")
    with pytest.raises(InputError, match="generation.max_new_tokens"):
        generate_completions(target, prompts, out, max_new_tokens=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "prompt_ids": [1, 99999]}) + "\n")
    with pytest.raises(InputError, match="outside the target vocabulary") as ei:
        generate_completions(target, bad, out, device="cpu", dtype="float32")
    assert ei.value.field == "line 1: prompt_ids"
    with pytest.raises(InputError, match="no config.json"):
        generate_completions(tmp_path, prompts, out, device="cpu")
    assert not out.exists()
    assert not list(tmp_path.glob(".c.jsonl*"))
