"""Long-context prompt sets: the conversation / repository / trajectory sources and the selection per context bin."""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.data.binned import build_set_with_meta
from dflash_eval.data.long_context import canonical, trajectory_candidates
from tiny import make_tiny_tokenizer

#: a ChatML template that renders tools, tool calls and tool results (in the manner of Qwen3's)
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools' }}{% for t in tools %}{{ '\n' + (t | tojson) }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\n' + (m.content or '') }}"
    "{% for c in m.tool_calls %}{{ '<tool_call>{\"name\": \"' + c.function.name + '\", \"arguments\": '"
    " + c.function.arguments + '}</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif m.role == 'tool' %}{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
#: one agent trajectory: assistant turns at messages[2], [4] and [6]; the last two become prompts
AGENT = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Why does test_parse fail?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"parse.py\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "def parse(s):\n    return int(s)\n"},
    {"role": "assistant", "content": "parse() does not strip whitespace."},
    {"role": "user", "content": "Fix it."},
    {"role": "assistant", "content": "Use int(s.strip())."},
]


@pytest.fixture(scope="module")
def tool_tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tooltok")
    tok = make_tiny_tokenizer(d)
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(str(d))
    return d


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _check_bins(rows, meta, tok_dir):
    """Every row's templated length lies in its bin (rows come bin by bin) and its ids are the text's."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    i = 0
    for b in meta["bins"]:
        for r in rows[i:i + b["taken"]]:
            assert b["lo"] <= len(r["prompt_ids"]) <= b["hi"], (r["id"], b)
            assert r["prompt_ids"] == tok(r["text"], add_special_tokens=False).input_ids
        i += b["taken"]
    assert i == len(rows)


# ---------------------------------------------------------------- conversation

@pytest.fixture(scope="module")
def sharegpt_head(tmp_path_factory):
    """The packaged ShareGPT file's first 2,000 records (a build over them takes a second, not ten)."""
    from dflash_eval.core.io import packaged_file
    from dflash_eval.data.prompts import SHAREGPT_DIST, SHAREGPT_FILE, decode_sharegpt

    records, _ = decode_sharegpt(packaged_file(SHAREGPT_DIST, SHAREGPT_FILE))
    path = tmp_path_factory.mktemp("sharegpt") / "head.json"
    path.write_text(json.dumps(records[:2000]), encoding="utf-8")
    return path


