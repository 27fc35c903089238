"""Prompt sets: packaged sources, user files, chat templating and the deterministic subset."""

from __future__ import annotations

import json
import logging
import random

import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.data.prompts import (build_prompt_set, load_file, load_humaneval, load_sharegpt, read_prompts,
                                 template_prompt, write_prompts)

HUMANEVAL_0 = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    "    given threshold.\n"
    "    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n"
    "    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)\n    True\n"
    '    """\n'
    "\n```"
)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tok_dir))


def _txt(tmp_path, lines, name="p.txt"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


# ---------------------------------------------------------------- humaneval

def test_humaneval_reference_format():
    items = load_humaneval()
    assert len(items) == 164
    assert items[0] == ("HumanEval/0", HUMANEVAL_0)
    assert items[163][0] == "HumanEval/163"


def test_humaneval_prompt_set_rows(tok_dir, tok):
    rows = build_prompt_set("humaneval", tok_dir, n=0, seed=0)
    assert len(rows) == 164 and len({r["id"] for r in rows}) == 164
    r0 = next(r for r in rows if r["id"] == "HumanEval/0")
    assert r0["source"] == "humaneval" and r0["prompt"] == HUMANEVAL_0
    expected_text = f"<|im_start|>user\n{HUMANEVAL_0}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert r0["text"] == expected_text
    # templated text already carries its specials: no extra tokens are added
    assert r0["prompt_ids"] == tok(expected_text, add_special_tokens=False).input_ids
    assert r0["prompt_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_enable_thinking_reaches_the_template(tok):
    off, _ = template_prompt(tok, "hi", enable_thinking=False)
    on, _ = template_prompt(tok, "hi", enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- sharegpt

def test_sharegpt_packaged_file_is_truncated_and_complete_records_kept(caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_eval.data.prompts"):
        items = load_sharegpt()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("ended early" in m and "kept the 17671 complete records" in m for m in warnings), warnings
    # 17671 complete records: 11137 open with a non-empty human turn, 2 with a 'user' turn and 29 with a
    # system turn before a human turn (read since the ShareGPT loader change); 6358 open with 'gpt', 126 are empty, 12 have a
    # system turn followed by no user turn, 7 an empty human turn
    assert len(items) == 11137 + 2 + 29
    assert sum(isinstance(p, list) for _, p in items) == 29
    assert items[0][0] == "QWJhYvA_0"
    assert items[0][1].startswith("Summarize the main ideas of Jeff Walker's Product Launch Formula")
    assert len({i for i, _ in items}) == len(items)


def _conv(rid, first_from, value):
    return {"id": rid, "conversations": [{"from": first_from, "value": value}, {"from": "gpt", "value": "ok"}]}


SHAREGPT_RECORDS = [
    _conv("a", "human", "hi there"),
    _conv("b", "gpt", "skipped: starts with the model"),
    {"id": "e", "conversations": []},
    _conv("a", "human", "again, with \"quotes\" and \\ escapes and ünïcode"),
    _conv("c", "human", "last one"),
]


def test_sharegpt_handmade_truncated(tmp_path, caplog):
    full = json.dumps(SHAREGPT_RECORDS, indent=2, ensure_ascii=False)
    cut = full[: full.index("last one") + 4]  # inside the last record's string
    p = tmp_path / "share.json"
    p.write_text(cut, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="dflash_eval.data.prompts"):
        items = load_sharegpt(p)
    assert items == [("a", "hi there"), ("a#2", SHAREGPT_RECORDS[3]["conversations"][0]["value"])]
    assert any("kept the 4 complete records" in r.getMessage() for r in caplog.records)


def test_sharegpt_every_cut_position(tmp_path):
    """Cut the file at every character: exactly the records closed before the cut are read."""
    full = json.dumps(SHAREGPT_RECORDS, indent=1, ensure_ascii=False)
    dec = json.JSONDecoder()
    ends, i = [], full.index("[") + 1  # end offsets of each record
    for _ in SHAREGPT_RECORDS:
        while full[i] in " \n,":
            i += 1
        _, i = dec.raw_decode(full, i)
        ends.append(i)
    usable = {0: "a", 3: "a#2", 4: "c"}
    p = tmp_path / "share.json"
    for k in range(full.index("[") + 1, len(full) + 1):
        p.write_text(full[:k], encoding="utf-8")
        complete = sum(1 for e in ends if e <= k)
        want = [usable[j] for j in range(complete) if j in usable]
        if not want:
            with pytest.raises(InputError, match="no record"):
                load_sharegpt(p)
        else:
            assert [i for i, _ in load_sharegpt(p)] == want, k


def test_sharegpt_complete_file_warns_only_about_skips(tmp_path, caplog):
    p = tmp_path / "share.json"
    p.write_text(json.dumps(SHAREGPT_RECORDS), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="dflash_eval.data.prompts"):
        items = load_sharegpt(p)
    assert [i for i, _ in items] == ["a", "a#2", "c"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "ended early" not in warnings[0]
    assert warnings[0].endswith("skipped 1 starts with an assistant turn, 1 empty conversation")


def test_sharegpt_both_role_vocabularies_and_system_turns(tmp_path, tok_dir):
    """User/assistant records and a leading system turn were dropped with an INFO line;
    now they are read (the system turn reaches the chat template) and every skip is counted by reason."""
    recs = [
        _conv("h", "human", "plain human"),
        {"id": "u", "conversations": [{"from": "user", "value": "user vocab"}, {"from": "assistant", "value": "x"}]},
        {"id": "oa", "conversations": [{"role": "user", "content": "openai keys"}]},
        {"id": "s", "conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "with system"}]},
        {"id": "s2", "conversations": [{"role": "system", "content": "Sys."}, {"role": "user", "content": "sys+user"}]},
        {"id": "so", "conversations": [{"from": "system", "value": "alone"}, {"from": "gpt", "value": "hi"}]},
        _conv("g", "gpt", "assistant first"),
        _conv("w", "wizard", "unknown role"),
        _conv("e", "human", "   "),
        {"id": "n", "conversations": []},
        {"id": "x"},
    ]
    p = tmp_path / "share.json"
    p.write_text(json.dumps(recs) + "", encoding="utf-8")
    from collections import Counter

    skipped, appended = Counter(), set()
    items = dict(load_sharegpt(p, skipped, appended))
    assert list(items) == ["h", "u", "oa", "s", "s2"]
    assert items["s"] == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "with system"}]
    assert appended == {"u", "oa", "s", "s2"}  # walked after the records read before
    assert skipped == {"system_without_user": 1, "assistant_first": 1, "unknown_role": 1, "empty_user_turn": 1,
                       "empty_conversation": 1, "not_a_conversation": 1}
    from dflash_eval.data.prompts import build_prompt_set_with_meta
    from dflash_eval.data.provenance import meta_path, read_prompt_meta, skip_table_markdown, write_meta

    rows, meta = build_prompt_set_with_meta("sharegpt", tok_dir, n=0, seed=0, path=p, max_prompt_tokens=0)
    assert rows[0]["id"] == "h"  # the previously read record first, whatever the seed does to the others
    s = next(r for r in rows if r["id"] == "s")
    assert s["prompt"] == "with system"
    assert s["text"] == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nwith system<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (meta["available"], meta["written"], meta["skipped"]) == (5, 5, dict(skipped))
    out = write_prompts(rows, tmp_path / "ps" / "share.jsonl")
    assert write_meta(out, meta) == meta_path(out) == tmp_path / "ps" / "share.meta.json"
    assert {k: v for k, v in read_prompt_meta(out).items() if k in meta} == meta
    assert len(read_prompts(out)) == 5  # the prompts file itself holds only rows
    table = skip_table_markdown({"share": meta})
    assert "| share | sharegpt | 5 | 5 | 1 | 1 | 1 | 1 | 1 | 1 |" in table and "starts with an assistant turn" in table
    # too long prompts are counted too
    _, meta = build_prompt_set_with_meta("sharegpt", tok_dir, n=0, seed=0, path=p, max_prompt_tokens=min(len(r["prompt_ids"]) for r in rows))
    assert meta["skipped"]["too_long"] == 5 - meta["written"] > 0


def test_sharegpt_subset_unchanged_by_newly_read_records(tmp_path, tok_dir):
    """Records only this version reads are walked after the others: a subset chosen before is unchanged."""
    legacy = [_conv(f"r{i}", "human", f"question {i}") for i in range(30)]
    extra = [{"id": f"s{i}", "conversations": [{"from": "system", "value": "S"}, {"from": "user", "value": f"q{i}"}]}
             for i in range(10)]
    mixed = [r for pair in zip(legacy, extra + [None] * 20) for r in pair if r is not None]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(legacy))
    b.write_text(json.dumps(mixed))
    for seed in (0, 1):
        before = [r["id"] for r in build_prompt_set("sharegpt", tok_dir, n=30, seed=seed, path=a)]
        after = [r["id"] for r in build_prompt_set("sharegpt", tok_dir, n=0, seed=seed, path=b)]
        assert after[:30] == before and sorted(after[30:]) == sorted(r["id"] for r in extra)


def test_sharegpt_damage_in_the_middle_is_an_error(tmp_path):
    p = tmp_path / "share.json"
    p.write_text('[\n{"id": "a", "conversations": []},\n{"id": oops},\n{"id": "c", "conversations": []}\n]')
    with pytest.raises(InputError, match=r"line 3 column 8.*malformed JSON") as ei:
        load_sharegpt(p)
    assert ei.value.file == str(p)


# ---------------------------------------------------------------- user files

def test_txt_file(tmp_path, tok_dir, tok):
    p = _txt(tmp_path, ["first prompt", "", "third  line with \\n literal"])
    assert load_file(p) == [("line-1", "first prompt"), ("line-3", "third  line with \\n literal")]
    rows = build_prompt_set("file", tok_dir, n=0, seed=1, path=p)
    assert sorted(r["id"] for r in rows) == ["line-1", "line-3"]
    r = next(r for r in rows if r["id"] == "line-1")
    assert r["source"] == "file" and r["prompt"] == "first prompt"
    assert r["text"] == "<|im_start|>user\nfirst prompt<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert r["prompt_ids"] == tok(r["text"], add_special_tokens=False).input_ids


def test_jsonl_prompt_and_messages(tmp_path, tok_dir):
    p = tmp_path / "p.jsonl"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    p.write_text(json.dumps({"id": "x", "prompt": "plain"}) + "\n\n" + json.dumps({"id": 7, "messages": msgs}) + "\n")
    rows = {r["id"]: r for r in build_prompt_set("file", tok_dir, n=0, seed=0, path=p, enable_thinking=True)}
    assert set(rows) == {"x", "7"}
    assert rows["x"]["text"] == "<|im_start|>user\nplain<|im_end|>\n<|im_start|>assistant\n"
    assert rows["7"]["prompt"] == "Q2"
    assert rows["7"]["text"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                                 "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
                                 "<|im_start|>assistant\n")


@pytest.mark.parametrize("lines, field", [
    (['{"id": "a", "prompt": "ok"}', '{"id": "b", "prompt": "broken'], "line 2"),
    (['{"id": "a"}'], "line 1: prompt"),
    (['{"prompt": "no id"}'], "line 1: id"),
    (['{"id": "a", "prompt": ""}'], "line 1: prompt"),
    (['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'], "line 2: id"),
    (['{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
     "line 1: messages[1].role"),
    (['{"id": "a", "messages": [{"role": "user"}]}'], "line 1: messages[0]"),
    (['["not", "an", "object"]'], "line 1"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, lines, field):
    p = tmp_path / "bad.jsonl"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as ei:
        load_file(p)
    assert ei.value.file == str(p)
    assert ei.value.field == field
    assert ei.value.fix


@pytest.mark.parametrize("name, data, field", [
    ("p.txt", b"first\ncaf\xe9 au lait\n", "line 2 column 4"),  # latin-1, the usual culprit
    ("p.jsonl", b"".join(b'{"id": %d, "prompt": "a"}\n' % i for i in range(2000)) + b'{"id": "x", "prompt": "\xff"}\n',
     "line 2001 column 24"),  # past the first read buffer: the line is still exact
])
def test_non_utf8_file_names_line_and_column(tmp_path, name, data, field):
    """A non-UTF-8 prompt file ended in a raw UnicodeDecodeError traceback."""
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(InputError) as ei:
        load_file(p)
    assert (ei.value.file, ei.value.field) == (str(p), field)
    assert "not UTF-8" in ei.value.problem and "iconv" in ei.value.fix


def test_missing_file(tmp_path, tok_dir):
    with pytest.raises(InputError, match="not found") as ei:
        build_prompt_set("file", tok_dir, n=1, seed=0, path=tmp_path / "nope.jsonl")
    assert ei.value.file.endswith("nope.jsonl")
    with pytest.raises(InputError, match="--path"):
        build_prompt_set("file", tok_dir, n=1, seed=0, path=None)
    with pytest.raises(InputError, match="tokenizer folder not found"):
        build_prompt_set("humaneval", tmp_path / "no-tok", n=1, seed=0)


# ---------------------------------------------------------------- subset

def test_subset_deterministic_and_seeded(tmp_path, tok_dir):
    p = _txt(tmp_path, [f"prompt number {i}" for i in range(20)])
    a = build_prompt_set("file", tok_dir, n=5, seed=3, path=p)
    b = build_prompt_set("file", tok_dir, n=5, seed=3, path=p)
    c = build_prompt_set("file", tok_dir, n=5, seed=4, path=p)
    assert [r["id"] for r in a] == [r["id"] for r in b]
    assert [r["id"] for r in a] != [r["id"] for r in c]
    order = list(range(20))
    random.Random(3).shuffle(order)
    assert [r["id"] for r in a] == [f"line-{i + 1}" for i in order[:5]]
    assert len(build_prompt_set("file", tok_dir, n=0, seed=0, path=p)) == 20


def test_max_prompt_tokens_filter(tmp_path, tok_dir, tok, caplog):
    prompts = [("word " * k).strip() for k in range(1, 31)]
    p = _txt(tmp_path, prompts)
    lens = {f"line-{i + 1}": len(template_prompt(tok, s)[1]) for i, s in enumerate(prompts)}
    limit = sorted(lens.values())[12]
    n_ok = sum(1 for v in lens.values() if v <= limit)
    assert 0 < n_ok < 30
    with caplog.at_level(logging.INFO, logger="dflash_eval.data.prompts"):
        rows = build_prompt_set("file", tok_dir, n=0, seed=0, path=p, max_prompt_tokens=limit)
    assert sorted(r["id"] for r in rows) == sorted(k for k, v in lens.items() if v <= limit)
    assert all(len(r["prompt_ids"]) <= limit for r in rows)
    assert any(f"skipped {30 - n_ok} prompts longer than {limit}" in r.getMessage() for r in caplog.records)
    # n stops the walk: the first n admissible prompts in shuffled order
    few = build_prompt_set("file", tok_dir, n=3, seed=0, path=p, max_prompt_tokens=limit)
    assert [r["id"] for r in few] == [r["id"] for r in rows[:3]]
    with pytest.raises(InputError, match="max_prompt_tokens"):
        build_prompt_set("file", tok_dir, n=0, seed=0, path=p, max_prompt_tokens=min(lens.values()) - 1)


# ---------------------------------------------------------------- JSONL I/O

def test_write_read_roundtrip(tmp_path, tok_dir):
    p = _txt(tmp_path, ["ünïcode ✓ prompt", "second"])
    rows = build_prompt_set("file", tok_dir, n=0, seed=0, path=p)
    out = write_prompts(rows, tmp_path / "sub" / "prompts.jsonl")
    assert read_prompts(out) == rows
    assert not [f for f in out.parent.iterdir() if f.name != "prompts.jsonl"]  # no temp files left


def test_read_prompts_errors(tmp_path):
    p = tmp_path / "prompts.jsonl"
    good = {"id": "a", "source": "file", "prompt": "x", "text": "x", "prompt_ids": [1, 2]}
    p.write_text(json.dumps(good) + "\n" + json.dumps({**good, "prompt_ids": []}) + "\n")
    with pytest.raises(InputError) as ei:
        read_prompts(p)
    assert ei.value.field == "line 2: prompt_ids"
    p.write_text(json.dumps({**good, "prompt_ids": [1, True]}) + "\n")  # JSON true is not a token id
    with pytest.raises(InputError) as ei:
        read_prompts(p)
    assert ei.value.field == "line 1: prompt_ids"
    p.write_text(json.dumps({k: v for k, v in good.items() if k != "text"}) + "\n")
    with pytest.raises(InputError) as ei:
        read_prompts(p)
    assert ei.value.field == "line 1: text"


def test_a_jsonl_file_with_a_byte_order_mark_is_named_as_such(tmp_path):
    """A UTF-8 BOM (PowerShell, Notepad) read "malformed JSON ... Fix: write one JSON object per
    line", a fix that does not help."""
    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "a", "prompt": "hi"}\n')
    with pytest.raises(InputError) as ei:
        load_file(p)
    assert (ei.value.file, ei.value.field) == (str(p), "line 1") and "byte-order mark" in ei.value.problem
    assert "without BOM" in ei.value.fix
