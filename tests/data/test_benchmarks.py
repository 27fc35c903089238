"""The reference benchmark's prompt sets: formats against ``dflash==0.1.0``'s own format functions,
both thinking modes, the reference's subset, mt-bench's second turn, local exports and their errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dflash_eval.data.benchmarks import (BENCHMARKS, MATH_SUFFIX, check_thinking, load_benchmark, mt_bench_turn2_messages,
                                    mt_bench_turns, read_rows)
from dflash_eval.core.errors import InputError
from dflash_eval.data.prompts import build_prompt_set_with_meta

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "prompt_sets"  # (not "benchmarks": .gitignore holds Snakemake's)
EXPORTS = {"gsm8k": FIX / "gsm8k.jsonl", "math500": FIX / "math500.jsonl", "mbpp": FIX / "mbpp.jsonl",
           "mt-bench": FIX / "mt_bench_prompts.jsonl", "alpaca": FIX / "alpaca.jsonl"}
REFERENCE_SETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")

ref = pytest.importorskip("dflash.benchmark")  # the reference wheel (envs/requirements-nodeps.txt)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _reference_rows(name: str, path: Path | None) -> list[dict]:
    """The rows the reference's format function gets, as ``datasets`` would give them."""
    if path is None:
        from dflash_eval.core.io import packaged_file

        path = packaged_file(*BENCHMARKS[name].package)
    rows = read_rows(path)
    if name == "mt-bench":  # FastChat's question.jsonl calls the turns 'turns'; the hub set 'prompt'
        rows = [{**r, "prompt": r.get("prompt", r.get("turns"))} for r in rows]
    return rows


def _reference_turns(name: str, row: dict) -> list[str]:
    cfg = ref.DATASETS[name]
    return cfg["format"](row) if cfg.get("multi_turn") else [cfg["format"](row)]


# (set, data path): the hand-written exports, the wheel's HumanEval (164) and FastChat mt-bench (80)
CASES = [(n, EXPORTS.get(n)) for n in REFERENCE_SETS] + [("mt-bench", None)]


@pytest.mark.parametrize("name,path", CASES, ids=[f"{n}-{'wheel' if p is None else 'export'}" for n, p in CASES])
def test_first_turn_equals_the_reference_format(name, path):
    ours = load_benchmark(name, path)
    rows = _reference_rows(name, path)
    assert len(ours) == len(rows) > 0
    assert [text for _, text in ours] == [_reference_turns(name, r)[0] for r in rows]


def test_packaged_sets_sizes_and_ids():
    humaneval = load_benchmark("humaneval")
    assert len(humaneval) == 164 and humaneval[0][0] == "HumanEval/0"
    mt = load_benchmark("mt-bench")
    assert len(mt) == 80 and [i for i, _ in mt[:2]] == ["81", "82"]
    turns = mt_bench_turns()
    assert all(len(t) == 2 for t in turns.values())
    assert mt[0][1] == turns["81"][0]


def test_exact_strings_on_hand_built_rows():
    gsm = load_benchmark("gsm8k", EXPORTS["gsm8k"])
    assert gsm[0] == ("test-0", "Ada has 3 boxes with 4 pens each. She gives away 5 pens. How many pens are left?"
                      "\nPlease reason step by step, and put your final answer within \\boxed{}.")
    assert MATH_SUFFIX.endswith("\\boxed{}.") and "{{" not in MATH_SUFFIX
    math = load_benchmark("math500", EXPORTS["math500"])
    assert math[1][0] == "test/algebra/2.json" and "{braces}" in math[1][1]  # no str.format of the problem text
    assert [i for i, _ in load_benchmark("mbpp", EXPORTS["mbpp"])] == ["9001", "9002"]
    # alpaca (z-lab/dflash model/utils.py before the refactor): instruction [+ "\n\nInput:\n" + input]
    alpaca = [t for _, t in load_benchmark("alpaca", EXPORTS["alpaca"])]
    assert alpaca == ["Give three tips for keeping a tidy desk.",
                      "Translate the sentence to French.\n\nInput:\nThe cat sleeps on the mat.",
                      "Summarise the paragraph in one line.\n\nInput:\nLine one.\nLine two with ünïcode."]


@pytest.mark.parametrize("thinking", ["on", "off"])
@pytest.mark.parametrize("name", REFERENCE_SETS)
def test_templated_rows_equal_the_reference_both_thinking_modes(name, thinking, tok_dir, tok):
    """The prompts stage's text and ids are the reference's apply_chat_template + encode of its format."""
    path = EXPORTS.get(name)
    rows, meta = build_prompt_set_with_meta(name, tok_dir, n=0, seed=42, path=path, enable_thinking=thinking == "on",
                                            max_prompt_tokens=0)
    ref_rows = _reference_rows(name, path)
    by_id = dict(load_benchmark(name, path))
    ids = list(by_id)
    assert len(rows) == len(ref_rows) and meta["source"] == name
    for row in rows:
        k = ids.index(row["id"])
        first = _reference_turns(name, ref_rows[k])[0]
        text = ref.apply_chat_template(tok, [{"role": "user", "content": first}], thinking)
        assert row["prompt"] == first
        assert row["text"] == text
        assert row["prompt_ids"] == tok.encode(text, add_special_tokens=False)
    assert rows[0]["text"].endswith("<|im_start|>assistant\n" + ("" if thinking == "on" else "<think>\n\n</think>\n\n"))