def test_conversation_bins_are_reproducible_supersets_and_hold_their_lengths(tok_dir, sharegpt_head):
    kw = dict(context_bins=[128, 256, 512], max_prompt_tokens=1024, path=sharegpt_head)
    a, meta = build_set_with_meta("conversation", tok_dir, 0, 0, per_bin=2, **kw)
    b, _ = build_set_with_meta("conversation", tok_dir, 0, 0, per_bin=2, **kw)
    big, meta3 = build_set_with_meta("conversation", tok_dir, 0, 0, per_bin=3, **kw)
    assert a == b and len(a) == 6
    assert [x["taken"] for x in meta["bins"]] == [2, 2, 2] and [x["taken"] for x in meta3["bins"]] == [3, 3, 3]
    assert [(x["lo"], x["hi"]) for x in meta["bins"]] == [(128, 255), (256, 511), (512, 1024)]
    # each bin of the larger set starts with the smaller set's prompts of that bin
    assert [r["id"] for r in big[0:2] + big[3:5] + big[6:8]] == [r["id"] for r in a]
    _check_bins(big, meta3, tok_dir)
    ids = [r["id"] for r in big]
    convs = [i.rsplit("/turn", 1)[0] for i in ids]
    assert len(set(convs)) == len(convs)  # one prompt per conversation
    for r in big:  # the prompt is the conversation's last user turn, answered after one assistant turn at least
        turn = int(r["id"].rsplit("/turn", 1)[1])
        assert turn >= 2 and r["text"].count("<|im_start|>user\n") == turn
        assert r["text"].endswith(r["prompt"] + "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_split_conversations_are_joined_back(tmp_path, tok_dir):
    h, g = (lambda v: {"from": "human", "value": v}), (lambda v: {"from": "gpt", "value": v})
    records = [{"id": "a_0", "conversations": [h("1"), g("2"), h("3")]},
               {"id": "a_2", "conversations": [h("3"), g("4"), h("5")]},  # overlaps a_0 by one turn
               {"id": "a_9", "conversations": [h("9"), g("10"), h("11")]},  # a gap: not joined
               {"id": "b_0", "conversations": [h("x"), g("y"), h("z")]}]
    path = tmp_path / "s.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    rows, meta = build_set_with_meta("conversation", tok_dir, 0, 0, path=path)
    # a = turns 1..5; its candidates end at "3" (turn2) and "5" (turn3); the one first in sha256 order is kept
    msgs = [{"role": "user" if i % 2 else "assistant", "content": str(i)} for i in range(1, 6)]
    first = "a/turn2" if hashlib.sha256(canonical(msgs[:3])).hexdigest() < hashlib.sha256(canonical(msgs)).hexdigest() \
        else "a/turn3"
    assert sorted(r["id"] for r in rows) == [first, "b/turn2"]
    assert next(r for r in rows if r["id"] == first)["prompt"] == {"a/turn2": "3", "a/turn3": "5"}[first]
    assert meta["skipped"] == {"split_part_not_joined": 1}


def test_conversation_candidate_is_cut_at_the_first_broken_turn(tmp_path, tok_dir):
    conv = [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"},
            {"from": "human", "value": "d"}, {"from": "gpt", "value": "e"}, {"from": "human", "value": "f"}]
    path = tmp_path / "s.json"
    path.write_text(json.dumps([{"id": "x", "conversations": conv},
                                {"id": "y", "conversations": conv[:2]}]), encoding="utf-8")
    rows, meta = build_set_with_meta("conversation", tok_dir, 0, 0, path=path)
    # only "x" has a user turn after an assistant turn; "d" repeats the user role, so x ends at "c"
    assert [r["id"] for r in rows] == ["x/turn2"] and rows[0]["prompt"] == "c"
    assert meta["skipped"] == {"no_follow_up": 1}


# ---------------------------------------------------------------- repository

def test_repository_bins_reproducible_supersets_and_added_bins(tok_dir):
    kw = dict(max_prompt_tokens=1023)
    a, meta = build_set_with_meta("repository", tok_dir, 0, 0, context_bins=[256, 512], per_bin=2, **kw)
    assert a == build_set_with_meta("repository", tok_dir, 0, 0, context_bins=[256, 512], per_bin=2, **kw)[0]
    assert meta["python"].count(".") == 2 and meta["directory"] and meta["files"] > 100
    more = build_set_with_meta("repository", tok_dir, 0, 0, context_bins=[256, 512], per_bin=3, **kw)[0]
    below = build_set_with_meta("repository", tok_dir, 0, 0, context_bins=[128, 256, 512], per_bin=2, **kw)[0]
    above, meta_up = build_set_with_meta("repository", tok_dir, 0, 0, context_bins=[256, 512, 1024], per_bin=2,
                                         max_prompt_tokens=2047)
    ids = {r["id"] for r in a}
    assert len(ids) == 4
    assert ids <= {r["id"] for r in more} and ids <= {r["id"] for r in below} and ids <= {r["id"] for r in above}
    assert [r["id"] for r in below[2:]] == [r["id"] for r in a] == [r["id"] for r in above[:4]]
    _check_bins(above, meta_up, tok_dir)
    r = a[0]
    assert r["prompt"].startswith("The files below are from the folder") and "### File: " in r["prompt"]
    assert r["id"].split("+")[0] in r["prompt"]  # the instruction is about the last file, named by its path


def test_a_bin_with_no_candidate_names_the_entry_and_a_short_bin_warns(tmp_path, tok_dir, caplog):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    (tmp_path / "pkg" / "b.py").write_text("def g(y):\n    return y * 2\n" * 40)
    (tmp_path / "tests").mkdir()  # skipped: a test folder
    (tmp_path / "tests" / "test_a.py").write_text("import a\n" * 2000)
    with pytest.raises(InputError) as ei:
        build_set_with_meta("repository", tok_dir, 0, 0, path=tmp_path, context_bins=[100, 50000], per_bin=1,
                            max_prompt_tokens=60000, set_name="code")
    assert ei.value.field == "prompt_sets.code.context_bins" and "[50000, 60000]" in ei.value.problem
    assert "drop that bin or move it" in ei.value.fix and "lower it for short data" in ei.value.fix
    with caplog.at_level(logging.WARNING, logger="dflash_eval.data.binned"):
        rows, meta = build_set_with_meta("repository", tok_dir, 0, 0, path=tmp_path, context_bins=[100], per_bin=5,
                                         max_prompt_tokens=60000)
    # pkg/a.py alone and pkg/a.py + pkg/b.py: two candidates for five places
    assert sorted(r["id"] for r in rows) == ["pkg/a.py+1", "pkg/b.py+2"]
    assert meta["bins"] == [{"lo": 100, "hi": 60000, "candidates": 2, "taken": 2}]
    assert any("holds 2 of per_bin 5 prompts (2 candidates fall in it)" in m.getMessage() for m in caplog.records)


# ---------------------------------------------------------------- trajectory

def test_trajectory_prefixes_are_the_assistant_turns_after_the_first(tmp_path, tool_tok_dir):
    from transformers import AutoTokenizer
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "t1", "messages": AGENT, "tools": TOOLS},
                                         {"id": "t2", "messages": AGENT[:3]}])  # one assistant turn: no prompt
    cands = trajectory_candidates(path)
    assert [c.id for c in cands] == ["t1/msg4", "t1/msg6"]
    assert [c.messages()[-1] for c in cands] == [AGENT[3], AGENT[5]]  # the tool result, the user's "Fix it."
    assert [len(c.messages()) for c in cands] == [4, 6]
    rows, meta = build_set_with_meta("trajectory", tool_tok_dir, 0, 0, path=path)
    assert sorted(r["id"] for r in rows) == ["t1/msg4", "t1/msg6"] and meta["skipped"] == {"no_follow_up": 1}
    tok = AutoTokenizer.from_pretrained(str(tool_tok_dir))
    r4 = next(r for r in rows if r["id"] == "t1/msg4")
    assert r4["text"] == tok.apply_chat_template(AGENT[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "read_file", "arguments": {"path": "parse.py"}}</tool_call>' in r4["text"]
    assert r4["text"].endswith("<tool_response>\ndef parse(s):\n    return int(s)\n\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert r4["prompt"] == "Why does test_parse fail?"  # the last user turn
    again, _ = build_set_with_meta("trajectory", tool_tok_dir, 0, 0, path=path)
    assert again == rows
    # one bin, one place: the prefix whose canonical JSON (messages, then tools) has the smaller sha256
    keys = {f"t1/msg{i}": hashlib.sha256(canonical(AGENT[:i]) + canonical(TOOLS)).hexdigest() for i in (4, 6)}
    one, meta = build_set_with_meta("trajectory", tool_tok_dir, 0, 0, path=path, context_bins=[1], per_bin=1,
                                    max_prompt_tokens=10**6)
    assert [r["id"] for r in one] == [min(keys, key=keys.get)] and meta["bins"][0]["taken"] == 1


@pytest.mark.parametrize("line2, field", [
    ("{not json", "line 2"),
    (json.dumps({"id": "b", "messages": [{"role": "robot", "content": "x"}]}), "line 2: messages[0].role"),
    (json.dumps({"id": "b", "messages": AGENT[:3] + [{"role": "tool", "content": "x"}]}), "line 2: messages[3].tool_call_id"),
    (json.dumps({"id": "b", "messages": AGENT[:3] + [{"role": "tool", "tool_call_id": "c9", "content": "x"}]}),
     "line 2: messages[3].tool_call_id"),
    (json.dumps({"id": "b", "messages": [AGENT[1], {"role": "assistant", "content": None}]}), "line 2: messages[1].content"),
    (json.dumps({"id": "b", "messages": [AGENT[1], {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]}),
     "line 2: messages[1].tool_calls[0].function"),
    (json.dumps({"id": "t1", "messages": AGENT}), "line 2: id"),
    (json.dumps({"messages": AGENT}), "line 2: id"),
    (json.dumps({"id": "b", "messages": AGENT, "tools": "read_file"}), "line 2: tools"),
])
def test_a_malformed_trajectory_line_is_refused_by_line_and_field(tmp_path, line2, field):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "t1", "messages": AGENT}) + "\n" + line2 + "\n", encoding="utf-8")
    with pytest.raises(InputError) as ei:
        trajectory_candidates(path)
    assert ei.value.field == field and str(ei.value.file) == str(path)


def test_a_template_without_tool_support_is_refused_by_line_and_field(tmp_path, tok_dir):
    # the tiny ChatML template concatenates content: a null content fails, and a tool call is dropped
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "t1", "messages": AGENT}])
    with pytest.raises(InputError) as ei:
        build_set_with_meta("trajectory", tok_dir, 0, 0, path=path)
    assert str(ei.value.file) == str(path) and ei.value.field == "line 1: messages[2].tool_calls"
    assert "chat template" in ei.value.problem and "renders tool calls" in ei.value.fix
    dropped = [dict(AGENT[2], content="")] + AGENT[3:]
    path = _jsonl(tmp_path / "u.jsonl", [{"id": "x", "messages": [AGENT[1], {"role": "assistant", "content": "ok"}]},
                                         {"id": "t1", "messages": AGENT[:2] + dropped}])
    with pytest.raises(InputError) as ei:
        build_set_with_meta("trajectory", tok_dir, 0, 0, path=path)
    assert ei.value.field == "line 2: messages[2].tool_calls" and "drops the tool call 'read_file'" in ei.value.problem


def test_the_last_bin_ends_at_the_targets_positions_less_the_generation(tmp_path):
    from dflash_eval.stages.prompts import last_bin_end

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert last_bin_end([1024], 0, 256, str(tmp_path), "x") == 4096 - 256
    assert last_bin_end([1024], 2000, 256, str(tmp_path), "x") == 2000  # given: kept
    assert last_bin_end([], 0, None, str(tmp_path), "x") == 0  # no bins: 0 stays "no limit"
    with pytest.raises(InputError) as ei:
        last_bin_end([1024], 0, None, str(tmp_path), "x")
    assert ei.value.field == "prompt_sets.x.max_prompt_tokens" and "--max-new-tokens is not given" in ei.value.problem


def test_a_tool_result_rendered_as_json_counts_as_rendered(tmp_path, tok_dir):
    """Llama 3.1's template writes a tool result through tojson (quoted, newlines escaped): not a dropped result."""
    from transformers import AutoTokenizer
    d = tmp_path / "tok"
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = TOOL_TEMPLATE.replace("' + m.content + '", "' + (m.content | tojson) + '", 1)  # the tool result's
    assert tok.chat_template != TOOL_TEMPLATE
    tok.save_pretrained(str(d))
    path = _jsonl(tmp_path / "t.jsonl", [{"id": "t1", "messages": AGENT}])
    rows, _ = build_set_with_meta("trajectory", d, 0, 0, path=path)
    r4 = next(r for r in rows if r["id"] == "t1/msg4")
    assert '<tool_response>\n"def parse(s):\\n    return int(s)\\n"\n</tool_response>' in r4["text"]