def test_subset_is_the_references_select_dataset_with_seed_42(tok_dir):
    rows = build_prompt_set_with_meta("humaneval", tok_dir, n=10, seed=42, max_prompt_tokens=0)[0]
    dataset = [{"turns": [t]} for _, t in load_benchmark("humaneval")]
    assert [r["prompt"] for r in rows] == [d["turns"][0] for d in ref._select_dataset(dataset, 10)]
    order = list(range(164))
    random.Random(42).shuffle(order)
    assert [r["id"] for r in rows] == [f"HumanEval/{i}" for i in order[:10]]


@pytest.mark.parametrize("thinking", ["on", "off"])
def test_mt_bench_second_turn_is_prompted_with_the_first_answer(thinking, tok_dir, tok, tmp_path):
    path = EXPORTS["mt-bench"]
    turn1 = build_prompt_set_with_meta("mt-bench", tok_dir, n=0, seed=0, path=path, enable_thinking=thinking == "on",
                                       max_prompt_tokens=0)[0]
    # the target's (here: made-up) greedy answers, ending with the stop id <|im_end|> as completions do
    answers = {r["id"]: f"Answer to {r['id']}: 391." for r in turn1}
    comp = tmp_path / "mt1.jsonl"
    comp.write_text("".join(json.dumps({"id": r["id"], "prompt_ids": r["prompt_ids"], "max_new_tokens": 64,
                                        "completion_ids": tok.encode(answers[r["id"]], add_special_tokens=False)
                                        + [tok.convert_tokens_to_ids("<|im_end|>")]}) + "\n" for r in turn1))
    rows = build_prompt_set_with_meta("mt-bench-turn2", tok_dir, n=0, seed=0, path=path, enable_thinking=thinking == "on",
                                      max_prompt_tokens=0, turn1_completions=comp)[0]
    assert sorted(r["id"] for r in rows) == sorted(answers)
    ref_rows = {str(r["prompt_id"]): r for r in _reference_rows("mt-bench", path)}
    for row in rows:
        t1, t2 = _reference_turns("mt-bench", ref_rows[row["id"]])
        # the reference: messages grow by the decoded answer (skip_special_tokens=True), then the next user turn
        messages = [{"role": "user", "content": t1}, {"role": "assistant", "content": answers[row["id"]]},
                    {"role": "user", "content": t2}]
        text = ref.apply_chat_template(tok, messages, thinking)
        assert row["prompt"] == t2 and row["text"] == text
        assert row["prompt_ids"] == tok.encode(text, add_special_tokens=False)
        assert "<|im_end|><|im_end|>" not in row["text"]  # the stop id was skipped in the decoded answer


def test_turn2_messages_and_errors(tok_dir, tmp_path):
    assert mt_bench_turn2_messages(["a", "b"], "x") == [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "b"}]
    with pytest.raises(InputError, match="turn1"):
        build_prompt_set_with_meta("mt-bench-turn2", tok_dir, n=0, seed=0, path=EXPORTS["mt-bench"])
    comp = tmp_path / "c.jsonl"
    comp.write_text(json.dumps({"id": "nope", "prompt_ids": [1], "completion_ids": [2], "max_new_tokens": 4}) + "\n")
    with pytest.raises(InputError, match="'nope' is not an mt-bench question id"):
        build_prompt_set_with_meta("mt-bench-turn2", tok_dir, n=0, seed=0, path=EXPORTS["mt-bench"],
                                   turn1_completions=comp)


def test_parquet_export_reads_like_jsonl(tmp_path):
    import pandas as pd

    for name in ("gsm8k", "mt-bench", "mbpp"):
        p = tmp_path / f"{name}.parquet"
        pd.DataFrame(read_rows(EXPORTS[name])).to_parquet(p)
        assert load_benchmark(name, p) == load_benchmark(name, EXPORTS[name])


def test_errors_name_the_file_and_the_expected_fields(tmp_path):
    with pytest.raises(InputError) as err:
        load_benchmark("gsm8k")
    assert "prompt_sets.<name>.path" in str(err.value) and "question" in str(err.value)
    bad = tmp_path / "gsm.jsonl"
    bad.write_text(json.dumps({"problem": "x"}) + "\n")
    with pytest.raises(InputError) as err:
        load_benchmark("gsm8k", bad)
    assert str(bad) in str(err.value) and "row 0: question" in str(err.value) and "openai/gsm8k" in str(err.value)
    mt = tmp_path / "mt.jsonl"
    mt.write_text(json.dumps({"prompt": "one string, not a list", "prompt_id": 1}) + "\n")
    with pytest.raises(InputError, match="a list of strings"):
        load_benchmark("mt-bench", mt)
    with pytest.raises(InputError, match="dataset export not found"):
        load_benchmark("mbpp", tmp_path / "missing.parquet")
    dup = tmp_path / "mbpp.jsonl"
    dup.write_text(json.dumps({"prompt": "a", "task_id": 1}) + "\n" + json.dumps({"prompt": "b", "task_id": 1}) + "\n")
    with pytest.raises(InputError, match="duplicate id '1'"):
        load_benchmark("mbpp", dup)


def test_thinking_on_needs_a_template_that_reads_the_flag(tok):
    class NoFlag:
        chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        name_or_path = "no-flag-target"

    check_thinking(NoFlag(), False)
    check_thinking(tok, True)
    with pytest.raises(InputError, match="no-flag-target: generation.enable_thinking: the chat template does not read"):
        check_thinking(NoFlag(), True)
